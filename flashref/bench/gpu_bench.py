"""GPU benchmark: flashref's Triton kernels against PyTorch's attention backends, in one run.

    python -m flashref.bench gpu                  # the whole grid of the book (an H100: a few minutes)
    python -m flashref.bench gpu --quick          # a small subset
    python -m flashref.bench gpu --memory-target  # the grid, then forward+backward at B=1, H=16, N=131072, d=64
    python -m flashref.bench gpu --plot book/data/gpu_bench.json   # redraw the figure from a saved run

Implementations: ``flashref-triton`` (flashref.triton), ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``,
``sdpa-math`` (``scaled_dot_product_attention`` pinned to one backend with ``sdpa_kernel``), ``plain``
(matmul, softmax, matmul) and, when importable, ``cupy-tiled`` / ``cupy-mma`` (flashref.cupy, forward only).
Grid (fp16): N in {1K..16K} with B = 65536 / N and H = 2048 / d, so every point holds the same number of
tokens and model width; d in {64, 128}; causal and not; forward, backward and forward+backward.
FLOPs (:func:`flashref.bench.results.flops`): 4 B H N_q N_k d forward, half when causal (notebook
``01_standard_attention``); backward 2.5x forward (notebook ``05_backward_recomputation``). Times are medians of
``triton.testing.do_bench``; memory is ``torch.cuda.max_memory_allocated`` after a reset. Out-of-memory is
caught and recorded as "OOM". Results go to JSON with the device, library versions and command; the book's
figures are drawn from that file (notebooks ``07_triton_forward`` and ``08_triton_backward``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from flashref.bench import results
from flashref.bench.results import flops

IMPLS = ["flashref-triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "plain", "cupy-tiled",
         "cupy-mma"]
MODES = ["fwd", "bwd", "fwd+bwd"]
FULL_N = [1024, 2048, 4096, 8192, 16384]
QUICK_N = [1024, 4096, 16384]
TOKENS = 65536
WIDTH = 2048


def sdpa(backend_name, **kw):
    """``fn(q, k, v, causal)``: ``scaled_dot_product_attention`` pinned to one backend (``sdpa-flash``,
    ``sdpa-cudnn``, ``sdpa-efficient``, ``sdpa-math``), with SDPA's keywords ``kw`` (``enable_gqa``,
    ``dropout_p``)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}[backend_name]

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)

    return fn


def _cupy(kernel):
    import cupy

    from flashref.cupy import flash_attention_forward

    def fn(q, k, v, causal):
        o = flash_attention_forward(cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(v), causal=causal,
                                    kernel=kernel)
        return o

    return fn


def implementation(name):
    """A callable ``fn(q, k, v, causal) -> o`` for ``name``, or raise ImportError when unavailable."""
    if name == "flashref-triton":
        from flashref.triton import flash_attention

        # check_finite=False: time the kernels as the peers run, with no pass over the inputs to look for NaN;
        # kernel="triton": the teaching kernel, also on an H100 (the Hopper forward is the hopper suite's)
        return lambda q, k, v, causal: flash_attention(q, k, v, causal=causal, check_finite=False, kernel="triton")
    if name.startswith("sdpa-"):
        return sdpa(name)
    if name == "plain":
        from flashref.torch_attention import plain_attention

        return plain_attention
    if name.startswith("cupy-"):
        return _cupy(name.split("-", 1)[1])
    raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLS}")


def _diff_vs_sdpa(out, q, k, v, causal) -> float:
    import torch

    if hasattr(out, "__cuda_array_interface__") and not isinstance(out, torch.Tensor):
        out = torch.from_dlpack(out)
    with torch.no_grad():
        want = sdpa("sdpa-flash")(q, k, v, causal)
    return float((out.float() - want.float()).abs().max())


def measure(fn, name, B, H, N, d, causal, mode, rep_ms=100, warmup_ms=25):
    """Time one point; return a result dict (status "ok", "OOM" or "unsupported: ...")."""
    import torch
    import triton

    row = {"impl": name, "mode": mode, "B": B, "H": H, "N": N, "d": d, "causal": causal}
    torch.cuda.empty_cache()
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (B, H, N, d)
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
        needs_grad = mode != "fwd"
        for x in (q, k, v):
            x.requires_grad_(needs_grad)
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    return fn(q, k, v, causal)
        elif mode == "bwd":
            o = fn(q, k, v, causal)

            def run():
                o.backward(do, retain_graph=True)
        else:
            def run():
                fn(q, k, v, causal).backward(do)
        out = run()  # compile / autotune / warm caches outside the timing
        if mode == "fwd":  # a fast wrong answer is no result: compare with SDPA's flash backend
            row["max_abs_diff_vs_sdpa_flash"] = _diff_vs_sdpa(out, q, k, v, causal)
        out = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, grad_to_none=[q, k, v] if needs_grad else None,
                                     return_mode="median")
        row.update(status="ok", ms=ms, tflops=flops(B, H, N, N, d, causal, mode) / (ms * 1e-3) / 1e12,
                   peak_bytes=int(peak), extra_bytes=int(peak - base))
    except Exception as exc:  # noqa: BLE001 (every failure is recorded, the run goes on)
        if results.is_oom(exc):
            row.update(status="OOM")
        else:
            row.update(status=f"unsupported: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    finally:
        q = k = v = do = o = None  # noqa: F841
        torch.cuda.empty_cache()
    return row


def memory_target(B=1, H=16, N=131072, d=64):
    """Forward+backward at the issue's memory point: peak memory against the size of q, k, v, o, do and the
    three gradients (8 tensors of B H N d fp16)."""
    import torch

    from flashref.triton import flash_attention

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    start = time.time()
    flash_attention(q, k, v, causal=False).backward(do)
    torch.cuda.synchronize()
    tensors = 8 * q.numel() * q.element_size()
    peak = torch.cuda.max_memory_allocated()
    return {"B": B, "H": H, "N": N, "d": d, "peak_bytes": int(peak), "eight_tensors_bytes": int(tensors),
            "ratio": peak / tensors, "seconds": time.time() - start}


def run_grid(impls, ns, ds, causals, modes, rep_ms, progress=True, checkpoint=None):
    """Measure every point; ``checkpoint(rows)`` is called every 10 points (partial results survive a kill)."""
    from tqdm.auto import tqdm

    points = [(n, d, c, m, i) for d in ds for c in causals for n in ns for m in modes for i in impls
              if not (i.startswith("cupy-") and m != "fwd")]
    available = {}
    for name in impls:
        try:
            available[name] = implementation(name)
        except Exception as exc:  # noqa: BLE001
            available[name] = exc
    rows = []
    for n, d, c, m, i in tqdm(points, desc="gpu bench", disable=not progress):
        B, H = TOKENS // n, WIDTH // d
        fn = available[i]
        if isinstance(fn, Exception):
            rows.append({"impl": i, "mode": m, "B": B, "H": H, "N": n, "d": d, "causal": c,
                         "status": f"unavailable: {type(fn).__name__}: {str(fn)[:120]}"})
            continue
        rows.append(measure(fn, i, B, H, n, d, c, m, rep_ms=rep_ms))
        if checkpoint is not None and len(rows) % 10 == 0:
            checkpoint(rows)
    return rows


def load_results(path=None) -> dict:
    """The committed benchmark run, book/data/gpu_bench.json (or ``path``), read by
    :func:`flashref.bench.results.load` (on Colab: the copy in the course repository)."""
    return results.load("gpu_bench.json", path)


def memory_table(rows, mode="fwd+bwd", impls=("flashref-triton", "sdpa-flash", "sdpa-cudnn", "plain")) -> str:
    """Peak memory (GiB, torch.cuda.max_memory_allocated) per implementation and point."""
    pts = sorted({(r["d"], r["causal"], r["N"]) for r in rows if r["mode"] == mode})
    get = {(r["impl"], r["d"], r["causal"], r["N"]): r for r in rows if r["mode"] == mode}
    lines = [f"{'peak GiB':8s} {'d':>4s} {'causal':>6s} {'N':>6s} " + " ".join(f"{i[:14]:>14s}" for i in impls)]
    for d, c, n in pts:
        cells = []
        for i in impls:
            r = get.get((i, d, c, n), {})
            ok = r.get("status") == "ok"
            cells.append(f"{r['peak_bytes'] / 2**30:14.2f}" if ok else f"{r.get('status', '-')[:14]:>14s}")
        lines.append(f"{mode:8s} {d:4d} {str(c):>6s} {n:6d} " + " ".join(cells))
    return "\n".join(lines)


def _short(impl: str) -> str:
    """A column title of at most 10 characters: "flashref" for our Triton kernel, SDPA's backends by name."""
    return "flashref" if impl == "flashref-triton" else impl.removeprefix("sdpa-")


def table(rows, mode, peers=("sdpa-flash", "sdpa-cudnn")) -> str:
    """A text table of TFLOP/s per implementation (columns named by :func:`_short`, whole) with the Triton
    kernel's ratio to each peer."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    pts = sorted({(r["d"], r["causal"], r["N"]) for r in rows if r["mode"] == mode})
    get = {(r["impl"], r["d"], r["causal"], r["N"]): r for r in rows if r["mode"] == mode}
    head = f"{mode:8s} {'d':>4s} {'causal':>6s} {'N':>6s} " + " ".join(f"{_short(i):>10s}" for i in impls)
    head += " " + " ".join(f"{'/' + _short(p):>8s}" for p in peers)
    lines = [head]
    for d, c, n in pts:
        cells = []
        for i in impls:
            r = get.get((i, d, c, n))
            cells.append(f"{r['tflops']:10.1f}" if r and r.get("status") == "ok" else
                         f"{(r or {}).get('status', '-')[:10]:>10s}")
        ratios = []
        mine = get.get(("flashref-triton", d, c, n))
        for p in peers:
            other = get.get((p, d, c, n))
            ok = mine and other and mine.get("status") == "ok" and other.get("status") == "ok"
            ratios.append(f"{mine['tflops'] / other['tflops']:8.2f}" if ok else f"{'-':>8s}")
        lines.append(f"{'':8s} {d:4d} {str(c):>6s} {n:6d} " + " ".join(cells) + " " + " ".join(ratios))
    return "\n".join(lines)


def plot(data, path=None, modes=("fwd", "fwd+bwd"), impls=None):
    """TFLOP/s against N, one panel per (mode, d, causal); returns the figure (saved to ``path`` if given)."""
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if r.get("status") == "ok"]
    impls = impls or [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    ds = sorted({r["d"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    cols = [(d, c) for d in ds for c in causals]
    fig, axes = plt.subplots(len(modes), len(cols), figsize=(3.2 * len(cols), 2.6 * len(modes)), squeeze=False,
                             sharex=True)
    for mi, mode in enumerate(modes):
        for ci, (d, c) in enumerate(cols):
            ax = axes[mi][ci]
            for impl in impls:
                pts = sorted((r["N"], r["tflops"]) for r in rows
                             if r["impl"] == impl and r["mode"] == mode and r["d"] == d and r["causal"] == c)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=impl,
                            lw=2.2 if impl == "flashref-triton" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, d={d}, {'causal' if c else 'full'}", fontsize=9)
            ax.tick_params(labelsize=7)
            if ci == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
            if mi == len(modes) - 1:
                ax.set_xlabel("N", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=7, frameon=False)
    fig.suptitle(f"fp16 attention on {data.get('device', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    if path:
        fig.savefig(path, dpi=110)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"N in {QUICK_N}, forward and fwd+bwd only")
    p.add_argument("--n", type=int, nargs="*", help="sequence lengths (default: the full grid)")
    p.add_argument("--d", type=int, nargs="*", default=[64, 128], help="head dims")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--modes", nargs="*", choices=MODES, help="default: all three")
    p.add_argument("--impls", nargs="*", choices=IMPLS, help="default: all")
    p.add_argument("--rep", type=float, default=100, help="milliseconds of repetitions per point (do_bench)")
    p.add_argument("--memory-target", action="store_true", help="also measure B=1, H=16, N=131072, d=64")
    p.add_argument("--out", default="book/data/gpu_bench.json")
    p.add_argument("--png", default=None, help="figure path (default: --out with .png)")
    p.add_argument("--plot", metavar="JSON", help="only redraw the figure from a saved JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.plot:
        data = results.load(os.path.basename(args.plot), args.plot)
        plot(data, args.png or args.plot.rsplit(".", 1)[0] + ".png")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("flashref.bench gpu needs a CUDA device", file=sys.stderr)
        return 2
    ns = args.n or (QUICK_N if args.quick else FULL_N)
    modes = args.modes or (["fwd", "fwd+bwd"] if args.quick else MODES)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    impls = args.impls or IMPLS
    start = time.time()
    data = results.start(None, torch.cuda.get_device_name(), results.versions(), results.command("gpu", argv),
                         capability=list(torch.cuda.get_device_capability()), dtype="float16", tokens=TOKENS,
                         width=WIDTH, flops="4 B H N^2 d forward (x0.5 causal); backward 2.5x; fwd+bwd 3.5x",
                         complete=False)

    def checkpoint(rows):
        results.save({**data, "results": rows, "seconds": time.time() - start}, args.out)

    rows = run_grid(impls, ns, args.d, causals, modes, args.rep, progress=not args.no_progress, checkpoint=checkpoint)
    data["results"] = rows
    data["complete"] = True
    if args.memory_target:
        try:
            data["memory_target"] = memory_target()
        except Exception as exc:  # noqa: BLE001
            data["memory_target"] = {"status": "OOM" if results.is_oom(exc) else f"error: {exc}"}
    data["seconds"] = time.time() - start
    results.save(data, args.out)
    for mode in modes:
        print(table(rows, mode))
    if "memory_target" in data:
        print("memory target:", data["memory_target"])
    plot(data, args.png or args.out.rsplit(".", 1)[0] + ".png")
    print(f"wrote {args.out} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
