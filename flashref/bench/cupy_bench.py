"""Timing the CuPy kernels next to PyTorch's SDPA flash backend, on the same GPU in the same run.

Taught in notebook ``06_cupy_kernel`` ("How fast"). ``python -m flashref.bench cupy`` measures the grid
of the course's benchmark (N in 1K..16K, B = 65536 / N, H = 2048 / d, fp16; the tiled kernel in fp32
and fp16 too) and writes book/data/cupy_bench.json, its rows in the course benchmark's schema (impl,
mode, B, H, N, d, causal, status, ms, tflops) and its FLOPs counted by :func:`flashref.bench.results.flops`.
"""

from __future__ import annotations

import argparse
import os
import sys

from flashref.bench import results
from flashref.bench.results import flops

OUT_PATH = os.path.join("book", "data", "cupy_bench.json")
#: The course benchmark's results (python -m flashref.bench gpu), read here for its CuPy rows.
GPU_BENCH_PATH = os.path.join("book", "data", "gpu_bench.json")


def time_ms(fn, warmup: int = 1, reps: int = 5) -> float:
    """Median time of ``fn()`` in milliseconds, with CUDA events on the current stream."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    times.sort()
    return times[len(times) // 2]


def _implementations(q, k, v, causal):
    """name -> callable on the same inputs: our kernels (fp16; the tiled one in fp32 too) and SDPA's
    flash backend. Names as in the course benchmark (flashref.bench gpu)."""
    import cupy as cp

    from flashref.bench.gpu_bench import sdpa
    from flashref.cupy import flash_attention_forward

    cq, ck, cv = (cp.from_dlpack(x) for x in (q, k, v))
    flash = sdpa("sdpa-flash")

    impls = {"cupy-mma": lambda: flash_attention_forward(cq, ck, cv, causal, kernel="mma", check_finite=False),
             "cupy-wmma": lambda: flash_attention_forward(cq, ck, cv, causal, kernel="wmma", check_finite=False),
             "cupy-tiled": lambda: flash_attention_forward(cq, ck, cv, causal, kernel="tiled", check_finite=False),
             "sdpa-flash": lambda: flash(q, k, v, causal)}
    q32, k32, v32 = (cp.from_dlpack(x.float()) for x in (q, k, v))
    impls["cupy-tiled-fp32"] = lambda: flash_attention_forward(q32, k32, v32, causal, kernel="tiled", check_finite=False)
    return impls


def run(Ns=(1024, 2048, 4096, 8192, 16384), ds=(64, 128), causals=(False, True), impls=None,
        tokens=65536, width=2048, reps=3, log=print) -> list[dict]:
    """Measure every implementation at every point; B = tokens / N, H = width / d."""
    import torch
    rows = []
    for d in ds:
        for N in Ns:
            B, H = max(1, tokens // N), max(1, width // d)
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
            for causal in causals:
                for name, fn in _implementations(q, k, v, causal).items():
                    if impls is not None and name not in impls:
                        continue
                    ms = time_ms(fn, reps=reps)
                    tflops = flops(B, H, N, N, d, causal, "fwd") / ms / 1e9
                    rows.append(dict(impl=name, mode="fwd", B=B, H=H, N=N, d=d, causal=causal, status="ok", ms=ms,
                                     tflops=tflops))
                    log(f"{name:16s} N={N:5d} d={d:3d} causal={causal!s:5s} {ms:9.3f} ms {tflops:7.1f} TFLOP/s")
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def load_results(path: str = OUT_PATH):
    """(device name, forward rows) of a saved benchmark: this module's book/data/cupy_bench.json or the
    course benchmark's book/data/gpu_bench.json (flashref.bench gpu), read by :func:`flashref.bench.results.load`.
    Rows: impl, N, d, causal, tflops. A missing file gives ("", [])."""
    try:
        data = results.load(os.path.basename(path), os.path.join(results.REPO_ROOT, path))
    except FileNotFoundError:
        return "", []
    raw, device = data.get("results", []), data.get("device", "")
    rows = [dict(impl=r["impl"], N=int(r["N"]), d=int(r["d"]), causal=bool(r["causal"]), tflops=float(r["tflops"]))
            for r in raw if r.get("mode", "fwd") == "fwd" and r.get("status", "ok") == "ok" and r.get("tflops")]
    return device, rows


def format_table(rows, d: int, causal: bool, baseline: str = "sdpa-flash") -> str:
    """TFLOP/s of every implementation at each N (one column per N), and each one's ratio to ``baseline``."""
    sel = [r for r in rows if r["d"] == d and r["causal"] == causal]
    Ns = sorted({r["N"] for r in sel})
    impls = sorted({r["impl"] for r in sel}, key=lambda s: (not s.startswith("cupy"), s))
    value = {(r["impl"], r["N"]): r["tflops"] for r in sel}
    head = f"d = {d}, causal = {causal}: TFLOP/s (ratio to {baseline})"
    lines = [head, f"{'':16s}" + "".join(f"{'N=' + str(N):>15s}" for N in Ns)]
    for impl in impls:
        cells = []
        for N in Ns:
            t, b = value.get((impl, N)), value.get((baseline, N))
            cells.append("" if t is None else f"{t:6.1f}" + (f" ({t / b:4.2f})" if b else "       "))
        lines.append(f"{impl:16s}" + "".join(f"{c:>15s}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashref.bench cupy", description=__doc__)
    parser.add_argument("--N", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--impls", nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=OUT_PATH)
    args = parser.parse_args(argv)
    import torch

    rows = run(Ns=args.N, ds=args.d, impls=args.impls, reps=args.reps)
    results.save({"device": torch.cuda.get_device_name(), "versions": results.versions(),
                  "command": results.command("cupy", argv), "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
