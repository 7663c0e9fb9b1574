"""Pictures of the CUDA kernels: where each tile lives, the tensor-core fragment layout, and how the
warps of a block split the work.

Taught in notebook ``06_cupy_kernel``. The facts the pictures show are data here
(:data:`TILE_HOMES`, :func:`mma_fragment_owner`), so tests check them against the kernels' sources and
PTX's documented layout; the functions only draw them. matplotlib is imported inside the functions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TILE_HOMES", "LEVELS", "memory_path_figure", "mma_fragment_owner", "fragment_layout_figure",
           "warp_partition_figure"]

#: the three levels of memory, slowest first
LEVELS = ("HBM", "shared memory", "registers")

#: kernel -> level -> [(tile, how it is held)]: where the forward pass keeps each tile during one step
#: of the loop over key tiles (the headers of flashref/cuda/*.cu say the same).
TILE_HOMES = {
    "tiled": {
        "HBM": [("Q, K, V", "fp32 or fp16, read"), ("O, lse", "written once")],
        "shared memory": [("$Q_i$", "fp32, whole step"), ("$K_j$ / $V_j$", "fp32, one buffer"),
                          ("$P_{ij}$", "fp32")],
        "registers": [("$S_{ij}$", "4x4 per thread"), ("$O_i$", "4 rows per thread"), ("$m_i, \\ell_i$", "")],
    },
    "wmma": {
        "HBM": [("Q, K, V", "fp16, read"), ("O, lse", "written once")],
        "shared memory": [("$K_j$ / $V_j$", "fp16, one buffer"), ("$S_{ij}$", "fp32"), ("$P_{ij}$", "fp16"),
                          ("$O_i$", "fp32")],
        "registers": [("$Q_i$", "fragments"), ("$S_{ij}$, $O_i$", "in passing"), ("$m_i, \\ell_i$", "")],
    },
    "mma": {
        "HBM": [("Q, K, V", "fp16, read"), ("O, lse", "written once")],
        "shared memory": [("$K_j$", "fp16"), ("$V_j$", "fp16")],
        "registers": [("$Q_i$", "fragments"), ("$S_{ij}$ = $P_{ij}$", "fragments"), ("$O_i$", "fragments"),
                      ("$m_i, \\ell_i$", "")],
    },
}

_TITLES = {"tiled": "tiled (CUDA cores)", "wmma": "wmma (tensor cores, C++ API)",
           "mma": "mma.sync (tensor cores, PTX)"}
#: kernel -> [(from level, to level, what moves, both ways)], levels as indices into LEVELS
_MOVES = {
    "tiled": [(0, 1, "$Q_i$ once; $K_j$, $V_j$ each step", False),
              (1, 2, "operands of every FMA; $P_{ij}$ back", True),
              (2, 0, "$O_i / \\ell_i$, lse at the end", False)],
    "wmma": [(0, 1, "$Q_i$ once; $K_j$, $V_j$ each step", False),
             (1, 2, "fragments; $S_{ij}$ and $O_i$ out and back each step", True),
             (1, 0, "$O_i / \\ell_i$ at the end (lse from registers)", False)],
    "mma": [(0, 1, "$Q_i$ once; $K_j$, $V_j$ each step", False),
            (1, 2, "$K_j$, $V_j$ fragments (ldmatrix)", False),
            (2, 0, "$O_i / \\ell_i$, lse at the end", False)],
}
_LEVEL_COLOURS = ("#d9d9d9", "#c6dbef", "#fdd0a2")


def memory_path_figure(kernels=("tiled", "wmma", "mma")):
    """A tile's path HBM -> shared memory -> registers in each kernel: one panel per kernel, one band per
    level of memory, a box for each tile held there (:data:`TILE_HOMES`), red arrows for what moves
    between levels (one that skips shared memory runs down the right margin)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, axes = plt.subplots(1, len(kernels), figsize=(4.3 * len(kernels), 4.8))
    axes = np.atleast_1d(axes)
    band_y = (0.70, 0.37, 0.04)   # bottom of each band, HBM on top
    band_h, right = 0.23, 0.87    # boxes stay left of `right`; the margin carries the long arrows
    for ax, kernel in zip(axes, kernels):
        for level_index, level in enumerate(LEVELS):
            y0 = band_y[level_index]
            ax.add_patch(FancyBboxPatch((0.0, y0), right + 0.01, band_h, boxstyle="round,pad=0,rounding_size=0.02",
                                        facecolor=_LEVEL_COLOURS[level_index], edgecolor="none", alpha=0.7))
            ax.text(0.015, y0 + band_h - 0.012, level, ha="left", va="top", fontsize=8, style="italic")
            tiles = TILE_HOMES[kernel][level]
            width = (right - 0.02) / len(tiles)
            for n, (name, note) in enumerate(tiles):
                x, y, h = 0.02 + n * width, y0 + 0.02, band_h - 0.07
                ax.add_patch(FancyBboxPatch((x + 0.008, y), width - 0.016, h,
                                            boxstyle="round,pad=0,rounding_size=0.015",
                                            facecolor="white", edgecolor="0.35", linewidth=0.8))
                ax.text(x + width / 2, y + h * 0.64, name, ha="center", va="center", fontsize=9)
                if note:
                    ax.text(x + width / 2, y + h * 0.24, note, ha="center", va="center", fontsize=6.5,
                            color="0.3")
        for a, b, label, both in _MOVES[kernel]:
            style = "<|-|>" if both else "-|>"
            if abs(a - b) == 1:   # between two adjacent bands, in the gap between them
                upper, lower = min(a, b), max(a, b)
                y_top, y_bottom = band_y[upper], band_y[lower] + band_h
                x = 0.10
                start, end = ((x, y_top), (x, y_bottom)) if a < b else ((x, y_bottom), (x, y_top))
                if a > b:        # upward arrows sit further right, so that two in one gap do not meet
                    start, end = ((0.55, y_bottom), (0.55, y_top))
                    x = 0.55
                ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color="crimson",
                                             linewidth=1.0, zorder=3))
                ax.text(x + 0.02, (y_top + y_bottom) / 2, label, ha="left", va="center", fontsize=6.5,
                        color="crimson", zorder=3)
            else:                 # registers -> HBM, past shared memory: down the right margin
                x = right + 0.05
                ax.add_patch(FancyArrowPatch((x, band_y[a] + band_h / 2), (x, band_y[b] + band_h / 2),
                                             arrowstyle=style, mutation_scale=9, color="crimson", linewidth=1.0))
                ax.text(x + 0.03, (band_y[a] + band_y[b] + band_h) / 2, label, rotation=90, ha="left",
                        va="center", fontsize=6.5, color="crimson")
        ax.set_xlim(0, 1.0)
        ax.set_ylim(0, 0.95)
        ax.axis("off")
        ax.set_title(_TITLES[kernel], fontsize=10)
    fig.tight_layout()
    return fig


def mma_fragment_owner(operand: str) -> np.ndarray:
    """Which lane holds each element of an operand of ``mma.sync.m16n8k16`` with fp16 inputs and an fp32
    accumulator (PTX ISA, "Matrix Fragments for mma.m16n8k16"); lane = 4 * groupID + threadID_in_group.

    ``"A"``: 16 x 16 (rows M, columns K), ``"B"``: 16 x 8 (rows K, columns N), ``"C"``: 16 x 8 (rows M,
    columns N). In C, lane 4g + t holds rows g and g + 8, columns 2t and 2t + 1; A is two C tiles side
    by side, which is why P_ij can go from the accumulator of S_ij to the A operand without moving."""
    if operand == "A":
        r, c = np.indices((16, 16))
        return 4 * (r % 8) + (c % 8) // 2
    if operand == "B":
        k, n = np.indices((16, 8))
        return 4 * n + (k % 8) // 2
    if operand == "C":
        r, c = np.indices((16, 8))
        return 4 * (r % 8) + c // 2
    raise ValueError(f"operand must be 'A', 'B' or 'C', got {operand!r}")


def fragment_layout_figure():
    """The lane that holds each element of the A (16x16), B (16x8) and C (16x8) operands of
    ``mma.sync.m16n8k16``, coloured by lane: the layout the tensor-core kernel programs against."""
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab20")(np.arange(20))
    lane_colour = np.vstack([colours[0::2], colours[1::2]])[:, :3]          # 20 distinct hues ...
    lane_colour = np.vstack([lane_colour, plt.get_cmap("Set3")(np.arange(12))[:, :3]])  # ... and 12 more
    panels = [("A", "A: $Q_i$ or $P_{ij}$, 16 x 16 fp16", "k"), ("B", "B: $K_j^T$ or $V_j$, 16 x 8 fp16", "n"),
              ("C", "C: $S_{ij}$ or $O_i$, 16 x 8 fp32", "n")]
    fig, axes = plt.subplots(1, 3, figsize=(11.5, 4.6), gridspec_kw={"width_ratios": [16, 8, 8]})
    for ax, (operand, title, col_name) in zip(axes, panels):
        owner = mma_fragment_owner(operand)
        ax.imshow(lane_colour[owner], interpolation="nearest")
        for (row, col), lane in np.ndenumerate(owner):
            ax.text(col, row, str(lane), ha="center", va="center", fontsize=6.5)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(owner.shape[1]))
        ax.set_yticks(range(owner.shape[0]))
        ax.tick_params(labelsize=6, length=0)
        ax.set_xlabel(col_name)
        ax.set_ylabel("k" if operand == "B" else "m")
        for edge in (7.5,):   # the 8 x 8 blocks (one ldmatrix each)
            ax.axhline(edge, color="black", linewidth=1)
            if owner.shape[1] == 16:
                ax.axvline(edge, color="black", linewidth=1)
    fig.suptitle("mma.sync.m16n8k16: the lane holding each element (lane = 4 g + t; in C, rows g and g + 8, "
                 "columns 2t and 2t + 1)", fontsize=9)
    fig.tight_layout()
    return fig


def warp_partition_figure(warps: int = 4):
    """How the warps of one block split a step, S_ij = Q_i K_j^T then O_i += P_ij V_j. Split-K
    (FlashAttention-1's "sliced-K"): each warp takes a slice of K_j and V_j and all rows of Q_i, so every
    warp holds a partial O_i (and partial row max and sum) that the warps must exchange and add through
    shared memory. Split-Q (FlashAttention-2): each warp owns rows of Q_i and sees all of K_j and V_j,
    so its rows of S_ij, P_ij and O_i are its own and no warp waits for another."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    colours = plt.get_cmap("Set2")(np.arange(warps))
    shared = "0.85"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))

    def block(ax, x, y, w, h, label, split=None):
        """A matrix at (x, y) (top-left), w x h, split into `warps` stripes by "rows" or "cols" (None: shared)."""
        for n in range(warps if split else 1):
            if split == "rows":
                ax.add_patch(Rectangle((x, y - (n + 1) * h / warps), w, h / warps, facecolor=colours[n],
                                       edgecolor="white"))
            elif split == "cols":
                ax.add_patch(Rectangle((x + n * w / warps, y - h), w / warps, h, facecolor=colours[n],
                                       edgecolor="white"))
            else:
                ax.add_patch(Rectangle((x, y - h), w, h, facecolor=shared, edgecolor="white"))
        ax.add_patch(Rectangle((x, y - h), w, h, facecolor="none", edgecolor="0.2", linewidth=1))
        ax.text(x + w / 2, y + 0.25, label, ha="center", va="bottom", fontsize=9)

    for ax, scheme in zip(axes, ("split-K", "split-Q")):
        q_split, k_split = ("rows", None) if scheme == "split-Q" else (None, "cols")
        # S_ij = Q_i K_j^T (top line) and O_i += P_ij V_j (bottom line)
        block(ax, 0.0, 9.5, 1.2, 3.5, "$Q_i$", q_split)
        ax.text(1.6, 7.75, "x", ha="center", va="center")
        block(ax, 2.0, 9.5, 3.5, 1.2, "$K_j^T$", k_split)
        ax.text(5.9, 7.75, "=", ha="center", va="center")
        block(ax, 6.3, 9.5, 3.5, 3.5, "$S_{ij}$", "rows" if scheme == "split-Q" else "cols")
        block(ax, 0.0, 4.3, 3.5, 3.5, "$P_{ij}$", "rows" if scheme == "split-Q" else "cols")
        ax.text(3.9, 2.55, "x", ha="center", va="center")
        block(ax, 4.3, 4.3, 1.2, 3.5, "$V_j$", "rows" if scheme == "split-K" else None)
        ax.text(5.9, 2.55, "=" if scheme == "split-Q" else "+=", ha="center", va="center")
        if scheme == "split-Q":
            block(ax, 6.3, 4.3, 1.2, 3.5, "$O_i$", "rows")
            ax.text(7.8, 2.55, "each warp: its own rows of\n$S_{ij}$, $m_i$, $\\ell_i$, $O_i$;\n"
                    "no exchange between warps", ha="left", va="center", fontsize=8)
        else:
            for n in range(warps):   # one partial O_i per warp
                x = 6.3 + 0.35 * n
                ax.add_patch(Rectangle((x, 4.3 - 3.5 - 0.25 * n), 1.2, 3.5, facecolor=colours[n],
                                       edgecolor="0.2", linewidth=0.8))
            ax.text(7.2, 4.6, "partial $O_i$ per warp", ha="center", va="bottom", fontsize=9)
            ax.add_patch(FancyArrowPatch((8.9, 2.2), (9.9, 2.2), arrowstyle="-|>", mutation_scale=10,
                                         color="crimson"))
            ax.text(10.0, 2.2, "shared memory:\nexchange row max\nand sum, add the\npartial $O_i$;\n"
                    "__syncthreads", ha="left", va="center", fontsize=8, color="crimson")
        for n in range(warps):
            ax.add_patch(Rectangle((0.0 + 1.6 * n, -1.3), 0.35, 0.35, facecolor=colours[n], edgecolor="none"))
            ax.text(0.45 + 1.6 * n, -1.12, f"warp {n}", va="center", fontsize=8)
        ax.add_patch(Rectangle((0.0 + 1.6 * warps, -1.3), 0.35, 0.35, facecolor=shared, edgecolor="none"))
        ax.text(0.45 + 1.6 * warps, -1.12, "all warps read", va="center", fontsize=8)
        ax.set_xlim(-0.2, 12.5)
        ax.set_ylim(-1.6, 10.3)
        ax.set_aspect("equal")
        ax.axis("off")
        title = ("split-K (FlashAttention-1, \"sliced-K\"): warps split $K_j$, $V_j$" if scheme == "split-K"
                 else "split-Q (FlashAttention-2): warps split $Q_i$")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
