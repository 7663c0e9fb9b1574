"""The checkers of notebook 12's exercises accept right answers and name the usual mistakes, and the plain-Python
tile ranges the notebook draws are the kernels' own (``_tile_ranges``, run in Triton's interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashref.triton  # noqa: F401  (switches the interpreter on before triton is imported)
import triton
import triton.language as tl
from flashref.exercises import score_mods as ex
from flashref.window_tiles import tile_ranges, window_tile_kinds
from flashref.triton.forward import _tile_ranges
from tests._triton_helpers import DEVICE, INTERPRETER_LANES


def test_cu_seqlens_checker():
    assert ex.check_cu_seqlens(lambda n: torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32))
    assert ex.check_cu_seqlens(lambda n: np.concatenate([[0], np.cumsum(n)]))
    assert "one more entry" in repr(ex.check_cu_seqlens(lambda n: np.cumsum(n)))
    assert "integers" in repr(ex.check_cu_seqlens(lambda n: np.concatenate([[0], np.cumsum(n)]).astype(float)))
    assert "expected [0, 3, 8, 10]" in repr(ex.check_cu_seqlens(lambda n: np.concatenate([[0], n])))
    assert "returns None" in repr(ex.check_cu_seqlens(lambda n: None))
    assert not ex.check_cu_seqlens(None) and not ex.check_cu_seqlens(3)


def test_padded_work_checker():
    n = np.array(ex.PAD_LENGTHS)
    want = len(n) * 12 * 13 / 2 / (n * (n + 1) / 2).sum()
    assert ex.check_padded_work(want) and abs(ex.padded_work() - want) < 1e-12
    assert "n (n + 1) / 2" in repr(ex.check_padded_work(len(n) * 12**2 / (n**2).sum()))
    assert "ratio of tokens" in repr(ex.check_padded_work(len(n) * 12 / n.sum()))
    assert not ex.check_padded_work(2.0) and not ex.check_padded_work(None) and not ex.check_padded_work("x")


@triton.jit
def _softcap_right(s, c):
    t = tl.exp2(-2.8853900817779268 * tl.abs(s / c))
    r = (1.0 - t) / (1.0 + t)
    return c * tl.where(s < 0, -r, r)


@triton.jit
def _softcap_overflows(s, c):
    e = tl.exp2(2.8853900817779268 * s / c)
    return c * (e - 1.0) / (e + 1.0)


@triton.jit
def _softcap_no_c(s, c):
    t = tl.exp2(-2.8853900817779268 * tl.abs(s / c))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(s < 0, -r, r)


@triton.jit
def _softcap_inner_c(s, c):
    t = tl.exp2(-2.8853900817779268 * tl.abs(s))
    r = (1.0 - t) / (1.0 + t)
    return c * tl.where(s < 0, -r, r)


@triton.jit
def _softcap_identity(s, c):
    return s


@INTERPRETER_LANES  # a function that overflows, on purpose
def test_softcap_checker_runs_the_function_in_a_kernel():
    assert ex.check_softcap_function(_softcap_right)
    assert "overflows" in repr(ex.check_softcap_function(_softcap_overflows))
    assert "multiply tanh(s / c) by c" in repr(ex.check_softcap_function(_softcap_no_c))
    assert "argument of tanh is s / c" in repr(ex.check_softcap_function(_softcap_inner_c))
    assert "unchanged" in repr(ex.check_softcap_function(_softcap_identity))
    assert not ex.check_softcap_function(None) and "@triton.jit" in repr(ex.check_softcap_function(lambda s, c: s))


@triton.jit
def _ranges_kernel(OUT, start, n_inner, before, after, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr,
                   BOUNDED_BEFORE: tl.constexpr, BOUNDED_AFTER: tl.constexpr):
    lo, full_lo, full_hi, hi = _tile_ranges(start, n_inner, before, after, BLOCK_OUTER, BLOCK_INNER,
                                            BOUNDED_BEFORE=BOUNDED_BEFORE, BOUNDED_AFTER=BOUNDED_AFTER)
    tl.store(OUT + 0, lo)
    tl.store(OUT + 1, full_lo)
    tl.store(OUT + 2, full_hi)
    tl.store(OUT + 3, hi)


@pytest.mark.parametrize("before, after", [(None, None), (None, 0), (20, 0), (5, 37), (None, 7), (100, None), (0, 0)])
def test_plain_python_tile_ranges_are_the_kernels(before, after):
    out = torch.empty(4, dtype=torch.int32, device=DEVICE)  # compiled for the GPU when there is one
    for n_inner in (1, 95, 256):
        for start in range(0, 300, 32):
            _ranges_kernel[(1,)](out, start, n_inner, before or 0, after or 0, BLOCK_OUTER=32, BLOCK_INNER=16,
                                 BOUNDED_BEFORE=before is not None, BOUNDED_AFTER=after is not None)
            want = tile_ranges(start, n_inner, before, after, 32, 16)
            assert tuple(out.tolist()) == want, (start, n_inner, before, after)
            lo, full_lo, full_hi, hi = want
            assert lo <= full_lo <= full_hi <= hi or hi < lo


def test_window_tile_kinds_cover_exactly_the_visible_pairs():
    """Every visible (query, key) pair lies in a full or masked tile, and every pair of a full tile is visible."""
    N_q, N_k, bm, bn, window = 160, 200, 32, 16, (60, 20)
    kinds = window_tile_kinds(N_q, N_k, bm, bn, window, causal=False)
    i, j = np.arange(N_q)[:, None], np.arange(N_k)[None, :]
    visible = (j >= i - window[0]) & (j <= i + window[1])
    for a, row in enumerate(kinds):
        for b, kind in enumerate(row):
            tile = visible[a * bm:(a + 1) * bm, b * bn:(b + 1) * bn]
            if kind == "skipped":
                assert not tile.any()
            if kind == "full":
                assert tile.all() and tile.shape == (bm, bn)
    counts = {k: sum(r.count(k) for r in kinds) for k in ("full", "masked", "skipped")}
    assert counts["skipped"] > counts["full"] > 0 and counts["masked"] > 0


@triton.jit
def _softcap_skeleton(s, c):
    return s  # your code: c * tanh(s / c)


def test_softcap_checker_says_when_the_skeleton_is_unwritten():
    assert "the line marked 'your code'" in repr(ex.check_softcap_function(_softcap_skeleton))
