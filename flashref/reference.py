"""Standard attention in NumPy, forward and backward: the ground truth every other part is checked against.

Taught in notebook ``01_standard_attention`` ("Q, K, V, S, P, O" and "Where S and P live").

This is the *slow-memory* algorithm on purpose: it materializes the two ``N_q x N_k`` matrices

    S = sm_scale * Q K^T          (the scores)
    P = softmax(S) row by row     (the attention weights)

and only then forms ``O = P V``. On a GPU both matrices would live in HBM; FlashAttention never
builds them. Called with float64 inputs it is the reference; called with float32 or float16 inputs it
is "plain attention in the same low precision", the baseline of the tolerance rule
(:mod:`flashref.tolerance`), because every step runs in the input's dtype.

Conventions (the whole package's): shapes ``(N, d)`` or ``(B, H, N, d)``; ``N_q`` may differ from ``N_k``;
``causal=True`` is top-left aligned as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
(query ``i`` attends keys ``j <= i``; every row sees key 0); ``sm_scale`` defaults to
``1/sqrt(d)``; ``lse`` is the natural-log log-sum-exp of the scaled, masked scores of each query row.

Inputs must be floating point (float16, float32 or float64): integer or boolean arrays raise
``TypeError`` rather than being cast silently, since "attention of integers" is almost always a bug.
NumPy has no bfloat16, so bfloat16 is refused here too (byte counts still know it).
"""

from __future__ import annotations

import numbers

import numpy as np

from flashref import validation, varlen
from flashref.score_mods import ScoreMods

#: dtypes the NumPy reference computes in (NumPy has no bfloat16).
FLOAT_DTYPES = ("float16", "float32", "float64")

#: bytes per element of the dtypes the byte counts know, by name.
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


# --------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, causal, sm_scale):
    """Validate q, k, v, causal and sm_scale; return NumPy arrays and the float scale. k and v may have
    fewer heads than q (grouped-query attention, 4-D inputs): ``H % H_kv == 0``."""
    _, _, d = validation.check_attention_inputs(q, k, v, allowed_ndims=(2, 4), allowed_dtypes=FLOAT_DTYPES,
                                                numpy=True, gqa=True)
    validation.check_causal(causal)
    scale = validation.check_sm_scale(sm_scale, d)
    return q, k, v, scale


def _masks(q, k, causal, dropout_mask, dropout_p, block_mask, block_size, mods=None):
    """The boolean ``visible`` mask (causal, the window of ``mods`` and block-sparse together, or None for
    all visible) and the dropout ``keep`` mask (or None), both broadcastable to ``(..., N_q, N_k)``, and the
    dropout scale."""
    N_q, N_k = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    visible = causal_mask(N_q, N_k) if causal else None
    window = None if mods is None else mods.window(np.arange(N_q), np.arange(N_k))
    if window is not None:
        visible = window if visible is None else (visible & window)
    if block_mask is not None:
        validation.check_numpy("block_mask", block_mask)
        blocks = validation.check_block_mask(block_mask, lead, N_q, N_k, block_size)
        element = expand_block_mask(blocks, block_size, N_q, N_k)
        visible = element if visible is None else (visible & element)
    p = validation.check_dropout_p(dropout_p)
    keep = validation.check_dropout_mask(dropout_mask, p, (*lead, N_q, N_k), "the reference is deterministic")
    return visible, keep, 1.0 / (1.0 - p)


def expand_block_mask(blocks: np.ndarray, block_size: int, N_q: int, N_k: int) -> np.ndarray:
    """The element mask ``(..., N_q, N_k)`` of a block mask ``(..., ceil(N_q / bs), ceil(N_k / bs))``:
    query i sees key j when block (i // bs, j // bs) is True."""
    rows = np.arange(N_q) // block_size
    cols = np.arange(N_k) // block_size
    return blocks[..., rows[:, None], cols[None, :]]


def _repeat_kv(x, H):
    """K or V with H_kv heads, repeated to H heads for the reference's arithmetic (query head h uses K/V
    head h // (H // H_kv), the convention of ``scaled_dot_product_attention(..., enable_gqa=True)``)."""
    if x.ndim != 4 or x.shape[1] == H:
        return x
    return np.repeat(x, H // x.shape[1], axis=1)


def _sum_groups(dx, H_kv):
    """dK or dV of the H query heads summed over each group of H // H_kv heads that share a K/V head."""
    if dx.ndim != 4 or dx.shape[1] == H_kv:
        return dx
    B, H, N, d = dx.shape
    return dx.reshape(B, H_kv, H // H_kv, N, d).sum(axis=2)


def _check_do(do, q):
    """``do`` (the gradient of the loss with respect to O) must look like O: q's shape and dtype."""
    validation.check_numpy("do", do)
    validation.check_same_shape("do", do, "q", q)
    if do.dtype != q.dtype:
        raise TypeError(f"do must have the dtype of q, k and v ({q.dtype}), got {do.dtype}")
    validation.check_finite({"do": do})
    return do


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

def causal_mask(N_q: int, N_k: int, align: str = "top_left") -> np.ndarray:
    """Boolean ``(N_q, N_k)`` array, True where query ``i`` may attend key ``j``: ``j <= i`` (top-left
    aligned; rows ``i >= N_k``, when ``N_q > N_k``, see every key), or with ``align="bottom_right"``
    ``j <= i + N_k - N_q`` (the last query sees every key; when ``N_q > N_k`` the first rows see none)."""
    _, bound = validation.split_causal(True, align, N_q, N_k)
    return np.tril(np.ones((N_q, N_k), dtype=bool), k=bound or 0)


def _mods(q, k, causal, causal_align, window_size, softcap, alibi_slopes):
    """``(causal, mods)``, the causal mask split by :func:`flashref.validation.split_causal`: a shifted
    (bottom-right) one travels in ``mods`` as a bound on ``j - i``."""
    causal, bound = validation.split_causal(causal, causal_align, q.shape[-2], k.shape[-2])
    return causal, ScoreMods(window_size, softcap, alibi_slopes, lead=q.shape[:-2], causal_right=bound)


def _scaled_qk(q, k, sm_scale: float) -> np.ndarray:
    """sm_scale * Q K^T in the input dtype (K repeated over each group of query heads)."""
    return np.matmul(q, np.swapaxes(_repeat_kv(k, q.shape[1] if q.ndim == 4 else 0), -1, -2)) * q.dtype.type(sm_scale)


def scores(q, k, causal: bool, sm_scale: float, visible=None, mods: ScoreMods | None = None) -> np.ndarray:
    """S = sm_scale * Q K^T in the input dtype, with masked entries set to -inf. Shape ``(..., N_q, N_k)``.
    ``visible`` (boolean, broadcastable) replaces the causal mask when given (it already includes it).
    ``mods`` (:class:`flashref.score_mods.ScoreMods`) caps and biases the scores before the mask."""
    s = _scaled_qk(q, k, sm_scale)
    if mods is not None and mods.changes_scores:
        s = mods.modify(s, np.arange(q.shape[-2]), np.arange(k.shape[-2]))
    if visible is None and causal:
        visible = causal_mask(q.shape[-2], k.shape[-2])
    if visible is not None:
        s = np.where(visible, s, q.dtype.type(-np.inf))
    return s


def softmax_rows(s: np.ndarray):
    """Row-wise softmax of S, stable: subtract each row's max before ``exp`` so nothing overflows.

    Returns ``(P, lse)`` with ``lse = m + log(l)``, ``m`` the row max and ``l = sum(exp(S - m))``. A row
    whose every entry is masked (-inf: a block mask, a window, or a bottom-right causal mask with N_q > N_k can
    do that) has P = 0 and lse = -inf, never NaN.
    """
    m = np.max(s, axis=-1, keepdims=True)
    empty = np.isneginf(m)
    m = np.where(empty, 0, m).astype(s.dtype)
    p = np.exp(s - m)
    l = np.sum(p, axis=-1, keepdims=True)
    p = p / np.where(empty, 1, l).astype(s.dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))[..., 0]
    return p, lse.astype(s.dtype)


def attention(q, k, v, causal=False, sm_scale=None, return_lse=False, *, dropout_mask=None, dropout_p=0.0,
              block_mask=None, block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              causal_align="top_left"):
    """Standard attention ``O = dropout(softmax(sm_scale * Q K^T)) V``, materializing S and P.

    ``q``: ``(..., N_q, d)``, ``k`` and ``v``: ``(..., N_k, d)`` with ``...`` empty or ``(B, H)``; for 4-D
    inputs ``k`` and ``v`` may have ``H_kv`` heads with ``H % H_kv == 0`` (grouped-query attention: query
    head h uses K/V head ``h // (H // H_kv)``). Returns ``o`` of q's shape and dtype, or ``(o, lse)`` with
    ``lse`` of shape ``(..., N_q)`` when ``return_lse``.

    ``block_mask`` (boolean, ``(B or 1, H or 1, ceil(N_q / block_size), ceil(N_k / block_size))``, or 2-D
    for 2-D inputs): block (i, j) False means the queries of block i never see the keys of block j; it
    combines with ``causal``. A query row that sees no key gets ``o = 0`` and ``lse = -inf``.
    ``dropout_mask`` (boolean keep-mask broadcastable to ``(..., N_q, N_k)``) with ``dropout_p``: P's
    dropped entries are zeroed and the kept ones scaled by ``1 / (1 - dropout_p)``; lse is that of P
    before dropout. ``window_size``, ``softcap`` and ``alibi_slopes`` modify the scores and the mask as
    FlashAttention's keywords do (:mod:`flashref.score_mods`: a token window ``i - left <= j <= i + right``,
    ``c * tanh(s / c)``, ``- a_h |i - j|``). ``causal_align="bottom_right"`` moves the causal diagonal to
    the bottom-right corner when ``N_q != N_k`` (query i sees ``j <= i + N_k - N_q``, FlashAttention's
    convention, what decoding needs; :func:`causal_mask`). Raises ``ValueError``/``TypeError`` naming the
    argument on bad input (integer dtypes included). Taught in notebook ``01_standard_attention``.
    """
    q, k, v, scale = _check_inputs(q, k, v, causal, sm_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}: {return_lse!r}")
    causal, mods = _mods(q, k, causal, causal_align, window_size, softcap, alibi_slopes)
    visible, keep, keep_scale = _masks(q, k, causal, dropout_mask, dropout_p, block_mask, block_size, mods)
    s = scores(q, k, causal, scale, visible, mods)
    p, lse = softmax_rows(s)
    if keep is not None:
        p = np.where(keep, p * p.dtype.type(keep_scale), p.dtype.type(0))
    o = np.matmul(p, _repeat_kv(v, q.shape[1] if q.ndim == 4 else 0))
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

def attention_backward(q, k, v, do, causal=False, sm_scale=None, *, dropout_mask=None, dropout_p=0.0,
                       block_mask=None, block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       causal_align="top_left"):
    """Gradients ``(dq, dk, dv)`` of standard attention, given ``do = dLoss/dO``; the keywords as in
    :func:`attention` (dk and dv have k's and v's shapes: with grouped-query attention each K/V head's
    gradient is the sum over the query heads that share it).

    With S = scale Q K^T, P = softmax(S), P~ = P * keep / (1 - p) (P~ = P without dropout), O = P~ V
    (notebook ``05_backward_recomputation`` derives it):

        dV = P~^T dO
        dP = (dO V^T) * keep / (1 - p)
        dS = P * (dP - rowsum(P * dP))      (the softmax Jacobian, row by row)
        dQ = scale dS K,   dK = scale dS^T Q

    With a softcap c, dS is taken with respect to the capped score and multiplied by its derivative,
    ``1 - tanh(scale q.k / c)^2``, before the last two products; the ALiBi bias has no gradient.

    Masked entries have P = 0, so their dS is 0 and they pass no gradient; a row that sees no key has
    zero gradients. This version stores P (the memory FlashAttention's backward saves by recomputing P
    from Q, K and lse).
    """
    q, k, v, scale = _check_inputs(q, k, v, causal, sm_scale)
    do = _check_do(do, q)
    causal, mods = _mods(q, k, causal, causal_align, window_size, softcap, alibi_slopes)
    visible, keep, keep_scale = _masks(q, k, causal, dropout_mask, dropout_p, block_mask, block_size, mods)
    H = q.shape[1] if q.ndim == 4 else 0
    k_full, v_full = _repeat_kv(k, H), _repeat_kv(v, H)
    p, _ = softmax_rows(scores(q, k, causal, scale, visible, mods))
    dp = np.matmul(do, np.swapaxes(v_full, -1, -2))
    if keep is not None:
        c = p.dtype.type(keep_scale)
        p_dropped = np.where(keep, p * c, p.dtype.type(0))
        dp = np.where(keep, dp * c, dp.dtype.type(0))
    else:
        p_dropped = p
    dv = np.matmul(np.swapaxes(p_dropped, -1, -2), do)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    if mods.softcap > 0:
        ds = mods.softcap_grad(ds, _scaled_qk(q, k, scale))
    s = q.dtype.type(scale)
    dq = np.matmul(ds, k_full) * s
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * s
    if q.ndim == 4:
        dk, dv = _sum_groups(dk, k.shape[1]), _sum_groups(dv, v.shape[1])
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Packed variable-length batches
# --------------------------------------------------------------------------------------------------

def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     sm_scale=None, return_lse=False, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Standard attention over a packed batch of documents of different lengths, as FlashAttention's
    ``flash_attn_varlen_func``: ``q`` is ``(total_q, H, d)``, ``k`` and ``v`` are ``(total_k, H_kv, d)``, and
    document b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
    of k and v. No query sees a key of another document; within one, everything is :func:`attention`'s
    (causal top-left aligned in each document, grouped heads, ``window_size``, ``softcap``, ``alibi_slopes``
    of shape ``(H,)`` or ``(B, H)``). Returns ``o`` of q's shape, and ``lse`` of shape ``(H, total_q)`` (as
    FlashAttention) when ``return_lse``. ``max_seqlen_q`` / ``max_seqlen_k``, when given, are checked against
    the longest document. A document of length 0 is a ``ValueError``.
    """
    docs = varlen.documents(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # first: the checks
    validation.check_bool("return_lse", return_lse)
    o = np.empty_like(q)
    lse = np.empty((q.shape[1], q.shape[0]), dtype=q.dtype)
    for b, (rows, cols) in enumerate(docs):
        o_b, lse_b = attention(varlen.unpack(q, rows), varlen.unpack(k, cols), varlen.unpack(v, cols), causal,
                               sm_scale, True, window_size=window_size, softcap=softcap,
                               alibi_slopes=varlen.document_slopes(alibi_slopes, b, len(docs), q.shape[1]))
        varlen.pack(o, o_b, rows)
        varlen.pack(lse, lse_b, rows)
    return (o, lse) if return_lse else o


def attention_varlen_backward(q, k, v, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                              causal=False, sm_scale=None, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen` given ``do`` (q's shape): each document's
    :func:`attention_backward`, packed back in place."""
    docs = varlen.documents(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    validation.check_numpy("do", do)
    validation.check_same_shape("do", do, "q", q)
    validation.check_finite({"do": do})  # the packed array: indices as the caller gave them
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    for b, (rows, cols) in enumerate(docs):
        grads = attention_backward(varlen.unpack(q, rows), varlen.unpack(k, cols), varlen.unpack(v, cols),
                                   varlen.unpack(do, rows), causal, sm_scale, window_size=window_size,
                                   softcap=softcap,
                                   alibi_slopes=varlen.document_slopes(alibi_slopes, b, len(docs), q.shape[1]))
        for packed, g, r in zip((dq, dk, dv), grads, (rows, cols, cols)):
            varlen.pack(packed, g, r)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Memory and work: the worked numbers of notebook 01
# --------------------------------------------------------------------------------------------------

def _dtype_name(dtype) -> str:
    """Name of a dtype given as a string, a NumPy dtype or type, or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = name.replace("torch.", "")
    if name not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {', '.join(_ITEMSIZE)}, got {dtype!r}")
    return name


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (float16 and bfloat16: 2, float32: 4, float64: 8)."""
    return _ITEMSIZE[_dtype_name(dtype)]


def _count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def score_matrix_bytes(N_q, N_k=None, heads=1, batch=1, dtype="float32") -> int:
    """Bytes of ONE materialized ``N_q x N_k`` matrix (S, or P) for every head and batch entry.

    ``N_k`` defaults to ``N_q``. ``dtype`` is a name (``"float16"``, ``"bfloat16"``, ``"float32"``,
    ``"float64"``) or a NumPy/torch dtype. Example: N = 8192 in fp32, one head: 256 MiB.
    """
    N_q = _count("N_q", N_q)
    N_k = N_q if N_k is None else _count("N_k", N_k)
    return N_q * N_k * _count("heads", heads) * _count("batch", batch) * itemsize(dtype)


def materialized_bytes(N_q, N_k=None, heads=1, batch=1, dtype="float32") -> int:
    """Bytes of S and P together, the two matrices standard attention materializes: twice
    :func:`score_matrix_bytes`. Example: N = 8192 in fp32, one head: 512 MiB."""
    return 2 * score_matrix_bytes(N_q, N_k, heads=heads, batch=batch, dtype=dtype)


def forward_flops(N_q, N_k=None, d=64, heads=1, batch=1, causal=False) -> int:
    """FLOPs of the attention forward pass: ``4 N_q N_k d`` a head (two matmuls, a multiply and an add
    each), half of it when causal. Taught in notebook ``01_standard_attention`` ("FLOPs against bytes"); the
    benchmarks count with it (:func:`flashref.bench.results.flops`)."""
    N_q = _count("N_q", N_q)
    N_k = N_q if N_k is None else _count("N_k", N_k)
    validation.check_causal(causal)
    flops = 4 * N_q * N_k * _count("d", d) * _count("heads", heads) * _count("batch", batch)
    return flops // 2 if causal else flops
