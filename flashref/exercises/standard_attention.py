"""Checkers for the exercises of notebook ``01_standard_attention``.

    from flashref.exercises import standard_attention as ex
    ex.check_score_bytes(answer)

The expected values come from :func:`flashref.reference.score_matrix_bytes`, the function the notebook
teaches, so the exercises and the package cannot disagree.
"""

from __future__ import annotations

from flashref import reference
from flashref.exercises import Verdict, check_number, wrong

MiB = 2 ** 20
GiB = 2 ** 30

#: The batch/heads configuration of the third exercise: the total is asked for this.
BATCH, HEADS, N_CONFIG, DTYPE_CONFIG = 8, 16, 4096, "float16"


def _unit_hint(answer, expected: int) -> str:
    """A hint for answers given in KiB/MiB/GiB, or for S and P counted together."""
    try:
        value = float(answer)
    except (TypeError, ValueError):
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
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True
