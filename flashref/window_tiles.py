"""Which tiles a token window lets the kernels skip, in plain Python (no torch, no triton): the rule of the
kernels' ``_tile_ranges`` (:mod:`flashref.triton.forward`), for figures and checkers. Tested against the
kernels' own function in Triton's interpreter. Notebook ``12_packing_and_score_mods``."""

from __future__ import annotations


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
