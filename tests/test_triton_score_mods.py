"""flashref.triton's score and mask modifications (a token window, a softcap, ALiBi) and packed
variable-length batches, forward and backward, against the float64 reference with the same keywords. The
tolerance rule's baseline is plain attention in the inputs' precision with the same modifications. In Triton's
CPU interpreter on CI; compiled on the GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashref import reference
from flashref.tolerance import assert_within_tolerance
from flashref.triton import dropout_mask, flash_attention, flash_attention_forward, flash_attention_varlen
from tests._triton_helpers import DEVICE, INTERPRETER_LANES
from tests._triton_helpers import no_autotune  # noqa: F401  (an autouse fixture: applies here)
from tests._triton_helpers import feature_inputs as _inputs
from tests._triton_helpers import np64 as _np64
from tests._triton_helpers import plain_with_features

DTYPES = [torch.float32, torch.float16]


def _plain(q, k, v, do, causal, window=(-1, -1), softcap=0.0, slopes=None, keep=None, p=0.0):
    return plain_with_features(q, k, v, do, causal, keep=keep, p=p, window=window, softcap=softcap, slopes=slopes)


def _assert_close(got, refs, base, dtype, names=("o", "dq", "dk", "dv")):
    for name, x, r, b in zip(names, got, refs, base):
        assert x.shape == b.shape and torch.isfinite(x).all(), f"{name}: shape or non-finite values"
        atol = 1e-5 * max(1.0, float(np.abs(r).max())) if dtype == torch.float32 else None
        assert_within_tolerance(x, r, b, factor=2.0 if name == "o" else 3.0, atol=atol, name=name)


def _check(B, H, H_kv, N_q, N_k, d, dtype, causal, window=(-1, -1), softcap=0.0, alibi=None, p=0.0,
           block_shape=None, block_size=32, seed=0, scale=1.0):
    """flash_attention with the given modifications against the float64 reference: o, lse and gradients."""
    q, k, v, do = _inputs(B, H, H_kv, N_q, N_k, d, dtype, seed, scale)
    gen = torch.Generator().manual_seed(seed + 1)
    slopes = None
    if alibi is not None:  # "H" or "BH": one slope per head, or per (batch, head)
        slopes = torch.rand((H,) if alibi == "H" else (B, H), generator=gen).to(DEVICE)
    block_mask = None if block_shape is None else (torch.rand(block_shape, generator=gen) < 0.7).to(DEVICE)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, dropout_p=p,
              seed=seed if p else None, block_mask=block_mask, block_size=block_size)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, **kw)
    o.backward(do)
    got = [o.detach(), qq.grad, kk.grad, vv.grad]
    _, lse = flash_attention_forward(q, k, v, **kw)

    ref_kw = dict(causal=causal, window_size=window, softcap=softcap,
                  alibi_slopes=None if slopes is None else slopes.cpu().numpy())
    keep = None
    if p:
        keep = dropout_mask(seed, B, H, N_q, N_k, p, DEVICE)
        ref_kw.update(dropout_mask=keep.cpu().numpy(), dropout_p=p)
    if block_mask is not None:
        ref_kw.update(block_mask=block_mask.cpu().numpy(), block_size=block_size)
    q64, k64, v64, do64 = (_np64(x) for x in (q, k, v, do))
    ref_o, ref_lse = reference.attention(q64, k64, v64, return_lse=True, **ref_kw)
    refs = [ref_o, *reference.attention_backward(q64, k64, v64, do64, **ref_kw)]
    if block_mask is None:  # the baseline: plain attention in the inputs' precision
        base = _plain(q, k, v, do, causal, window, softcap, slopes, keep, p)
    else:  # with a block mask: the reference rounded to the dtype stands in (the block mask is tested elsewhere)
        base = [torch.from_numpy(r).to(dtype).to(DEVICE) for r in refs]
    _assert_close(got, refs, base, dtype)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(_np64(lse)), empty), "lse is -inf exactly on the rows that see no key"
    np.testing.assert_allclose(_np64(lse)[~empty], ref_lse[~empty], rtol=0,
                               atol=1e-4 * max(1.0, np.abs(ref_lse[~empty]).max(initial=0)))
    return got


# The interpreter's tiles are 32 x 16 (forward, dQ) and 16 x 32 (dK/dV): windows of 5 to 40 keys make
# tiles wholly outside, partly inside and wholly inside the window in every kernel.
WINDOWS = [(0, 0), (5, 0), (20, 5), (10, -1), (-1, 7), (40, 40)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_window(window, causal):
    _check(1, 2, 1, 70, 95, 16, torch.float32, causal, window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N_q, N_k", [(1, 1), (1, 40), (47, 33), (96, 64)])
def test_window_uneven_shapes(N_q, N_k, dtype):
    _check(2, 2, 2, N_q, N_k, 16, dtype, True, window=(9, 0))
    _check(1, 2, 1, N_q, N_k, 16, dtype, False, window=(3, 12))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap(softcap, causal, dtype):
    # scale 4: scores of a few units, so a cap of 0.5 bends nearly every score and 30 almost none
    _check(1, 2, 1, 70, 95, 16, dtype, causal, softcap=softcap, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q, N_k", [(1, 1), (1, 47), (47, 1)])
@INTERPRETER_LANES  # fp16 with one key: the padded key slots' dS overflows fp16 (never stored)
def test_softcap_and_alibi_on_one_query_or_one_key(N_q, N_k, causal, dtype):
    _check(1, 2, 1, N_q, N_k, 16, dtype, causal, softcap=0.5, scale=4.0)
    _check(2, 4, 2, N_q, N_k, 16, dtype, causal, alibi="BH")


def test_softcap_with_extreme_logits():
    """Logits of 1e3: the cap holds every score within c, and nothing overflows."""
    _check(1, 2, 2, 47, 33, 16, torch.float32, False, softcap=20.0, scale=1e3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("alibi", ["H", "BH"])
def test_alibi(alibi, causal, dtype):
    _check(2, 4, 2, 70, 95, 16, dtype, causal, alibi=alibi)


@pytest.mark.parametrize("causal", [False, True])
def test_everything_together(causal):
    """Window, softcap, ALiBi, grouped heads (a split dK/dV group), dropout and a block mask in one call."""
    _check(2, 4, 2, 70, 95, 16, torch.float32, causal, window=(30, 10), softcap=2.0, alibi="BH", p=0.2,
           block_shape=(2, 1, 3, 3), block_size=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@INTERPRETER_LANES  # as above: the padded key slots of the last key tile
def test_alibi_at_the_edge_of_a_window(dtype):
    """Causal, a window of 50, ALiBi, N_q > N_k: rows past the last key see only keys 40 to 50 away, whose
    bias puts every score far below 0, after a masked tile in which they saw nothing. The running max must
    stay -inf through that tile: a stand-in max of 0 carried on rounds their P to 0 in the fp16 P V product."""
    _check(1, 3, 3, 150, 97, 16, dtype, True, window=(50, 0), alibi="H", seed=1)


def test_window_with_every_score_far_below_zero():
    """Every score below -150 (q.k < 0 everywhere, logits scaled by 100), windowed so that rows see nothing in
    their first key tile: exp2 of a score against a stand-in max of 0 would be 0 in fp32, and the rows would
    come out empty (o = 0, lse = -inf) instead of averaging their keys."""
    q, k, v, do = _inputs(1, 2, 1, 70, 95, 16, torch.float32)
    q, k = 100 * (q.abs() + 0.5), -(k.abs() + 0.5)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, window_size=(5, 20))
    o.backward(do)
    _, lse = flash_attention_forward(q, k, v, window_size=(5, 20))
    q64, k64, v64, do64 = (_np64(x) for x in (q, k, v, do))
    ref_o, ref_lse = reference.attention(q64, k64, v64, return_lse=True, window_size=(5, 20))
    refs = [ref_o, *reference.attention_backward(q64, k64, v64, do64, window_size=(5, 20))]
    assert ref_lse.max() < -150, "the case needs every score far below 0 (exp2 of -216 is 0 in fp32)"
    base = _plain(q, k, v, do, False, window=(5, 20))
    _assert_close([o.detach(), qq.grad, kk.grad, vv.grad], refs, base, torch.float32)
    np.testing.assert_allclose(_np64(lse), ref_lse, rtol=1e-6)


def test_window_rows_that_see_no_key_are_zero():
    """With N_q > N_k and a window, the last queries see no key: o = 0, lse = -inf, zero gradients."""
    q, k, v, do = _inputs(1, 2, 1, 80, 30, 16, torch.float32)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, window_size=(5, 5))
    o.backward(do)
    _, lse = flash_attention_forward(q, k, v, window_size=(5, 5))
    assert torch.all(o[:, :, 35:] == 0) and torch.all(torch.isneginf(lse[:, :, 35:]))
    assert torch.isfinite(lse[:, :, :35]).all() and torch.all(qq.grad[:, :, 35:] == 0)
    assert all(torch.isfinite(x.grad).all() for x in (qq, kk, vv))


@INTERPRETER_LANES  # NaN keys on purpose: the masked tiles that do load them reduce over NaN
def test_tiles_outside_the_window_are_never_loaded():
    """NaN in the keys and values of the first 16 positions: queries whose window does not reach their tile
    stay finite, forward and backward, which only happens if that tile is skipped (a masked load would spread
    the NaN through P V and dS K). check_finite=False lets the NaN in. Rows from 256 on are clear of it for
    every tile size up to 128 (query blocks from 256 start their keys at 236 or later)."""
    N, w = 512, 20
    q, k, v, do = _inputs(1, 1, 1, N, N, 16, torch.float32)
    k[:, :, :16] = float("nan")
    v[:, :, :16] = float("nan")
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, True, window_size=(w, 0), check_finite=False)
    o.backward(do)
    assert torch.isfinite(o[:, :, 256:]).all() and torch.isnan(o[:, :, :16]).any()
    assert torch.isfinite(qq.grad[:, :, 256:]).all()
    assert torch.isfinite(kk.grad[:, :, 256:]).all() and torch.isfinite(vv.grad[:, :, 256:]).all()


# --------------------------------------------------------------------------------------------------
# Packed variable-length batches
# --------------------------------------------------------------------------------------------------

def _packed(lengths_q, lengths_k, H, H_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), H, d, generator=g)
    k, v = (torch.randn(sum(lengths_k), H_kv, d, generator=g) for _ in range(2))
    do = torch.randn(sum(lengths_q), H, d, generator=g)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=DEVICE)
          for n in (lengths_q, lengths_k)]
    return [x.to(DEVICE, dtype) for x in (q, k, v, do)], cu


def _varlen(q, k, v, do, cu_q, cu_k, lengths_q, lengths_k, causal, **kw):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = flash_attention_varlen(qq, kk, vv, cu_q, cu_k, max(lengths_q), max(lengths_k), causal,
                                    return_lse=True, **kw)
    o.backward(do)
    return [o.detach(), qq.grad, kk.grad, vv.grad], lse


# The lengths (1, 17, 255, 1000). In the interpreter a 1000-token document costs 100-190 s a case, so there
# it runs in two of the four cases (each dtype once, each causal flag once) and the other two pack a 300-token
# document in its place (300 is not a multiple of any tile either); on a GPU all four pack the 1000-token one.
VARLEN_CASES = [(False, torch.float32, 1000), (True, torch.float16, 1000),
                (False, torch.float16, 300), (True, torch.float32, 300)]


@pytest.mark.parametrize("causal, dtype, cpu_longest", VARLEN_CASES, ids=str)
def test_varlen_against_the_reference(causal, dtype, cpu_longest):
    """Packed documents of 1, 17, 255 and 1000 tokens, grouped heads: o, lse (H, total_q) and gradients."""
    lengths = [1, 17, 255, cpu_longest if DEVICE == "cpu" else 1000]
    (q, k, v, do), (cu_q, cu_k) = _packed(lengths, lengths, 2, 1, 16, dtype)
    got, lse = _varlen(q, k, v, do, cu_q, cu_k, lengths, lengths, causal)
    q64, k64, v64, do64 = (_np64(x) for x in (q, k, v, do))
    cu = cu_q.cpu().numpy()
    ref_o, ref_lse = reference.attention_varlen(q64, k64, v64, cu, cu, causal=causal, return_lse=True)
    refs = [ref_o, *reference.attention_varlen_backward(q64, k64, v64, do64, cu, cu, causal=causal)]
    base = [torch.cat(parts) for parts in zip(*(
        [x.squeeze(0).transpose(0, 1) for x in _plain(*(t[a:b].transpose(0, 1).unsqueeze(0)
                                                         for t in (q, k, v, do)), causal)]
        for a, b in zip(cu[:-1], cu[1:])))]
    _assert_close(got, refs, base, dtype)
    assert lse.shape == (2, sum(lengths)) and lse.dtype == torch.float32
    np.testing.assert_allclose(_np64(lse), ref_lse, rtol=0, atol=1e-4 * max(1.0, np.abs(ref_lse).max()))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_each_document_alone(causal):
    """Each document of a packed batch (N_q != N_k, with a window, a softcap and per-document ALiBi slopes)
    gives bit for bit what flash_attention gives for it alone: the same kernel, tiles and arithmetic."""
    lengths_q, lengths_k = [1, 40, 33, 70], [5, 17, 64, 70]
    (q, k, v, do), (cu_q, cu_k) = _packed(lengths_q, lengths_k, 4, 2, 16, torch.float32)
    slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mods = dict(window_size=(20, 3), softcap=3.0)
    got, lse = _varlen(q, k, v, do, cu_q, cu_k, lengths_q, lengths_k, causal, alibi_slopes=slopes, **mods)
    for b in range(4):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = [x[rows if i in (0, 3) else cols].transpose(0, 1).unsqueeze(0) for i, x in enumerate((q, k, v, do))]
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in alone[:3])
        o = flash_attention(qq, kk, vv, causal, alibi_slopes=slopes[b], **mods)
        o.backward(alone[3])
        _, lse_b = flash_attention_forward(*alone[:3], causal, alibi_slopes=slopes[b], **mods)
        for name, packed, one, r in zip(("o", "dq", "dk", "dv"), got, (o, qq.grad, kk.grad, vv.grad),
                                        (rows, rows, cols, cols)):
            assert torch.equal(packed[r], one[0].transpose(0, 1)), f"document {b}: {name} differs"
        assert torch.equal(lse[:, rows], lse_b[0]), f"document {b}: lse differs"


def test_varlen_follows_flash_attn_varlen_func():
    """FlashAttention's conventions: q (total_q, H, d) and k, v (total_k, H_kv, d) in, o like q and lse of shape
    (H, total_q) out; int64 offsets are taken too; o is laid out like q; no attention across documents (a
    change to one document's keys leaves the other documents' outputs as they were)."""
    lengths = [3, 50, 20]
    (q, k, v, _), (cu_q, cu_k) = _packed(lengths, lengths, 2, 2, 16, torch.float32)
    o, lse = flash_attention_varlen(q, k, v, cu_q.long(), cu_k.long(), 50, 50, return_lse=True)
    assert o.shape == q.shape and o.is_contiguous() and lse.shape == (2, 73)
    k2 = k.clone()
    k2[3:53] += 1.0  # document 1's keys
    o2 = flash_attention_varlen(q, k2, v, cu_q, cu_k, 50, 50)
    assert torch.equal(o2[:3], o[:3]) and torch.equal(o2[53:], o[53:]) and not torch.equal(o2[3:53], o[3:53])


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

def test_bad_modifications_name_the_argument():
    q, k, v, _ = _inputs(2, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="window_size's left side must be >= -1"):
        flash_attention(q, k, v, window_size=(-2, 0))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attention(q, k, v, window_size=5)
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        flash_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(4,\) or \(B, H\) = \(2, 4\)"):
        flash_attention(q, k, v, alibi_slopes=torch.ones(2, device=DEVICE))
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor"):
        flash_attention(q, k, v, alibi_slopes=[1.0] * 4)
    with pytest.raises(TypeError, match="alibi_slopes must have a floating dtype"):
        flash_attention(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        flash_attention(q, k, v, alibi_slopes=torch.tensor([1.0, float("nan"), 1.0, 1.0], device=DEVICE))
    # finite, but inf in the kernels' float32 once multiplied by log2(e) (or, for softcap, divided into)
    with pytest.raises(ValueError, match="alibi_slopes must lie within"):
        flash_attention(q, k, v, alibi_slopes=torch.tensor([3e38, 1.0, 1.0, 1.0], device=DEVICE))
    for softcap in (3e38, 1e-45):
        with pytest.raises(ValueError, match="softcap must be 0 \\(off\\) or between"):
            flash_attention(q, k, v, softcap=softcap)


def test_bad_packed_batches_name_the_argument():
    lengths = [3, 5]
    (q, k, v, _), (cu_q, cu_k) = _packed(lengths, lengths, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="document 1 has length 0"):
        flash_attention_varlen(q, k, v, torch.tensor([0, 8, 8], dtype=torch.int32, device=DEVICE), cu_k, 8, 5)
    with pytest.raises(ValueError, match="q must have shape \\(total, heads, d\\)"):
        flash_attention_varlen(q[None], k, v, cu_q, cu_k, 5, 5)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D torch.Tensor of int32"):
        flash_attention_varlen(q, k, v, cu_q.float(), cu_k, 5, 5)
    with pytest.raises(ValueError, match="the same number of documents"):
        flash_attention_varlen(q, k, v, cu_q, torch.tensor([0, 8], dtype=torch.int32, device=DEVICE), 5, 8)
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is shorter than the longest document"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match="must start at 0 and end at the packed length 8"):
        flash_attention_varlen(q, k, v, torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE), cu_k, 6, 5)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(2,\) or \(number of documents"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, alibi_slopes=torch.ones(3, 2, device=DEVICE))
    # shapes and NaN indices as the caller packed them, not the kernels' (1, H, total, d) views
    with pytest.raises(ValueError, match=r"k must have the head dimension of q \(d = 16\), got k.shape \(8, 2, 8\)"):
        flash_attention_varlen(q, k[..., :8], v[..., :8], cu_q, cu_k, 5, 5)
    bad = q.clone()
    bad[6, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"q must be finite .*index \(6, 1, 3\)"):
        flash_attention_varlen(bad, k, v, cu_q, cu_k, 5, 5)
    with pytest.raises(ValueError, match="cu_seqlens_k must be on q's device"):
        flash_attention_varlen(q, k, v, cu_q, torch.zeros(3, dtype=torch.int32, device="meta"), 5, 5)
