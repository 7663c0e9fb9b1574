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
    "programs": number of programs per (batch, head)}``. Notebook ``07_triton_forward``, "Causal tiles"."""
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


def tile_ranges(start: int, n_inner: int, before: int | None, after: int | None, block_outer: int,
                block_inner: int) -> tuple[int, int, int, int]:
    """The kernels' ``_tile_ranges`` (``flashref.triton.forward``) in plain Python: for the outer block
    ``[start, start + block_outer)``, whose row y sees inner row x for ``y - before <= x <= y + after``
    (None: that side unbounded), ``(lo, full_lo, full_hi, hi)``: inner tiles in ``[full_lo, full_hi)`` need
    no mask, those in ``[lo, full_lo)`` and ``[full_hi, hi)`` a mask, and the rest are never loaded. The
    forward kernel: outer = queries, inner = keys, ``(before, after) = (left, right)`` of the window
    (causal: ``after = 0``); the dK/dV kernel: outer = keys, inner = queries, the two sides swapped."""
    last = start + block_outer - 1
    lo, full_lo = 0, 0
    hi, full_hi = n_inner, (n_inner // block_inner) * block_inner
    if after is not None:
        hi = min(hi, last + after + 1)
        full_hi = min(full_hi, ((start + after + 1) // block_inner) * block_inner)
    if before is not None:
        lo = (max(start - before, 0) // block_inner) * block_inner
        full_lo = -(-max(last - before, 0) // block_inner) * block_inner
        full_lo = min(max(full_lo, lo), hi)
        full_hi = max(min(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


def window_tile_kinds(N_q: int, N_k: int, block_m: int, block_n: int, window_size=(-1, -1),
                      causal: bool = False) -> list[list[str]]:
    """What the forward kernel does with each (query tile, key tile) pair under a token window and
    ``causal``: "full" (no mask), "masked" or "skipped" (never loaded), as a grid of strings. Notebook
    ``12_packing_and_score_mods`` draws it."""
    left, right = window_size
    after = 0 if causal else (right if right >= 0 else None)
    before = left if left >= 0 else None
    kinds = []
    for start in range(0, N_q, block_m):
        lo, full_lo, full_hi, hi = tile_ranges(start, N_k, before, after, block_m, block_n)
        row = []
        for j0 in range(0, N_k, block_n):
            inside = lo <= j0 < hi
            row.append("full" if full_lo <= j0 < full_hi else "masked" if inside else "skipped")
        kinds.append(row)
    return kinds
