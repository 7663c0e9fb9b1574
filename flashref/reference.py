"""Standard attention in NumPy, forward and backward: the ground truth every other part is checked against.

Taught in notebook ``01_standard_attention`` ("Standard attention" and "Where S and P live").

This is the *slow-memory* algorithm on purpose: it materializes the two ``N_q x N_k`` matrices

    S = sm_scale * Q K^T          (the scores)
    P = softmax(S) row by row     (the attention weights)

and only then forms ``O = P V``. On a GPU both matrices would live in HBM; FlashAttention never
builds them. Called with float64 inputs it is the reference; called with float32 or float16 inputs it
is "plain attention in the same low precision", the baseline of the tolerance rule
(:mod:`flashref.tolerance`), because every step runs in the input's dtype.

Conventions (DESIGN.md): shapes ``(N, d)`` or ``(B, H, N, d)``; ``N_q`` may differ from ``N_k``;
``causal=True`` is top-left aligned as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
(query ``i`` attends keys ``j <= i``; every row sees key 0, so no row is empty); ``sm_scale`` defaults to
``1/sqrt(d)``; ``lse`` is the natural-log log-sum-exp of the scaled, masked scores of each query row.

Inputs must be floating point (float16, float32 or float64): integer or boolean arrays raise
``TypeError`` rather than being cast silently, since "attention of integers" is almost always a bug.
NumPy has no bfloat16, so bfloat16 is refused here too (byte counts still know it).
"""

from __future__ import annotations

import numbers

import numpy as np

from flashref import validation

#: dtypes the NumPy reference computes in (NumPy has no bfloat16).
FLOAT_DTYPES = ("float16", "float32", "float64")

#: bytes per element of the dtypes the byte counts know, by name.
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


# --------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, causal, sm_scale):
    """Validate q, k, v, causal and sm_scale; return NumPy arrays and the float scale."""
    _, _, d = validation.check_attention_inputs(q, k, v, allowed_ndims=(2, 4), allowed_dtypes=FLOAT_DTYPES,
                                                numpy=True)
    validation.check_causal(causal)
    scale = validation.check_sm_scale(sm_scale, d)
    return q, k, v, scale


def _check_do(do, q):
    """``do`` (the gradient of the loss with respect to O) must look like O: q's shape and dtype."""
    validation.check_numpy("do", do)
    validation.check_same_shape("do", do, "o", q)
    if do.dtype != q.dtype:
        raise TypeError(f"do must have the dtype of q, k and v ({q.dtype}), got {do.dtype}")
    validation.check_finite({"do": do})
    return do


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

def causal_mask(N_q: int, N_k: int) -> np.ndarray:
    """Boolean ``(N_q, N_k)`` array, True where query ``i`` may attend key ``j``: ``j <= i`` (top-left
    aligned). Rows ``i >= N_k`` (when ``N_q > N_k``) see every key."""
    return np.tril(np.ones((N_q, N_k), dtype=bool))


def scores(q, k, causal: bool, sm_scale: float) -> np.ndarray:
    """S = sm_scale * Q K^T in the input dtype, with masked entries set to -inf. Shape ``(..., N_q, N_k)``."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(sm_scale)
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, q.dtype.type(-np.inf))
    return s


def softmax_rows(s: np.ndarray):
    """Row-wise softmax of S, stable: subtract each row's max before ``exp`` so nothing overflows.

    Returns ``(P, lse)`` with ``lse = m + log(l)``, ``m`` the row max and ``l = sum(exp(S - m))``.
    Every row has at least one finite entry (key 0), so ``m`` is finite and masked entries give 0.
    """
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = np.sum(p, axis=-1, keepdims=True)
    p = p / l
    lse = (m + np.log(l))[..., 0]
    return p, lse


def attention(q, k, v, causal=False, sm_scale=None, return_lse=False):
    """Standard attention ``O = softmax(sm_scale * Q K^T) V``, materializing S and P.

    ``q``: ``(..., N_q, d)``, ``k`` and ``v``: ``(..., N_k, d)`` with ``...`` empty or ``(B, H)``.
    Returns ``o`` of q's shape and dtype, or ``(o, lse)`` with ``lse`` of shape ``(..., N_q)`` when
    ``return_lse``. Raises ``ValueError``/``TypeError`` naming the argument on bad input (integer
    dtypes included). Taught in notebook ``01_standard_attention``.
    """
    q, k, v, scale = _check_inputs(q, k, v, causal, sm_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}: {return_lse!r}")
    s = scores(q, k, causal, scale)
    p, lse = softmax_rows(s)
    o = np.matmul(p, v)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

def attention_backward(q, k, v, do, causal=False, sm_scale=None):
    """Gradients ``(dq, dk, dv)`` of standard attention, given ``do = dLoss/dO``.

    With S = scale Q K^T, P = softmax(S), O = P V (notebook ``05_backward_recomputation`` derives it):

        dV = P^T dO
        dP = dO V^T
        dS = P * (dP - rowsum(P * dP))      (the softmax Jacobian, row by row)
        dQ = scale dS K,   dK = scale dS^T Q

    Masked entries have P = 0, so their dS is 0 and they pass no gradient. This version stores P (the
    memory FlashAttention's backward saves by recomputing P from Q, K and lse).
    """
    q, k, v, scale = _check_inputs(q, k, v, causal, sm_scale)
    do = _check_do(do, q)
    p, _ = softmax_rows(scores(q, k, causal, scale))
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v, -1, -2))
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    s = q.dtype.type(scale)
    dq = np.matmul(ds, k) * s
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * s
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
    each), half of it when causal (DESIGN.md's convention for benchmarks)."""
    N_q = _count("N_q", N_q)
    N_k = N_q if N_k is None else _count("N_k", N_k)
    validation.check_causal(causal)
    flops = 4 * N_q * N_k * _count("d", d) * _count("heads", heads) * _count("batch", batch)
    return flops // 2 if causal else flops
