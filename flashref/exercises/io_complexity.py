"""Checkers for the exercises of notebook ``04_io_complexity``.

    from flashref.exercises import io_complexity as ex
    ex.check_block_sizes(answer)

The expected values come from :mod:`flashref.iomodel`, the model the notebook teaches, so the exercises
and the package cannot disagree (the test suite checks them against numbers worked out by hand).
"""

from __future__ import annotations

from flashref import iomodel
from flashref.exercises import NOT_ANSWERED, Verdict, as_number, check_number, right, wrong

#: Exercise 1: one A100 SM's 192 KB of SRAM in fp32 elements, and a head dimension of 80.
BLOCKS_M, BLOCKS_D = 192 * 1024 // 4, 80
#: Exercise 2: 100 KB of fp32 SRAM, the paper's rough figure for the SRAM a block may use.
TILED_N, TILED_D, TILED_M = 1024, 64, 25600
#: Exercise 3: one A100 SM's 192 KB in fp16 elements.
RATIO_N, RATIO_D, RATIO_M = 4096, 64, 192 * 1024 // 2


def _as_int_pair(answer):
    try:
        first, second = answer
        pair = (int(first), int(second))
    except (TypeError, ValueError, OverflowError):
        return None
    return pair if pair == (first, second) else None


def check_block_sizes(answer) -> Verdict:
    """(B_c, B_r) of Algorithm 1 for M = 49152 elements and d = 80."""
    if answer is None:
        return Verdict(False, NOT_ANSWERED)
    pair = _as_int_pair(answer)
    if pair is None:
        return wrong(f"give a pair of whole numbers (B_c, B_r), got {answer!r}.")
    B_c, B_r = iomodel.block_sizes(BLOCKS_M, BLOCKS_D)
    if pair == (B_c, B_r):
        return right(f"B_c = ceil({BLOCKS_M} / (4 * {BLOCKS_D})) = ceil({BLOCKS_M / (4 * BLOCKS_D):.1f}) = {B_c}, "
                     f"and B_r = min({B_c}, {BLOCKS_D}) = {B_r}.")
    if pair == (B_r, B_c):
        return wrong("the order is (B_c, B_r): the key block first, as in the paper.")
    if pair[0] == BLOCKS_M // (4 * BLOCKS_D):
        return wrong(f"M / 4d = {BLOCKS_M / (4 * BLOCKS_D):.1f} is rounded up, not down.")
    if pair[0] == B_c and pair[1] != B_r:
        return wrong("B_c is right; B_r is the smaller of B_c and d.")
    return wrong("B_c = ceil(M / 4d) and B_r = min(B_c, d).")


def check_tiled_accesses(answer) -> Verdict:
    """HBM accesses (reads + writes) of Algorithm 1 for N = 1024, d = 64, M = 25600, not causal."""
    io = iomodel.tiled_io(TILED_N, TILED_D, TILED_M)
    N, d = TILED_N, TILED_D
    hints = {
        io.reads: "that is the reads only; add the writes.",
        io.writes: "that is the writes only; add the reads.",
        io.total - N * (d + 2): "initializing O, l and m in HBM (line 2 of Algorithm 1) is a write too.",
    }
    try:
        hint = hints.get(int(answer), "") if answer is not None and float(answer) == int(answer) else ""
    except (TypeError, ValueError, OverflowError):
        hint = ""
    hint = hint or ("T_c = ceil(N / B_c) passes, each reading Q, O, l, m and writing O, l, m; "
                    "K and V are read once; O, l, m are initialized once.")
    return check_number(answer, io.total, what="the HBM accesses", hint=hint,
                        explain=f"{io.reads:,} reads + {io.writes:,} writes = {io.total:,} elements.")


def check_ratio(answer) -> Verdict:
    """Standard over tiled HBM accesses for N = 4096, d = 64, M = 98304 (to 1%)."""
    standard = iomodel.standard_io(RATIO_N, RATIO_D, RATIO_M).total
    tiled = iomodel.tiled_io(RATIO_N, RATIO_D, RATIO_M).total
    ratio = standard / tiled
    rough = RATIO_M / (3 * RATIO_D ** 2)
    return check_number(answer, ratio, what="standard / tiled", rel=1e-2,
                        hint=f"divide the exact counts; the rough estimate M / 3d^2 = {rough:.2f} only says "
                             "where to look.",
                        explain=f"{standard:,} / {tiled:,} = {ratio:.2f}: close to M / 3d^2 = {rough:.2f}, which "
                                "keeps only the 4N^2 of S and P and the 12 N^2 d^2 / M of the passes. The exact tiled "
                                "count also reads K and V, initializes O, l, m, moves rows of 2d + 2 and d + 2 "
                                "numbers, and rounds T_c = ceil(N / B_c) up.")


#: (N, d, M) cases a reader's closed form is checked on: the exercise's, uneven N, a small SRAM, an A100's (192 KB in fp16).
FORMULA_CASES = [(1024, 64, 25600), (1000, 32, 4096), (77, 16, 1000), (4096, 128, 98304), (5, 4, 64)]


def check_tiled_accesses_function(fn) -> Verdict:
    """``fn(N, d, M)`` must return the HBM accesses (elements read plus written) of Algorithm 1, not causal,
    for any N, d and M (:func:`flashref.iomodel.tiled_io`)."""
    import math

    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (tiled_accesses), not {type(fn).__name__}.")
    for N, d, M in FORMULA_CASES:
        try:
            got = fn(N, d, M)
        except Exception as exc:  # noqa: BLE001 (a reader's bug must not stop the notebook)
            return wrong(f"on N = {N}, d = {d}, M = {M} your function raised {type(exc).__name__}: {exc}")
        if got is None:
            return Verdict(False, "Not answered yet: your function returns None; write its body and run the cell again.")
        want = iomodel.tiled_io(N, d, M).total
        value = as_number(got)
        if value == want:
            continue
        B_c = -(-M // (4 * d))
        T_c, T_floor = -(-N // B_c), max(1, N // B_c)
        reads = 2 * N * d + T_c * N * (2 * d + 2)
        if value == reads:
            return wrong(f"on N = {N}, d = {d}, M = {M} you counted the reads only: each pass over a K/V block "
                         "also writes O_i, l_i and m_i back.")
        if value == want - N * (d + 2):
            return wrong("Algorithm 1 first writes O = 0, l = 0 and m = -inf to HBM: one more write of every row.")
        floor = 2 * N * d + T_floor * N * (2 * d + 2) + (T_floor + 1) * N * (d + 2)
        if value == floor and T_floor != T_c:
            return wrong(f"on N = {N}, d = {d}, M = {M}: T_c = ceil(N / B_c), not floor: the last block of keys "
                         "may be short, and it is still a pass.")
        if value is not None and math.isclose(value, want, rel_tol=0.02):
            return wrong(f"on N = {N}, d = {d}, M = {M} you are close ({value:,.0f} against {want:,}): count l and m, "
                         "one element per row each, in every read and write of a row.")
        return wrong(f"on N = {N}, d = {d}, M = {M} your function gave {got!r}; Algorithm 1 makes {want:,} accesses. "
                     "B_c = ceil(M / 4d), T_c = ceil(N / B_c); K and V are read once, and every pass reads Q_i, O_i, "
                     "l_i, m_i and writes O_i, l_i, m_i.")
    return right("Your closed form equals the simulator's count on every case.")
