"""The library's exceptions (moerunner/core/error.hpp) as Python exceptions.

Each class derives from MoeError (catch it for any library error) and from the built-in
exception a Python caller expects for that kind of failure; the message is the library's.

    C++ (moerunner::)         Python (moerunner.)     also a
    invalid_argument_error    InvalidArgumentError    ValueError
    registry_error            RegistryError           LookupError
    unsupported_error         UnsupportedError        NotImplementedError (a RuntimeError)
    cuda_error                CudaError               RuntimeError
    moe_error (any other)     MoeError                Exception
"""


class MoeError(Exception):
    """Any error the library raised (moe_error)."""


class InvalidArgumentError(MoeError, ValueError):
    """A shape, dtype, stride, alignment, device, id or config value is wrong."""


class RegistryError(MoeError, LookupError):
    """A backend name is malformed or unknown."""


class UnsupportedError(MoeError, NotImplementedError):
    """The backend (or this build) cannot do what was asked."""


class CudaError(MoeError, RuntimeError):
    """A CUDA runtime or library call failed."""
