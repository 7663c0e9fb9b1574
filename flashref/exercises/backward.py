"""Checkers for the exercises of notebook ``05_backward_recomputation``.

    from flashref.exercises import backward as ex
    q, k, v, do = ex.delta_problem()
    ex.check_delta(answer)

The expected values come from :mod:`flashref.reference`, so the exercises and the package cannot
disagree.
"""

from __future__ import annotations

import numpy as np

from flashref import reference
from flashref.exercises import (NOT_ANSWERED, UNWRITTEN, Verdict, as_number, check_array, check_number, host_array,
                                right, wrong)


#: Exercise "stored P": batch 4, 16 heads, N = 4096, P in fp16.
P_BATCH, P_HEADS, P_N, P_DTYPE = 4, 16, 4096, "float16"

#: Exercise "recomputation FLOPs": one head, N = 4096, d = 64.
FLOP_N, FLOP_D = 4096, 64


def check_stored_p_bytes(answer) -> Verdict:
    """Bytes a backward that stores P would keep from the forward, for the configuration above."""
    expected = reference.score_matrix_bytes(P_N, heads=P_HEADS, batch=P_BATCH, dtype=P_DTYPE)
    value = as_number(answer)
    if value == 2 * expected:
        return wrong("that is S and P; the backward only needs P kept.")
    if value == P_BATCH * P_HEADS * P_N * 2:
        return wrong("that is the lse-sized answer (one number per row); P has N x N entries per head.")
    if value is not None and value * 2**30 == expected:
        return wrong("that is the right size in GiB; give it in bytes.")
    return check_number(answer, expected, what="the bytes of P",
                        hint=f"{P_BATCH} sequences x {P_HEADS} heads x {P_N} x {P_N} entries x 2 bytes.",
                        explain=f"{expected / 2**30:g} GiB for one layer; the lse FlashAttention keeps instead is "
                                f"{P_BATCH * P_HEADS * P_N * 4 / 2**20:g} MiB in fp32.")


def delta_problem(seed: int = 5):
    """The small causal problem of the D exercise: ``(q, k, v, do)``, float64, N_q = 6, N_k = 9, d = 4."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((6, 4))
    k, v = rng.standard_normal((9, 4)), rng.standard_normal((9, 4))
    do = rng.standard_normal((6, 4))
    return q, k, v, do


def check_delta(answer, seed: int = 5) -> Verdict:
    """D = rowsum(dO * O) (equivalently rowsum(P * dP)) for :func:`delta_problem`, causal."""
    q, k, v, do = delta_problem(seed)
    o = reference.attention(q, k, v, causal=True)
    expected = np.sum(do * o, axis=-1)
    try:
        if answer is not None:
            answer = host_array(answer)
        shape = np.shape(answer)
    except Exception:  # noqa: BLE001 (a ragged list, or something that is no array)
        return wrong("D must be an array of numbers, one per query row (shape (6,)).")
    if answer is not None and shape == (6, 9):
        return wrong("D has one number per query row (shape (6,)), not one per score.")
    low = getattr(answer, "dtype", None)
    if low is not None and np.dtype(low) in (np.float32, np.float16) and shape == expected.shape \
            and np.allclose(np.asarray(answer, np.float64), expected, rtol=10 * np.finfo(low).eps, atol=0):
        return wrong(f"right to {np.dtype(low).name} precision, but the problem is in float64: compute in "
                     "float64 (do not cast q, k, v or dO down) and the answer will match to the last digits.")
    return check_array(answer, expected, what="D", rtol=1e-9, atol=1e-12,
                       hint="Compute O = reference.attention(q, k, v, causal=True), then sum dO * O over d.",
                       explain="One dot product per row: no N_q x N_k array needed.")


def expected_recompute_flops() -> int:
    return 2 * FLOP_N * FLOP_N * FLOP_D


def check_recompute_flops(answer) -> Verdict:
    """Extra FLOPs the backward spends recomputing S = Q K^T for one head, N = 4096, d = 64."""
    expected = expected_recompute_flops()
    value = as_number(answer)
    if value == 4 * FLOP_N * FLOP_N * FLOP_D:
        return wrong("that is the whole forward (two matmuls); recomputing P needs only S = Q K^T again.")
    if value == FLOP_N * FLOP_N * FLOP_D:
        return wrong("a matmul of (N x d) by (d x N) has N * N * d multiply-adds: count 2 FLOPs each.")
    return check_number(answer, expected, what="the extra FLOPs",
                        hint="One matmul of an N x d by a d x N matrix: 2 FLOPs per multiply-add.",
                        explain=f"2 N^2 d = {expected:,} FLOPs: the backward's four matmuls become five "
                                "(8 N^2 d to 10 N^2 d, 2.5 times the forward).")



#: tile_problem's tile: (n_q, n_k, d, lo, hi, scale), keys 2:7 of a 6 x 9 problem with head dim 4.
_TILE = (6, 9, 4, 2, 7, 0.5)


def tile_problem(seed: int = 8):
    """One tile of a backward pass: ``(q_i, k_j, v_j, do_i, lse_i, delta_i, scale)`` in float64 for 6 query
    rows and 5 keys of a 6 x 9 problem (lse_i and delta_i are the whole rows', from the forward)."""
    return _tile_problem(seed, *_TILE)


def _tile_problem(seed: int, n_q: int, n_k: int, d: int, lo: int, hi: int, scale: float):
    """Keys lo:hi of an n_q x n_k problem with head dim d, as :func:`tile_problem` gives them."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((n, d)) for n in (n_q, n_k, n_k, n_q))
    o, lse = reference.attention(q, k, v, return_lse=True, sm_scale=scale)
    return q, k[lo:hi], v[lo:hi], do, lse, np.sum(do * o, axis=-1), scale


# The tiles the checker tries: tile_problem's, a single query row, and an uneven tile with a scale of 1/sqrt(d).
_TILE_CASES = {"the 6 x 5 tile of tile_problem()": (8, *_TILE),
               "one query row against 3 keys": (3, 1, 8, 5, 5, 8, 5 ** -0.5),
               "a 7 x 2 tile, head dim 3": (4, 7, 6, 3, 0, 2, 3 ** -0.5)}


def _tile_grads(q, k, v, do, lse, delta, scale, use_delta=True, scaled=True):
    p = np.exp(scale * q @ k.T - lse[:, None])
    dv = p.T @ do
    ds = p * (do @ v.T - (delta[:, None] if use_delta else 0))
    c = scale if scaled else 1.0
    return c * ds @ k, c * ds.T @ q, dv


def check_tile_backward(fn) -> Verdict:
    """``fn(q_i, k_j, v_j, do_i, lse_i, delta_i, scale)`` must return this tile's contributions
    ``(dq_i, dk_j, dv_j)``: P = exp(scale Q_i K_j^T - lse_i), dV_j = P^T dO_i, dP = dO_i V_j^T,
    dS = P * (dP - D_i), dQ_i = scale dS K_j, dK_j = scale dS^T Q_i (:func:`tile_problem`)."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (tile_backward), not {type(fn).__name__}.")
    for name, case in _TILE_CASES.items():
        args = _tile_problem(*case)
        try:
            result = fn(*(a.copy() if hasattr(a, "copy") else a for a in args))
            if result is None:
                return Verdict(False, UNWRITTEN)
            got = [np.asarray(x, dtype=np.float64) for x in result]
        except Exception as exc:  # noqa: BLE001
            return wrong(f"on {name}: your function raised {type(exc).__name__}: {exc}")
        problem = _tile_mistake(got, args)
        if problem:
            return wrong(f"on {name}: {problem}")
    return right("That is one tile of FlashAttention's backward: P from the saved lse, dS = P * (dP - D).")


def _tile_mistake(got, args) -> str:
    """What is wrong with one tile's (dq_i, dk_j, dv_j), or "" when nothing is."""
    want = _tile_grads(*args)
    if len(got) != 3 or any(g.shape != w.shape for g, w in zip(got, want)):
        return "return three arrays (dq_i, dk_j, dv_j) shaped like q_i, k_j and v_j."
    close = [np.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want)]
    if all(close):
        return ""
    if not close[2]:
        return ("dV is off: P = exp(scale Q K^T - lse) (the forward's lse of each row, not the tile's own "
                "softmax), and dV_j = P^T dO_i.")
    no_delta = _tile_grads(*args, use_delta=False)
    if all(np.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got[:2], no_delta[:2])):
        return "dQ and dK miss D: the softmax's Jacobian gives dS = P * (dP - D), with D = rowsum(dO * O)."
    unscaled = _tile_grads(*args, scaled=False)
    if all(np.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got[:2], unscaled[:2])):
        return "dQ and dK miss the scale: S = scale Q K^T, so dQ = scale dS K and dK = scale dS^T Q."
    return f"dQ or dK differ from the expected by up to {max(np.max(np.abs(g - w)) for g, w in zip(got, want)):.3g}."
