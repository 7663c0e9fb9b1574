"""Checkers for notebook ``06_cupy_kernel`` (the CUDA C kernels)."""

from __future__ import annotations

import math

from flashref.cupy.config import T4_BLOCK_SMEM, bank_conflict_ways, tiled_smem_bytes
from flashref.exercises import check_number

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
