"""Streams and default allocations for the arrays a call receives, without importing torch:
a torch tensor can only exist where torch is already imported."""

import sys

import numpy as np


def torch_of(x):
    """The torch module when x is a torch tensor, else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


def is_host(x):
    """Whether x lives in host memory (DLPack device cpu or pinned CUDA host memory)."""
    dev = getattr(x, "__dlpack_device__", None)
    return dev is None or dev()[0] in (1, 3)


def stream_handle(stream, like):
    """The cudaStream_t to run on, as an int. None: torch's current stream for a CUDA torch
    tensor `like`, else 0 (the legacy default stream)."""
    if stream is None:
        torch = torch_of(like)
        if torch is not None and like.is_cuda:
            return torch._C._cuda_getCurrentRawStream(like.device.index)
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):  # the CUDA stream protocol: (version, handle)
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        return int(stream.ptr)
    raise TypeError(
        f"stream must be an int (a cudaStream_t), an object with __cuda_stream__ or cuda_stream, or None; "
        f"got {type(stream).__name__}"
    )


def device_index(device):
    """The CUDA device ordinal a query plans for: -1 (the current device) for None or a device
    without an index, the int itself, or a torch.device's index (cuda devices only)."""
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    if getattr(device, "type", "cuda") != "cuda":
        return -1
    index = getattr(device, "index", None)
    return -1 if index is None else int(index)


def keep_for_stream(tensors, stream, like):
    """Tells torch's caching allocator that tensors it allocated for a call on its current stream
    are used on `stream` (a call given a stream of its own): they are not handed out again
    before that stream's work is done."""
    torch = torch_of(like)
    if torch is None or stream is None or not like.is_cuda:
        return
    handle = stream_handle(stream, like)
    if handle == torch.cuda.current_stream(like.device).cuda_stream:
        return
    used_on = torch.cuda.ExternalStream(handle, device=like.device)
    for t in tensors:
        t.record_stream(used_on)


def empty(like, shape, dtype, what):
    """An uninitialized array of `shape` where `like` lives, in its framework. dtype is
    "f32", "i32", "u8" or "output" (like's dtype; bf16 for an fp8 like)."""
    torch = torch_of(like)
    if torch is not None:
        types = {"f32": torch.float32, "i32": torch.int32, "u8": torch.uint8}
        if dtype == "output":
            t = torch.bfloat16 if like.dtype == getattr(torch, "float8_e4m3fn", None) else like.dtype
        else:
            t = types[dtype]
        return torch.empty(shape, dtype=t, device=like.device)
    if isinstance(like, np.ndarray):
        t = like.dtype if dtype == "output" else {"f32": np.float32, "i32": np.int32, "u8": np.uint8}[dtype]
        return np.empty(shape, dtype=t)
    if not hasattr(like, "shape") and not hasattr(like, "__dlpack__"):
        return None  # not an array at all: the call names the argument for what it is
    raise TypeError(
        f"{what} was not given and moerunner allocates it only for numpy arrays and torch tensors, "
        f"not {type(like).__module__}.{type(like).__name__}: pass {what}="
    )


def leading_dim(x):
    """x.shape[0], or 0 where x has no dimension (the library then names the rank)."""
    shape = getattr(x, "shape", ())
    return int(shape[0]) if len(shape) else 0
