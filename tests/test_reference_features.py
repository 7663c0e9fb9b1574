"""The float64 reference's grouped-query attention, block mask and dropout: the oracle the kernels are
checked against, itself checked against repeated heads, explicit masks and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from flashref import reference as ref

from tests._finite_differences import assert_reference_gradients_match


def _inputs(B=2, H=4, H_kv=2, N_q=33, N_k=47, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N_q, d))
    k, v = (rng.standard_normal((B, H_kv, N_k, d)) for _ in range(2))
    return rng, q, k, v


def test_gqa_is_attention_with_repeated_kv_heads():
    _, q, k, v = _inputs(H=6, H_kv=2)
    rep = lambda x: np.repeat(x, 3, axis=1)  # noqa: E731  (query head h uses K/V head h // 3)
    o, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    o2, lse2 = ref.attention(q, rep(k), rep(v), causal=True, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    do = np.random.default_rng(1).standard_normal(q.shape)
    dq, dk, dv = ref.attention_backward(q, k, v, do, causal=True)
    dq2, dk2, dv2 = ref.attention_backward(q, rep(k), rep(v), do, causal=True)
    np.testing.assert_allclose(dq, dq2, rtol=1e-13, atol=1e-13)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_allclose(dk, dk2.reshape(2, 2, 3, 47, 8).sum(axis=2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, dv2.reshape(2, 2, 3, 47, 8).sum(axis=2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block_size", [1, 16, 40, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_is_an_element_mask(block_size, causal):
    rng, q, k, v = _inputs()
    blocks = rng.random((2, 1, -(-33 // block_size), -(-47 // block_size))) > 0.4
    o, lse = ref.attention(q, k, v, causal=causal, block_mask=blocks, block_size=block_size, return_lse=True)
    visible = blocks[:, :, np.arange(33)[:, None] // block_size, np.arange(47)[None, :] // block_size]
    if causal:
        visible = visible & np.tril(np.ones((33, 47), bool))
    s = np.where(visible, q @ np.repeat(k, 2, 1).swapaxes(-1, -2) / np.sqrt(8), -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        want = np.nan_to_num(p / p.sum(-1, keepdims=True)) @ np.repeat(v, 2, 1)
        want_lse = np.log(p.sum(-1)) + np.where(np.isfinite(m), m, 0)[..., 0]
    np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_row_that_sees_no_key_is_zero_with_lse_minus_inf_and_zero_gradients():
    _, q, k, v = _inputs()
    blocks = np.ones((1, 1, 3, 3), bool)
    blocks[..., 1, :] = False  # queries 16..31 see nothing
    o, lse = ref.attention(q, k, v, block_mask=blocks, block_size=16, return_lse=True)
    assert np.all(o[..., 16:32, :] == 0) and np.all(np.isneginf(lse[..., 16:32]))
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[..., :16]))
    do = np.ones_like(q)
    dq, dk, dv = ref.attention_backward(q, k, v, do, block_mask=blocks, block_size=16)
    assert np.all(dq[..., 16:32, :] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


def test_dropout_scales_the_kept_entries():
    rng, q, k, v = _inputs()
    keep = rng.random((2, 4, 33, 47)) > 0.25
    o = ref.attention(q, k, v, dropout_mask=keep, dropout_p=0.25)
    p = np.exp(ref.scores(q, k, False, 1 / np.sqrt(8)) - ref.attention(q, k, v, return_lse=True)[1][..., None])
    np.testing.assert_allclose(o, (p * keep / 0.75) @ np.repeat(v, 2, 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_every_feature_together_match_finite_differences(causal):
    rng, q, k, v = _inputs(H=4, H_kv=1, N_q=21, N_k=30, d=5)
    blocks = rng.random((2, 4, 3, 4)) > 0.3
    keep = rng.random((2, 4, 21, 30)) > 0.2
    kw = dict(causal=causal, dropout_mask=keep, dropout_p=0.2, block_mask=blocks, block_size=8)
    assert_reference_gradients_match(q, k, v, rng.standard_normal(q.shape), rng, **kw)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(dropout_p=0.1), ValueError, "needs the dropout_mask"),
    (dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
    (dict(dropout_mask=np.ones((33, 47), bool)), ValueError, "dropout_p = 0.0"),
    (dict(dropout_mask=np.ones((33, 47)), dropout_p=0.1), TypeError, "boolean keep-mask"),
    (dict(dropout_mask=np.ones((33, 46), bool), dropout_p=0.1), ValueError, "dropout_mask must broadcast"),
    (dict(block_mask=np.ones((1, 1, 2, 1), bool)), ValueError, "block_mask must have shape (B or 1, H or 1, 1, 1)"),
    (dict(block_mask=np.ones((1, 1, 3, 3), bool), block_size=32), ValueError, "(B or 1, H or 1, 2, 2)"),
    (dict(block_mask=np.ones((1, 1, 1, 1), int)), TypeError, "block_mask must be boolean"),
    (dict(block_mask=np.ones((1, 1, 1, 1), bool), block_size=0), ValueError, "block_size must be a positive int"),
    (dict(block_mask=np.ones((3, 1, 1, 1), bool)), ValueError, "block_mask must have shape"),
])
def test_bad_feature_arguments_name_themselves(kwargs, exc, words):
    _, q, k, v = _inputs()
    with pytest.raises(exc, match=__import__("re").escape(words)):
        ref.attention(q, k, v, **kwargs)


def test_bad_kv_head_count_is_a_clear_error():
    _, q, k, v = _inputs(H=4, H_kv=3)
    with pytest.raises(ValueError, match="H_kv that divides q's H = 4"):
        ref.attention(q, k, v)


@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H, H_kv, N_q, N_k, block_size", [(4, 2, 33, 47, 8), (3, 1, 20, 70, 16), (2, 2, 1, 1, 128)])
def test_numpy_flash_learns_the_same_keywords(order, causal, H, H_kv, N_q, N_k, block_size):
    """numpy_flash's tiled forward and backward with grouped-query heads, a block mask and dropout all at
    once equal the reference to float64 rounding; tiles that no head sees are skipped."""
    from flashref import numpy_flash

    rng, q, k, v = _inputs(B=2, H=H, H_kv=H_kv, N_q=N_q, N_k=N_k, d=8, seed=3)
    blocks = rng.random((1, H, -(-N_q // block_size), -(-N_k // block_size))) > 0.4
    keep = rng.random((2, H, N_q, N_k)) > 0.2
    kw = dict(causal=causal, block_mask=blocks, block_size=block_size, dropout_mask=keep, dropout_p=0.2)
    do = rng.standard_normal(q.shape)
    trace = []
    o, lse = numpy_flash.flash_attention_forward(q, k, v, block_q=16, block_k=16, order=order, trace=trace, **kw)
    ref_o, ref_lse = ref.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(o, ref_o, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)], rtol=1e-12, atol=1e-12)
    grads = numpy_flash.flash_attention_backward(q, k, v, o, lse, do, block_q=16, block_k=16, **kw)
    for got, want in zip(grads, ref.attention_backward(q, k, v, do, **kw)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)
    hidden = [(i, j) for i in range(-(-N_q // 16)) for j in range(-(-N_k // 16))
              if not blocks[..., (np.arange(16 * i, min(16 * i + 16, N_q)) // block_size)[:, None],
                            (np.arange(16 * j, min(16 * j + 16, N_k)) // block_size)[None, :]].any()]
    assert not set(hidden) & set(trace), "a tile the block mask hides from every head is never visited"
