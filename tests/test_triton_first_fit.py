"""The order in which a short sequence's launch tries its configs (ops._launch_first_fit), on the CPU: the
launch itself is replaced by a recorder, so only the choice is under test."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (the interpreter is switched on before triton is imported)
from flashref.triton import configs, ops
from triton.runtime.errors import OutOfResources

TC = configs.TileConfig
LISTED = [TC(128, 64, 4, 3), TC(64, 64, 4, 3), TC(32, 16, 4, 1), TC(64, 32, 4, 2)]


@pytest.fixture
def recorder(monkeypatch):
    tried = []
    refuse = set()

    def launch(kernel, name, grid_rows, bh, cfg, args, meta):
        tried.append(cfg)
        if cfg in refuse:
            raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(ops, "_launch_config", launch)
    monkeypatch.setattr(ops, "_FIRST_FIT", {})
    monkeypatch.setattr(ops.configs, "device_candidates", lambda name, block_d, elem, device=None: list(LISTED))
    return tried, refuse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tries_the_listed_order(recorder, dtype):
    tried, refuse = recorder
    refuse.add(LISTED[0])
    ops._launch_first_fit(None, "forward", 100, 2, (torch.zeros(1, dtype=dtype),), {"BLOCK_D": 64})
    assert tried == LISTED[:2]


def test_float32_tries_the_smallest_tile_first_and_remembers_it(recorder):
    tried, refuse = recorder
    q = torch.zeros(1, dtype=torch.float32)
    refuse.add(TC(32, 16, 4, 1))
    ops._launch_first_fit(None, "forward", 100, 2, (q,), {"BLOCK_D": 64})
    assert tried == [TC(32, 16, 4, 1), TC(64, 32, 4, 2)]  # by tile area, the refused one falls through
    tried.clear()
    ops._launch_first_fit(None, "forward", 100, 2, (q,), {"BLOCK_D": 64})
    assert tried == [TC(64, 32, 4, 2)]  # the choice is remembered per key
