"""Shared test set-up for tests/ and notebooks/ (at the root so that `pytest notebooks/...` alone sees it too):
GPU markers and nbval's `gpu` cell tag."""

from __future__ import annotations

import ctypes
import functools
import os

import pytest


def openblas_core() -> str:
    """The kernel family NumPy's OpenBLAS runs on this CPU (OPENBLAS_CORETYPE may force one)."""
    import numpy as np

    np.ones((2, 2)) @ np.ones((2, 2))  # make sure the library is loaded and initialized
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for name in sorted(os.listdir(libs)) if os.path.isdir(libs) else []:
        if "openblas" in name:
            lib = ctypes.CDLL(os.path.join(libs, name))
            for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
                if hasattr(lib, symbol):
                    getter = getattr(lib, symbol)
                    getter.restype = ctypes.c_char_p
                    return getter().decode()
    return "unknown"


def pytest_configure(config):
    """tests/openblas_cores.py forces an OpenBLAS core type: make sure it is the one in use, in every worker.
    Without CUDA, flashref.triton is imported first, in every worker: it switches Triton's interpreter on, which
    must happen before triton is first imported. A test that imports triton itself (``results.versions()``
    does), or under a faked GPU, would otherwise leave the kernels of every later test in that process
    unable to run."""
    expected = os.environ.get("FLASHREF_EXPECT_OPENBLAS_CORE")
    if expected and openblas_core().lower() != expected.lower():
        raise pytest.UsageError(f"OPENBLAS_CORETYPE={expected} was asked for, but OpenBLAS runs {openblas_core()}")
    if not cuda_available():
        try:
            import flashref.triton  # noqa: F401
        except ImportError:  # no triton installed: the tests that need it skip
            pass


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip, visibly, what needs CUDA hardware where there is none: tests marked `gpu` and notebook
    cells tagged `gpu` (DESIGN.md). On the GPU machine they all run."""
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's notebook cell items
        tags = cell.metadata.get("tags", []) if cell is not None else []
        if item.get_closest_marker("gpu") is not None or "gpu" in tags:
            item.add_marker(skip)
