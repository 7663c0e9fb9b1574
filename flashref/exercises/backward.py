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
from flashref.exercises import Verdict, as_number, check_array, check_number, wrong

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
    if answer is not None and np.shape(answer) == (6, 9):
        return wrong("D has one number per query row (shape (6,)), not one per score.")
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

