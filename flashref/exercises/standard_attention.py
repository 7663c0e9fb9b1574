"""Checkers for the exercises of notebook ``01_standard_attention``.

    from flashref.exercises import standard_attention as ex
    ex.check_score_bytes(answer)

The expected values come from :func:`flashref.reference.score_matrix_bytes`, the function the notebook
teaches, so the exercises and the package cannot disagree.
"""

from __future__ import annotations

import numpy as np

from flashref import reference
from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, as_number, check_number, right, wrong


MiB = 2 ** 20
GiB = 2 ** 30

#: The batch/heads configuration of the third exercise: the total is asked for this.
BATCH, HEADS, N_CONFIG, DTYPE_CONFIG = 8, 16, 4096, "float16"


def _unit_hint(answer, expected: int) -> str:
    """A hint for answers given in KiB/MiB/GiB, or for S and P counted together."""
    value = as_number(answer)
    if value is None:
        return ""
    for unit, size in (("KiB", 1024), ("MiB", MiB), ("GiB", GiB)):
        if value * size == expected:
            return f"That is the right size in {unit}; give it in bytes."
    if value == 2 * expected:
        return "That counts two matrices; the question asks for one."
    if value * 2 == expected:
        return "Count bytes, not half of them: which dtype has how many bytes a number?"
    return ""


def check_score_bytes(answer) -> Verdict:
    """Bytes of one fp32 score matrix S for one head at N = 4096."""
    expected = reference.score_matrix_bytes(4096, dtype="float32")
    hint = _unit_hint(answer, expected) or "S has N x N entries of 4 bytes each."
    return check_number(answer, expected, what="the bytes of S", hint=hint,
                        explain="4096 * 4096 entries * 4 bytes = 67,108,864 bytes = 64 MiB.")


def check_tile_bytes(answer) -> Verdict:
    """Bytes of one 32 x 128 tile of fp16 scores (what a kernel would keep in SRAM)."""
    expected = reference.score_matrix_bytes(32, 128, dtype="float16")
    if as_number(answer) == 2 * expected:
        return wrong("that is the tile in fp32, 4 bytes a number; these scores are fp16, 2 bytes each.")
    hint = _unit_hint(answer, expected) or "A tile has 32 x 128 entries of 2 bytes each."
    return check_number(answer, expected, what="the bytes of the tile", hint=hint,
                        explain="32 * 128 * 2 bytes = 8192 bytes = 8 KiB: it fits in SRAM many times over.")


def check_config_bytes(answer) -> Verdict:
    """Bytes of S and P together for the batch/heads configuration above, in fp16."""
    one = reference.score_matrix_bytes(N_CONFIG, heads=HEADS, batch=BATCH, dtype=DTYPE_CONFIG)
    expected = 2 * one
    if answer is not None and _is_number(answer) and float(answer) == one:
        return wrong("that is one matrix for every head and batch entry; S and P are two.")
    hint = _unit_hint(answer, expected) or (
        f"Multiply N x N entries by 2 bytes, by {HEADS} heads, by a batch of {BATCH}, and by 2 matrices.")
    return check_number(answer, expected, what="the bytes of S and P", hint=hint,
                        explain=f"2 * {BATCH} * {HEADS} * 4096^2 * 2 bytes = 8 GiB, for one layer's attention.")


def _is_number(x) -> bool:
    return as_number(x) is not None


def _attention_cases():
    """(name, q, k, v, causal) cases a reader's attention is run on: uneven, N_q != N_k, causal, large logits."""
    rng = np.random.default_rng(11)
    r = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    return [("N_q = 5, N_k = 7, d = 4", r(5, 4), r(7, 4), r(7, 4), False),
            ("causal, N_q = N_k = 6", r(6, 4), r(6, 4), r(6, 4), True),
            ("causal, N_q = 9 > N_k = 4", r(9, 3), r(4, 3), r(4, 3), True),
            ("one query, one key", r(1, 8), r(1, 8), r(1, 8), False),
            ("scores of size 1e3 (a softmax without the max subtracted overflows)", r(4, 4) * 30, r(6, 4) * 30,
             r(6, 4), False)]


def check_attention_function(fn) -> Verdict:
    """``fn(q, k, v, causal)`` must return standard attention softmax(Q K^T / sqrt(d)) V for (N, d) arrays
    (causal: query i sees keys j <= i), checked against :func:`flashref.reference.attention` in float64."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (attention), not {type(fn).__name__}.")
    for name, q, k, v, causal in _attention_cases():
        try:
            with np.errstate(all="ignore"):
                result = fn(q.copy(), k.copy(), v.copy(), causal)
            if result is None:
                return Verdict(False, UNWRITTEN)
            got = np.asarray(result, dtype=np.float64)
        except Exception as exc:  # noqa: BLE001 (a reader's bug must not stop the notebook)
            return wrong(f"on the case {name}: your function raised {type(exc).__name__}: {exc}")
        want = reference.attention(q, k, v, causal=causal)
        if got.shape != want.shape:
            return wrong(f"on the case {name}: the output has shape {got.shape}, expected {want.shape} "
                         "(one row per query, d columns).")
        if np.allclose(got, want, rtol=1e-9, atol=1e-12):
            continue
        if not np.all(np.isfinite(got)):
            return wrong(f"on the case {name}: your output holds NaN or inf. Subtract each row's max from the "
                         "scores before exp (softmax does not change), so exp never overflows.")
        if np.allclose(got, reference.attention(q, k, v, causal=causal, sm_scale=1.0), rtol=1e-9, atol=1e-12):
            return wrong(f"on the case {name}: the scores are not scaled. S = Q K^T / sqrt(d).")
        if causal and np.allclose(got, reference.attention(q, k, v), rtol=1e-9, atol=1e-12):
            return wrong(f"on the case {name}: the causal mask is missing: set S[i, j] = -inf where j > i.")
        s = q @ k.T / np.sqrt(q.shape[-1])
        if causal:
            s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
        with np.errstate(all="ignore"):
            columns = np.exp(s - s.max(axis=0, keepdims=True))
            columns = columns / columns.sum(axis=0, keepdims=True)
        if np.allclose(got, np.nan_to_num(columns) @ v, rtol=1e-9, atol=1e-12):
            return wrong(f"on the case {name}: the softmax normalizes columns. Each query's row of S must sum "
                         "to 1: take max and sum over the last axis (axis=-1).")
        return wrong(f"on the case {name}: the output differs from the reference by up to "
                     f"{np.max(np.abs(got - want)):.3g}.")
    return right("Your attention matches the float64 reference on every case, causal and not.")
