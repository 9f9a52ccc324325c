"""The installed package: version, metadata, backends, exception classes."""

import importlib.metadata
import re
from pathlib import Path

import pytest

import moerunner

MESON_BUILD = Path(__file__).resolve().parents[2] / "meson.build"


def meson_version():
    return re.search(r"version\s*:\s*'([^']+)'", MESON_BUILD.read_text()).group(1)


def test_version_is_meson_builds():
    assert moerunner.__version__ == meson_version()
    assert importlib.metadata.version("moerunner") == meson_version()
    assert moerunner.build_info()["version"] == meson_version()


def test_backends_follow_the_build():
    info = moerunner.build_info()
    if info["cuda"]:
        assert moerunner.backends() == ["reference", "cuda_fused", "cublas_grouped", "cuda_fused_fp8"]
        assert info["gpu_archs"]
    else:
        assert moerunner.backends() == ["reference"]
        assert info["gpu_archs"] == []


@pytest.mark.parametrize("cls, builtin", [
    (moerunner.InvalidArgumentError, ValueError),
    (moerunner.RegistryError, LookupError),
    (moerunner.UnsupportedError, NotImplementedError),
    (moerunner.UnsupportedError, RuntimeError),
    (moerunner.CudaError, RuntimeError),
])
def test_exceptions_are_builtin_ones_too(cls, builtin):
    assert issubclass(cls, moerunner.MoeError) and issubclass(cls, builtin)


def test_gpu_backend_without_cuda_build_is_unsupported():
    if moerunner.build_info()["cuda"]:
        pytest.skip("this build has the GPU backends")
    with pytest.raises(moerunner.UnsupportedError, match="backend 'cuda_fused' needs the GPU build"):
        moerunner.MoeRunner("cuda_fused", num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)
