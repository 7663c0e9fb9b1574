"""Shared test set-up for tests/ and notebooks/ (at the root so that `pytest notebooks/...` alone sees it too):
GPU markers and nbval's `gpu` cell tag."""

from __future__ import annotations

import functools

import pytest


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
