"""The block-mask tile benchmark on the CPU: its candidates hold the shipped tiles and fit the masks' blocks, its
table reads rows as the GPU run writes them, and it refuses to run without an sm_90 GPU. (The timings run on an
H100: python -m flashref.bench sparse-tiles.)"""

from __future__ import annotations

import pytest
import torch

from flashref.bench import sparse_tiles_bench as stb


def test_the_candidates_hold_the_shipped_tiles_and_fit_the_blocks():
    hopper = pytest.importorskip("flashref.triton.hopper")
    for d, tiles in stb.CANDIDATES.items():
        shipped = hopper.block_mask_config(d, stb.BLOCK)
        assert any(all(shipped[k] == v for k, v in t.items()) for t in tiles), d
        for t in tiles:
            cfg = dict(shipped, **t)
            assert cfg == hopper.config(d, **t), cfg  # each candidate names every switch the kernels check
            assert hopper.lists_fit(cfg, "fwd", stb.BLOCK), cfg
            hopper.kernel_and_constexprs(cfg, d, causal=True, block_size=stb.BLOCK)  # raises on a tile it cannot run


def test_the_masks_are_the_features_bench_ones():
    from flashref import block_masks

    got = stb.masks(8)
    assert list(got) == ["sliding window", "bigbird", "causal", "all-True"]
    assert [c for _, c in got.values()] == [True, False, True, False]
    assert torch.equal(got["causal"][0], block_masks.causal_blocks(8))
    assert block_masks.density(got["all-True"][0]) == 1.0


def test_the_table_gives_each_tile_against_the_teaching_forward():
    base = dict(d=64, B=1, N=16384, pattern="causal", causal=True, density=0.5)
    rows = [dict(base, impl="teaching", tile=None, capped=None, ms=1.5, graph_ms=1.2),
            dict(base, impl="dense", tile=None, capped=None, ms=1.3, graph_ms=1.1),
            dict(base, impl="gluon", tile="64x128 w4 s1", capped=True, ms=1.4, graph_ms=1.0, shipped=True),
            dict(base, impl="gluon", tile="64x128 w4 s1", capped=False, ms=1.45, graph_ms=1.2, shipped=True),
            dict(base, impl="gluon", tile="64x64 w4 s2", capped=None, ms=1.6, graph_ms=None, shipped=False)]
    (line,) = stb.table(rows).splitlines()
    cells = line.split(" | ")
    assert cells[0].endswith("teaching 1.2") and cells[1] == "dense 1.100 ms"
    assert cells[2:] == ["64x128 w4 s1* 1.20", "64x128 w4 s1* (no cap) 1.00"]  # no graph time: no cell
    assert stb.table(rows, field="ms").splitlines()[0].split(" | ")[-1] == "64x64 w4 s2 0.94"


def test_it_needs_a_hopper_gpu(capsys):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an H100 would run it")
    assert stb.main([]) == 2
    assert "sm_90" in capsys.readouterr().err
