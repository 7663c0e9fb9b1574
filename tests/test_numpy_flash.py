"""flashref.numpy_flash against the float64 reference: forward in both loop orders, backward, causal tile
skipping, bad input.

The grid (issue 2): N_q, N_k in {1, 7, 64, 100, 257} (every pair, so N_q != N_k too), d in {1, 16, 64, 80},
block sizes (16, 33, 48) that divide none of them but 64 (16 does), causal and not, logits scaled by 1e3 (a naive exp
would overflow), batch and head dimensions. Each parametrized case loops over d, blocks and logit
scales inside, so the file stays fast on two cores.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from flashref import numpy_flash, reference
from flashref.numpy_flash import (BLOCK_K, BLOCK_Q, flash_attention_backward, flash_attention_forward,
                                  tile_ranges, visited_tiles)
from flashref.tolerance import assert_within_tolerance, dtype_eps

SIZES = (1, 7, 64, 100, 257)
HEAD_DIMS = (1, 16, 64, 80)
BLOCKS = ((16, 33), (48, 16), (33, 48))
EPS64 = 2.0**-52


def _inputs(rng, N_q, N_k, d, batch=(), logit_scale=1.0, dtype=np.float64):
    q = rng.standard_normal(batch + (N_q, d)) * logit_scale
    k = rng.standard_normal(batch + (N_k, d))
    v = rng.standard_normal(batch + (N_k, d))
    return tuple(x.astype(dtype) for x in (q, k, v))


def _max_logit(q, k):
    """max |S| with the default scale: errors of exp(S - m) scale with it."""
    return float(np.max(np.abs(q @ np.swapaxes(k, -1, -2)))) / np.sqrt(q.shape[-1])


def _assert_close64(actual, expected, logit, what):
    """float64: the error may be a few hundred rounding steps of the logits' magnitude (exp turns an
    absolute error of S into a relative error of P) and of the values'."""
    assert np.all(np.isfinite(actual)), f"{what}: NaN or inf"
    bound = 256 * EPS64 * (1.0 + logit) * max(1.0, float(np.max(np.abs(expected))))
    error = float(np.max(np.abs(actual - expected)))
    assert error <= bound, f"{what}: max error {error:.3g} > {bound:.3g}"


# ----------------------------------------------------------------------------------------------------
# Forward, float64
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N_q,N_k", list(itertools.product(SIZES, SIZES)))
def test_forward_matches_float64_reference(N_q, N_k, causal, order):
    rng = np.random.default_rng(1000 * N_q + N_k)
    for d, (block_q, block_k), logit_scale in itertools.product(HEAD_DIMS, BLOCKS[:2], (1.0, 1e3)):
        q, k, v = _inputs(rng, N_q, N_k, d, logit_scale=logit_scale)
        o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k, order=order)
        ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        what = f"d={d} blocks={block_q}x{block_k} logits x{logit_scale:g}"
        assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == q.dtype
        logit = _max_logit(q, k)
        _assert_close64(o, ref_o, logit, f"o, {what}")
        _assert_close64(lse, ref_lse, logit, f"lse, {what}")


@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_batch_and_heads_vectorized(causal, order):
    rng = np.random.default_rng(7)
    for N_q, N_k, d in ((257, 100, 80), (64, 257, 16), (7, 7, 64)):
        q, k, v = _inputs(rng, N_q, N_k, d, batch=(2, 3))
        trace = []
        o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=33, block_k=48, order=order, trace=trace)
        ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        _assert_close64(o, ref_o, _max_logit(q, k), "o")
        _assert_close64(lse, ref_lse, _max_logit(q, k), "lse")
        # one visit per tile for all 6 heads at once: the loop is over tiles, not heads
        assert len(trace) == len(visited_tiles(N_q, N_k, 33, 48, causal, order))


def test_sm_scale_and_default_blocks():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 300, 1100, 32)  # more than one default tile in each direction
    assert 1100 > BLOCK_K and 300 > BLOCK_Q
    for causal, order in itertools.product((False, True), ("fa1", "fa2")):
        o, lse = flash_attention_forward(q, k, v, causal=causal, sm_scale=0.3, order=order)
        ref_o, ref_lse = reference.attention(q, k, v, causal=causal, sm_scale=0.3, return_lse=True)
        _assert_close64(o, ref_o, 10.0, "o")
        _assert_close64(lse, ref_lse, 10.0, "lse")


def test_extreme_logits_never_give_nan():
    """Logits of order 1e5 in float32 (a naive exp overflows at 89) and a causal N_q > N_k: all finite."""
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 100, 7, 16, logit_scale=1e5, dtype=np.float32)
    for causal, order in itertools.product((False, True), ("fa1", "fa2")):
        o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=16, block_k=3, order=order)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
        do = np.ones_like(o)
        for g in flash_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=16, block_k=3):
            assert np.all(np.isfinite(g))


# ----------------------------------------------------------------------------------------------------
# Forward, float32 with the tolerance rule
# ----------------------------------------------------------------------------------------------------

SHAPES32 = ((257, 100, 64), (64, 257, 80), (100, 100, 16), (7, 257, 1), (1, 64, 64), (257, 1, 16))


@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("logit_scale", [1.0, 1e3])
def test_forward_float32_within_tolerance_rule(logit_scale, causal, order):
    rng = np.random.default_rng(11)
    for (N_q, N_k, d), (block_q, block_k) in zip(SHAPES32, itertools.cycle(BLOCKS)):
        q, k, v = _inputs(rng, N_q, N_k, d, batch=(2, 2), logit_scale=logit_scale)
        ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
        base_o, base_lse = reference.attention(q32, k32, v32, causal=causal, return_lse=True)
        o, lse = flash_attention_forward(q32, k32, v32, causal=causal, block_q=block_q, block_k=block_k,
                                         order=order)
        assert o.dtype == np.float32 and lse.dtype == np.float32
        assert_within_tolerance(o, ref_o, base_o, name=f"o {N_q}x{N_k}x{d}")
        assert_within_tolerance(lse, ref_lse, base_lse, name=f"lse {N_q}x{N_k}x{d}")


# ----------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------

BACKWARD_PAIRS = ((1, 1), (7, 100), (100, 7), (64, 64), (257, 100), (100, 257))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N_q,N_k", BACKWARD_PAIRS)
def test_backward_matches_float64_reference(N_q, N_k, causal):
    rng = np.random.default_rng(2000 + N_q + N_k)
    for d, (block_q, block_k), logit_scale in zip(HEAD_DIMS, itertools.cycle(BLOCKS), (1.0, 1e3, 1.0, 1e3)):
        q, k, v = _inputs(rng, N_q, N_k, d, batch=(1, 2), logit_scale=logit_scale)
        do = rng.standard_normal(q.shape)
        o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
        trace = []
        grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k,
                                         trace=trace)
        ref = reference.attention_backward(q, k, v, do, causal=causal)
        logit = _max_logit(q, k)
        for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype
            _assert_close64(g, r, logit, f"{name}, d={d} blocks={block_q}x{block_k} logits x{logit_scale:g}")
        # the backward visits exactly the forward's tiles (in key-block-major order)
        assert sorted(trace) == sorted(visited_tiles(N_q, N_k, block_q, block_k, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("logit_scale", [1.0, 1e3])
def test_backward_float32_within_tolerance_rule(logit_scale, causal):
    """float32 gradients against float64, the baseline being the reference backward in float32.

    Recomputing P = exp(S - lse) turns the absolute rounding error of S and lse (about eps * |S|) into
    a relative error of P, which the stored-P reference does not have where a row is nearly one-hot.
    So the absolute slack is eps * max|S| times the gradient's magnitude: it only matters with the
    1e3-scaled logits.
    """
    rng = np.random.default_rng(13)
    for (N_q, N_k, d), (block_q, block_k) in zip(SHAPES32, itertools.cycle(BLOCKS)):
        q, k, v = _inputs(rng, N_q, N_k, d, batch=(2, 1), logit_scale=logit_scale)
        do = rng.standard_normal(q.shape)
        ref = reference.attention_backward(q, k, v, do, causal=causal)
        q32, k32, v32, do32 = (x.astype(np.float32) for x in (q, k, v, do))
        base = reference.attention_backward(q32, k32, v32, do32, causal=causal)
        o, lse = flash_attention_forward(q32, k32, v32, causal=causal, block_q=block_q, block_k=block_k)
        grads = flash_attention_backward(q32, k32, v32, o, lse, do32, causal=causal, block_q=block_q,
                                         block_k=block_k)
        logit = _max_logit(q, k)
        for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
            assert g.dtype == np.float32
            magnitude = max(1.0, float(np.max(np.abs(r))))
            atol = 2 * dtype_eps(g) * magnitude * max(1.0, 4 * logit)
            assert_within_tolerance(g, r, b, atol=atol, name=f"{name} {N_q}x{N_k}x{d}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N_q,N_k", [(5, 7), (7, 5), (1, 3)])
def test_backward_matches_finite_differences(N_q, N_k, causal):
    """Central differences of L = sum(O * dO), O from the tiled forward itself, at every entry."""
    rng = np.random.default_rng(17)
    q, k, v = _inputs(rng, N_q, N_k, 3)
    do = rng.standard_normal(q.shape)
    blocks = dict(block_q=2, block_k=3)

    def loss(q_, k_, v_):
        return float(np.sum(flash_attention_forward(q_, k_, v_, causal=causal, **blocks)[0] * do))

    o, lse = flash_attention_forward(q, k, v, causal=causal, **blocks)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal, **blocks)
    h = 1e-6
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for idx in np.ndindex(grad.shape):
            plus, minus = [list((q, k, v)) for _ in range(2)]
            plus[which], minus[which] = plus[which].copy(), minus[which].copy()
            plus[which][idx] += h
            minus[which][idx] -= h
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg=f"d{'qkv'[which]}")


# ----------------------------------------------------------------------------------------------------
# Causal tile skipping
# ----------------------------------------------------------------------------------------------------

def _tiles_with_a_visible_key(N_q, N_k, block_q, block_k):
    """The (i, j) tiles holding at least one (query, key) pair with key <= query: brute force."""
    keep = set()
    for i, (q0, q1) in enumerate(tile_ranges(N_q, block_q)):
        for j, (k0, k1) in enumerate(tile_ranges(N_k, block_k)):
            if any(key <= query for query in range(q0, q1) for key in range(k0, k1)):
                keep.add((i, j))
    return keep


@pytest.mark.parametrize("N_q,N_k,block_q,block_k", [(257, 257, 16, 48), (100, 257, 33, 16), (257, 64, 48, 33),
                                                     (64, 64, 16, 16), (1, 257, 16, 16)])
def test_causal_visits_exactly_the_tiles_with_visible_keys(N_q, N_k, block_q, block_k):
    rng = np.random.default_rng(19)
    q, k, v = _inputs(rng, N_q, N_k, 8)
    expected = _tiles_with_a_visible_key(N_q, N_k, block_q, block_k)
    for order in ("fa1", "fa2"):
        trace = []
        flash_attention_forward(q, k, v, causal=True, block_q=block_q, block_k=block_k, order=order, trace=trace)
        assert len(trace) == len(set(trace)), "a tile visited twice"
        assert set(trace) == expected
        assert trace == visited_tiles(N_q, N_k, block_q, block_k, True, order)
        # fa2: query-block-major; fa1: key-block-major
        key = (lambda t: t) if order == "fa2" else (lambda t: (t[1], t[0]))
        assert trace == sorted(trace, key=key)
    trace = []
    flash_attention_forward(q, k, v, causal=False, block_q=block_q, block_k=block_k, trace=trace)
    assert len(trace) == len(tile_ranges(N_q, block_q)) * len(tile_ranges(N_k, block_k))


def test_skipped_key_blocks_are_never_read(monkeypatch):
    """Causal with N_k > N_q: keys 32.. are never attended. Poison them with NaN: the key blocks wholly
    beyond the diagonal must never be read, so every output and gradient stays finite. (The public
    functions refuse NaN inputs; the check is switched off here to watch the algorithm's reads.)"""
    monkeypatch.setattr("flashref.numpy_flash.check_attention_inputs",
                        functools.partial(numpy_flash.check_attention_inputs, finite=False))
    rng = np.random.default_rng(23)
    q, k, v = _inputs(rng, 32, 100, 8)
    k[32:], v[32:] = np.nan, np.nan
    for order in ("fa1", "fa2"):
        o, lse = flash_attention_forward(q, k, v, causal=True, block_q=16, block_k=16, order=order)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
        ref_o = reference.attention(q[:, :], k[:32], v[:32], causal=True)
        _assert_close64(o, ref_o, 10.0, order)
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, np.ones_like(q), causal=True, block_q=16, block_k=16)
    assert np.all(np.isfinite(dq))
    assert np.all(dk[32:] == 0) and np.all(dv[32:] == 0)


# ----------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------

def _ok(rng=np.random.default_rng(29)):
    return _inputs(rng, 10, 12, 4)


@pytest.mark.parametrize("name,value,error", [("block_q", 0, ValueError), ("block_k", -3, ValueError),
                                              ("block_q", 1.5, TypeError), ("block_k", True, TypeError),
                                              ("order", "fa3", ValueError), ("causal", 1, TypeError),
                                              ("sm_scale", float("nan"), ValueError), ("trace", (), TypeError)])
def test_forward_rejects_bad_arguments(name, value, error):
    with pytest.raises(error, match=name):
        flash_attention_forward(*_ok(), **{name: value})


def test_forward_rejects_bad_arrays():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="q"):
        flash_attention_forward(q[0], k, v)
    with pytest.raises(ValueError, match="head dimension"):
        flash_attention_forward(q, k[:, :3], v)
    with pytest.raises(ValueError, match="empty"):
        flash_attention_forward(q[:0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        flash_attention_forward(q.astype(np.float32), k, v)
    with pytest.raises(TypeError, match="float16 or float32 or float64, got int64"):
        flash_attention_forward(*(x.astype(np.int64) for x in (q, k, v)))
    with pytest.raises(TypeError, match="^q must be a NumPy array"):
        flash_attention_forward(q.tolist(), k, v)


def test_backward_rejects_bad_arrays():
    q, k, v = _ok()
    o, lse = flash_attention_forward(q, k, v)
    do = np.ones_like(o)
    with pytest.raises(ValueError, match="^o must have the shape"):
        flash_attention_backward(q, k, v, o[:5], lse, do)
    with pytest.raises(ValueError, match="^do must have the shape"):
        flash_attention_backward(q, k, v, o, lse, do[:, :2])
    with pytest.raises(ValueError, match="^lse must have shape"):
        flash_attention_backward(q, k, v, o, lse[:, None], do)
    with pytest.raises(TypeError, match="^lse must have the dtype"):
        flash_attention_backward(q, k, v, o, lse.astype(np.float32), do)
    with pytest.raises(ValueError, match="block_k"):
        flash_attention_backward(q, k, v, o, lse, do, block_k=0)


@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
def test_float16_within_the_tolerance_rule(order, causal):
    """float16 inputs accumulate in float32, as a GPU kernel does: O within the rule against the float64
    reference, with plain float16 attention as the baseline; gradients likewise (factor 3)."""
    rng = np.random.default_rng(16)
    q, k, v, do = (rng.standard_normal((2, 2, n, 40)) for n in (70, 97, 97, 70))
    q16, k16, v16, do16 = (x.astype(np.float16) for x in (q, k, v, do))
    o, lse = flash_attention_forward(q16, k16, v16, causal=causal, block_q=32, block_k=48, order=order)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    assert_within_tolerance(o, reference.attention(q, k, v, causal=causal),
                            reference.attention(q16, k16, v16, causal=causal), name="O")
    grads = flash_attention_backward(q16, k16, v16, o, lse, do16, causal=causal, block_q=32, block_k=48)
    exact = reference.attention_backward(q, k, v, do, causal=causal)
    plain = reference.attention_backward(q16, k16, v16, do16, causal=causal)
    for name, g, r, b in zip(("dQ", "dK", "dV"), grads, exact, plain):
        assert g.dtype == np.float16
        assert_within_tolerance(g, r, b, factor=3.0, name=name)
