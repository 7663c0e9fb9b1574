"""Pictures of the tile grid: which tiles a tiled pass visits, in which order, which it skips.

Used by notebooks/03_tiled_forward.ipynb (forward, fa1 against fa2 order) and
notebooks/05_backward_recomputation.ipynb (the backward's order). The tiles and their order come from
the ``trace=`` list the functions of :mod:`flashref.numpy_flash` fill, so the picture shows what the code
did, not a separate drawing of what it should do.
"""

from __future__ import annotations

from flashref.numpy_flash import tile_needs_mask, tile_ranges


def draw_tile_visits(ax, trace, N_q: int, N_k: int, block_q: int, block_k: int, causal: bool = False,
                     title: str = ""):
    """Draw the ``N_q x N_k`` score matrix cut into tiles on ``ax``, in element coordinates (a short
    last block looks short). Each visited tile shows its visit number, coloured from first (light) to
    last (dark); tiles never visited are grey; hatched tiles straddle the causal diagonal and are masked
    inside."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    q_tiles, k_tiles = tile_ranges(N_q, block_q), tile_ranges(N_k, block_k)
    order = {tile: n for n, tile in enumerate(trace, start=1)}
    cmap = plt.get_cmap("Blues")
    for i, (q0, q1) in enumerate(q_tiles):
        for j, (k0, k1) in enumerate(k_tiles):
            n = order.get((i, j))
            colour = "0.85" if n is None else cmap(0.2 + 0.7 * n / max(len(trace), 1))
            hatch = "///" if n is not None and tile_needs_mask((q0, q1), (k0, k1), causal) else None
            ax.add_patch(Rectangle((k0, q0), k1 - k0, q1 - q0, facecolor=colour, edgecolor="white",
                                   hatch=hatch, linewidth=1.5))
            if n is not None:
                dark = n / max(len(trace), 1) > 0.45
                ax.text((k0 + k1) / 2, (q0 + q1) / 2, str(n), ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
    if causal:
        ax.plot([0, min(N_q, N_k)], [0, min(N_q, N_k)], color="crimson", linewidth=1)
    ax.set_xlim(0, N_k)
    ax.set_ylim(N_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key index j")
    ax.set_ylabel("query index i")
    ax.set_title(title, fontsize=10)
    return ax
