"""The K/V tiles the Triton forward kernel visits, counted in plain Python (no torch, no triton), so
that exercise checkers can use it on any machine. It mirrors the two phases of
``flashref.triton.forward.flash_fwd_kernel`` (which re-exports it). Notebook ``07_triton_forward``."""

from __future__ import annotations


def keys_visited(start_m: int, block_m: int, N_k: int, causal: bool) -> int:
    """The keys [0, hi) that the program of query rows [start_m, start_m + block_m) walks: all N_k, or,
    causal (top-left), those up to its last row; the tiles right of the diagonal are never loaded. The
    forward and dQ kernels' ``hi``; ``tile_counts`` and ``flashref.hbm`` count from it."""
    return min(N_k, start_m + block_m) if causal else N_k


def tile_counts(N_q: int, N_k: int, block_m: int, block_n: int, causal: bool) -> dict:
    """How many K/V tiles the forward kernel's programs visit, in plain Python, mirroring the kernel's
    two phases: ``{"full": unmasked tiles, "masked": tiles with a mask, "skipped": tiles never loaded,
    "programs": number of programs per (batch, head)}``. Notebook ``07_triton_forward``, "Causal attention:
    skip whole tiles, mask only the diagonal"."""
    if block_m % block_n:
        raise ValueError(f"block_m must be a multiple of block_n, got {block_m} and {block_n}")
    programs = -(-N_q // block_m)
    per_row = -(-N_k // block_n)
    full = masked = 0
    for pid in range(programs):
        start_m = pid * block_m
        full_end = (N_k // block_n) * block_n
        if causal:
            full_end = min(full_end, start_m)
        hi = keys_visited(start_m, block_m, N_k, causal)
        full += full_end // block_n
        masked += max(0, -(-(hi - full_end) // block_n))
    return {"full": full, "masked": masked, "skipped": programs * per_row - full - masked, "programs": programs}
