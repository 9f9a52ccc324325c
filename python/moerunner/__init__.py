"""moerunner: the Mixture-of-Experts layer of an inference engine (routing, expert GEMMs with
their gated activation, combine), on the C++ library's backends.

    backends()            the backends this build runs ("reference"; with CUDA also "cuda_fused",
                          "cublas_grouped", "cuda_fused_fp8")
    MoeRunner(...)        one layer's runner: run(), workspace_bytes(), describe()
    topk(...)             routing: router logits to (topk_weights, topk_ids)
    moerunner.torch       torch.library ops (imported on demand; needs torch)

Tensors are any DLPack arrays (torch, CuPy, JAX, numpy on the host). Errors are the library's,
as the exceptions of moerunner._errors (InvalidArgumentError is a ValueError, and so on).
"""

from ._errors import CudaError, InvalidArgumentError, MoeError, RegistryError, UnsupportedError
from . import _build, _moerunner
from ._routing import topk
from ._runner import MoeRunner

__version__ = _moerunner.__version__


def backends():
    """The backends this build can run, in the library's order."""
    return _moerunner.backends()


def build_info():
    """What this build holds: its version, whether it has the GPU backends, their architectures."""
    return {"version": _build.version, "cuda": _build.cuda, "gpu_archs": list(_build.gpu_archs)}


__all__ = [
    "CudaError", "InvalidArgumentError", "MoeError", "MoeRunner", "RegistryError", "UnsupportedError",
    "backends", "build_info", "topk",
]
