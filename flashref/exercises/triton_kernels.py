"""Checkers for notebooks ``07_triton_forward`` and ``08_triton_backward`` (the Triton kernels)."""

from __future__ import annotations

from flashref.exercises import check_number
from flashref.kernel_tiles import tile_counts

#: exercise "causal tiles": N = 4096, BLOCK_M = 128, BLOCK_N = 64, causal
CAUSAL_N, CAUSAL_BLOCK_M, CAUSAL_BLOCK_N = 4096, 128, 64
#: exercise "stored P": B = 8, H = 16, N = 4096, fp16 P against fp32 (m, l) per row
STORE_B, STORE_H, STORE_N = 8, 16, 4096


def check_causal_fraction_skipped(answer):
    """Fraction of the K/V tiles (over all programs) that causal attention never loads, N = 4096,
    BLOCK_M = 128, BLOCK_N = 64."""
    c = tile_counts(CAUSAL_N, CAUSAL_N, CAUSAL_BLOCK_M, CAUSAL_BLOCK_N, True)
    total = c["full"] + c["masked"] + c["skipped"]
    expected = c["skipped"] / total
    return check_number(
        answer, expected, what="fraction of tiles skipped", rel=1e-3,
        hint="Program i (rows 128 i .. 128 i + 127) needs key tiles up to its last row: 2 (i + 1) of the 64. "
             "Sum over the 32 programs and compare with 32 x 64.",
        explain=f"{c['skipped']} of {total} tiles are skipped ({expected:.3f}), {c['masked']} are masked "
                f"(2 per program, on the diagonal) and {c['full']} need no mask at all.")


def check_backward_matmuls(answer):
    """Tile matrix products per (Q tile, K/V tile) pair in the deterministic two-kernel backward."""
    return check_number(
        answer, 7, what="matrix products per tile pair",
        hint="dK/dV kernel: S (Q K^T), dV (P^T dO), dP (dO V^T), dK (dS^T Q). dQ kernel: which does it need?",
        explain="4 in the dK/dV kernel and 3 in the dQ kernel (S, dP, dQ = dS K): S and dP are computed "
                "twice, 7 instead of the 5 of a backward that adds dQ with atomics; the price of "
                "determinism is 40% more tensor-core work in the backward.")


def check_stored_p_ratio(answer):
    """How many times more memory storing P (fp16, N x N per head) takes than the row statistics the
    backward keeps instead (m and l, two fp32 numbers per row), for N = 4096."""
    p_bytes = STORE_B * STORE_H * STORE_N * STORE_N * 2
    stats_bytes = STORE_B * STORE_H * STORE_N * 2 * 4
    expected = p_bytes / stats_bytes
    return check_number(
        answer, expected, what="ratio of bytes", rel=1e-6,
        hint="P: B H N^2 values of 2 bytes. Statistics: B H N rows of two 4-byte numbers. B and H cancel.",
        explain=f"N * 2 / 8 = {expected:.0f}: {p_bytes / 2**30:.0f} GiB of P against "
                f"{stats_bytes / 2**20:.0f} MiB of statistics.")
