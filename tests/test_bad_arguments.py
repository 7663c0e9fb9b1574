"""More bad inputs to the public entry points, each refused with a ValueError or TypeError that names the
argument (the project's rule, :mod:`flashref.validation`): the cases test_validation, test_bad_values and the
feature tests do not already cover. Only behaviour that holds today is pinned here; every call is on tiny
shapes (the Triton ones run in the interpreter on a machine without a GPU, compiled on one with it), and most
are refused before any kernel runs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import flashref.triton  # noqa: F401  (the interpreter is switched on before triton is imported)
from flashref import block_masks as bmk
from flashref import numpy_flash, online_softmax as osm, reference as ref, validation
from flashref.tolerance import assert_within_tolerance
from flashref.ring_attention import gather_sequence, sequence_positions, shard_sequence, simulate_ring
from flashref.triton import (KVCache, backward_kernel, dropout_mask, flash_attention, flash_attention_backward,
                             flash_attention_forward, flash_attention_varlen, flash_decode, forward_kernel)
from tests._triton_helpers import DEVICE, no_autotune  # noqa: F401  (an autouse fixture: applies here)


def _t(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _qkv(B=2, H=2, H_kv=2, N_q=8, N_k=8, d=16):
    return _t(B, H, N_q, d, seed=1), _t(B, H_kv, N_k, d, seed=2), _t(B, H_kv, N_k, d, seed=3)


def _bool(*shape):
    return torch.ones(*shape, dtype=torch.bool, device=DEVICE)


# ------------------------------------------------------------------ Triton: q, k, v

QKV_CASES = {
    "q 5-d": (lambda q, k, v: (q[None], k[None], v[None]), ValueError, r"q must have shape \(B, H, N, d\), got 5-d"),
    "k batch": (lambda q, k, v: (q[:1], k, v), ValueError, "share their batch and head dimensions"),
    "k and v heads differ": (lambda q, k, v: (q, k[:, :1], v), ValueError, "share their batch and head dimensions"),
    "H_kv = 0": (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, "H_kv that divides q's H = 2"),
    "v rows": (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, r"v must have as many rows as k \(N_k = 8\)"),
    "v head dim": (lambda q, k, v: (q, k, v[..., :8]), ValueError, r"v must have the head dimension of q \(d = 16\)"),
    "k empty": (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "k is an empty sequence"),
    "d = 0": (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), ValueError, "head dimension d must be at least 1"),
    "float64": (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError,
                "float16 or bfloat16 or float32, got torch.float64"),
    "complex": (lambda q, k, v: tuple(x.to(torch.complex64) for x in (q, k, v)), TypeError, "got torch.complex64"),
    "k, v on another device": (lambda q, k, v: (q, k.to("meta"), v.to("meta")), ValueError,
                               "q, k and v must be on the same device"),
}


@pytest.mark.parametrize("case", list(QKV_CASES))
@pytest.mark.parametrize("fn", [flash_attention_forward, flash_attention, forward_kernel, backward_kernel],
                         ids=lambda f: f.__name__)
def test_triton_bad_q_k_v(fn, case):
    make, exc, words = QKV_CASES[case]
    with pytest.raises(exc, match=words):
        fn(*make(*_qkv()))


def test_triton_n_q_may_differ_from_n_k_and_q_may_be_strided():
    q, k, v = _qkv(N_q=5)
    o, lse = flash_attention_forward(q, k, v)
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    strided = q.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.allclose(flash_attention_forward(strided, k, v)[0], o)


# ------------------------------------------------------------------ Triton: the feature keywords

FEATURE_CASES = [
    # block masks (N_q = N_k = 40, block_size 16: 3 x 3 blocks)
    (dict(block_mask=("bool", (1, 3, 3)), block_size=16), ValueError, "block_mask must have shape (B or 1, H or 1, 3, 3)"),
    (dict(block_mask=("bool", (3, 3)), block_size=16), ValueError, "got (3, 3)"),
    (dict(block_mask=("bool", (1, 1, 1, 3, 3)), block_size=16), ValueError, "got (1, 1, 1, 3, 3)"),
    (dict(block_mask=("bool", (3, 1, 3, 3)), block_size=16), ValueError, "got (3, 1, 3, 3)"),
    (dict(block_mask=("bool", (1, 3, 3, 3)), block_size=16), ValueError, "got (1, 3, 3, 3)"),
    (dict(block_mask=("int8", (1, 1, 3, 3)), block_size=16), TypeError, "block_mask must be boolean"),
    (dict(block_mask=("uint8", (1, 1, 3, 3)), block_size=16), TypeError, "block_mask must be boolean"),
    (dict(block_mask=("meta", (1, 1, 3, 3)), block_size=16), ValueError, "block_mask must be on q's device"),
    (dict(block_mask=[[True]], block_size=64), TypeError, "block_mask must be a torch.Tensor"),
    (dict(block_mask=("bool", (1, 1, 3, 3)), block_size=-16), ValueError, "block_size must be a positive integer, got -16"),
    (dict(block_mask=("bool", (1, 1, 40, 40)), block_size=True), TypeError, "block_size must be a positive integer, got bool"),
    (dict(block_mask=("bool", (1, 1, 1, 1)), block_size=2**31), ValueError, "block_size must be below 2**31 for the Triton"),
    (dict(block_mask=("bool", (1, 1, 3, 3)), block_size=16.0), TypeError, "block_size must be a positive integer, got float"),
    (dict(block_size=0), ValueError, "block_size must be a positive integer"),  # checked even without a mask
    # windows
    (dict(window_size=(1,)), TypeError, "window_size must be a pair (left, right)"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair (left, right)"),
    (dict(window_size=None), TypeError, "window_size must be a pair"),
    (dict(window_size="12"), TypeError, "window_size must be a pair"),
    (dict(window_size=torch.tensor([1, 2])), TypeError, "window_size must be a pair"),
    (dict(window_size=(0, -5)), ValueError, "window_size's right side must be >= -1"),
    (dict(window_size=(1.0, 2)), TypeError, "window_size's left side must be an integer"),
    (dict(window_size=("1", 2)), TypeError, "window_size's left side must be an integer"),
    (dict(window_size=(True, 0)), TypeError, "window_size's left side must be an integer >= -1, got bool"),
    (dict(window_size=(0, None)), TypeError, "window_size's right side must be an integer"),
    # softcap
    (dict(softcap=float("nan")), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=True), TypeError, "softcap must be a real number"),
    (dict(softcap=None), TypeError, "softcap must be a real number"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(softcap=torch.tensor(2.0)), TypeError, "softcap must be a real number"),
    # ALiBi (B = 2, H = 2)
    (dict(alibi_slopes=("float32", (1, 2))), ValueError, "alibi_slopes must have shape (H,) = (2,) or (B, H) = (2, 2), got (1, 2)"),
    (dict(alibi_slopes=("float32", (2, 2, 1))), ValueError, "got (2, 2, 1)"),
    (dict(alibi_slopes=("float32", ())), ValueError, "got ()"),
    (dict(alibi_slopes=("complex64", (2,))), TypeError, "alibi_slopes must have a floating dtype"),
    (dict(alibi_slopes=("meta", (2,))), ValueError, "alibi_slopes must be on q's device"),
    (dict(alibi_slopes=np.ones(2)), TypeError, "alibi_slopes must be a torch.Tensor"),
    (dict(alibi_slopes=("inf", (2,))), ValueError, "alibi_slopes must be finite (no NaN or inf), got +inf at index (1,)"),
    # dropout and its seed
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be in [0, 1), got -0.1"),
    (dict(dropout_p=1.5), ValueError, "dropout_p must be in [0, 1), got 1.5"),
    (dict(dropout_p=float("nan")), ValueError, "dropout_p must be in [0, 1)"),
    (dict(dropout_p=True), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=None), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=torch.tensor(0.1)), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.1, seed=3.0), TypeError, "seed must be None or an int in [0, 2**63), got float"),
    (dict(dropout_p=0.1, seed="1"), TypeError, "seed must be None or an int"),
    (dict(dropout_p=0.1, seed=2**63), (TypeError, ValueError), "seed must be None or an int in [0, 2**63)"),
    (dict(dropout_p=0.1, seed=torch.tensor(1)), TypeError, "seed must be None or an int"),
    # the remaining flags
    (dict(causal_align=None), ValueError, "causal_align must be one of"),
    (dict(kernel="TRITON"), ValueError, "kernel must be one of"),
]


def _feature_kwargs(kwargs):
    """Materialize the ("kind", shape) stand-ins of FEATURE_CASES on the test device."""
    out = dict(kwargs)
    for name in ("block_mask", "alibi_slopes"):
        spec = out.get(name)
        if isinstance(spec, tuple):
            kind, shape = spec
            if kind == "bool":
                out[name] = _bool(*shape)
            elif kind == "meta":
                out[name] = torch.ones(shape, dtype=torch.bool if name == "block_mask" else torch.float32,
                                       device="meta")
            elif kind == "inf":
                out[name] = torch.tensor([1.0, float("inf")], device=DEVICE)
            else:
                out[name] = torch.ones(shape, dtype=getattr(torch, kind), device=DEVICE)
    return out


@pytest.mark.parametrize("kwargs, exc, words", FEATURE_CASES, ids=[str(i) for i in range(len(FEATURE_CASES))])
def test_triton_bad_feature_arguments(kwargs, exc, words):
    q, k, v = _qkv(N_q=40, N_k=40)
    kwargs = _feature_kwargs(kwargs)
    with pytest.raises(exc, match=re.escape(words)):
        flash_attention_forward(q, k, v, **kwargs)
    if "seed" not in kwargs and kwargs.get("kernel") is None and "at index" not in words:
        # the dispatch helpers check the same arguments without reading the data (a value found in a tensor's data
        # is reported with its index)
        with pytest.raises(exc, match=re.escape(words)):
            forward_kernel(q, k, v, **kwargs)


@pytest.mark.parametrize("window", [[1, 2], (np.int64(2), np.int64(1))], ids=["list", "numpy ints"])
def test_triton_window_may_be_a_list_or_numpy_ints(window):
    """Read as the tuple of Python ints it holds: the same output, bit for bit."""
    q, k, v = _qkv()
    o, _ = flash_attention_forward(q, k, v, window_size=window)
    want, _ = flash_attention_forward(q, k, v, window_size=tuple(int(w) for w in window))
    assert torch.equal(o, want)
    if tuple(int(w) for w in window) == (1, 2):  # and not the sides swapped
        swapped, _ = flash_attention_forward(q, k, v, window_size=(2, 1))
        assert not torch.equal(o, swapped)


def test_triton_block_size_need_not_divide_a_tile_and_the_mask_may_be_strided():
    """A block size that is no multiple of the kernel's tiles (coarse lists, the mask applied element by element) and a
    non-contiguous mask give the float64 reference's answer."""
    q, k, v = _qkv(B=1, N_q=40, N_k=33)
    n64 = lambda x: x.detach().cpu().double().numpy()  # noqa: E731
    g = torch.Generator().manual_seed(5)
    for mask, bs in (((torch.rand(1, 2, 4, 4, generator=g) > 0.4), 10),
                     ((torch.rand(1, 2, 3, 6, generator=g) > 0.4)[..., ::2], 16)):
        o, _ = flash_attention_forward(q, k, v, block_mask=mask.to(DEVICE), block_size=bs)
        expected = ref.attention(n64(q), n64(k), n64(v), block_mask=mask.numpy(), block_size=bs)
        np.testing.assert_allclose(n64(o), expected, rtol=0, atol=2e-5)


# ------------------------------------------------------------------ Triton: the backward's o, lse, do

def test_triton_backward_bad_o_lse_do():
    q, k, v = _qkv()
    o, lse = flash_attention_forward(q, k, v)
    do = torch.ones_like(o)
    with pytest.raises(TypeError, match="o must be an array or tensor, got NoneType"):
        flash_attention_backward(q, k, v, None, lse, do)
    with pytest.raises(TypeError, match="do must be an array or tensor, got NoneType"):
        flash_attention_backward(q, k, v, o, lse, None)
    with pytest.raises(ValueError, match=r"o must have the shape of q \(2, 2, 8, 16\), got \(2, 2, 4, 16\)"):
        flash_attention_backward(q, k, v, o[:, :, :4], lse, do[:, :, :4])
    with pytest.raises(TypeError, match=r"o and do must have the dtype of q \(torch.float32\)"):
        flash_attention_backward(q, k, v, o.half(), lse, do)
    with pytest.raises(TypeError, match=r"o and do must have the dtype of q"):
        flash_attention_backward(q, k, v, o, lse, do.half())
    with pytest.raises(ValueError, match=r"lse must be finite or -inf \(a masked score\), got \+inf"):
        flash_attention_backward(q, k, v, o, torch.full_like(lse, float("inf")), do)
    for seed in (-3, np.int64(3), 3.0):
        with pytest.raises((TypeError, ValueError), match="seed must be None or an int"):
            flash_attention_backward(q, k, v, o, lse, do, dropout_p=0.1, seed=seed)
    with pytest.raises(ValueError, match=re.escape("dropout_p must be in [0, 1)")):
        flash_attention_backward(q, k, v, o, lse, do, dropout_p=1.0, seed=1)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attention_backward(q, k, v, o, lse, do, window_size=3)


@pytest.mark.parametrize("which, make, exc, words", [
    ("lse", lambda x: x.int(), TypeError, "lse must be a floating tensor (the forward's fp32 lse), got dtype torch.int32"),
    ("lse", lambda x: x > 0, TypeError, "lse must be a floating tensor"),
    ("lse", lambda x: x.cpu().numpy(), TypeError, "lse must be a torch.Tensor, got ndarray"),
    ("lse", lambda x: x.tolist(), TypeError, "lse must be a torch.Tensor, got list"),
    ("lse", lambda x: None, TypeError, "lse must be a torch.Tensor, got NoneType"),
    ("lse", lambda x: x.to("meta"), ValueError, "lse must be on q's device"),
    ("lse", lambda x: x.to_sparse(), TypeError, "lse must be a dense (strided) tensor"),
    ("o", lambda x: x.cpu().numpy(), TypeError, "o must be a torch.Tensor, got ndarray"),
    ("o", lambda x: x.to("meta"), ValueError, "o must be on q's device"),
    ("o", lambda x: x.to_sparse(), TypeError, "o must be a dense (strided) tensor"),
    ("do", lambda x: x.cpu().numpy(), TypeError, "do must be a torch.Tensor, got ndarray"),
    ("do", lambda x: x.to("meta"), ValueError, "do must be on q's device"),
    ("do", lambda x: x.to_sparse(), TypeError, "do must be a dense (strided) tensor"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 4 else None)
def test_triton_backward_o_lse_do_must_be_dense_tensors_on_q_device(which, make, exc, words):
    q, k, v = _qkv()
    o, lse = flash_attention_forward(q, k, v)
    args = dict(o=o, lse=lse, do=torch.ones_like(o))
    args[which] = make(args[which])
    with pytest.raises(exc, match=re.escape(words)):
        flash_attention_backward(q, k, v, args["o"], args["lse"], args["do"])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype, score", [(torch.float32, -1000.0), (torch.float16, -60.0)], ids=str)
def test_triton_backward_atomic_dq_very_negative_logits_are_valid_input(dtype, score):
    """Scores ~ score everywhere (lse very negative) with N_k = 37, not a multiple of the key tile: the atomic
    dQ (deterministic=False) was NaN (the ragged key tile's padded slots had P = exp2(0 - lse) = inf). Now the
    autograd backward is within the tolerance rule against the float64 reference with either dQ, and
    flash_attention_backward from (o, lse) gives the deterministic path's dK and dV bit for bit and its dQ up to
    the order of the additions."""
    g = torch.Generator().manual_seed(5)  # test_edges_decode_ring_bottom_right's inputs
    u = torch.ones(16) / 4
    k = (u + 0.05 * torch.randn(1, 1, 37, 16, generator=g)).to(DEVICE, dtype)
    q = (4 * score * u + torch.randn(1, 2, 20, 16, generator=g)).to(DEVICE, dtype)
    v, do = (torch.randn(*shape, generator=g).to(DEVICE, dtype) for shape in ((1, 1, 37, 16), (1, 2, 20, 16)))
    n64 = lambda x: x.detach().cpu().double().numpy()  # noqa: E731
    refs = ref.attention_backward(n64(q), n64(k), n64(v), n64(do))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    s = qq @ kk.repeat_interleave(2, 1).transpose(-1, -2) / 4.0
    (torch.softmax(s, -1) @ vv.repeat_interleave(2, 1)).backward(do)  # plain attention in dtype: the baseline
    baseline = (qq.grad, kk.grad, vv.grad)
    for det in (True, False):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        flash_attention(qq, kk, vv, deterministic=det, kernel="triton").backward(do)
        for name, x, r, b in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), refs, baseline):
            atol = 1e-5 * max(1.0, float(np.abs(r).max())) if dtype == torch.float32 else None
            assert_within_tolerance(x, r, b, factor=3.0, atol=atol, name=f"{name} (deterministic={det})")
    o, lse = flash_attention_forward(q, k, v, kernel="triton")
    (dq, dk, dv), (dq_a, dk_a, dv_a) = (flash_attention_backward(q, k, v, o, lse, do, deterministic=det,
                                                                 kernel="triton") for det in (True, False))
    assert torch.isfinite(dq_a).all() and torch.equal(dk_a, dk) and torch.equal(dv_a, dv)
    assert torch.allclose(dq_a.float(), dq.float(), rtol=0, atol=1e-5 * max(1.0, dq.abs().max().item()))


# ------------------------------------------------------------------ Triton: dropout_mask

@pytest.mark.parametrize("args, exc, words", [
    ((1, 1, 2, 8, 8, 1.0), ValueError, "dropout_p must be in [0, 1), got 1.0"),
    ((1, 1, 2, 8, 8, -0.1), ValueError, "dropout_p must be in [0, 1)"),
    ((1, 0, 2, 8, 8, 0.1), ValueError, "B must be a positive integer, got 0"),
    ((1, 1, 2.0, 8, 8, 0.1), TypeError, "H must be a positive integer, got float"),
    ((1, 1, 2, 8, -1, 0.1), ValueError, "N_k must be a positive integer"),
    ((-1, 1, 2, 8, 8, 0.1), (TypeError, ValueError), "seed must be an int in [0, 2**63), got int: -1"),
    ((np.int64(1), 1, 2, 8, 8, 0.1), TypeError, "seed must be an int"),
    ((1.5, 1, 2, 8, 8, 0.1), TypeError, "seed must be an int"),
])
def test_dropout_mask_bad_arguments(args, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        dropout_mask(*args, DEVICE)


@pytest.mark.parametrize("device", ["meta", "cpu" if torch.cuda.is_available() else "cuda", "cuda:99", "bogus", 1.5,
                                    [DEVICE]], ids=repr)
def test_dropout_mask_bad_device(device):
    """meta gave NotImplementedError, cuda without a GPU an AssertionError, a bogus name a RuntimeError."""
    with pytest.raises(ValueError, match="device must be"):
        dropout_mask(1, 1, 1, 8, 8, 0.1, device)


def test_dropout_mask_and_kv_cache_take_a_torch_device_or_none():
    assert torch.equal(dropout_mask(1, 1, 1, 8, 8, 0.1, torch.device(DEVICE)), dropout_mask(1, 1, 1, 8, 8, 0.1, None))
    assert KVCache(1, 1, 4, 16, device=torch.device(DEVICE)).k_cache.device.type == DEVICE


# ------------------------------------------------------------------ Triton: packed batches

def _packed():
    q, k, v = (_t(8, 2, 16, seed=s) for s in (1, 2, 3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


VARLEN_CASES = {
    "not monotone": (lambda q, k, v, cu: (q, k, v, _i32(0, 5, 3, 8), _i32(0, 5, 3, 8), 5, 5), ValueError,
                     "cu_seqlens_q holds an empty (or negative) sequence: document 1 has length -2"),
    "negative inside": (lambda q, k, v, cu: (q, k, v, _i32(0, -1, 8), cu, 9, 5), ValueError,
                        "document 0 has length -1"),
    "int16": (lambda q, k, v, cu: (q, k, v, cu.short(), cu, 5, 5), TypeError,
              "cu_seqlens_q must be a 1-D torch.Tensor of int32 (or int64), got Tensor torch.int16"),
    "uint8": (lambda q, k, v, cu: (q, k, v, cu, cu.to(torch.uint8), 5, 5), TypeError, "cu_seqlens_k must be a 1-D"),
    "list": (lambda q, k, v, cu: (q, k, v, [0, 3, 8], cu, 5, 5), TypeError, "cu_seqlens_q must be a 1-D torch.Tensor"),
    "numpy": (lambda q, k, v, cu: (q, k, v, np.array([0, 3, 8]), cu, 5, 5), TypeError, "got ndarray"),
    "2-d": (lambda q, k, v, cu: (q, k, v, cu[None], cu, 5, 5), TypeError, "of shape (1, 3)"),
    "0-d": (lambda q, k, v, cu: (q, k, v, cu[2], cu, 5, 5), TypeError, "of shape ()"),
    "one entry": (lambda q, k, v, cu: (q, k, v, cu[2:], cu[2:], 5, 5), ValueError,
                  "cu_seqlens_q must be 1-D with at least two entries"),
    "empty": (lambda q, k, v, cu: (q, k, v, cu[:0], cu[:0], 5, 5), ValueError, "at least two entries"),
    "max_seqlen float": (lambda q, k, v, cu: (q, k, v, cu, cu, 5.0, 5), TypeError,
                         "max_seqlen_q must be a positive integer, got float"),
    "max_seqlen tensor": (lambda q, k, v, cu: (q, k, v, cu, cu, 5, torch.tensor(5)), TypeError,
                          "max_seqlen_k must be a positive integer, got Tensor"),
    "max_seqlen None": (lambda q, k, v, cu: (q, k, v, cu, cu, None, None), TypeError,
                        "max_seqlen_q must be a positive integer, got NoneType"),
    "max_seqlen_k short": (lambda q, k, v, cu: (q, k, v, cu, cu, 5, 4), ValueError,
                           "max_seqlen_k = 4 is shorter than the longest document of cu_seqlens_k (5)"),
    "k heads": (lambda q, k, v, cu: (q, _t(8, 3, 16), _t(8, 3, 16), cu, cu, 5, 5), ValueError,
                "H_kv that divides q's H = 2"),
    "v shape": (lambda q, k, v, cu: (q, k, v[:5], cu, cu, 5, 5), ValueError, "v must have the shape of k (8, 2, 16)"),
    "k total": (lambda q, k, v, cu: (q, k[:6], v[:6], cu, cu, 5, 5), ValueError,
                "cu_seqlens_k must start at 0 and end at the packed length 6"),
    "dtypes": (lambda q, k, v, cu: (q.half(), k, v, cu, cu, 5, 5), TypeError, "q, k and v must have the same dtype"),
    "k sparse": (lambda q, k, v, cu: (q, k.to_sparse(), v, cu, cu, 5, 5), TypeError, "k must be a dense"),
    "q not a tensor": (lambda q, k, v, cu: (q.cpu().numpy(), k, v, cu, cu, 5, 5), TypeError, "q must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_triton_varlen_bad_packing(case):
    make, exc, words = VARLEN_CASES[case]
    with pytest.raises(exc, match=re.escape(words)):
        flash_attention_varlen(*make(*_packed()))


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(deterministic="x"), TypeError, "deterministic must be a bool"),
    (dict(window_size=(-3, 0)), ValueError, "window_size's left side must be >= -1"),
    (dict(softcap=-1), ValueError, "softcap must be finite and >= 0"),
    (dict(sm_scale=0.0), ValueError, "sm_scale must be a finite number > 0"),
    (dict(check_finite="yes"), TypeError, "check_finite must be a bool"),
])
def test_triton_varlen_bad_options(kwargs, exc, words):
    q, k, v, cu = _packed()
    with pytest.raises(exc, match=re.escape(words)):
        flash_attention_varlen(q, k, v, cu, cu, 5, 5, **kwargs)


# ------------------------------------------------------------------ Triton: flash-decoding and the KV cache

def _decode_inputs():
    return _t(2, 4, 1, 16), _t(2, 2, 20, 16), _t(2, 2, 20, 16), _i32(20, 7)


DECODE_CASES = {
    "num_splits negative": (lambda q, k, v, L: flash_decode(q, k, v, L, num_splits=-1), ValueError,
                            "num_splits must be a positive integer, got -1"),
    "num_splits bool": (lambda q, k, v, L: flash_decode(q, k, v, L, num_splits=True), TypeError,
                        "num_splits must be a positive integer, got bool"),
    "seqlens negative": (lambda q, k, v, L: flash_decode(q, k, v, _i32(-1, 5)), ValueError,
                         r"cache_seqlens[0] = -1 is out of range: each length must be in [1, N_max = 20]"),
    "seqlens int16": (lambda q, k, v, L: flash_decode(q, k, v, L.short()), TypeError,
                      "cache_seqlens must be None or an int32 (or int64) torch.Tensor of shape (B,), got a tensor of dtype torch.int16"),
    "seqlens bool": (lambda q, k, v, L: flash_decode(q, k, v, L > 0), TypeError, "got a tensor of dtype torch.bool"),
    "seqlens 2-d": (lambda q, k, v, L: flash_decode(q, k, v, L[None]), ValueError,
                    "cache_seqlens must have shape (B,) = (2,), got (1, 2)"),
    "seqlens device": (lambda q, k, v, L: flash_decode(q, k, v, L.to("meta")), ValueError,
                       "cache_seqlens must be on q's device"),
    "float64": (lambda q, k, v, L: flash_decode(q.double(), k.double(), v.double()), TypeError,
                "q must have dtype float16 or bfloat16 or float32, got torch.float64"),
    "head dim 300": (lambda q, k, v, L: flash_decode(_t(1, 1, 1, 300), _t(1, 1, 4, 300), _t(1, 1, 4, 300)), ValueError,
                     "head dimension d = 300 is larger than this implementation supports (256)"),
    "v_cache device": (lambda q, k, v, L: flash_decode(q, k, v.to("meta")), ValueError, "v_cache must be on q's device"),
    "v_cache dtype": (lambda q, k, v, L: flash_decode(q, k, v.half()), TypeError, "v_cache must have q's dtype"),
    "H_kv 0": (lambda q, k, v, L: flash_decode(q, k[:, :0], v[:, :0]), ValueError, "k_cache must not be empty"),
    "N_q 0": (lambda q, k, v, L: flash_decode(q[:, :, :0], k, v), ValueError, "q must not be empty"),
    "N_max 0": (lambda q, k, v, L: flash_decode(q, k[:, :, :0], v[:, :, :0]), ValueError, "k_cache must not be empty"),
    "B 0": (lambda q, k, v, L: flash_decode(q[:0], k[:0], v[:0]), ValueError, "q must not be empty"),
    "sm_scale str": (lambda q, k, v, L: flash_decode(q, k, v, sm_scale="1"), TypeError, "sm_scale must be a real number"),
    "check_finite int": (lambda q, k, v, L: flash_decode(q, k, v, check_finite=1), TypeError,
                         "check_finite must be a bool"),
    "q 5-d": (lambda q, k, v, L: flash_decode(q[None], k, v), ValueError, "q must have shape (B, H, N_q, d), got 5-d"),
    "q list": (lambda q, k, v, L: flash_decode(q.tolist(), k, v), TypeError, "q must be a torch.Tensor, got list"),
    "k_cache numpy": (lambda q, k, v, L: flash_decode(q, k.cpu().numpy(), v), TypeError,
                      "k_cache must be a torch.Tensor, got ndarray"),
    # check_finite=False skips reading the data and the lengths, never the arguments' own checks
    "fast causal int": (lambda q, k, v, L: flash_decode(q, k, v, check_finite=False, causal=1), TypeError,
                        "causal must be a bool"),
    "fast num_splits 0": (lambda q, k, v, L: flash_decode(q, k, v, check_finite=False, num_splits=0), ValueError,
                          "num_splits must be a positive integer"),
    "fast sm_scale nan": (lambda q, k, v, L: flash_decode(q, k, v, check_finite=False, sm_scale=float("nan")),
                          ValueError, "sm_scale must be a finite number > 0"),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_flash_decode_bad_arguments(case):
    call, exc, words = DECODE_CASES[case]
    with pytest.raises(exc, match=re.escape(words)):
        call(*_decode_inputs())


def test_flash_decode_more_splits_than_key_tiles_is_still_exact():
    q, k, v, L = _decode_inputs()
    one = flash_decode(q, k, v, L, num_splits=1)
    many = flash_decode(q, k, v, L, num_splits=np.int64(6))  # 20 keys are 2 interpreter tiles: empty splits
    assert torch.allclose(one, many, rtol=0, atol=1e-6)


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((0, 1, 4, 16), {}, ValueError, "batch must be a positive integer, got 0"),
    ((1, 1.0, 4, 16), {}, TypeError, "heads_kv must be a positive integer, got float"),
    ((1, 1, -4, 16), {}, ValueError, "max_len must be a positive integer"),
    ((1, 1, 4, True), {}, TypeError, "head_dim must be a positive integer, got bool"),
    ((1, 1, 4, 16), dict(dtype="float16"), TypeError, "dtype must be torch.float16, torch.bfloat16 or torch.float32"),
    ((1, 1, 4, 16), dict(dtype=torch.float64), TypeError, "got torch.float64"),
    ((1, 1, 4, 300), {}, ValueError, "head_dim = 300 is larger than the kernels support (256)"),
    ((1, 1, 4, 16), dict(device="bogus"), ValueError, "device must be a torch.device or a device string"),
    ((1, 1, 4, 16), dict(device=1.5), ValueError, "device must be a torch.device or a device string"),
    ((1, 1, 4, 16), dict(device="meta"), ValueError, "device must be"),
    ((1, 1, 4, 16), dict(device="cpu" if torch.cuda.is_available() else "cuda"), ValueError, "device must be"),
    ((1, 1, 4, 16), dict(device="cuda:99"), ValueError, "device must be"),
])
def test_kv_cache_bad_constructor_arguments(args, kwargs, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        KVCache(*args, **kwargs)


def _cache():
    cache = KVCache(2, 2, 8, 16, dtype=torch.float32, device=DEVICE)
    k = _t(2, 2, 3, 16)
    cache.append(k, k.clone())
    return cache, k


def test_kv_cache_append_past_capacity_changes_nothing():
    cache, _ = _cache()
    big = _t(2, 2, 6, 16)
    with pytest.raises(ValueError, match="k: appending 6 tokens to row 0, which holds 3, would overflow max_len = 8"):
        cache.append(big, big)
    assert cache.lengths == [3, 3] and cache.seqlens.tolist() == [3, 3]
    with pytest.raises(ValueError, match="v must be finite"):
        cache.append(big[:, :, :1], torch.full_like(big[:, :, :1], float("nan")))
    assert cache.lengths == [3, 3]


@pytest.mark.parametrize("lengths", [[4, 1], [-1, 1], [1.0, 1], [True, 1], [1], torch.tensor([1, 1]),
                                     np.array([1, 1]), 2],
                         ids=["too long", "negative", "float", "bool", "short list", "tensor", "ndarray", "int"])
def test_kv_cache_append_bad_lengths(lengths):
    cache, k = _cache()
    with pytest.raises((ValueError, TypeError), match=r"lengths must be None or a list of B = 2 integers in \[0, n = 3\]"):
        cache.append(k, k, lengths=lengths)
    assert cache.lengths == [3, 3]


def test_kv_cache_append_bad_tensors():
    cache, k = _cache()
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got ndarray"):
        cache.append(k, k.cpu().numpy())
    with pytest.raises(TypeError, match="v must have the cache's dtype torch.float32"):
        cache.append(k, k.half())
    with pytest.raises(TypeError, match="k must have the cache's dtype torch.float32 and device"):
        cache.append(k.to("meta"), k.to("meta"))
    with pytest.raises(ValueError, match=r"k must have shape \(B, H_kv, n, d\) = \(2, 2, n, 16\)"):
        cache.append(k[..., :8], k[..., :8])
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        cache.append(k, k, check_finite="no")
    cache.append(k[:, :, :2], k[:, :, :2], lengths=[0, 0])  # nothing real to add: allowed, changes nothing
    assert cache.lengths == [3, 3]


@pytest.mark.parametrize("make, kwargs, exc, words", [
    # named against the cache's own shape (flash_decode named k_cache, an argument the caller never passed)
    (lambda: _t(2, 3, 1, 16), {}, ValueError, "q must have a number of heads H that the cache's H_kv = 2 divides "
                                              "(grouped-query attention) (the cache holds (B, H_kv, max_len, d) = "
                                              "(2, 2, 8, 16)), got q.shape (2, 3, 1, 16)"),
    (lambda: _t(2, 4, 1, 8), {}, ValueError, "q must have the cache's head dimension d = 16 (the cache holds"),
    (lambda: _t(1, 4, 1, 16), {}, ValueError, "q must have the cache's batch size B = 2 (the cache holds (B, H_kv, "
                                              "max_len, d) = (2, 2, 8, 16)), got q.shape (1, 4, 1, 16)"),
    (lambda: _t(1, 4, 4, 16), {}, ValueError, "q must have the cache's batch size B = 2"),  # before the lengths
    (lambda: _t(2, 4, 1, 16).cpu().numpy(), {}, TypeError, "q must be a torch.Tensor, got ndarray"),
    (lambda: _t(2, 4, 1, 16, dtype=torch.float16), {}, TypeError,
     "q must have the cache's dtype torch.float32, got torch.float16"),
    (lambda: _t(2, 4, 1, 16).to("meta"), {}, ValueError, "q must be on the cache's device"),
    (lambda: _t(4, 1, 16), {}, ValueError, "q must have shape (B, H, N_q, d), got 3-d"),
    (lambda: _t(2, 4, 4, 16), {}, ValueError, "row 0 of the cache holds 3 tokens, fewer than the 4 queries (causal)"),
    (lambda: _t(2, 4, 1, 16), dict(causal=1), TypeError, "causal must be a bool"),
    (lambda: _t(2, 4, 1, 16), dict(causal="no"), TypeError, "causal must be a bool"),
    (lambda: _t(2, 4, 1, 16), dict(num_splits=0), ValueError, "num_splits must be a positive integer"),
    (lambda: _t(2, 4, 1, 16), dict(check_finite=1), TypeError, "check_finite must be a bool"),
    (lambda: _t(2, 4, 1, 16), dict(return_lse=None), TypeError, "return_lse must be a bool"),
    (lambda: torch.full((2, 4, 1, 16), float("nan"), device=DEVICE), {}, ValueError, "q must be finite"),
])
def test_kv_cache_attend_bad_arguments(make, kwargs, exc, words):
    cache, _ = _cache()
    with pytest.raises(exc, match=re.escape(words)):
        cache.attend(make(), **kwargs)


def test_kv_cache_attend_on_an_empty_cache_is_refused_causal_or_not():
    cache = KVCache(1, 1, 4, 16, dtype=torch.float32, device=DEVICE)
    for causal in (True, False):
        with pytest.raises(ValueError, match="row 0 of the cache holds 0 tokens.*append first"):
            cache.attend(_t(1, 1, 1, 16), causal=causal)


# ------------------------------------------------------------------ NumPy: reference and tiled attention

def _np_inputs(B=2, H=4, H_kv=2, N_q=10, N_k=12, d=8):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, H, N_q, d)), rng.standard_normal((B, H_kv, N_k, d)),
            rng.standard_normal((B, H_kv, N_k, d)))


NUMPY_FORWARDS = {
    "reference.attention": ref.attention,
    "numpy_flash.flash_attention_forward": lambda *a, **kw: numpy_flash.flash_attention_forward(
        *a, block_q=4, block_k=4, **kw),
}

NUMPY_FEATURE_CASES = [
    (dict(dropout_p=0.1, dropout_mask=torch.ones(10, 12, dtype=torch.bool)), TypeError,
     "dropout_mask must be a NumPy array, got a torch.Tensor"),
    (dict(dropout_p=0.1, dropout_mask=[[True] * 12] * 10), TypeError, "dropout_mask must be a NumPy array, got list"),
    (dict(block_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool), block_size=4), TypeError,
     "block_mask must be a NumPy array, got a torch.Tensor"),
    (dict(block_mask=[[True]], block_size=64), TypeError, "block_mask must be a NumPy array, got list"),
    (dict(block_mask=np.ones((1, 2, 3, 3), bool), block_size=4), ValueError,  # H_kv heads: the mask follows q's H
     "block_mask must have shape (B or 1, H or 1, 3, 3)"),
    (dict(block_mask=np.ones((1, 1, 3, 3), bool), block_size=4.0), TypeError, "block_size must be a positive integer, got float"),
    (dict(block_mask=np.ones((1, 1, 10, 12), bool), block_size=True), TypeError, "block_size must be a positive integer, got bool"),
    (dict(alibi_slopes=np.ones(2)), ValueError, "alibi_slopes must have shape (H,) = (4,) or (B, H) = (2, 4), got (2,)"),
    (dict(alibi_slopes=np.ones(4, bool)), TypeError, "alibi_slopes must be an array of real numbers"),
    (dict(alibi_slopes=[None] * 4), TypeError, "alibi_slopes must be an array of real numbers"),
    (dict(alibi_slopes=np.ones(4, complex)), TypeError, "alibi_slopes must be an array of real numbers"),
    (dict(alibi_slopes=1.0), ValueError, "alibi_slopes must have shape (H,) = (4,)"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
    (dict(window_size=(0, -2)), ValueError, "window_size's right side must be >= -1"),
    (dict(softcap=np.nan), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=None), TypeError, "softcap must be a real number"),
    (dict(causal=True, causal_align=None), ValueError, "causal_align must be one of"),
    (dict(causal=True, causal_align=["top_left"]), ValueError, "causal_align must be one of"),
    (dict(sm_scale=torch.tensor(0.5)), TypeError, "sm_scale must be a real number or None, got Tensor"),
    (dict(dropout_p=-0.5), ValueError, "dropout_p must be in [0, 1)"),
]


@pytest.mark.parametrize("kwargs, exc, words", NUMPY_FEATURE_CASES, ids=[str(i) for i in range(len(NUMPY_FEATURE_CASES))])
@pytest.mark.parametrize("name", list(NUMPY_FORWARDS))
def test_numpy_bad_feature_arguments(name, kwargs, exc, words):
    q, k, v = _np_inputs()
    with pytest.raises(exc, match=re.escape(words)):
        NUMPY_FORWARDS[name](q, k, v, **kwargs)


@pytest.mark.parametrize("name", list(NUMPY_FORWARDS))
def test_numpy_keywords_take_numpy_integers_and_torch_slopes(name):
    q, k, v = _np_inputs()
    fn = NUMPY_FORWARDS[name]
    plain = fn(q, k, v, block_mask=np.ones((1, 4, 3, 3), bool), block_size=4)
    again = fn(q, k, v, block_mask=np.ones((1, 1, 3, 3), bool), block_size=np.int32(4))
    np.testing.assert_allclose(np.asarray(again[0] if isinstance(again, tuple) else again),
                               np.asarray(plain[0] if isinstance(plain, tuple) else plain))
    a = fn(q, k, v, alibi_slopes=torch.arange(1, 5, dtype=torch.float64), window_size=(np.int64(2), np.int64(0)))
    b = fn(q, k, v, alibi_slopes=np.arange(1, 5), window_size=(2, 0))
    np.testing.assert_allclose(np.asarray(a[0] if isinstance(a, tuple) else a), np.asarray(b[0] if isinstance(b, tuple) else b))


def test_dropout_mask_dtype_and_shape_are_named():
    q, k, v = _np_inputs()
    for fn in (ref.attention, numpy_flash.flash_attention_forward):  # the same words from both
        with pytest.raises(TypeError, match="dropout_mask must be a boolean keep-mask .*got dtype int64"):
            fn(q, k, v, dropout_p=0.1, dropout_mask=np.ones((10, 12), np.int64))
        with pytest.raises(ValueError, match="dropout_mask was given with dropout_p = 0.0"):
            fn(q, k, v, dropout_mask=np.ones((10, 12), bool))
        for shape in ((3, 4, 10, 12), (2, 2, 10, 12), (10, 11)):
            with pytest.raises(ValueError, match=re.escape("dropout_mask must broadcast to (2, 4, 10, 12)")):
                fn(q, k, v, dropout_p=0.1, dropout_mask=np.ones(shape, bool))


DROPOUT_MASK_CALLS = {
    "reference.attention": lambda q, k, v, m: ref.attention(q, k, v, dropout_p=0.1, dropout_mask=m),
    "reference.attention_backward": lambda q, k, v, m: ref.attention_backward(q, k, v, q, dropout_p=0.1,
                                                                              dropout_mask=m),
    "numpy_flash.flash_attention_forward": lambda q, k, v, m: numpy_flash.flash_attention_forward(
        q, k, v, block_q=4, block_k=4, dropout_p=0.1, dropout_mask=m),
    "numpy_flash.flash_attention_backward": lambda q, k, v, m: numpy_flash.flash_attention_backward(
        q, k, v, q, np.zeros(q.shape[:-1]), q, block_q=4, block_k=4, dropout_p=0.1, dropout_mask=m),
}


@pytest.mark.parametrize("shape", [(1, 2, 4, 10, 12), (1, 1, 1, 10, 12), (3, 4, 10, 12), (2, 2, 10, 12), (10, 11),
                                   (12, 10)], ids=str)
@pytest.mark.parametrize("name", list(DROPOUT_MASK_CALLS))
def test_dropout_mask_must_broadcast_to_the_scores_shape_itself(name, shape):
    """Extra leading dimensions are refused too (NumPy would broadcast o to them), and the tiled attention
    names dropout_mask as the reference does (it reached NumPy's own broadcasting error)."""
    q, k, v = _np_inputs()
    with pytest.raises(ValueError, match=re.escape(f"dropout_mask must broadcast to (2, 4, 10, 12), got shape {shape}")):
        DROPOUT_MASK_CALLS[name](q, k, v, np.ones(shape, bool))


@pytest.mark.parametrize("shape", [(10, 12), (4, 10, 12), (1, 4, 1, 12), (2, 1, 10, 12), (2, 4, 10, 12)], ids=str)
def test_dropout_mask_that_broadcasts_gives_the_full_masks_result(shape):
    """A keep-mask of any shape that broadcasts to (B, H, N_q, N_k) drops what its expansion drops: the
    reference, the tiled forward and backward against the float64 formula with the expanded mask."""
    q, k, v = _np_inputs()
    do = np.random.default_rng(7).standard_normal(q.shape)
    mask = np.random.default_rng(8).random(shape) > 0.3
    full = np.broadcast_to(mask, (2, 4, 10, 12))
    kf, vf = (np.repeat(x, 2, axis=1) for x in (k, v))
    p = np.exp(q @ np.swapaxes(kf, -1, -2) / np.sqrt(8))
    p /= p.sum(-1, keepdims=True)
    expected = np.where(full, p / 0.9, 0) @ vf
    o = ref.attention(q, k, v, dropout_p=0.1, dropout_mask=mask)
    np.testing.assert_allclose(o, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(o, ref.attention(q, k, v, dropout_p=0.1, dropout_mask=full.copy()))
    o_t, lse = numpy_flash.flash_attention_forward(q, k, v, block_q=4, block_k=4, dropout_p=0.1, dropout_mask=mask)
    np.testing.assert_allclose(o_t, expected, rtol=1e-12, atol=1e-12)
    grads = ref.attention_backward(q, k, v, do, dropout_p=0.1, dropout_mask=full.copy())
    for g, r in zip(ref.attention_backward(q, k, v, do, dropout_p=0.1, dropout_mask=mask), grads):
        np.testing.assert_array_equal(g, r)
    tiled = numpy_flash.flash_attention_backward(q, k, v, o_t, lse, do, block_q=4, block_k=4, dropout_p=0.1,
                                                 dropout_mask=mask)
    for g, r in zip(tiled, grads):
        np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-11)


def test_numpy_flash_backward_bad_saved_arrays():
    q, k, v = _np_inputs()
    o, lse = numpy_flash.flash_attention_forward(q, k, v)
    do = np.ones_like(o)
    bw = numpy_flash.flash_attention_backward
    with pytest.raises(TypeError, match="o must be a NumPy array, got NoneType"):
        bw(q, k, v, None, lse, do)
    with pytest.raises(TypeError, match="lse must be a NumPy array, got a torch.Tensor"):
        bw(q, k, v, o, torch.tensor(lse), do)
    with pytest.raises(TypeError, match=r"o must have the dtype of q \(float64\), got float32"):
        bw(q, k, v, o.astype(np.float32), lse, do)
    with pytest.raises(ValueError, match=r"lse must be finite or -inf"):
        bw(q, k, v, o, np.full_like(lse, np.inf), do)
    with pytest.raises(TypeError, match="trace must be a list or None"):
        bw(q, k, v, o, lse, do, trace="yes")
    with pytest.raises(ValueError, match=re.escape("block_mask must have shape (B or 1, H or 1, 1, 1)")):
        bw(q, k, v, o, lse, do, block_mask=np.ones((1, 1, 2, 2), bool))


def test_numpy_forward_bad_observe():
    q, k, v = _np_inputs()
    with pytest.raises(TypeError, match="observe must be a callable or None, got int"):
        numpy_flash.flash_attention_forward(q, k, v, observe=5)


# ------------------------------------------------------------------ NumPy: packed batches

def _np_packed():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((10, 2, 8)), rng.standard_normal((12, 1, 8)), rng.standard_normal((12, 1, 8))
    return q, k, v, np.array([0, 4, 10]), np.array([0, 5, 12])


NUMPY_VARLEN = {
    "reference.attention_varlen": ref.attention_varlen,
    "numpy_flash.flash_attention_varlen_forward": numpy_flash.flash_attention_varlen_forward,
}


@pytest.mark.parametrize("change, exc, words", [
    (dict(cu_seqlens_q=None), TypeError, "cu_seqlens_q must be a 1-D array of integers, got dtype object"),
    (dict(cu_seqlens_q="0,4,10"), TypeError, "cu_seqlens_q must be a 1-D array of integers"),
    (dict(cu_seqlens_q=np.array([False, True])), TypeError, "cu_seqlens_q must be a 1-D array of integers, got dtype bool"),
    (dict(cu_seqlens_k=np.array([0, 7, 5, 12])), ValueError, "cu_seqlens_k holds an empty (or negative) sequence"),
    (dict(max_seqlen_q=6.0), TypeError, "max_seqlen_q must be a positive integer, got float"),
    (dict(max_seqlen_k=0), ValueError, "max_seqlen_k must be a positive integer, got 0"),
    (dict(k="k3"), ValueError, "H_kv that divides q's H = 2"),
    (dict(q="f32"), TypeError, "q, k and v must have the same dtype"),
    (dict(q="4-d"), ValueError, "q must have shape (total, heads, d) for a packed batch, got 4-d"),
    (dict(k="list"), TypeError, "k must be a NumPy array, got list"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes must have shape (H,) = (2,)"),
])
@pytest.mark.parametrize("name", list(NUMPY_VARLEN))
def test_numpy_varlen_bad_arguments(name, change, exc, words):
    q, k, v, cu_q, cu_k = _np_packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    special = {"k3": lambda: args.update(k=np.ones((12, 3, 8)), v=np.ones((12, 3, 8))),
               "f32": lambda: args.update(q=q.astype(np.float32)),
               "4-d": lambda: args.update(q=q[None]),
               "list": lambda: args.update(k=k.tolist())}
    for key, value in change.items():
        if key in ("q", "k"):
            special[value]()
        else:
            args[key] = value
    with pytest.raises(exc, match=re.escape(words)):
        NUMPY_VARLEN[name](**args)


NUMPY_VARLEN_ALL = {
    **NUMPY_VARLEN,
    "reference.attention_varlen_backward": lambda q, k, v, cu_seqlens_q, cu_seqlens_k, **kw:
        ref.attention_varlen_backward(q, k, v, q, cu_seqlens_q, cu_seqlens_k, **kw),
    "numpy_flash.flash_attention_varlen_backward": lambda q, k, v, cu_seqlens_q, cu_seqlens_k, **kw:
        numpy_flash.flash_attention_varlen_backward(q, k, v, q, np.zeros((2, 10)), q, cu_seqlens_q, cu_seqlens_k, **kw),
}


@pytest.mark.parametrize("rows", [13, 11], ids=["v longer", "v shorter"])
@pytest.mark.parametrize("name", list(NUMPY_VARLEN_ALL))
def test_numpy_varlen_v_must_have_the_shape_of_k(name, rows):
    q, k, _, cu_q, cu_k = _np_packed()
    v = np.ones((rows, 1, 8))
    with pytest.raises(ValueError, match=re.escape(f"v must have the shape of k (12, 1, 8), got ({rows}, 1, 8)")):
        NUMPY_VARLEN_ALL[name](q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("shape", [(3, 2), (5, 2), (1, 2), (2, 3), (2, 2, 1), (3,), ()], ids=str)
@pytest.mark.parametrize("name", list(NUMPY_VARLEN_ALL))
def test_numpy_varlen_alibi_slopes_one_row_per_document(name, shape):
    """Two documents, H = 2: (H,) or (number of documents, H); the reference read rows 0 and 1 of a (3, 2) or
    (5, 2) array silently, indexed a (1, 2) one out of range, and named (B, H) = (1, 2) for (2, 3)."""
    q, k, v, cu_q, cu_k = _np_packed()
    with pytest.raises(ValueError, match=re.escape(
            f"alibi_slopes must have shape (H,) = (2,) or (number of documents, H) = (2, 2), got {shape}")):
        NUMPY_VARLEN_ALL[name](q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=np.ones(shape))


@pytest.mark.parametrize("return_lse", [None, 1, "yes", np.bool_(True)], ids=repr)
def test_reference_varlen_return_lse_must_be_a_bool(return_lse):
    q, k, v, cu_q, cu_k = _np_packed()
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        ref.attention_varlen(q, k, v, cu_q, cu_k, return_lse=return_lse)


def test_reference_varlen_checks_before_allocating():
    """A torch q reached np.empty_like before the checks (an opaque error); now the NumPy rule names it."""
    q, k, v, cu_q, cu_k = _np_packed()
    with pytest.raises(TypeError, match="q must be a NumPy array, got a torch.Tensor"):
        ref.attention_varlen(torch.tensor(q), k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="q must be a NumPy array, got list"):
        ref.attention_varlen(q.tolist(), k, v, cu_q, cu_k)


def test_numpy_varlen_gradients_are_each_documents_own():
    """Valid packed batches (grouped heads, per-document ALiBi slopes): o, lse and every row of dq, dk, dv
    equal each document's float64 reference, packed back (dv had an uninitialised row when v was longer)."""
    q, k, v, cu_q, cu_k = _np_packed()
    do = np.random.default_rng(3).standard_normal(q.shape)
    slopes = np.array([[0.5, 0.25], [0.125, 1.0]])
    o, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, alibi_slopes=slopes)
    grads = ref.attention_varlen_backward(q, k, v, do, cu_q, cu_k, causal=True, alibi_slopes=slopes)
    o_t, lse_t = numpy_flash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, causal=True, block_q=4, block_k=4,
                                                            alibi_slopes=slopes)
    tiled = numpy_flash.flash_attention_varlen_backward(q, k, v, o_t, lse_t, do, cu_q, cu_k, causal=True, block_q=4,
                                                        block_k=4, alibi_slopes=slopes)
    unpack = lambda x, a, b: np.swapaxes(x[a:b], 0, 1)[None]  # noqa: E731
    for b in range(2):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        args = (unpack(q, q0, q1), unpack(k, k0, k1), unpack(v, k0, k1))
        o_b, lse_b = ref.attention(*args, causal=True, return_lse=True, alibi_slopes=slopes[b])
        grads_b = ref.attention_backward(*args, unpack(do, q0, q1), causal=True, alibi_slopes=slopes[b])
        np.testing.assert_array_equal(unpack(o, q0, q1), o_b)
        np.testing.assert_array_equal(lse[:, q0:q1], lse_b[0])
        np.testing.assert_allclose(unpack(o_t, q0, q1), o_b, rtol=1e-12, atol=1e-12)
        for g, t, r, (a, c) in zip(grads, tiled, grads_b, ((q0, q1), (k0, k1), (k0, k1))):
            np.testing.assert_array_equal(unpack(g, a, c), r)
            np.testing.assert_allclose(unpack(t, a, c), r, rtol=1e-11, atol=1e-11)


def test_numpy_varlen_backward_bad_arrays():
    q, k, v, cu_q, cu_k = _np_packed()
    with pytest.raises(ValueError, match=re.escape("do must have the shape of q (10, 2, 8), got (5, 2, 8)")):
        ref.attention_varlen_backward(q, k, v, q[:5], cu_q, cu_k)
    with pytest.raises(TypeError, match=re.escape("do must have the dtype of q, k and v (float64), got float32")):
        ref.attention_varlen_backward(q, k, v, q.astype(np.float32), cu_q, cu_k)
    with pytest.raises(TypeError, match="do must be a NumPy array, got a torch.Tensor"):
        ref.attention_varlen_backward(q, k, v, torch.tensor(q), cu_q, cu_k)
    with pytest.raises(TypeError, match="q must be a NumPy array, got a torch.Tensor"):
        ref.attention_varlen_backward(torch.tensor(q), k, v, q, cu_q, cu_k)
    with pytest.raises(ValueError, match="do must be finite"):
        ref.attention_varlen_backward(q, k, v, np.full_like(q, np.nan), cu_q, cu_k)
    o, lse = numpy_flash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k)
    bw = numpy_flash.flash_attention_varlen_backward
    with pytest.raises(ValueError, match=re.escape("lse must have shape (H, total_q) = (2, 10), got (10, 2)")):
        bw(q, k, v, o, lse.T, q, cu_q, cu_k)
    with pytest.raises(TypeError, match="lse must be a NumPy array, got list"):
        bw(q, k, v, o, lse.tolist(), q, cu_q, cu_k)
    with pytest.raises(TypeError, match=re.escape("o must have the dtype of q (float64), got float32")):
        bw(q, k, v, o.astype(np.float32), lse, q, cu_q, cu_k)
    with pytest.raises(ValueError, match="block_q must be a positive integer, got 0"):
        numpy_flash.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, block_q=0)


# ------------------------------------------------------------------ online softmax

def test_online_softmax_update_bad_value_rows():
    state = osm.init((2,), d=4)
    with pytest.raises(TypeError, match="v_block must be a NumPy array, got a torch.Tensor"):
        osm.update(state, np.zeros((2, 3)), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=re.escape("v_block must be finite (no NaN or inf), got NaN at index (0, 0)")):
        osm.update(state, np.zeros((2, 3)), np.full((3, 4), np.nan))
    with pytest.raises(ValueError, match=re.escape("scores_block must be finite or -inf (a masked score), got +inf")):
        osm.update(state, np.array([[0.0, np.inf, 0.0], [0.0, 0.0, 0.0]]), np.zeros((3, 4)))
    with pytest.raises(TypeError, match="scores_block must be real numbers"):
        osm.update(osm.init((2,)), np.ones((2, 3), bool))


@pytest.mark.parametrize("call, exc, words", [
    # v_block's rows and width (raw NumPy errors before), scores whose rows are not the state's (some broadcast)
    (lambda: osm.update(osm.init((2,), d=4), np.zeros((2, 3)), np.zeros((4, 4))), ValueError,
     "v_block must have shape (b, d) = (3, 4): the block's b value rows, as wide as state.o (d = 4), got shape (4, 4)"),
    (lambda: osm.update(osm.init((2,), d=4), np.zeros((2, 3)), np.zeros((3, 5))), ValueError, "got shape (3, 5)"),
    (lambda: osm.update(osm.init((2,), d=4), np.zeros((2, 3)), np.zeros(3)), ValueError, "v_block must have shape"),
    (lambda: osm.update(osm.init((2,), d=4), np.zeros((2, 3)), np.zeros((5, 3, 4))), ValueError,
     "v_block must have shape (b, d) = (3, 4)"),
    (lambda: osm.update(osm.init((2, 3, 5), d=4), np.zeros((2, 3, 5, 3)), np.zeros((4, 3, 4))), ValueError,
     "v_block must have shape (b, d) = (3, 4) or (2, 3, 3, 4)"),
    (lambda: osm.update(osm.init((2,), d=4), np.zeros((3, 3)), np.zeros((3, 4))), ValueError,
     "scores_block must have shape (2, b): a row of b scores for each row of the state (state.m.shape = (2,)), "
     "got shape (3, 3)"),
    (lambda: osm.update(osm.init((2,)), np.zeros((4, 2, 3))), ValueError, "scores_block must have shape (2, b)"),
    (lambda: osm.update(osm.init(), np.zeros((2, 3))), ValueError, "scores_block must have shape (b,)"),
    # not a state
    (lambda: osm.update("state", np.zeros(3)), TypeError, "state must be a SoftmaxState (from init, update or merge), got str"),
    (lambda: osm.update(None, np.zeros(3)), TypeError, "state must be a SoftmaxState"),
    (lambda: osm.merge(osm.init(), (np.float64(0), np.float64(1))), TypeError,
     "b must be a SoftmaxState (from init, update or merge), got tuple"),
    (lambda: osm.merge(None, osm.init()), TypeError, "a must be a SoftmaxState"),
    (lambda: osm.finalize({"m": 0}), TypeError, "state must be a SoftmaxState (from init, update or merge), got dict"),
    (lambda: osm.lse_of(np.zeros(2)), TypeError, "state must be a SoftmaxState (from init, update or merge), got ndarray"),
    # merge of states of different shapes (they broadcast)
    (lambda: osm.merge(osm.init((2,)), osm.init((3,))), ValueError, "b must have the shape of a (m, l: (2,), (2,)), got (3,), (3,)"),
    (lambda: osm.merge(osm.init((2, 1)), osm.init((2,))), ValueError, "b must have the shape of a"),
    (lambda: osm.merge(osm.init((2,), d=3), osm.init((2,), d=4)), ValueError,
     "b must have the shape of a (m, l, o: (2,), (2,), (2, 3)), got (2,), (2,), (2, 4)"),
    # init's d
    (lambda: osm.init(d=-1), ValueError, "d must be a positive integer, got -1"),
    (lambda: osm.init(d=0), ValueError, "d must be a positive integer, got 0"),
    (lambda: osm.init(d="a"), TypeError, "d must be a positive integer, got str"),
    (lambda: osm.init(d=2.7), TypeError, "d must be a positive integer, got float: 2.7"),
    # merge_outputs of lists (AttributeError before)
    (lambda: osm.merge_outputs([[0.0]], [0.0], [[0.0]], [0.0]), TypeError, "o_a must be a NumPy array or a torch.Tensor, got list"),
    (lambda: osm.merge_outputs(1.0, 1.0, 1.0, 1.0), TypeError, "o_a must be a NumPy array or a torch.Tensor, got float"),
])
def test_online_softmax_states_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_online_softmax_states_take_broadcast_values_and_numpy_widths():
    """Valid calls are unchanged: v_block (b, d) shared by every row, or with leading dims that broadcast."""
    s = osm.update(osm.init((2, 3), d=4), np.zeros((2, 3, 5)), np.ones((2, 5, 4)))
    s = osm.update(s, np.zeros((2, 3, 5)), np.ones((5, 4)))
    s = osm.update(s, np.zeros((2, 3, 5)), np.ones((1, 5, 4)))
    np.testing.assert_allclose(osm.finalize(s)[0], np.ones((2, 3, 4)))
    assert osm.init(d=np.int64(3)).o.shape == (3,)
    assert osm.merge(osm.update(osm.init(), [1.0]), osm.init()).m == 1.0


@pytest.mark.parametrize("fn", [osm.running_trace, osm.scan, osm.logsumexp], ids=lambda f: f.__name__)
def test_online_softmax_bad_blocks_and_scores(fn):
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        fn(np.ones(4), 0)
    with pytest.raises(TypeError, match="block_size must be a positive integer, got float"):
        fn(np.ones(4), 2.0)
    with pytest.raises(ValueError, match=re.escape("x must be finite or -inf (a masked score), got NaN at index (0,)")):
        fn(np.array([np.nan]))
    with pytest.raises(TypeError, match="x must be real numbers .* got dtype object"):
        fn(np.array([1, None]))


def test_attention_by_key_blocks_bad_arguments():
    q = np.zeros((3, 2))
    with pytest.raises(TypeError, match="causal must be a bool"):
        osm.attention_by_key_blocks(q, q, q, causal=1)
    with pytest.raises(TypeError, match="block_k must be a positive integer, got bool"):
        osm.attention_by_key_blocks(q, q, q, block_k=True)
    with pytest.raises(ValueError, match="share their batch and head dimensions"):  # no grouped heads here
        osm.attention_by_key_blocks(np.zeros((1, 4, 3, 2)), np.zeros((1, 2, 3, 2)), np.zeros((1, 2, 3, 2)))
    with pytest.raises(TypeError, match="q must be a NumPy array, got a torch.Tensor"):
        osm.attention_by_key_blocks(torch.zeros(3, 2), q, q)


# ------------------------------------------------------------------ ring attention's layout helpers

@pytest.mark.parametrize("rank", [0.0, -1, None, True, 2], ids=["float", "negative", "None", "bool", "too big"])
def test_ring_bad_rank(rank):
    exc = ValueError if isinstance(rank, int) and not isinstance(rank, bool) else (ValueError, TypeError)
    with pytest.raises(exc, match=re.escape("rank must be an int in [0, world_size) = [0, 2)")):
        shard_sequence(np.zeros((1, 1, 8, 2)), rank, 2, False)
    with pytest.raises(exc, match="rank must be an int in"):
        sequence_positions(rank, 2, 8, False)


def test_ring_layout_bad_arguments():
    x = np.zeros((1, 1, 8, 2))
    with pytest.raises(TypeError, match="world_size must be a positive integer, got str"):
        shard_sequence(x, 0, "2", False)
    with pytest.raises(TypeError, match="x must be a NumPy array or a torch.Tensor, got list"):
        shard_sequence([x], 0, 2, False)
    with pytest.raises(ValueError, match="N must be a positive integer, got 0"):
        sequence_positions(0, 2, 0, False)
    with pytest.raises(TypeError, match="N must be a positive integer, got float"):
        sequence_positions(0, 2, 8.0, False)
    with pytest.raises(ValueError, match="the sequence has N = 7 tokens .* multiple of 2"):
        sequence_positions(0, 2, 7, False)
    with pytest.raises(ValueError, match="multiple of 4"):
        sequence_positions(0, 2, 6, True)
    with pytest.raises(TypeError, match="zigzag must be a bool"):
        sequence_positions(0, 2, 8, "yes")
    assert sequence_positions(np.int64(1), np.int64(2), np.int64(8), True).tolist() == [2, 3, 4, 5]


def test_gather_sequence_bad_shards():
    x = np.zeros((1, 1, 4, 2))
    with pytest.raises(TypeError, match="zigzag must be a bool, got NoneType"):
        gather_sequence([x, x], None)
    for shards in ([x, torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2), x]):
        with pytest.raises(TypeError, match="shards must be all NumPy arrays or all torch tensors"):
            gather_sequence(shards, False)
    with pytest.raises(ValueError, match=re.escape("shards[0] must have the sequence along dim 2")):
        gather_sequence([np.zeros((8, 2))], False)
    with pytest.raises(TypeError, match="shards must be a non-empty list of every rank's shard, got ndarray"):
        gather_sequence(x, False)
    with pytest.raises(TypeError, match=re.escape("shards[1] must be a NumPy array or a torch.Tensor, got list")):
        gather_sequence([x, x.tolist()], False)


@pytest.mark.parametrize("make, exc, words", [
    (lambda do: do.long(), TypeError, "do must have the dtype of q (torch.float32), got torch.int64"),
    (lambda do: do > 0, TypeError, "do must have the dtype of q (torch.float32), got torch.bool"),
    (lambda do: do.half(), TypeError, "do must have the dtype of q (torch.float32), got torch.float16"),
    (lambda do: do.to("meta"), ValueError, "do must be on q's device"),
    (lambda do: do.to_sparse(), TypeError, "do must be a dense (strided) tensor"),
], ids=["int64", "bool", "float16", "meta", "sparse"])
def test_simulate_ring_do_must_be_like_q(make, exc, words):
    """An int64 do crashed check_finite (torch takes no norm of integers); its dtype is checked first now."""
    q = _t(1, 2, 8, 16)
    with pytest.raises(exc, match=re.escape(words)):
        simulate_ring(q, q, q, 2, do=make(torch.ones_like(q)))


@pytest.mark.parametrize("x", [torch.empty(0), torch.empty(2, 0, 3), torch.ones(3, dtype=torch.int64),
                               torch.ones(2, dtype=torch.bool), np.empty((0, 2))],
                         ids=["empty", "empty 3-d", "int64", "bool", "numpy empty"])
def test_check_finite_passes_empty_and_integer_arrays(x):
    validation.check_finite({"x": x})
    validation.check_finite({"x": x}, allow_neg_inf=True)


def test_kv_cache_append_of_zero_tokens_with_check_finite():
    cache, k = _cache()
    cache.append(k[:, :, :0], k[:, :, :0], check_finite=True)  # crashed in check_finite
    assert cache.lengths == [3, 3] and cache.seqlens.tolist() == [3, 3]


@pytest.mark.parametrize("which", ["k", "v"])
def test_kv_cache_append_sparse_tensors_are_named(which):
    cache, k = _cache()
    kv = dict(k=k, v=k.clone())
    kv[which] = kv[which].to_sparse()
    with pytest.raises(TypeError, match=re.escape(f"{which} must be a dense (strided) tensor")):
        cache.append(kv["k"], kv["v"])
    assert cache.lengths == [3, 3]


def test_simulate_ring_more_ranks_than_the_sequence_divides():
    q = _t(1, 2, 8, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        simulate_ring(q, q, q, 16)
    with pytest.raises(ValueError, match="H_kv that divides q's H = 2"):
        simulate_ring(q, _t(1, 3, 8, 16), _t(1, 3, 8, 16), 2)


# ------------------------------------------------------------------ block masks

@pytest.mark.parametrize("call, exc, words", [
    (lambda: bmk.n_blocks(0, 16), ValueError, "N must be a positive integer, got 0"),
    (lambda: bmk.n_blocks(10.0, 16), (ValueError, TypeError), "N must be a positive integer, got float: 10.0"),
    (lambda: bmk.n_blocks(10, True), TypeError, "block_size must be a positive integer, got bool"),
    (lambda: bmk.n_blocks(10, -1), ValueError, "block_size must be a positive integer, got -1"),
    (lambda: bmk.causal_blocks(0), ValueError, "n_q_blocks must be a positive integer, got 0"),
    (lambda: bmk.causal_blocks("3"), (ValueError, TypeError), "n_q_blocks must be a positive integer, got str: '3'"),
    (lambda: bmk.causal_blocks(3, 0), ValueError, "n_k_blocks must be a positive integer, got 0"),
    (lambda: bmk.sliding_window(4, window=True), (ValueError, TypeError), "window must be a positive integer, got bool: True"),
    (lambda: bmk.sliding_window(4, window=2.0), (ValueError, TypeError), "window must be a positive integer, got float: 2.0"),
    (lambda: bmk.sliding_window(4, 0), ValueError, "n_k_blocks must be a positive int"),
    (lambda: bmk.bigbird(0), ValueError, "n_blocks must be a positive int"),
    (lambda: bmk.bigbird(4, window=0), ValueError, "window must be a positive integer, got 0"),
    (lambda: bmk.bigbird(4, n_global=-1), ValueError, "n_global must be a non-negative int"),
    (lambda: bmk.visible_pairs(bmk.causal_blocks(3)[0, 0], 40, 40, 16), ValueError, "got (3, 3)"),
    (lambda: bmk.visible_pairs(torch.ones(1, 3, 3, dtype=torch.bool), 40, 40, 16), ValueError, "got (1, 3, 3)"),
    (lambda: bmk.visible_pairs(torch.ones(1, 1, 1, 3, 3, dtype=torch.bool), 40, 40, 16), ValueError, "got (1, 1, 1, 3, 3)"),
    (lambda: bmk.visible_pairs(torch.ones(1, 1, 3, 3, dtype=torch.int64), 40, 40, 16), TypeError,
     "block_mask must be boolean"),
    (lambda: bmk.visible_pairs(bmk.causal_blocks(3), 0, 40, 16), ValueError, "N_q must be a positive integer, got 0"),
    (lambda: bmk.visible_pairs(bmk.causal_blocks(3), 40, 40, 0), ValueError, "block_size must be a positive integer"),
])
def test_block_mask_helpers_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_block_mask_helpers_take_extreme_counts():
    """More global or random blocks than there are blocks is clipped, not an error: every block visible."""
    assert bool(bmk.bigbird(4, n_global=10).all())
    assert bool(bmk.bigbird(4, n_random=10).all())
    assert int(bmk.visible_pairs(np.ones((1, 1, 3, 3), bool), 40, 40, 16)) == 40 * 40


@pytest.mark.parametrize("call, exc, words", [
    (lambda: bmk.sliding_window(4, causal="no"), TypeError, "causal must be a bool, got str: 'no'"),
    (lambda: bmk.sliding_window(4, causal=1), TypeError, "causal must be a bool, got int"),
    (lambda: bmk.sliding_window(4, causal=None), TypeError, "causal must be a bool, got NoneType"),
    (lambda: bmk.visible_pairs(bmk.causal_blocks(3), 40, 40, 16, causal="no"), TypeError, "causal must be a bool"),
    (lambda: bmk.visible_pairs(bmk.causal_blocks(3), 40, 40, 16, causal=np.bool_(True)), TypeError,
     "causal must be a bool"),
    (lambda: bmk.bigbird(4, seed="1"), TypeError, "seed must be an int, got str"),
    (lambda: bmk.bigbird(4, seed=None), TypeError, "seed must be an int, got NoneType"),
    (lambda: bmk.bigbird(4, seed=1.7), TypeError, "seed must be an int, got float: 1.7"),
    (lambda: bmk.bigbird(4, seed=True), TypeError, "seed must be an int, got bool"),
    (lambda: bmk.bigbird(4, seed=2**64), ValueError, "seed must be in [-2**63, 2**64)"),
    (lambda: bmk.density(None), TypeError, "block_mask must be a boolean array or tensor, got NoneType"),
    (lambda: bmk.density([[True]]), TypeError, "block_mask must be a boolean array or tensor, got list"),
    (lambda: bmk.density(torch.ones(1, 1, 2, 2)), TypeError, "got Tensor of dtype torch.float32"),
])
def test_block_mask_flags_seed_and_density_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_block_mask_helpers_take_numpy_ints_and_numpy_masks():
    assert torch.equal(bmk.bigbird(6, seed=np.int64(3)), bmk.bigbird(6, seed=3))
    assert bmk.density(np.ones((1, 1, 2, 2), bool)) == 1.0


# ------------------------------------------------------------------ empty batch or head axes

EMPTY_AXES = {"B = 0": (slice(0, 0),), "H = 0": (slice(None), slice(0, 0))}


@pytest.mark.parametrize("axis", list(EMPTY_AXES))
@pytest.mark.parametrize("fn", [flash_attention_forward, flash_attention, forward_kernel, backward_kernel,
                                lambda q, k, v: simulate_ring(q, k, v, 2)], ids=["forward", "autograd", "forward_kernel",
                                                                                 "backward_kernel", "simulate_ring"])
def test_triton_empty_batch_or_heads(fn, axis):
    """Triton gave RuntimeError / ZeroDivisionError; every axis must be non-empty (validation's rule)."""
    q, k, v = (x[EMPTY_AXES[axis]] for x in _qkv())
    with pytest.raises(ValueError, match=re.escape("q must not be empty: its batch and head axes (B, H)")):
        fn(q, k, v)


@pytest.mark.parametrize("axis", list(EMPTY_AXES))
@pytest.mark.parametrize("name", ["reference.attention", "reference.attention_backward",
                                  "numpy_flash.flash_attention_forward", "online_softmax.attention_by_key_blocks"])
def test_numpy_empty_batch_or_heads(name, axis):
    """numpy_flash divided by zero and the reference returned empty arrays."""
    q, k, v = (x[EMPTY_AXES[axis]] for x in _np_inputs(H=2))
    fn = {"reference.attention": ref.attention,
          "reference.attention_backward": lambda q, k, v: ref.attention_backward(q, k, v, q),
          "numpy_flash.flash_attention_forward": numpy_flash.flash_attention_forward,
          "online_softmax.attention_by_key_blocks": osm.attention_by_key_blocks}[name]
    with pytest.raises(ValueError, match=re.escape("q must not be empty")):
        fn(q, k, v)



# ------------------------------------------------------------------ sparse tensors

def _sparse_mask():
    return torch.ones(1, 1, 3, 3, dtype=torch.bool, device=DEVICE).to_sparse()


SPARSE_CASES = {
    "triton block_mask": (lambda: flash_attention_forward(*_qkv(N_q=40, N_k=40), block_mask=_sparse_mask(),
                                                          block_size=16), "block_mask"),
    "forward_kernel block_mask": (lambda: forward_kernel(*_qkv(N_q=40, N_k=40), block_mask=_sparse_mask(),
                                                         block_size=16), "block_mask"),
    "triton alibi_slopes": (lambda: flash_attention(*_qkv(), alibi_slopes=torch.ones(2, device=DEVICE).to_sparse()),
                            "alibi_slopes"),
    "backward alibi_slopes": (lambda: backward_kernel(*_qkv(), alibi_slopes=torch.ones(2, device=DEVICE).to_sparse()),
                              "alibi_slopes"),
    "varlen alibi_slopes": (lambda: flash_attention_varlen(*_packed(), _packed()[3], 5, 5,
                                                           alibi_slopes=torch.ones(2, device=DEVICE).to_sparse()),
                            "alibi_slopes"),
    "reference alibi_slopes": (lambda: ref.attention(*_np_inputs(), alibi_slopes=torch.ones(4).to_sparse()),
                               "alibi_slopes"),
    "numpy varlen alibi_slopes": (lambda: ref.attention_varlen(*_np_packed(), alibi_slopes=torch.ones(2).to_sparse()),
                                  "alibi_slopes"),
    "visible_pairs": (lambda: bmk.visible_pairs(_sparse_mask(), 40, 40, 16), "block_mask"),
    "density": (lambda: bmk.density(_sparse_mask()), "block_mask"),
}


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_tensors_are_refused_by_name(case):
    call, name = SPARSE_CASES[case]
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a dense (strided) tensor, got layout torch.sparse")):
        call()


# ------------------------------------------------------------------ smaller ones

@pytest.mark.parametrize("return_lse", [None, 1, "yes", torch.tensor(True)], ids=repr)
def test_triton_varlen_return_lse_must_be_a_bool(return_lse):
    q, k, v, cu = _packed()
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attention_varlen(q, k, v, cu, cu, 5, 5, return_lse=return_lse)


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("x", [np.zeros((1, 1, 0, 2)), torch.zeros(1, 1, 0), np.zeros((2, 3, 0))],
                         ids=["numpy 4-d", "torch lse", "numpy lse"])
def test_shard_sequence_refuses_an_empty_sequence(x, zigzag):
    """It returned empty shards while sequence_positions refuses N = 0."""
    with pytest.raises(ValueError, match=re.escape("x must hold at least one token along dim 2 (N >= 1")):
        shard_sequence(x, 0, 2, zigzag)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: numpy_flash.tile_ranges(10, 0), ValueError, "block must be a positive integer, got 0"),
    (lambda: numpy_flash.tile_ranges(10, -4), ValueError, "block must be a positive integer, got -4"),
    (lambda: numpy_flash.tile_ranges(10, 2.0), TypeError, "block must be a positive integer, got float"),
    (lambda: numpy_flash.visited_tiles(10, 10, 0, 4), ValueError, "block_q must be a positive integer, got 0"),
    (lambda: numpy_flash.visited_tiles(10, 10, 4, 0, causal=True), ValueError, "block_k must be a positive integer"),
    (lambda: numpy_flash.visited_tiles(10, 10, 4, None), TypeError, "block_k must be a positive integer, got NoneType"),
])
def test_tile_grid_helpers_bad_blocks(call, exc, words):
    """range() arg 3 must not be zero, before."""
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_tile_grid_helpers_take_numpy_ints():
    assert numpy_flash.tile_ranges(10, np.int64(4)) == [(0, 4), (4, 8), (8, 10)]
    assert numpy_flash.visited_tiles(8, 8, np.int32(4), 4, causal=True) == [(0, 0), (1, 0), (1, 1)]
