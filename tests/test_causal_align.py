"""Causal attention aligned bottom-right (``causal_align="bottom_right"``: query i sees keys j <= i + N_k - N_q,
FlashAttention's convention and what decoding needs) in the float64 reference, the tiled NumPy attention and
the Triton kernels, forward and backward, on uneven shapes with N_q < N_k, N_q > N_k (the first rows then
see no key) and N_q = 1. The Triton part runs in the interpreter on CI and compiled on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashref import numpy_flash, reference
from flashref.tolerance import assert_within_tolerance
from flashref.triton import flash_attention, flash_attention_backward, flash_attention_forward
from tests._finite_differences import assert_reference_gradients_match
from tests._triton_helpers import DEVICE, no_autotune  # noqa: F401  (an autouse fixture: applies here)
from tests._triton_helpers import feature_inputs, np64, plain_with_features

SHAPES = [(1, 37), (5, 37), (37, 5), (33, 70), (70, 33), (48, 48)]
BR = dict(causal=True, causal_align="bottom_right")


def _visible(N_q, N_k):
    """The rule written out: query i sees key j when j <= i + N_k - N_q."""
    i, j = np.arange(N_q)[:, None], np.arange(N_k)[None, :]
    return j <= i + (N_k - N_q)


def _arrays(N_q, N_k, d=8, B=1, H=2, H_kv=2, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N_q, d)) * scale
    k, v = (rng.standard_normal((B, H_kv, N_k, d)) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape), rng


@pytest.mark.parametrize("N_q, N_k", [(3, 5), (5, 3), (1, 7), (7, 1), (4, 4)])
def test_causal_mask_follows_the_rule(N_q, N_k):
    assert np.array_equal(reference.causal_mask(N_q, N_k, "bottom_right"), _visible(N_q, N_k))
    if N_q == N_k:  # square: both alignments are the same mask
        assert np.array_equal(reference.causal_mask(N_q, N_k, "bottom_right"), reference.causal_mask(N_q, N_k))


@pytest.mark.parametrize("N_q, N_k", SHAPES)
def test_reference_against_the_formula(N_q, N_k):
    q, k, v, do, rng = _arrays(N_q, N_k)
    o, lse = reference.attention(q, k, v, return_lse=True, **BR)
    s = np.where(_visible(N_q, N_k), q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0.0)
    l = p.sum(-1, keepdims=True)
    want = np.where(seen, p / np.where(seen, l, 1), 0.0) @ v
    np.testing.assert_allclose(o, want, rtol=0, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), ~seen[..., 0]), "lse = -inf exactly on rows that see no key"
    if N_q > N_k:
        assert np.all(o[..., : N_q - N_k, :] == 0), "the first N_q - N_k rows see no key: o = 0"
    assert_reference_gradients_match(q, k, v, do, rng, **BR)


@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("N_q, N_k", SHAPES)
def test_numpy_flash_equals_the_reference_and_skips_tiles(N_q, N_k, order):
    q, k, v, do, _ = _arrays(N_q, N_k, H=4, H_kv=2)
    trace = []
    o, lse = numpy_flash.flash_attention_forward(q, k, v, block_q=8, block_k=16, order=order, trace=trace, **BR)
    ref_o, ref_lse = reference.attention(q, k, v, return_lse=True, **BR)
    np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    for i, j in trace:  # no tile lies wholly above the shifted diagonal
        assert j * 16 <= min(N_q, (i + 1) * 8) - 1 + N_k - N_q, (i, j)
    grads = numpy_flash.flash_attention_backward(q, k, v, o, lse, do, block_q=8, block_k=16, **BR)
    for g, r in zip(grads, reference.attention_backward(q, k, v, do, **BR)):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-12)


def test_square_bottom_right_is_top_left():
    q, k, v, do, _ = _arrays(40, 40)
    np.testing.assert_array_equal(reference.attention(q, k, v, **BR), reference.attention(q, k, v, causal=True))


def test_window_composes_with_the_shifted_diagonal():
    """(left, right) windows and the bottom-right mask: both bounds hold (the window stays top-left)."""
    q, k, v, do, _ = _arrays(20, 50)
    window = (6, -1)
    got = reference.attention(q, k, v, window_size=window, **BR)
    i, j = np.arange(20)[:, None], np.arange(50)[None, :]
    mask = _visible(20, 50) & (j >= i - window[0])
    s = np.where(mask, q @ np.swapaxes(k, -1, -2) / np.sqrt(8), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(got, (p / p.sum(-1, keepdims=True)) @ v, rtol=0, atol=1e-12)


def _triton_check(N_q, N_k, dtype, H=4, H_kv=2, d=16, window=(-1, -1), scale=1.0):
    q, k, v, do = feature_inputs(1, H, H_kv, N_q, N_k, d, dtype, scale=scale)
    kw = dict(window_size=window, **BR)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, **kw)
    o.backward(do)
    got = [o.detach(), qq.grad, kk.grad, vv.grad]
    q64, k64, v64, do64 = (np64(x) for x in (q, k, v, do))
    ref_o, ref_lse = reference.attention(q64, k64, v64, return_lse=True, **kw)
    refs = [ref_o, *reference.attention_backward(q64, k64, v64, do64, **kw)]
    base = plain_with_features(q, k, v, do, False, visible=torch.from_numpy(_visible(N_q, N_k)), window=window)
    for name, x, r, b in zip(("o", "dq", "dk", "dv"), got, refs, base):
        assert torch.isfinite(x).all(), f"{name}: non-finite values"
        atol = 1e-5 * max(1.0, float(np.abs(r).max())) if dtype == torch.float32 else None
        assert_within_tolerance(x, r, b, factor=2.0 if name == "o" else 3.0, atol=atol, name=name)
    _, lse = flash_attention_forward(q, k, v, **kw)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(np64(lse)), empty), "lse is -inf exactly on the rows that see no key"
    np.testing.assert_allclose(np64(lse)[~empty], ref_lse[~empty], rtol=0,
                               atol=1e-4 * max(1.0, np.abs(ref_lse[~empty]).max(initial=0)))
    # The backward from (o, lse) alone, as a ring or a decoder calls it. Its P is recomputed from the lse the
    # caller kept in fp32, whose own rounding (half an ulp of |lse|: 6e-5 at |lse| = 1300, the extreme-logit
    # case) is a relative error of P that plain attention, one pass that keeps no lse, does not have; the
    # slack grows with it (measured on an H100: dv off by 1.5e-4 there, where the autograd path, which keeps
    # the kernel's own lse, stays within the rule).
    grads = flash_attention_backward(q, k, v, got[0], lse, do, **kw)
    lse_rounding = 0.5 * float(np.finfo(np.float32).eps) * float(np.abs(ref_lse[~empty]).max(initial=0))
    for name, x, r, b in zip(("dq", "dk", "dv"), grads, refs[1:], base[1:]):
        atol = (1e-5 + lse_rounding) * max(1.0, float(np.abs(r).max())) if dtype == torch.float32 else None
        assert_within_tolerance(x, r, b, factor=3.0, atol=atol, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("N_q, N_k", SHAPES)
def test_triton_against_the_reference(N_q, N_k, dtype):
    _triton_check(N_q, N_k, dtype)


def test_triton_with_a_window_and_extreme_logits():
    _triton_check(21, 90, torch.float32, window=(9, -1), scale=300.0)
    _triton_check(90, 21, torch.float32, window=(-1, 4))


def test_triton_visits_only_key_tiles_before_the_shifted_diagonal():
    """The kernels' tile rule (``_tile_ranges``, run as a kernel) under a bottom-right mask with
    N_q > N_k, where the bound on j - i is negative: a query tile visits exactly the key tiles that hold a key
    one of its rows sees, and none when it sees nothing. The kernels take the shifted diagonal as a window, so
    the left side is always bounded (an unbounded side comes as N_q + N_k), which keeps every range >= 0."""
    from tests.test_score_mods_exercises import _ranges_kernel  # the kernels' own function in the interpreter

    N_q, N_k, bm, bn = 96, 40, 32, 16
    after = N_k - N_q
    out = torch.empty(4, dtype=torch.int32, device=DEVICE)
    for before in (5, N_q + N_k):
        for start in range(0, N_q, bm):
            _ranges_kernel[(1,)](out, start, N_k, before, after, BLOCK_OUTER=bm, BLOCK_INNER=bn, BOUNDED_BEFORE=True,
                                 BOUNDED_AFTER=True)
            lo, full_lo, full_hi, hi = out.tolist()
            visited = {*range(lo, full_lo, bn), *range(full_lo, full_hi, bn), *range(full_hi, hi, bn)}
            first, last = max(0, start - before), min(N_k - 1, start + bm - 1 + after)  # the keys the rows see
            want = {j for j in range(0, N_k, bn) if j <= last and j + bn - 1 >= first}
            assert visited == want, (before, start, out.tolist())
            assert all(0 <= x for x in (lo, full_lo, full_hi)) or not want


@pytest.mark.parametrize("fn", [
    lambda q, k, v, **kw: reference.attention(q, k, v, **kw),
    lambda q, k, v, **kw: reference.attention_backward(q, k, v, q, **kw),
    lambda q, k, v, **kw: numpy_flash.flash_attention_forward(q, k, v, **kw),
], ids=["reference", "reference_backward", "numpy_flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_bad_alignment_names_the_argument(fn, causal):
    q = np.zeros((4, 8))
    with pytest.raises(ValueError, match="causal_align"):
        fn(q, q, q, causal=causal, causal_align="diagonal")


def test_triton_bad_alignment_names_the_argument():
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    for fn in (flash_attention, flash_attention_forward):
        with pytest.raises(ValueError, match="causal_align"):
            fn(q, q, q, causal=True, causal_align="top-left")


def test_split_causal_is_the_one_rule():
    """Every implementation splits a causal mask the same way: top-left (and bottom-right at N_q == N_k,
    the same mask) stays causal; bottom-right with N_q != N_k is a bound on j - i of N_k - N_q."""
    from flashref.validation import split_causal

    assert split_causal(True, "top_left", 3, 7) == (True, None)
    assert split_causal(True, "bottom_right", 5, 5) == (True, None)
    assert split_causal(True, "bottom_right", 3, 7) == (False, 4)
    assert split_causal(True, "bottom_right", 7, 3) == (False, -4)
    assert split_causal(False, "bottom_right", 3, 7) == (False, None)
    with pytest.raises(ValueError, match="causal_align must be one of"):
        split_causal(True, "bottom", 3, 7)
