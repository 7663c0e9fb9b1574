"""Tiled NumPy attention against naive NumPy attention on the CPU: time and peak memory over N.

    python -m flashref.bench numpy                              # N = 1K..16K, d = 64, float32
    python -m flashref.bench numpy --sizes 1024 2048 --plot bench.png

For each N it times the tiled forward of :mod:`flashref.numpy_flash` in both loop orders and the
standard forward of :mod:`flashref.reference` (which materializes S and P), and measures the peak
memory each one allocates with ``tracemalloc`` (NumPy reports its buffers to it). Writes a JSON file
with the machine, the versions and the results; notebooks/03_tiled_forward.ipynb draws its figures
from the committed one (book/data/numpy_bench.json).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

from flashref import numpy_flash, reference
from flashref.bench import results as saved

DEFAULT_OUT = os.path.join("book", "data", "numpy_bench.json")
DEFAULT_SIZES = (1024, 2048, 4096, 8192, 16384)
METHODS = ("naive", "fa2", "fa1")


def peak_bytes(fn, *args, **kwargs) -> int:
    """Peak bytes ``fn`` allocates (traced by ``tracemalloc``) above what was allocated before it."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()


def best_time(fn, repeats: int) -> float:
    """Best wall-clock seconds of ``repeats`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_info() -> dict:
    """Where the numbers come from: CPU, cores, Python, NumPy and its BLAS."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # older NumPy: no dict mode
        blas = "unknown"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_cores": cores, "python": platform.python_version(), "numpy": np.__version__, "blas": blas,
            "loadavg_1_5_15min": load}


def _methods(block_q: int, block_k: int):
    return {
        "naive": lambda q, k, v: reference.attention(q, k, v, return_lse=True),
        "fa2": lambda q, k, v: numpy_flash.flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k,
                                                                   order="fa2"),
        "fa1": lambda q, k, v: numpy_flash.flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k,
                                                                   order="fa1"),
    }


def run(sizes=DEFAULT_SIZES, d: int = 64, block_q: int = numpy_flash.BLOCK_Q, block_k: int = numpy_flash.BLOCK_K,
        repeats: int = 5, progress: bool = True) -> dict:
    """Time and measure every method at every N; return the results as a JSON-ready dict."""
    from tqdm.auto import tqdm

    methods = _methods(block_q, block_k)
    load_before = machine_info()["loadavg_1_5_15min"]  # other work on the machine skews the timings
    rows = []
    bar = tqdm(total=len(sizes) * len(methods), desc="numpy bench", disable=not progress)
    for N in sizes:
        rng = np.random.default_rng(N)
        q, k, v = (rng.standard_normal((N, d), dtype=np.float32) for _ in range(3))
        row = {"N": N}
        for name, fn in methods.items():
            bar.set_postfix_str(f"N={N} {name}")
            out_bytes = sum(x.nbytes for x in fn(q, k, v))
            row[name] = {"time_s": best_time(lambda: fn(q, k, v), repeats), "peak_bytes": peak_bytes(fn, q, k, v),
                         "output_bytes": out_bytes}
            bar.update()
        rows.append(row)
    bar.close()
    info = machine_info()
    info["loadavg_before"] = load_before
    return {
        "benchmark": "tiled NumPy attention forward vs naive NumPy attention",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": info,
        "config": {"d": d, "dtype": "float32", "causal": False, "block_q": block_q, "block_k": block_k,
                   "repeats": repeats, "timing": "best of repeats after one warm-up",
                   "memory": "tracemalloc peak during the call, above the inputs (outputs included); "
                             "workspace = peak - output_bytes (o and lse)"},
        "results": rows,
    }


def summary_rows(results: dict) -> list[dict]:
    """Per N: times, peaks, tiled/naive time ratios and each peak's growth since the previous N."""
    out, previous = [], None
    for row in results["results"]:
        line = {"N": row["N"]}
        for name in METHODS:
            line[f"{name}_ms"] = 1e3 * row[name]["time_s"]
            line[f"{name}_MiB"] = row[name]["peak_bytes"] / 2**20
            line[f"{name}_work_MiB"] = (row[name]["peak_bytes"] - row[name]["output_bytes"]) / 2**20
            line[f"{name}_growth"] = (row[name]["peak_bytes"] / previous[name]["peak_bytes"]) if previous else None
        line["fa2_speedup"] = row["naive"]["time_s"] / row["fa2"]["time_s"]  # above 1: the tiled one is faster
        line["fa1_speedup"] = row["naive"]["time_s"] / row["fa1"]["time_s"]
        out.append(line)
        previous = row
    return out


def format_table(results: dict) -> str:
    """The results as a fixed-width text table."""
    head = (f"{'N':>6} | {'naive ms':>9} {'fa2 ms':>8} {'fa1 ms':>8} {'fa2 speed':>9} {'fa1 speed':>9} | "
            f"{'naive MiB':>9} {'x':>5} {'fa2 MiB':>8} {'x':>5} {'fa1 MiB':>8} {'x':>5} | {'tiled work MiB':>14}")
    lines = [head, "-" * len(head)]
    growth = lambda g: "" if g is None else f"{g:.2f}"
    for r in summary_rows(results):
        lines.append(f"{r['N']:>6} | {r['naive_ms']:>9.1f} {r['fa2_ms']:>8.1f} {r['fa1_ms']:>8.1f} "
                     f"{r['fa2_speedup']:>8.2f}x {r['fa1_speedup']:>8.2f}x | {r['naive_MiB']:>9.1f} "
                     f"{growth(r['naive_growth']):>5} {r['fa2_MiB']:>8.2f} {growth(r['fa2_growth']):>5} "
                     f"{r['fa1_MiB']:>8.2f} {growth(r['fa1_growth']):>5} | "
                     f"{r['fa2_work_MiB']:>6.2f} {r['fa1_work_MiB']:>7.2f}")
    lines.append("speed: the naive forward's time over the tiled one's (above 1x: tiled is faster). x: peak memory "
                 "relative to the previous N (a doubling of N). tiled work: peak minus the outputs o and lse (fa2, fa1), "
                 "the tiles' workspace")
    return "\n".join(lines)


def load_results(path: str | None = None) -> dict | None:
    """The committed results (book/data/numpy_bench.json in a checkout of the repository, or ``path``), read
    by :func:`flashref.bench.results.load`; None where there is no such file (on Colab: notebook
    ``03_tiled_forward`` then measures the machine it runs on)."""
    path = path or os.path.join(saved.REPO_ROOT, DEFAULT_OUT)
    if not os.path.exists(path):
        return None
    return saved.load(os.path.basename(path), path)


def plot_results(results: dict, path: str | None = None):
    """Two log-log panels over N: forward time, and peak memory with the N^2 and N reference slopes."""
    import matplotlib.pyplot as plt

    rows = results["results"]
    N = np.array([r["N"] for r in rows], dtype=float)
    labels = {"naive": "naive (S, P in memory)", "fa2": "tiled, fa2 order", "fa1": "tiled, fa1 order"}
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, marker in zip(METHODS, "osd"):
        ax_t.loglog(N, [r[name]["time_s"] * 1e3 for r in rows], marker=marker, label=labels[name])
        ax_m.loglog(N, [r[name]["peak_bytes"] / 2**20 for r in rows], marker=marker, label=labels[name])
    naive0 = rows[0]["naive"]["peak_bytes"] / 2**20
    ax_m.loglog(N, naive0 * (N / N[0]) ** 2, "k:", lw=1, label="slope 2 (x4 per doubling)")
    ax_m.loglog(N, [r["fa2"]["output_bytes"] / 2**20 for r in rows], "k--", lw=1,
                label="O and lse alone (slope 1, x2)")
    ax_t.set(xlabel="N", ylabel="forward time (ms)", title=f"time, d = {results['config']['d']}, float32")
    ax_m.set(xlabel="N", ylabel="peak memory (MiB)", title="peak memory (tracemalloc)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(N, [f"{int(n) // 1024}K" for n in N])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashref.bench numpy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="sequence lengths N")
    parser.add_argument("--d", type=int, default=64, help="head dimension")
    parser.add_argument("--block-q", type=int, default=numpy_flash.BLOCK_Q, help="query rows per tile")
    parser.add_argument("--block-k", type=int, default=numpy_flash.BLOCK_K, help="keys per tile")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (best is kept)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON file to write (default {DEFAULT_OUT})")
    parser.add_argument("--plot", default=None, help="also save the figure to this PNG file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("d", "block_q", "block_k", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if any(n < 1 for n in args.sizes):
        parser.error(f"--sizes must be positive ints, got {args.sizes}")
    results = run(args.sizes, args.d, args.block_q, args.block_k, args.repeats, progress=not args.no_progress)
    m = results["machine"]
    print(f"{m['processor']}, {m['cpu_cores']} cores, NumPy {m['numpy']} ({m['blas']}), "
          f"load average before/after: {m['loadavg_before']} / {m['loadavg_1_5_15min']}")
    print(format_table(results))
    if args.out:
        saved.save(results, args.out, indent=2)
        print(f"wrote {args.out}")
    if args.plot:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
