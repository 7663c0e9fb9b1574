"""Score and mask modifications (token window, softcap, ALiBi) and packed variable-length batches in the
float64 reference and in numpy_flash: each checked against an explicit formula written here, finite
differences, per-document attention, and each other."""

from __future__ import annotations

import re

import numpy as np
import pytest

from flashref import numpy_flash
from flashref import reference as ref
from flashref.tolerance import assert_within_tolerance

from tests._finite_differences import assert_reference_gradients_match

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])


def _inputs(B=2, H=4, H_kv=2, N_q=33, N_k=47, d=8, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N_q, d)) * scale
    k, v = (rng.standard_normal((B, H_kv, N_k, d)) for _ in range(2))
    return rng, q, k, v


def _explicit(q, k, v, causal, window, softcap, slopes):
    """Attention written out from the definition in flashref.score_mods: cap, bias, mask, softmax."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, 1), np.repeat(v, G, 1)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :]
    if slopes is not None:
        s = s - slopes.reshape(1, -1, 1, 1) * np.abs(i - j)
    visible = np.ones(s.shape[-2:], bool)
    if causal:
        visible &= j <= i
    if window[0] >= 0:
        visible &= j >= i - window[0]
    if window[1] >= 0:
        visible &= j <= i + window[1]
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, np.log(np.where(l > 0, l, 1))[..., 0] + m[..., 0], -np.inf)
    return (p / np.where(l > 0, l, 1)) @ v, lse


MODS = [
    dict(window_size=(5, 3)),
    dict(window_size=(0, 0)),
    dict(window_size=(-1, 7)),
    dict(window_size=(12, -1)),
    dict(softcap=2.0),
    dict(alibi_slopes=SLOPES),
    dict(window_size=(6, 2), softcap=3.0, alibi_slopes=SLOPES),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", MODS, ids=[",".join(m) for m in MODS])
def test_reference_modifications_follow_their_definition(mods, causal):
    _, q, k, v = _inputs(scale=3.0)  # logits large enough that the cap matters
    o, lse = ref.attention(q, k, v, causal=causal, return_lse=True, **mods)
    want_o, want_lse = _explicit(q, k, v, causal, mods.get("window_size", (-1, -1)), mods.get("softcap", 0.0),
                                 mods.get("alibi_slopes"))
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12, atol=1e-12)


def test_a_window_that_leaves_a_row_without_keys_gives_zeros_and_minus_inf():
    _, q, k, v = _inputs(N_q=40, N_k=20)
    o, lse = ref.attention(q, k, v, return_lse=True, window_size=(3, 0))
    assert np.all(o[..., 23:, :] == 0) and np.all(np.isneginf(lse[..., 23:]))   # rows 23.. see keys >= 20 only
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[..., :23]))
    grads = ref.attention_backward(q, k, v, np.ones_like(q), window_size=(3, 0))
    assert np.all(grads[0][..., 23:, :] == 0) and all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_every_modification_match_finite_differences(causal):
    rng, q, k, v = _inputs(H=4, H_kv=2, N_q=21, N_k=30, d=5, scale=2.0)
    blocks = rng.random((2, 4, 3, 4)) > 0.2
    keep = rng.random((2, 4, 21, 30)) > 0.2
    kw = dict(causal=causal, window_size=(9, 4), softcap=2.5, alibi_slopes=SLOPES, block_mask=blocks, block_size=8,
              dropout_mask=keep, dropout_p=0.2)
    assert_reference_gradients_match(q, k, v, rng.standard_normal(q.shape), rng, **kw)


@pytest.mark.parametrize("order", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", MODS, ids=[",".join(m) for m in MODS])
def test_numpy_flash_learns_the_modifications(mods, causal, order):
    rng, q, k, v = _inputs(scale=3.0, seed=4)
    do = rng.standard_normal(q.shape)
    trace = []
    o, lse = numpy_flash.flash_attention_forward(q, k, v, causal, block_q=8, block_k=8, order=order, trace=trace,
                                                 **mods)
    want_o, want_lse = ref.attention(q, k, v, causal, return_lse=True, **mods)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12, atol=1e-12)
    grads = numpy_flash.flash_attention_backward(q, k, v, o, lse, do, causal, block_q=8, block_k=8, **mods)
    for got, want in zip(grads, ref.attention_backward(q, k, v, do, causal, **mods)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)
    left, right = mods.get("window_size", (-1, -1))
    outside = {(i, j) for i in range(5) for j in range(6)
               if (left >= 0 and 8 * j + 7 < 8 * i - left) or (right >= 0 and 8 * j > min(8 * i + 7, 32) + right)}
    assert not outside & set(trace), "a tile wholly outside the window is never visited"


def test_numpy_flash_modifications_compose_with_gqa_block_mask_dropout_in_float16():
    rng, q, k, v = _inputs(H=4, H_kv=1, N_q=30, N_k=41, seed=6)
    blocks = rng.random((1, 4, 4, 6)) > 0.3
    keep = rng.random((2, 4, 30, 41)) > 0.1
    kw = dict(causal=True, window_size=(20, 0), softcap=1.5, alibi_slopes=np.tile(SLOPES, (2, 1)),
              block_mask=blocks, block_size=8, dropout_mask=keep, dropout_p=0.1)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    o, lse = numpy_flash.flash_attention_forward(q16, k16, v16, block_q=16, block_k=8, **kw)
    assert o.dtype == np.float16
    # the tolerance rule: float64 on the same fp16 inputs, against the reference computed in fp16
    want = ref.attention(*(x.astype(np.float64) for x in (q16, k16, v16)), **kw)
    assert_within_tolerance(o, want, ref.attention(q16, k16, v16, **kw), name="o")


# ------------------------------------------------------------------------------------------------------------
# Packed variable-length batches
# ------------------------------------------------------------------------------------------------------------

LENGTHS = [(1, 17, 255, 100), (5, 1, 30)]


def _packed(lengths_q, lengths_k, H=4, H_kv=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.cumsum([0, *lengths_q]), np.cumsum([0, *lengths_k])
    q = rng.standard_normal((cu_q[-1], H, d))
    k, v = (rng.standard_normal((cu_k[-1], H_kv, d)) for _ in range(2))
    return rng, q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_varlen_is_attention_of_each_document_alone(lengths, causal):
    lengths_k = tuple(n + (3 if i % 2 else 0) for i, n in enumerate(lengths))  # N_k != N_q for some documents
    rng, q, k, v, cu_q, cu_k = _packed(lengths, lengths_k)
    slopes = np.tile(SLOPES, (len(lengths), 1)) * np.arange(1, len(lengths) + 1)[:, None]
    kw = dict(causal=causal, window_size=(40, 5), softcap=4.0, alibi_slopes=slopes)
    o, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths_k), return_lse=True, **kw)
    assert o.shape == q.shape and lse.shape == (4, cu_q[-1])
    do = rng.standard_normal(q.shape)
    grads = ref.attention_varlen_backward(q, k, v, do, cu_q, cu_k, **kw)
    for b in range(len(lengths)):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        doc = lambda x, r: x[r].transpose(1, 0, 2)[None]  # noqa: E731
        one = dict(kw, alibi_slopes=slopes[b])
        want_o, want_lse = ref.attention(doc(q, rows), doc(k, cols), doc(v, cols), return_lse=True, **one)
        np.testing.assert_array_equal(o[rows], want_o[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, rows], want_lse[0])
        want = ref.attention_backward(doc(q, rows), doc(k, cols), doc(v, cols), doc(do, rows), **one)
        for g, w, r in zip(grads, want, (rows, cols, cols)):
            np.testing.assert_array_equal(g[r], w[0].transpose(1, 0, 2))
    # and the tiled version agrees, tile for tile no document mixing with the next
    o2, lse2 = numpy_flash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, block_q=16, block_k=16,
                                                          **{k_: v_ for k_, v_ in kw.items() if k_ != "causal"})
    np.testing.assert_allclose(o2, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse2, lse, rtol=1e-12, atol=1e-12)
    grads2 = numpy_flash.flash_attention_varlen_backward(q, k, v, o2, lse2, do, cu_q, cu_k, causal=causal,
                                                         block_q=16, block_k=16,
                                                         **{k_: v_ for k_, v_ in kw.items() if k_ != "causal"})
    for g2, g in zip(grads2, grads):
        np.testing.assert_allclose(g2, g, rtol=1e-11, atol=1e-11)


def test_varlen_never_lets_a_query_see_another_document():
    _, q, k, v, cu, _ = _packed((6, 9), (6, 9), H=2, H_kv=2)
    v2 = v.copy()
    v2[6:] += 100.0                                       # change only the second document's values
    o, o2 = ref.attention_varlen(q, k, v, cu, cu), ref.attention_varlen(q, k, v2, cu, cu)
    np.testing.assert_array_equal(o[:6], o2[:6])


@pytest.mark.parametrize("args, exc, words", [
    (dict(cu_seqlens_q=[0, 0, 15]), ValueError, "cu_seqlens_q holds an empty (or negative) sequence: document 0"),
    (dict(cu_seqlens_k=[1, 6, 15]), ValueError, "cu_seqlens_k must start at 0 and end at"),
    (dict(cu_seqlens_q=[0, 6, 14]), ValueError, "end at the packed length 15"),
    (dict(cu_seqlens_q=[0.0, 6.0, 15.0]), TypeError, "cu_seqlens_q must be a 1-D array of integers"),
    (dict(cu_seqlens_q=[[0, 6, 15]]), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_k=[0, 15]), ValueError, "the same number of documents, got 2 and 1"),
    (dict(max_seqlen_q=8), ValueError, "max_seqlen_q = 8 is shorter than the longest document of cu_seqlens_q (9)"),
])
def test_bad_packing_is_a_clear_error(args, exc, words):
    _, q, k, v, cu, _ = _packed((6, 9), (6, 9), H=2, H_kv=2)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu) | args
    with pytest.raises(exc, match=re.escape(words)):
        ref.attention_varlen(q, k, v, **kw)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(window_size=5), TypeError, "window_size must be a pair (left, right)"),
    (dict(window_size=(-2, 0)), ValueError, "window_size's left side must be >= -1"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size's left side must be an integer"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes must have shape (H,) = (4,) or (B, H) = (2, 4)"),
    (dict(alibi_slopes=np.array([1, np.nan, 1, 1])), ValueError, "alibi_slopes must be finite"),
    (dict(alibi_slopes=["a"] * 4), TypeError, "alibi_slopes must be an array of real numbers"),
])
def test_bad_modification_arguments_name_themselves(kwargs, exc, words):
    _, q, k, v = _inputs()
    with pytest.raises(exc, match=re.escape(words)):
        ref.attention(q, k, v, **kwargs)
    with pytest.raises(exc, match=re.escape(words)):
        numpy_flash.flash_attention_forward(q, k, v, **kwargs)


def test_varlen_messages_show_the_packed_arrays_as_given():
    """A NaN is named at its index in the caller's packed array, a head dimension against the caller's k."""
    from flashref import numpy_flash, reference

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((9, 2, 4)), rng.standard_normal((11, 2, 4))
    q[5, 1, 2] = np.nan
    for fn in (reference.attention_varlen, numpy_flash.flash_attention_varlen_forward):
        with pytest.raises(ValueError, match=r"q must be finite \(no NaN or inf\), got NaN at index \(5, 1, 2\)"):
            fn(q, k, k, [0, 4, 9], [0, 5, 11])
        with pytest.raises(ValueError, match=r"k must have the head dimension of q \(d = 3\), got k.shape \(11, 2,"):
            fn(q[..., :3] * 0, k, k, [0, 4, 9], [0, 5, 11])
        with pytest.raises(ValueError, match="H_kv that divides q's H = 3"):
            fn(np.zeros((9, 3, 4)), k, k, [0, 4, 9], [0, 5, 11])
        with pytest.raises(TypeError, match="dtype"):  # strings have no NaN to look for: their dtype is named
            fn(np.full((9, 2, 4), "a"), k, k, [0, 4, 9], [0, 5, 11])
