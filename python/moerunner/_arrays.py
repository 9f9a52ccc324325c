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
    raise TypeError(
        f"{what} was not given and moerunner allocates it only for numpy arrays and torch tensors, "
        f"not {type(like).__module__}.{type(like).__name__}: pass {what}="
    )


def leading_dim(x):
    """x.shape[0], or 0 where x has no dimension (the library then names the rank)."""
    shape = getattr(x, "shape", ())
    return int(shape[0]) if len(shape) else 0
