"""flashref.online_softmax: the blocked recurrence and the merge equal the one-shot softmax."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from flashref import online_softmax as osm
from flashref import reference

BLOCKS = [1, 2, 3, 7, 16, 64, 100, 1000]


def one_shot(x):
    """Softmax and lse over the last axis, written out directly in float64."""
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True), (m + np.log(e.sum(-1, keepdims=True)))[..., 0]


@pytest.fixture(autouse=True)
def no_float_warnings():
    """A NaN, overflow or log(0) anywhere in these tests is an error (underflow to 0 is expected)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            yield


@pytest.mark.parametrize("scale", [1.0, 1e3])
@pytest.mark.parametrize("n", [1, 7, 64, 100, 257])
@pytest.mark.parametrize("block", BLOCKS)
def test_blocked_softmax_equals_one_shot(block, n, scale):
    x = np.random.default_rng(n).standard_normal((3, n)) * scale
    p_ref, lse_ref = one_shot(x)
    np.testing.assert_allclose(osm.softmax(x, block), p_ref, rtol=1e-13, atol=1e-300)
    np.testing.assert_allclose(osm.logsumexp(x, block), lse_ref, rtol=1e-14)
    np.testing.assert_allclose(osm.safe_softmax(x), p_ref, rtol=1e-13, atol=1e-300)


def test_one_dimensional_stream_and_lists():
    x = [0.5, -1.0, 3.0, 2.0, 2.0]
    p_ref, lse_ref = one_shot(np.array(x))
    np.testing.assert_allclose(osm.softmax(x, 2), p_ref, rtol=1e-15)
    assert osm.logsumexp(x, 2).shape == ()
    np.testing.assert_allclose(osm.logsumexp([1, 2, 3]), one_shot(np.array([1.0, 2.0, 3.0]))[1])


def test_state_after_stream():
    x = np.array([1.0, 3.0, 2.0, 5.0])
    state = osm.scan(x, 3)
    assert state.m == 5.0
    np.testing.assert_allclose(state.l, np.exp(x - 5).sum(), rtol=1e-15)


def test_running_trace_is_the_running_max_and_sum():
    x = np.array([1.0, 3.0, 2.0, 5.0, 4.0])
    ends, m, l = osm.running_trace(x, 2)
    assert ends.tolist() == [2, 4, 5]
    assert m.tolist() == [3.0, 5.0, 5.0]
    for t, end in enumerate(ends):
        np.testing.assert_allclose(l[t], np.exp(x[:end] - x[:end].max()).sum(), rtol=1e-15)
    ends1, m1, _ = osm.running_trace(x)
    assert m1.tolist() == np.maximum.accumulate(x).tolist() and ends1.tolist() == [1, 2, 3, 4, 5]


def split_states(x, v, rng, n_parts):
    """Cut the last axis of x at random places; one state (with o) per part."""
    cuts = np.sort(rng.choice(np.arange(1, x.shape[-1]), size=n_parts - 1, replace=False))
    states = []
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, x.shape[-1]]):
        s = osm.init(x.shape[:-1], d=v.shape[-1])
        states.append(osm.update(s, x[..., lo:hi], v[lo:hi]))
    return states


@pytest.mark.parametrize("seed", range(8))
def test_merge_in_random_orders_is_exact(seed):
    """Merge adjacent states in a random tree order: the same result as the whole row at once."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 60)) * (1e3 if seed % 2 else 3.0)
    v = rng.standard_normal((60, 5))
    p_ref, lse_ref = one_shot(x)
    states = split_states(x, v, rng, n_parts=int(rng.integers(2, 12)))
    while len(states) > 1:
        i = int(rng.integers(len(states) - 1))
        states[i:i + 2] = [osm.merge(states[i], states[i + 1])]
    o, lse = osm.finalize(states[0])
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-14)
    np.testing.assert_allclose(o, p_ref @ v, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("seed", range(5))
def test_merge_is_associative_and_commutative(seed):
    rng = np.random.default_rng(100 + seed)
    a, b, c = (osm.update(osm.init((3,)), rng.standard_normal((3, n)) * 50) for n in (4, 9, 1))
    left, right = osm.merge(osm.merge(a, b), c), osm.merge(a, osm.merge(b, c))
    swapped = osm.merge(c, osm.merge(b, a))
    for other in (right, swapped):
        np.testing.assert_array_equal(left.m, other.m)
        np.testing.assert_allclose(left.l, other.l, rtol=1e-14)


def test_merge_with_empty_state_is_identity():
    s = osm.update(osm.init((2,), d=3), np.array([[1.0, 2.0], [0.0, -np.inf]]), np.ones((2, 3)))
    for merged in (osm.merge(s, osm.init((2,), d=3)), osm.merge(osm.init((2,), d=3), s)):
        np.testing.assert_array_equal(merged.m, s.m)
        np.testing.assert_array_equal(merged.l, s.l)
        np.testing.assert_array_equal(merged.o, s.o)


def test_all_masked_blocks_give_no_nan():
    x = np.array([[-np.inf, -np.inf, -np.inf, 1.0, 2.0, -np.inf, -np.inf, -np.inf],
                  [-np.inf] * 8,
                  [0.0, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, 3.0]])
    for block in (1, 2, 3, 8):
        state = osm.scan(x, block)
        assert state.m.tolist() == [2.0, -np.inf, 3.0]
        assert state.l[1] == 0.0
        p = osm.softmax(x, block)
        assert not np.isnan(p).any()
        np.testing.assert_allclose(p[0], one_shot(x[0])[0], rtol=1e-15)
        assert p[1].tolist() == [0.0] * 8  # a fully masked row has no weights, and no NaN
        lse = osm.logsumexp(x, block)
        assert lse[1] == -np.inf and np.isfinite(lse[[0, 2]]).all()


def test_state_that_saw_only_masked_scores_then_real_ones():
    s = osm.init((), d=2)
    s = osm.update(s, np.array([-np.inf, -np.inf]), np.ones((2, 2)))
    assert s.m == -np.inf and s.l == 0 and not s.o.any()
    o, lse = osm.finalize(s)
    assert lse == -np.inf and o.tolist() == [0.0, 0.0]
    s = osm.update(s, np.array([0.0, np.log(3.0)]), np.array([[1.0, 0.0], [0.0, 1.0]]))
    o, lse = osm.finalize(s)
    np.testing.assert_allclose(o, [0.25, 0.75], rtol=1e-15)
    np.testing.assert_allclose(lse, np.log(4.0), rtol=1e-15)


def test_rescale_factor_is_what_the_recurrence_uses():
    """After a block raises the max from m to m_new, the old sum is multiplied by exp(m - m_new)."""
    s = osm.update(osm.init(), np.array([0.0, 1.0]))
    s2 = osm.update(s, np.array([4.0]))
    np.testing.assert_allclose(s2.l, s.l * np.exp(1.0 - 4.0) + 1.0, rtol=1e-15)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_k", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("N_q,N_k,d", [(1, 1, 1), (7, 100, 16), (100, 7, 80), (257, 64, 64)])
def test_attention_by_key_blocks_equals_reference(N_q, N_k, d, block_k, causal):
    rng = np.random.default_rng(N_q + N_k + d)
    q = rng.standard_normal((2, 1, N_q, d)) * 10
    k = rng.standard_normal((2, 1, N_k, d)) * 10
    v = rng.standard_normal((2, 1, N_k, d))
    o, lse = osm.attention_by_key_blocks(q, k, v, block_k, causal=causal)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-13, atol=1e-12)


def test_attention_by_key_blocks_extreme_logits_2d():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((33, 8)) for _ in range(3))
    o, lse = osm.attention_by_key_blocks(q * 1e3, k, v, 4, causal=True)
    o_ref, lse_ref = reference.attention(q * 1e3, k, v, causal=True, return_lse=True)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-13)


def test_float32_stays_float32():
    x = np.random.default_rng(2).standard_normal((2, 50)).astype(np.float32) * 1e3
    state = osm.scan(x, 7)
    assert state.m.dtype == np.float32 and state.l.dtype == np.float32
    p = osm.softmax(x, 7)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, one_shot(x.astype(np.float64))[0], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("bad,exc,match", [
    (np.array([1.0, np.nan]), ValueError, "got NaN"),
    (np.array([1.0, np.inf]), ValueError, r"got \+inf"),
    (np.array([1 + 1j]), TypeError, "real"),
    (np.array(["a"]), TypeError, "real"),
    (np.float64(1.0), ValueError, "scalar"),
    ([[1.0, 2.0], [3.0]], ValueError, "x must be a rectangular array"),
])
def test_bad_scores(bad, exc, match):
    with pytest.raises(exc, match=match):
        osm.softmax(bad)


def test_ragged_value_rows_are_named():
    with pytest.raises(ValueError, match="v_block must be a rectangular array"):
        osm.update(osm.init((1,), d=2), [[1.0, 2.0]], [[1.0, 2.0], [3.0]])
    with pytest.raises(TypeError, match="v_block must be real numbers, got dtype complex128"):
        osm.update(osm.init((1,), d=2), [[1.0, 2.0]], np.ones((2, 2), complex))


@pytest.mark.parametrize("block,exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_block_size(block, exc):
    with pytest.raises(exc, match="block_size"):
        osm.softmax(np.ones(4), block)


def test_update_and_merge_misuse():
    with pytest.raises(ValueError, match="v_block"):
        osm.update(osm.init(), np.ones(2), np.ones((2, 1)))
    with pytest.raises(ValueError, match="v_block"):
        osm.update(osm.init(d=1), np.ones(2))
    with pytest.raises(ValueError, match="both"):
        osm.merge(osm.init(), osm.init(d=1))


@pytest.mark.parametrize("split", [1, 6, 10])
@pytest.mark.parametrize("as_torch", [False, True])
def test_merge_outputs_of_two_key_sets_is_attention_over_both(split, as_torch):
    """(O, lse) of keys [0, split) and of [split, N_k), merged, are attention over all keys; a part with no key
    (split = N_k: the second is empty, lse = -inf) weighs nothing."""
    import torch

    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 5, 8)) * 4
    k, v = rng.standard_normal((2, 3, 10, 8)), rng.standard_normal((2, 3, 10, 8))
    want_o, want_lse = reference.attention(q, k, v, return_lse=True)
    a = reference.attention(q, k[..., :split, :], v[..., :split, :], return_lse=True)
    if split < 10:
        b = reference.attention(q, k[..., split:, :], v[..., split:, :], return_lse=True)
    else:
        b = (np.zeros_like(a[0]), np.full_like(a[1], -np.inf))
    args = [torch.from_numpy(x) if as_torch else x for x in (*a, *b)]
    o, lse = osm.merge_outputs(*args)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=0, atol=1e-12)


def test_merge_outputs_of_two_empty_parts_is_zero_not_nan():
    empty = np.full((2, 3), -np.inf)
    o, lse = osm.merge_outputs(np.zeros((2, 3, 4)), empty, np.zeros((2, 3, 4)), empty)
    assert np.all(o == 0) and np.all(np.isneginf(lse))


def test_merge_outputs_misuse():
    import torch

    with pytest.raises(TypeError, match="one array type"):
        osm.merge_outputs(np.zeros((2, 4)), np.zeros(2), torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="lse.shape"):
        osm.merge_outputs(np.zeros((2, 4)), np.zeros(3), np.zeros((2, 4)), np.zeros(3))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_merge_outputs_in_place_writes_the_same_merge_into_o_a(lib):
    """``inplace=True`` (ring attention's running O in float32) gives the merge's values, written into o_a and
    lse_a, through views too, with no NaN where a part saw no key."""
    import torch

    rng = np.random.default_rng(3)
    o_a, o_b = rng.standard_normal((2, 5, 3, 8))
    lse_a, lse_b = rng.standard_normal((2, 5, 3))
    lse_a[0, 0] = lse_b[0, 0] = -np.inf  # a row no part saw
    lse_b[1, 1] = -np.inf                # a row only part a saw
    want_o, want_lse = osm.merge_outputs(o_a, lse_a, o_b, lse_b)
    conv = (lambda x: x.copy()) if lib == "numpy" else torch.from_numpy
    big_o, big_lse = conv(np.zeros((5, 6, 8))), conv(np.zeros((5, 6)))
    big_o[:, 1:4], big_lse[:, 1:4] = conv(o_a), conv(lse_a)
    got_o, got_lse = osm.merge_outputs(big_o[:, 1:4], big_lse[:, 1:4], conv(o_b), conv(lse_b), inplace=True)
    np.testing.assert_allclose(np.asarray(big_o[:, 1:4]), want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(big_lse[:, 1:4]), want_lse)
    assert np.asarray(got_o).shape == want_o.shape and np.isfinite(np.asarray(big_o)).all()
    assert (np.asarray(big_o[:, 0]) == 0).all() and (np.asarray(big_o[:, 4:]) == 0).all()  # only the view written


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_merge_outputs_refuses_integers_nan_and_a_non_bool_inplace(lib):
    import torch

    arr = (lambda x: np.asarray(x)) if lib == "numpy" else (lambda x: torch.as_tensor(np.asarray(x)))
    o, lse = arr(np.ones((2, 3))), arr(np.zeros(2))
    with pytest.raises(TypeError, match="o_a must have a floating-point dtype"):
        osm.merge_outputs(arr(np.ones((2, 3), int)), lse, o, lse)  # 0.5 weights would truncate to 0
    with pytest.raises(TypeError, match="lse_b must have a floating-point dtype"):
        osm.merge_outputs(o, lse, o, arr(np.zeros(2, int)), inplace=True)
    with pytest.raises(ValueError, match=r"lse_a must be finite or -inf \(a masked score\), got \+inf"):
        osm.merge_outputs(o, arr([0.0, np.inf]), o, lse)
    with pytest.raises(ValueError, match="o_b must be finite"):
        osm.merge_outputs(o, lse, arr([[0.0, np.nan, 0.0], [0.0, 0.0, 0.0]]), lse)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        osm.merge_outputs(o, lse, o, lse, inplace="no")
    merged, _ = osm.merge_outputs(o, arr([0.0, -np.inf]), o, arr([0.0, -np.inf]))  # -inf: a part that saw no key
    np.testing.assert_array_equal(np.asarray(merged), [[1.0] * 3, [0.0] * 3])
    bad_o = arr([[0.0, np.nan, 0.0], [0.0, 0.0, 0.0]])  # check_finite=False trusts the caller (ring attention)
    assert np.isnan(np.asarray(osm.merge_outputs(bad_o, lse, o, lse, check_finite=False)[0])).any()


@pytest.mark.parametrize("shape, dtype", [(5, np.float64), ("ab", np.float64), ((2, -1), np.float64),
                                          ((2.0,), np.float64), ((2,), np.int64)])
def test_init_names_a_bad_shape_or_dtype(shape, dtype):
    with pytest.raises(TypeError, match="shape must be a tuple" if dtype is np.float64 else "dtype must be"):
        osm.init(shape, dtype=dtype)
