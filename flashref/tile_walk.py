"""The tile walk, animated: which tile the tiled forward computes at each step, the running m, l and O
rows as they are rescaled, and the HBM traffic so far.

    from flashref import tile_walk
    frames = tile_walk.walk(q, k, v, causal=True, block_q=16, block_k=16, order="fa2")
    tile_walk.animate(frames)           # a matplotlib FuncAnimation; .to_jshtml() plays in a web page

Nothing here computes attention or counts bytes on its own. The tiles, their order and the state after
each one come from :func:`flashref.numpy_flash.flash_attention_forward` (its ``trace`` and ``observe``
hooks); the reads and writes come from replaying that order's loads and stores on
:class:`flashref.iomodel.TwoLevelMemory`, the simulated SRAM/HBM of notebook ``04_io_complexity`` (for
Algorithm 1's order the totals equal :func:`flashref.iomodel.account_tiled`'s). Notebook
``03_tiled_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashref import iomodel, numpy_flash
from flashref.numpy_flash import tile_ranges

#: Bytes per element in the counters: the NumPy code computes in fp32 (or fp64); a GPU kernel's fp16 Q, K,
#: V, O would halve those.
BYTES = 4


@dataclass
class Frame:
    """The state after one tile: its index ``tile = (i, j)``, the tiles visited so far, the running max
    ``m`` and sum ``l`` of every query row (``-inf`` and 0 before a row's first tile) and the output so
    far ``O`` (normalized, 0 before a row's first tile), and the HBM reads and writes so far, in
    elements; and what the walk was: ``N_k``, ``blocks = (block_q, block_k)``, ``causal``, ``order``."""

    step: int
    tile: tuple
    visited: list
    m: np.ndarray
    l: np.ndarray  # noqa: E741  (the paper's name)
    O: np.ndarray
    reads: int
    writes: int
    N_k: int
    blocks: tuple
    causal: bool
    order: str


def walk(q, k, v, causal=False, block_q=16, block_k=16, order="fa2") -> list[Frame]:
    """Run the tiled forward on ``q`` ``(N_q, d)``, ``k``, ``v`` ``(N_k, d)`` and return one
    :class:`Frame` per tile, in the order ``order`` ("fa1": key blocks outer; "fa2": query blocks outer)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim != 2:
        raise ValueError(f"q must be (N_q, d) for the walk, got shape {q.shape}")
    states, trace = [], []
    numpy_flash.flash_attention_forward(q, k, v, causal, block_q=block_q, block_k=block_k, order=order, trace=trace,
                                        observe=lambda i, j, m, l, o: states.append((i, j, m, l, o)))
    counts = _hbm_counts(trace, q.shape[0], k.shape[0], q.shape[1], block_q, block_k, order)
    N_q, d = q.shape
    m, l, O = np.full(N_q, -np.inf), np.zeros(N_q), np.zeros((N_q, d))
    frames = []
    for step, ((i, j, m_i, l_i, o_i), (reads, writes)) in enumerate(zip(states, counts)):
        r0, r1 = tile_ranges(N_q, block_q)[i]
        m, l, O = m.copy(), l.copy(), O.copy()
        m[r0:r1], l[r0:r1], O[r0:r1] = m_i, l_i, o_i
        frames.append(Frame(step, (i, j), trace[:step + 1], m, l, O, reads, writes, k.shape[0], (block_q, block_k),
                            bool(causal), order))
    return frames


def _hbm_counts(trace, N_q, N_k, d, block_q, block_k, order):
    """(reads, writes) after each tile of ``trace``, from the loads and stores each order makes."""
    mem = iomodel.TwoLevelMemory(M=2**62, execute=False)
    for name, rows in (("Q", N_q), ("K", N_k), ("V", N_k)):
        mem.place(name, (rows, d))
    q_tiles, k_tiles = tile_ranges(N_q, block_q), tile_ranges(N_k, block_k)
    out = []
    if order == "fa1":  # Algorithm 1: O, l, m initialized in HBM, then read and written at every tile
        mem.fill("O", (N_q, d), 0.0)
        mem.fill("l", (N_q, 1), 0.0)
        mem.fill("m", (N_q, 1), -np.inf)
        KV, current = (), None
        for i, j in trace:
            if j != current:
                mem.free(*KV)
                KV, current = (mem.load("K", k_tiles[j]), mem.load("V", k_tiles[j])), j
            rows = q_tiles[i]
            tiles = [mem.load(name, rows) for name in ("Q", "O", "l", "m")]
            for tile, name in zip(tiles[1:], ("O", "l", "m")):
                mem.store(tile, name, rows)
            mem.free(*tiles)
            out.append((mem.reads, mem.writes))
        return out
    # FlashAttention-2: Q_i loaded once, m, l and the accumulator stay on chip, O_i and lse_i written once
    mem.allocate("O", (N_q, d))
    mem.allocate("lse", (N_q, 1))
    for n, (i, j) in enumerate(trace):
        rows = q_tiles[i]
        if n == 0 or trace[n - 1][0] != i:
            Q = mem.load("Q", rows)
        KV = (mem.load("K", k_tiles[j]), mem.load("V", k_tiles[j]))
        mem.free(*KV)
        if n + 1 == len(trace) or trace[n + 1][0] != i:  # the block's last tile: normalize and write
            shape = (rows[1] - rows[0], d)
            O, lse = mem.scratch(shape, "O_i"), mem.scratch((shape[0], 1), "lse_i")
            mem.store(O, "O", rows)
            mem.store(lse, "lse", rows)
            mem.free(Q, O, lse)
        out.append((mem.reads, mem.writes))
    return out


def animate(frames, interval: int = 800):
    """A matplotlib ``FuncAnimation`` of ``frames``: the tile grid (visited tiles numbered, the current
    one outlined), the running m and l of every query row, and O. ``anim.to_jshtml()`` plays it in a web
    page (the rendered book) without a running kernel; in Jupyter, ``IPython.display.HTML`` of it."""
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation
    from matplotlib.patches import Rectangle

    from flashref.tile_plots import draw_tile_visits

    N_q, d = frames[0].O.shape
    N_k, (block_q, block_k), causal = frames[0].N_k, frames[0].blocks, frames[0].causal
    title = f"{frames[0].order.upper()} order{', causal' if causal else ''}: "
    fig, (ax_grid, ax_ml, ax_o) = plt.subplots(1, 3, figsize=(11, 3.8), dpi=60,  # small frames: about 35 KB each
                                               gridspec_kw={"width_ratios": [1.1, 1.2, 0.8]})
    fig.subplots_adjust(wspace=0.5, left=0.06, right=0.97, top=0.83, bottom=0.14)
    finite = np.concatenate([f.m[np.isfinite(f.m)] for f in frames])
    l_max = max(float(f.l.max()) for f in frames)
    o_lim = max(float(np.abs(f.O).max()) for f in frames) or 1.0
    rows = np.arange(N_q)

    def draw(n):
        f = frames[n]
        for ax in (ax_grid, ax_ml, ax_o):
            ax.clear()
        draw_tile_visits(ax_grid, f.visited, N_q, N_k, block_q, block_k, causal=causal, title="tiles computed")
        (i, j), (r0, r1) = f.tile, tile_ranges(N_q, block_q)[f.tile[0]]
        k0, k1 = tile_ranges(N_k, block_k)[j]
        ax_grid.add_patch(Rectangle((k0, r0), k1 - k0, r1 - r0, fill=False, edgecolor="crimson", linewidth=2.5))
        ax_ml.step(rows, np.where(np.isfinite(f.m), f.m, np.nan), where="mid", label="m (running max)")
        ax_ml.set_ylim(finite.min() - 0.2, finite.max() + 0.2)
        ax_ml.set_xlabel("query row")
        ax_ml.axvspan(r0 - 0.5, r1 - 0.5, color="crimson", alpha=0.12)
        ax_l = ax_ml.twinx()
        ax_l.step(rows, f.l, where="mid", color="C1", label="l (running sum)")
        ax_l.set_ylim(0, l_max * 1.05)
        ax_ml.legend(loc="upper left", fontsize=7)
        ax_l.legend(loc="upper right", fontsize=7)
        ax_ml.set_title("m and l of every row", fontsize=10)
        ax_o.imshow(f.O, aspect="auto", cmap="RdBu", vmin=-o_lim, vmax=o_lim, interpolation="nearest")
        ax_o.add_patch(Rectangle((-0.5, r0 - 0.5), d, r1 - r0, fill=False, edgecolor="crimson", linewidth=2))
        ax_o.set_title("O (normalized so far)", fontsize=10)
        ax_o.set(xlabel="feature", ylabel="query row")
        fig.suptitle(f"{title}step {n + 1} of {len(frames)}: tile ({i}, {j});  HBM read {f.reads * BYTES:,} B, "
                     f"written {f.writes * BYTES:,} B", fontsize=10)
        # twinx axes pile up across frames: remove all but the newest
        for extra in fig.axes[3:-1]:
            extra.remove()

    anim = FuncAnimation(fig, draw, frames=len(frames), interval=interval)
    plt.close(fig)  # the animation is shown as HTML, not as a still figure
    return anim

