"""Checkers for notebook ``06_cupy_kernel`` (the CUDA C kernels), and its coding exercise: the causal rule
of the key loop (which tiles to skip, which to mask)."""

from __future__ import annotations

import math

from flashref.cupy.config import T4_BLOCK_SMEM, tiled_smem_bytes
from flashref.cupy.teaching import bank_conflict_ways
from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, check_number, right, wrong

#: the exercise's configuration: fp32 tiled kernel, d = 128, 64 x 64 tiles
SMEM_D, SMEM_BLOCK_M, SMEM_BLOCK_N = 128, 64, 64
#: the exercise's launch: B = 4, H = 16, N_q = 1000, 128 query rows per block (mma kernel on an H100)
GRID_B, GRID_H, GRID_N_Q, GRID_BLOCK_M = 4, 16, 1000, 128
#: the exercise's unpadded K_j tile: rows of 64 floats, 16 threads reading rows tx = 0..15 at one column
BANK_STRIDE, BANK_THREADS = 64, 16


def check_tiled_smem_bytes(answer):
    """Shared memory of the fp32 tiled kernel with d = 128 and 64 x 64 tiles, padded rows included."""
    expected = tiled_smem_bytes(SMEM_D, SMEM_BLOCK_M, SMEM_BLOCK_N)
    fits = "fits" if expected <= T4_BLOCK_SMEM else "does not fit"
    return check_number(
        answer, expected, what="shared memory in bytes",
        hint="Count floats: Q_i and the K_j/V_j buffer have BLOCK rows of d + 1 floats, P_ij has BLOCK_M "
             "rows of BLOCK_N + 1 floats; 4 bytes each.",
        explain=f"{expected} bytes {fits} in a T4 block ({T4_BLOCK_SMEM} bytes), which is why the package "
                "takes 32 query rows per block when d > 80.")


def check_grid_blocks(answer):
    """Thread blocks in the grid of the mma kernel for B = 4, H = 16, N_q = 1000, BLOCK_M = 128."""
    expected = math.ceil(GRID_N_Q / GRID_BLOCK_M) * GRID_B * GRID_H
    return check_number(
        answer, expected, what="number of thread blocks",
        hint="One block per (query tile, batch x head); the last query tile is partial but still a block.",
        explain=f"ceil(1000 / 128) = 8 query tiles times 64 (batch, head) pairs = {expected}.")


def check_bank_conflict_ways(answer):
    """Passes needed when threads tx = 0..15 read K_j[tx][x] from rows of 64 floats (no padding)."""
    expected = bank_conflict_ways(tx * BANK_STRIDE for tx in range(BANK_THREADS))
    return check_number(
        answer, expected, what="number of passes (ways of the conflict)",
        hint="Word tx * 64 + x lives in bank (tx * 64 + x) mod 32: which banks do the 16 threads hit?",
        explain=f"All 16 addresses land in one bank: a {expected}-way conflict. With rows of 65 floats "
                f"they land in 16 different banks: {bank_conflict_ways(tx * 65 for tx in range(16))} pass.")


# --------------------------------------------------------------------------------------------------
# Coding exercise: the causal rule of the tensor-core kernel's key loop
# --------------------------------------------------------------------------------------------------

#: (block_m, block_n, N_q, N_k) the reader's rule is checked on: uneven lengths, N_q != N_k, one key.
RULE_CASES = [(64, 64, 1000, 1000), (128, 64, 300, 500), (64, 32, 200, 77), (128, 64, 40, 1)]


def causal_tile_rule(i0: int, j0: int, block_m: int, block_n: int, N_k: int) -> str:
    """The kernels' rule (flash_mma.cu: ``j_end`` and ``need_mask``) for the tile whose first query row is
    ``i0`` and first key ``j0``, causal: "skip" when no row of the tile sees any of its keys (the loop
    stops before it), "mask" when some entries must be masked (the diagonal crosses it, or it runs past
    the last key), "full" when every entry is visible."""
    if j0 >= min(N_k, i0 + block_m):
        return "skip"
    if j0 + block_n > N_k or j0 + block_n - 1 > i0:
        return "mask"
    return "full"


def _rule_problem(i0, j0, bm, bn, N_k, got, want) -> str:
    tile = f"the tile of rows {i0}..{i0 + bm - 1} and keys {j0}..{j0 + bn - 1} (N_k = {N_k})"
    if got == "skip":
        return f"{tile} was skipped, but row {max(i0 + bm - 1, j0)} sees key {j0}: its keys go missing."
    if want == "skip":
        return (f"{tile} is computed, but every one of its keys comes after every row (or after the last key): "
                "the loop can stop before it, which is half the work of causal attention.")
    if got == "full":
        why = "it runs past the last key" if j0 + bn > N_k else f"key {j0 + bn - 1} comes after row {i0}"
        return f"{tile} is computed without the mask, but {why}: those entries must be -inf."
    return (f"{tile} is masked, but every row sees every key of it: it is right, only slower. The mask is "
            "needed where the diagonal crosses the tile or the tile runs past N_k.")


def check_causal_tile_rule(fn) -> Verdict:
    """``fn(i0, j0, block_m, block_n, N_k)`` must return "skip", "mask" or "full" as the kernels decide."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (tile_rule), not {type(fn).__name__}.")
    counts = {"skip": 0, "mask": 0, "full": 0}
    for bm, bn, N_q, N_k in RULE_CASES:
        for i0 in range(0, N_q, bm):
            for j0 in range(0, N_k, bn):
                try:
                    got = fn(i0, j0, bm, bn, N_k)
                except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
                    return wrong(f"for i0 = {i0}, j0 = {j0} your function raised {type(exc).__name__}: {exc}")
                if got is None:
                    return Verdict(False, UNWRITTEN)
                if not isinstance(got, str) or got not in counts:
                    return wrong(f'return one of "skip", "mask" or "full", got {got!r}.')
                want = causal_tile_rule(i0, j0, bm, bn, N_k)
                if got != want:
                    return wrong(_rule_problem(i0, j0, bm, bn, N_k, got, want))
                counts[got] += 1
    return right(f"On these shapes {counts['full']} tiles run unmasked, {counts['mask']} masked and {counts['skip']} "
                 "are skipped: the masked ones are only those the diagonal or the end of the keys crosses.")
