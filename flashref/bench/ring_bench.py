"""Ring attention over the GPUs of one machine against FlashAttention on one GPU, in one run.

    python -m flashref.bench ring                # the points below, on every visible GPU
    python -m flashref.bench ring --device cpu   # a rehearsal of every step on CPUs (gloo, tiny shapes)

It spawns its own processes: first one on GPU 0 for the baseline (:func:`flashref.triton.flash_attention` on
the whole sequence), then one per visible GPU joined by NCCL for :func:`flashref.ring_attention.ring_attention`
(each holding 1/R of the sequence; zigzag layout when causal). The parent process never touches a GPU, so
each worker has its GPU's whole memory.

- ``scaling``: fp16, B = 1, H = H_kv = 16, d = 128, N = 32K, 64K, 128K, 256K tokens, causal and not:
  forward + backward time (CUDA events, after a warm-up; repeated up to 10 times within ~1.5 s, the slowest
  rank's time), tokens/s, TFLOP/s (the whole sequence's FLOPs, :func:`flashref.bench.results.flops`, so the
  ring's figure is all GPUs together) and the peak memory of the busiest GPU; the ring's rows carry
  ``speedup`` = 1-GPU time / ring time (the ratio of tokens/s).
- ``longest``: N from 256K, four steps per doubling (:func:`probe_lengths`), until out of memory, then three
  halvings of the gap between the longest that fit and the shortest that did not (:func:`next_probe`), for
  1 GPU and for the ring, with the peak memory per GPU, the forward's and the backward's apart. The probe runs one
  forward + backward with a causal window of 128 keys (``window_size=(127, 0)``): the kernels allocate exactly
  what the dense ones do (the window only skips tiles), so what fits is the same, and a probe takes seconds
  rather than the minutes of dense attention at millions of tokens.
- ``trace``: a ``torch.profiler`` trace of one ring forward + backward at N = 128K, causal, on rank 0, reduced
  to its GPU kernels ``[stream, name, start_us, dur_us]``: the attention kernels on the compute stream and
  NCCL's send/receive kernels on its own, to see whether communication hides behind compute
  (:func:`plot_timeline`, :func:`overlap_fraction`).

The Triton kernels' tile configs are autotuned once at N = 16K and then pinned (``fixed_configs``) for
every point of both sides: autotuning at 256K would time each config for seconds, and pinned configs make the
comparison the ring's, not the autotuner's. Results go to ``book/data/ring_bench.json`` with the device,
library versions, command and pinned configs (:func:`load_results` reads them back; :func:`scaling_table`,
:func:`longest_table` and :func:`plot_timeline` show them). Sized to take under 5 minutes on two H200s. Notebook
``13_beyond_one_gpu_and_decoding``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback
from functools import partial
from unittest import mock

from flashref.bench import results
from flashref.bench.results import flops

PARTS = ("scaling", "longest", "trace")
B, H, D = 1, 16, 128
LENGTHS = [32768, 65536, 131072, 262144]
TUNE_N = 16384
TRACE_N = 131072
LONGEST_FROM = 262144
LONGEST_MAX = 1 << 24
LONGEST_STEPS = 4  # probes per doubling of N: the longest fit is known to within 19%, not a factor of 2 ...
LONGEST_REFINE = 3  # ... then bisections of that gap: within 2.4%
PROBE_WINDOW = (127, 0)
BUDGET_S = 1.5
MAX_REPS = 10
PHASE_TIMEOUT_S = 600
# How long a rank waits in NCCL for its peer before NCCL gives up. A rank out of memory inside the ring leaves
# its peer waiting for a block that never comes: the longest probe ends that way, and each minute of waiting
# is a minute of GPU time.
NCCL_TIMEOUT_S = 60


# ---- reading a saved run: pure Python, tested on the CPU ------------------------------------------------------

def load_results(path=None) -> dict:
    """The committed run, book/data/ring_bench.json (or ``path``), read by :func:`flashref.bench.results.load`."""
    return results.load("ring_bench.json", path)


def is_communication(name: str) -> bool:
    """Whether a GPU kernel is NCCL's (communication) rather than compute."""
    return "nccl" in name.lower()


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f}"


def scaling_table(rows) -> str:
    """A text table of the ``scaling`` rows: per (causal, N), the 1-GPU and the ring's forward + backward time,
    tokens/s, the speedup and each one's peak memory per GPU."""
    sel = [r for r in rows if r.get("part") == "scaling"]
    one = {(r["causal"], r["N"]): r for r in sel if r["gpus"] == 1}
    rings = sorted({r["gpus"] for r in sel if r["gpus"] > 1})
    head = f"{'causal':>6s} {'N':>7s} {'1 GPU ms':>9s} {'Mtok/s':>7s} {'GiB':>5s}"
    for g in rings:
        head += f" | {f'{g} GPUs ms':>10s} {'Mtok/s':>7s} {'GiB/GPU':>7s} {'speedup':>7s}"
    lines = [head]
    for causal, N in sorted({(r["causal"], r["N"]) for r in sel}):
        base = one.get((causal, N), {})
        line = f"{str(causal):>6s} {N // 1024:>6d}K " + _cells(base, 9, 5)
        for g in rings:
            r = next((x for x in sel if x["gpus"] == g and x["causal"] == causal and x["N"] == N), {})
            line += " | " + _cells(r, 10, 7)
            line += f" {r['speedup']:7.2f}" if r.get("speedup") else f" {'-':>7s}"
        lines.append(line)
    return "\n".join(lines)


def _cells(r, w_ms, w_gib) -> str:
    if r.get("status", "ok") != "ok" or "ms" not in r:
        return f"{r.get('status', '-')[:w_ms]:>{w_ms}s} {'-':>7s} {'-':>{w_gib}s}"
    return f"{r['ms']:{w_ms}.1f} {r['tokens_per_s'] / 1e6:7.3f} {_gib(r.get('peak_bytes')):>{w_gib}s}"


def longest_fit(rows) -> dict:
    """``{gpus: (N, peak_bytes)}``: the longest N whose ``longest`` probe fit, per number of GPUs."""
    best = {}
    for r in rows:
        if r.get("part") == "longest" and r.get("status") == "ok" and r["N"] > best.get(r["gpus"], (0, 0))[0]:
            best[r["gpus"]] = (r["N"], r.get("peak_bytes"))
    return best


def longest_table(rows) -> str:
    """Each probed N and what happened, per number of GPUs, with the peak per GPU and, where the run saved them,
    the forward's and the backward's peaks counted in tensors of the GPU's shard (``shard_bytes``); then the
    longest that fit."""
    sel = sorted((r for r in rows if r.get("part") == "longest"), key=lambda r: (r["gpus"], r["N"]))
    lines = [f"{'GPUs':>4s} {'N':>9s} {'status':>10s} {'peak GiB/GPU':>12s} {'fwd, bwd peak in shard tensors':>31s}"]
    lines += [f"{r['gpus']:>4d} {r['N']:>9d} {r['status'][:10]:>10s} {_gib(r.get('peak_bytes')):>12s} "
              f"{_in_shards(r):>31s}" for r in sel]
    for g, (N, peak) in sorted(longest_fit(rows).items()):
        gpus = f"{g} GPU{'s' if g > 1 else ''}"
        lines.append(f"longest on {gpus}: N = {N} ({N // 1024}K tokens), {_gib(peak)} GiB per GPU")
    return "\n".join(lines)


def _in_shards(row) -> str:
    fwd, bwd, unit = (row.get(k) for k in ("forward_peak_bytes", "backward_peak_bytes", "shard_bytes"))
    return "-" if None in (fwd, bwd, unit) else f"{fwd / unit:.1f}, {bwd / unit:.1f}"


def plot_scaling(data, axes=None):
    """Forward + backward tokens/s against N, one panel for non-causal and one for causal attention: one GPU,
    the ring, and the ring's ideal (R times one GPU), each ring point labelled with its speedup. ``data``: the
    results dict. Returns the figure."""
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if r.get("part") == "scaling" and r.get("status") == "ok"]
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    fig = axes[0].figure
    for ax, causal in zip(axes, (False, True)):
        sel = [r for r in rows if r["causal"] == causal]
        one = {r["N"]: r["tokens_per_s"] / 1e6 for r in sel if r["gpus"] == 1}
        for g in sorted({r["gpus"] for r in sel}):
            pts = sorted((r["N"], r["tokens_per_s"] / 1e6, r.get("speedup")) for r in sel if r["gpus"] == g)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="1 GPU" if g == 1 else f"ring, {g} GPUs")
            if g > 1:
                ideal = [(n, g * one[n]) for n, _, _ in pts if n in one]
                ax.plot([p[0] for p in ideal], [p[1] for p in ideal], ":", color="gray",
                        label=f"{g} x one GPU" if ideal else None)
                for n, y, speedup in pts:
                    if speedup:
                        ax.annotate(f"{speedup:.2f}x", (n, y), textcoords="offset points", xytext=(0, 6),
                                    ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # tokens/s falls as 1/N: attention's work per token grows with N
        ticks = sorted({r["N"] for r in sel})
        ax.set_xticks(ticks, [f"{n // 1024}K" for n in ticks])
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_title("causal (zigzag layout)" if causal else "non-causal", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("forward + backward, M tokens/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"ring attention against one GPU, {data.get('device', '?')}", fontsize=10)
    fig.tight_layout()
    return fig


def _intervals(events, communication: bool):
    spans = sorted((e[2], e[2] + e[3]) for e in events if is_communication(e[1]) == communication)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap_fraction(trace) -> float:
    """The fraction of the time NCCL kernels run during which a compute kernel runs too (1: communication
    wholly hidden behind compute; 0: none of it). ``trace``: the saved dict (``data["trace"]``) or the
    whole results dict."""
    trace = trace.get("trace", trace)
    comm, comp = _intervals(trace["events"], True), _intervals(trace["events"], False)
    total = sum(b - a for a, b in comm)
    if total == 0:
        return 0.0
    both = 0.0
    for a, b in comm:
        for c, d in comp:
            both += max(0.0, min(b, d) - max(a, c))
    return both / total


def plot_timeline(data, ax=None, title=None):
    """The GPU kernels of the saved trace on a time axis (ms), one row per CUDA stream, compute kernels and
    NCCL kernels in two colours. ``data``: the results dict (or its ``trace``). Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    trace = data.get("trace", data)
    events = trace["events"]
    streams = sorted({e[0] for e in events},
                     key=lambda s: (any(is_communication(e[1]) for e in events if e[0] == s), s))
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * max(1, len(streams))))
    else:
        fig = ax.figure
    colors = {False: "tab:blue", True: "tab:orange"}
    for y, s in enumerate(streams):
        for comm in (False, True):
            bars = [(e[2] / 1e3, max(e[3], 0.5) / 1e3) for e in events if e[0] == s and is_communication(e[1]) == comm]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colors[comm], edgecolor="white", linewidth=0.3)
    labels = []
    for s in streams:
        kind = "NCCL" if any(is_communication(e[1]) for e in events if e[0] == s) else "compute"
        labels.append(f"stream {s} ({kind})")
    ax.set_yticks(range(len(streams)), labels)
    ax.set_ylim(-0.6, len(streams) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[Patch(color=colors[False], label="compute kernels"),
                       Patch(color=colors[True], label="NCCL kernels (send/receive)")], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title is None:
        title = (f"ring attention forward + backward, rank {trace.get('rank', 0)} of {trace.get('gpus', '?')}, "
                 f"N = {trace.get('N', '?')}, causal = {trace.get('causal', '?')}: "
                 f"{overlap_fraction(trace):.0%} of NCCL time overlaps compute")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def reduce_chrome_trace(trace_json: dict, device: int | None = None, max_name: int = 80) -> list:
    """The GPU kernels of a Chrome trace (``torch.profiler``'s ``export_chrome_trace``) as ``[stream, name,
    start_us, dur_us]`` sorted by start, times from the first kernel's start (on ``device`` only, when given)."""
    kernels = [e for e in trace_json.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e
               and (device is None or e.get("args", {}).get("device") in (None, device))]
    if not kernels:
        return []
    t0 = min(float(e["ts"]) for e in kernels)
    out = [[int(e.get("args", {}).get("stream", e.get("tid", 0))), str(e["name"])[:max_name],
            round(float(e["ts"]) - t0, 1), round(float(e["dur"]), 1)] for e in kernels]
    return sorted(out, key=lambda e: e[2])


# ---- measuring (the workers) ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run measures, handed to every worker. ``device="cuda"``: the GPUs, NCCL (the measurement).
    ``device="cpu"``: a rehearsal of the whole run on CPUs (gloo, the kernels in Triton's interpreter, the
    shapes of :data:`REHEARSAL`): its numbers mean nothing, but every step of the GPU run is taken, so a
    machine with several GPUs is not spent finding a mistake in the bench itself."""

    device: str = "cuda"
    parts: tuple = PARTS
    H: int = H
    d: int = D
    lengths: tuple = tuple(LENGTHS)
    tune_n: int = TUNE_N
    trace_n: int = TRACE_N
    longest_from: int = LONGEST_FROM
    longest_max: int = LONGEST_MAX
    longest_steps: int = LONGEST_STEPS
    longest_refine: int = LONGEST_REFINE


#: The rehearsal's shapes: small enough for Triton's interpreter, the zigzag layout's chunks still uneven tiles.
REHEARSAL = dict(H=2, d=16, lengths=(192,), tune_n=128, trace_n=128, longest_from=128, longest_max=256,
                 longest_steps=4, longest_refine=LONGEST_REFINE)


class _Device:
    """One worker's device: a GPU (CUDA events, the allocator's peak, NCCL) or, for a rehearsal, the CPU
    (wall-clock time, no peak memory, gloo)."""

    def __init__(self, kind: str, index: int = 0):
        import torch

        self.kind, self.index = kind, index
        if kind == "cuda":
            torch.cuda.set_device(index)
            self.torch = torch.device("cuda", index)
        else:
            torch.set_num_threads(1)  # the ranks share the machine's cores
            self.torch = torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    def name(self) -> str:
        import torch

        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.index)
        return "cpu (rehearsal: Triton's interpreter, gloo)"

    def nccl(self) -> str | None:
        """NCCL's version, where the ring runs over it."""
        import torch

        return ".".join(map(str, torch.cuda.nccl.version())) if self.kind == "cuda" else None

    def sync(self):
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize()

    def fresh(self):
        """Memory released and the peak counter reset, before a point."""
        import torch

        if self.kind == "cuda":
            torch.cuda.empty_cache()
        self.reset_peak()

    def reset_peak(self):
        """The peak counter reset, the allocator's cache kept (the timed calls reuse the warm-up's blocks)."""
        import torch

        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated()) if self.kind == "cuda" else None

    def elapsed_ms(self, step, reps: int) -> float:
        """Milliseconds per call of ``reps`` calls of ``step``: CUDA events on a GPU, the wall clock on the CPU."""
        import torch

        if self.kind != "cuda":
            start = time.perf_counter()
            for _ in range(reps):
                step()
            return (time.perf_counter() - start) * 1e3 / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps


def _inputs(dev: _Device, plan: Plan, n, seed):
    import torch

    g = torch.Generator(device=dev.torch).manual_seed(seed)
    q, k, v, do = (torch.randn(B, plan.H, n, plan.d, device=dev.torch, dtype=torch.float16, generator=g)
                   for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do):
    def step():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v).backward(do)

    return step


def _status(exc) -> str:
    return "OOM" if results.is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


class _Ranks:
    """Agreement between the ranks over a gloo group (CPU: waiting costs no GPU); one rank: a no-op."""

    def __init__(self, group=None, world=1):
        self.group, self.world = group, world

    def reduce(self, value, op: str):
        """``value`` reduced over the ranks (``op``: "MAX", "MIN", "SUM"); None stays None (no peak on CPUs)."""
        if self.world == 1 or value is None:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self.group)
        return float(t.item())

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)


def _time_ms(step, dev: _Device, ranks: _Ranks):
    """(ms per call, peak bytes of the busiest GPU): a warm-up, one timed call, then up to MAX_REPS within
    BUDGET_S; every rank runs as many, and the slowest rank's time counts."""
    step()
    dev.sync()

    def timed(reps):
        ranks.barrier()
        return ranks.reduce(dev.elapsed_ms(step, reps), "MAX")

    dev.reset_peak()
    ms = timed(1)
    reps = int(ranks.reduce(max(1, min(MAX_REPS, int(BUDGET_S * 1e3 / max(ms, 1e-3)))), "MIN"))
    if reps > 1:
        ms = timed(reps)
    peak = ranks.reduce(dev.peak(), "MAX")
    return ms, None if peak is None else int(peak)


def _scaling_row(impl, gpus, N, causal, ms, peak, H=H, d=D):
    return {"part": "scaling", "impl": impl, "gpus": gpus, "B": B, "H": H, "H_kv": H, "N": N, "d": d,
            "causal": causal, "status": "ok", "ms": ms, "tokens_per_s": B * N / (ms * 1e-3),
            "tflops": flops(B, H, N, N, d, causal, "fwd+bwd") / (ms * 1e-3) / 1e12,
            "tflops_per_gpu": flops(B, H, N, N, d, causal, "fwd+bwd") / (ms * 1e-3) / 1e12 / gpus,
            "peak_bytes": peak}


def _failed_row(part, impl, gpus, N, causal, status):
    return {"part": part, "impl": impl, "gpus": gpus, "N": N, "causal": causal, "status": status}


def _tune(dev: _Device, plan: Plan):
    """The teaching kernels' tile configs, autotuned once at ``plan.tune_n`` (non-causal), to pin: calls the
    Hopper kernels cannot take (a window, strided slices) run the teaching ones, and autotuning those at 256K
    tokens would time each config for seconds. Under the interpreter nothing is tuned: ``{}``."""
    from flashref.triton import flash_attention, ops

    q, k, v, do = _inputs(dev, plan, plan.tune_n, 0)
    flash_attention(q, k, v, check_finite=False, kernel="triton").backward(do)
    dev.sync()
    return {key[0]: cfg for key, cfg in ops._CHOSEN.items()}


def _one_gpu_worker(plan: Plan, out):
    """GPU 0: the device name, the pinned configs, then flash_attention on the whole sequence."""
    try:
        dev = _Device(plan.device, 0)
        from flashref.triton import flash_attention
        from flashref.triton.ops import fixed_configs

        out.put(("device", dev.name(), dev.nccl()))
        pinned = _tune(dev, plan)
        out.put(("pinned", pinned))
        ranks = _Ranks()
        with fixed_configs(**pinned):
            if "scaling" in plan.parts:
                for causal in (False, True):
                    for N in plan.lengths:
                        out.put(("row", _one_gpu_point(flash_attention, N, causal, dev, plan, ranks)))
            if "longest" in plan.parts:
                for row in _longest_one_gpu(flash_attention, dev, plan):
                    out.put(("row", row))
        out.put(("done", 0))
    except BaseException:  # noqa: BLE001 (the parent shows it)
        out.put(("error", 0, traceback.format_exc()))


def _one_gpu_point(flash_attention, N, causal, dev, plan, ranks):
    impl = "flashref-triton 1 GPU"
    try:
        q, k, v, do = _inputs(dev, plan, N, 1)
        ms, peak = _time_ms(_fwd_bwd(lambda q, k, v: flash_attention(q, k, v, causal=causal, check_finite=False),
                                     q, k, v, do), dev, ranks)
        row = _scaling_row(impl, 1, N, causal, ms, peak, plan.H, plan.d)
    except Exception as exc:  # noqa: BLE001 (recorded)
        row = _failed_row("scaling", impl, 1, N, causal, _status(exc))
    q = k = v = do = None
    dev.fresh()
    return row


def _probe_row(impl, gpus, N, status, peaks=(None, None), H=H, d=D):
    """A ``longest`` row. ``peaks``: the forward's and the backward's peak bytes (the busiest GPU's);
    ``shard_bytes`` is one fp16 tensor of a GPU's N / gpus tokens, the unit in which :func:`longest_table`
    counts them (one GPU holds 8 at its backward's end: Q, K, V, O, dO, dQ, dK, dV)."""
    fwd, bwd = peaks
    peak = None if fwd is None or bwd is None else max(fwd, bwd)
    return {"part": "longest", "impl": impl, "gpus": gpus, "B": B, "H": H, "H_kv": H, "N": N, "d": d,
            "probe": f"fwd+bwd, window_size={list(PROBE_WINDOW)}", "status": status, "peak_bytes": peak,
            "forward_peak_bytes": fwd, "backward_peak_bytes": bwd, "shard_bytes": B * H * (N // gpus) * d * 2}


def unanswered_probe_row(probing, rows, failures) -> dict | None:
    """The ``longest`` row of a ring probe that never answered: ``probing`` is the last ``("probing", impl,
    gpus, N, H, d)`` message the ring sent (or None), ``rows`` what the run recorded, ``failures`` how the
    ring's processes ended (:func:`_run`). None when nothing failed, nothing was in flight or its row exists."""
    if not failures or probing is None:
        return None
    impl, gpus, N, H, d = probing[1:]
    if any(r.get("part") == "longest" and r.get("impl") == impl and r.get("N") == N for r in rows):
        return None
    row = _probe_row(impl, gpus, N, "no answer", H=H, d=d)
    row["failure"] = failures[0].splitlines()[0][:300]
    return row


def _probe_peaks(fn, q, k, v, do, dev):
    """(forward peak, backward peak) in bytes of one forward + backward of ``fn`` (``None`` on the CPU): the
    allocator's peak read after the forward, reset, and read again after the backward."""
    o = fn(q, k, v)
    dev.sync()
    fwd = dev.peak()
    dev.reset_peak()
    o.backward(do)
    dev.sync()
    return fwd, dev.peak()


def probe_lengths(start: int, stop: int, steps: int) -> list:
    """The ``longest`` probe's N: ``start * 2**(i / steps)`` up to ``stop``, each rounded down to a multiple of
    ``max(64, start // 16)`` (whole chunks of the zigzag layout), without repeats."""
    quantum = max(64, start // 16)
    out, i = [], 0
    while (N := int(start * 2 ** (i / steps)) // quantum * quantum) <= stop:
        if not out or N > out[-1]:
            out.append(N)
        i += 1
    return out


def next_probe(tried: dict, start: int, stop: int, steps: int, refine: int):
    """The next N of a ``longest`` probe, given ``tried`` ({N: whether it fit}), or None when done: the
    :func:`probe_lengths` ladder until a length does not fit, then up to ``refine`` bisections of the gap between
    the longest that fit and the shortest that did not (rounded down to the ladder's multiple)."""
    ladder = probe_lengths(start, stop, steps)
    for i, N in enumerate(ladder):
        if N not in tried:
            return N
        if not tried[N]:
            break
    else:
        return None  # everything up to ``stop`` fit
    fit = [n for n, ok in tried.items() if ok]
    if not fit or len(tried) - (i + 1) >= refine:
        return None
    lo, hi = max(fit), min(n for n, ok in tried.items() if not ok)
    quantum = max(64, start // 16)
    mid = (lo + hi) // 2 // quantum * quantum
    return mid if mid > lo else None


def _next_length(tried: dict, plan):
    return next_probe(tried, plan.longest_from, plan.longest_max, plan.longest_steps, plan.longest_refine)


def _longest_one_gpu(flash_attention, dev, plan):
    tried = {}
    while (N := _next_length(tried, plan)) is not None:
        dev.fresh()
        try:
            q, k, v, do = _inputs(dev, plan, N, 2)
            fn = partial(flash_attention, causal=True, window_size=PROBE_WINDOW, check_finite=False)
            status, peaks = "ok", _probe_peaks(fn, q, k, v, do, dev)
        except Exception as exc:  # noqa: BLE001 (out of memory is the result)
            status, peaks = _status(exc), (None, None)
        q = k = v = do = None
        tried[N] = status == "ok"
        yield _probe_row("flashref-triton 1 GPU", 1, N, status, peaks, plan.H, plan.d)


def _ring_worker(rank, world, port, plan: Plan, pinned, out):
    """One GPU of the ring: NCCL for the attention, a gloo group beside it for agreeing on counts and times."""
    exit_hard = False
    try:
        import datetime

        import torch.distributed as dist

        dev = _Device(plan.device, rank)
        import flashref.triton  # noqa: F401
        from flashref.triton.ops import fixed_configs

        dist.init_process_group(dev.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=NCCL_TIMEOUT_S), pg_options=_group_options(dev))
        ranks = _Ranks(dist.new_group(backend="gloo"), world)
        with fixed_configs(**pinned):
            if "scaling" in plan.parts:
                for causal in (False, True):
                    for N in plan.lengths:
                        row = _ring_point(N, causal, rank, world, dev, plan, ranks)
                        if rank == 0:
                            out.put(("row", row))
            if "trace" in plan.parts:
                trace = _ring_trace(plan.trace_n, True, rank, world, dev, plan, ranks)
                if rank == 0:
                    out.put(("trace", trace))
            if "longest" in plan.parts:
                announce = (lambda N: out.put(("probing", f"ring {world} GPUs", world, N, plan.H, plan.d))
                            ) if rank == 0 else (lambda N: None)
                for row in _longest_ring(rank, world, dev, plan, ranks, announce):
                    if rank == 0:
                        out.put(("row", row))
                    if row["status"] != "ok":
                        # After out of memory the ring's transfers may be half done: no synchronization at the
                        # end (it could wait forever), and no orderly shutdown of NCCL either.
                        exit_hard = True
        if not exit_hard:
            ranks.barrier()
            dist.destroy_process_group()
        out.put(("done", rank))
    except BaseException:  # noqa: BLE001 (the parent shows it)
        out.put(("error", rank, traceback.format_exc()))
        exit_hard = True
    if exit_hard:
        out.close()
        out.join_thread()  # what was put is delivered before the process ends
        os._exit(0)


def _group_options(dev: _Device):
    """NCCL's kernels on a high-priority stream (:func:`flashref.ring_attention.nccl_group_options` says why);
    gloo takes no options."""
    if dev.backend != "nccl":
        return None
    from flashref.ring_attention import nccl_group_options

    return nccl_group_options()


def _ring_fn(causal):
    from flashref.ring_attention import ring_attention

    return lambda q, k, v: ring_attention(q, k, v, causal=causal, check_finite=False)


def _ring_point(N, causal, rank, world, dev, plan, ranks):
    impl = f"ring {world} GPUs"
    try:
        q, k, v, do = _inputs(dev, plan, N // world, 100 + rank)  # this rank's shard (values: random; layout: any)
        ms, peak = _time_ms(_fwd_bwd(_ring_fn(causal), q, k, v, do), dev, ranks)
        row = _scaling_row(impl, world, N, causal, ms, peak, plan.H, plan.d)
    except Exception as exc:  # noqa: BLE001 (recorded; a failure in one rank only would hang: it is not expected)
        row = _failed_row("scaling", impl, world, N, causal, _status(exc))
    q = k = v = do = None
    dev.fresh()
    return row


def _ring_trace(N, causal, rank, world, dev, plan, ranks):
    """One ring forward + backward after a warm-up, profiled on rank 0: its GPU kernels (none on the CPU)."""
    q, k, v, do = _inputs(dev, plan, N // world, 200 + rank)
    step = _fwd_bwd(_ring_fn(causal), q, k, v, do)
    step()
    dev.sync()
    ranks.barrier()
    if rank != 0:
        step()
        dev.sync()
        return None
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.kind == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        dev.sync()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = reduce_chrome_trace(json.load(f), device=dev.index if dev.kind == "cuda" else None)
    span = max((e[2] + e[3] for e in events), default=0.0)
    return {"N": N, "causal": causal, "gpus": world, "rank": 0, "B": B, "H": plan.H, "d": plan.d, "span_us": span,
            "events": events}


def _longest_ring(rank, world, dev, plan, ranks, announce=lambda N: None):
    """N as :func:`next_probe` picks it (up the ladder, then bisecting past the first that did not fit); every
    rank learns whether all ranks fit before anything synchronizes. Where the ranks run out of memory at the
    same allocation, the ring's transfers stay paired and the bisection goes on. Where one rank runs out inside
    the ring alone, its peer waits in NCCL until the ring's timeout ends both processes: ``announce(N)`` before
    each probe tells the parent which N is in flight, so that probe is still recorded
    (:func:`unanswered_probe_row`), and it is the last."""
    import flashref.ring_attention as ring_module

    saved = ring_module._block_forward, ring_module._block_backward
    # The probe's window: the same allocations as the dense kernels, a fraction of their work.
    ring_module._block_forward = partial(saved[0], window_size=PROBE_WINDOW)
    ring_module._block_backward = partial(saved[1], window_size=PROBE_WINDOW)
    impl = f"ring {world} GPUs"
    tried = {}
    try:
        while (N := _next_length(tried, plan)) is not None:
            announce(N)
            dev.fresh()
            try:
                q, k, v, do = _inputs(dev, plan, N // world, 300 + rank)
                peaks = _probe_peaks(_ring_fn(True), q, k, v, do, dev)
                status = "ok"
            except Exception as exc:  # noqa: BLE001 (out of memory is the result)
                status = _status(exc)
            q = k = v = do = None
            failed = ranks.reduce(0.0 if status == "ok" else 1.0, "SUM")
            tried[N] = failed == 0
            if failed == 0:
                peaks = tuple(None if p is None else int(ranks.reduce(p, "MAX")) for p in peaks)
                yield _probe_row(impl, world, N, "ok", peaks, plan.H, plan.d)
                continue
            yield _probe_row(impl, world, N, status if status != "ok" else f"OOM on {int(failed)} of {world} ranks",
                             (None, None), plan.H, plan.d)
    finally:
        ring_module._block_forward, ring_module._block_backward = saved


# ---- the parent: spawns the workers, records what they send --------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(targets, on_message, timeout=PHASE_TIMEOUT_S, hide_gpus=False) -> list:
    """Start one spawned process per ``(target, args)``, hand each message to ``on_message`` until every one
    said done, failed or the time ran out; returns the failures (text, with the workers' tracebacks).
    ``hide_gpus`` (the rehearsal): the workers see no CUDA device, so that :mod:`flashref.triton` runs its kernels
    in Triton's interpreter on their CPU tensors even on a machine with GPUs (where it would compile them for the
    GPU and refuse CPU tensors)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=t, args=(*a, out), daemon=True) for t, a in targets]
    # A spawned process copies this process's environment when it starts; the parent's is restored after.
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""} if hide_gpus else {}):
        for p in procs:
            p.start()
    done, failures = set(), []
    deadline = time.monotonic() + timeout
    try:
        while len(done) < len(procs) and not failures:
            try:
                msg = out.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    failures.append(f"workers exited with {dead}" if dead else f"no answer within {timeout} s")
                continue
            if msg[0] == "done":
                done.add(msg[1])
            elif msg[0] == "error":
                failures.append(f"rank {msg[1]} failed:\n{msg[2]}")
            else:
                on_message(msg)
    finally:
        for p in procs:
            p.join(timeout=30 if not failures else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return failures


def _print(r):
    head = f"{r['part']:8s} {r['impl']:22s} N={r['N']:>8d} causal={str(r.get('causal', '-')):5s}"
    if r.get("status") != "ok":
        print(f"{head} {r.get('status')}", flush=True)
    elif r["part"] == "scaling":
        extra = f" x{r['speedup']:.2f}" if r.get("speedup") else ""
        print(f"{head} {r['ms']:9.1f} ms {r['tokens_per_s'] / 1e6:7.3f} Mtok/s {r['tflops']:6.1f} TFLOP/s "
              f"{_gib(r['peak_bytes'])} GiB/GPU{extra}", flush=True)
    else:
        print(f"{head} fits, {_gib(r['peak_bytes'])} GiB/GPU", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashref.bench ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: rehearse the whole run on CPUs (gloo, Triton's interpreter, tiny shapes; its numbers "
                        "mean nothing) before spending GPUs on it")
    p.add_argument("--out", default=None,
                   help="default book/data/ring_bench.json; with --device cpu a file in the temporary folder")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--n", nargs="+", type=int, default=None, metavar="N",
                   help=f"sequence lengths of the scaling part (default {' '.join(map(str, LENGTHS))})")
    p.add_argument("--gpus", type=int, default=None,
                   help="ranks in the ring (default: every visible GPU; 2 with --device cpu)")
    p.add_argument("--trace-n", type=int, default=None, help=f"default {TRACE_N}")
    p.add_argument("--longest-max", type=int, default=None, help=f"stop probing N past this (default {LONGEST_MAX})")
    p.add_argument("--longest-steps", type=int, default=None,
                   help=f"probes per doubling of N (default {LONGEST_STEPS})")
    p.add_argument("--longest-refine", type=int, default=None,
                   help=f"bisections of the gap past the ladder's longest fit (default {LONGEST_REFINE})")
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (a run split over several calls; same GPU and versions)")
    args = p.parse_args(argv)
    for N in (args.n or []) + ([args.trace_n] if args.trace_n is not None else []):
        if N <= 0 or N % 64:
            p.error(f"sequence lengths must be positive multiples of 64 (the zigzag layout's 2R chunks), got {N}")
    if args.longest_steps is not None and args.longest_steps < 1:
        p.error(f"--longest-steps must be at least 1, got {args.longest_steps}")
    if args.longest_refine is not None and args.longest_refine < 0:
        p.error(f"--longest-refine must be at least 0, got {args.longest_refine}")
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus must be at least 1, got {args.gpus}")
    if args.out is None:
        args.out = ("book/data/ring_bench.json" if args.device == "cuda"
                    else os.path.join(tempfile.gettempdir(), "flashref_ring_rehearsal.json"))
    return args


def measures(row: dict) -> tuple:
    """What a row measures, for ``--append``: a scaling point (one implementation, length and mask), or one
    implementation's whole series of longest probes. A run that measures it again replaces the file's rows of
    it, so the file never holds a measurement twice."""
    if row.get("part") == "scaling":
        return ("scaling", row.get("impl"), row.get("N"), row.get("causal"))
    return (row.get("part"), row.get("impl"))


def plan_of(args) -> Plan:
    """The :class:`Plan` of parsed arguments: the defaults of the device (the rehearsal's shapes on the CPU),
    then what the command line gave."""
    given = {"parts": tuple(args.parts), "lengths": tuple(args.n) if args.n else None, "trace_n": args.trace_n,
             "longest_max": args.longest_max, "longest_steps": args.longest_steps,
             "longest_refine": args.longest_refine}
    base = dict(REHEARSAL) if args.device == "cpu" else {}
    base.update({k: v for k, v in given.items() if v is not None})
    return Plan(device=args.device, **base)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = plan_of(args)
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():  # no CUDA context here: the workers own the GPUs
        print("flashref.bench ring needs CUDA devices (--device cpu rehearses the run on CPUs)", file=sys.stderr)
        return 2
    if plan.device == "cpu":
        from flashref.triton import interpreter_problem

        problem = interpreter_problem()
        if problem:
            print(f"flashref.bench ring --device cpu: {problem}", file=sys.stderr)
            return 2
    gpus = args.gpus or (torch.cuda.device_count() if plan.device == "cuda" else 2)
    command = results.command("ring", argv)
    state = {"data": None, "add": None, "pinned": None, "base": {}, "probing": None}

    def on_message(msg):
        kind = msg[0]
        if kind == "device":
            state["data"] = results.start(args.out if args.append else None, msg[1], results.versions(), command,
                                          dtype="float16", gpus=gpus, nccl=msg[2])
            state["add"] = results.recorder(state["data"], args.out, show=_print, group=measures)
        elif kind == "pinned":
            state["pinned"] = msg[1]
            state["data"]["pinned_configs"] = {k: dataclasses.asdict(v) for k, v in msg[1].items()}
            state["data"]["tuned_at_N"] = plan.tune_n
        elif kind == "row":
            row = msg[1]
            if row["part"] == "scaling" and row.get("status") == "ok":
                if row["gpus"] == 1:
                    state["base"][(row["causal"], row["N"])] = row
                elif (row["causal"], row["N"]) in state["base"]:
                    row["speedup"] = state["base"][(row["causal"], row["N"])]["ms"] / row["ms"]
            state["add"](row)
        elif kind == "probing":
            state["probing"] = msg
        elif kind == "trace":
            state["data"]["trace"] = msg[1]
            results.save(state["data"], args.out)
            print(f"trace    {len(msg[1]['events'])} kernels over {msg[1]['span_us'] / 1e3:.1f} ms, "
                  f"{overlap_fraction(msg[1]):.0%} of NCCL time overlapping compute", flush=True)

    rehearsal = plan.device == "cpu"
    failures = _run([(_one_gpu_worker, (plan,))], on_message, hide_gpus=rehearsal)
    if not failures and gpus > 1 and state["pinned"] is not None:
        port = _free_port()
        failures = _run([(_ring_worker, (r, gpus, port, plan, state["pinned"])) for r in range(gpus)], on_message,
                        hide_gpus=rehearsal)
        row = unanswered_probe_row(state["probing"], state["data"]["results"], failures)
        if row is not None:
            state["add"](row)
    elif gpus < 2:
        print("one GPU visible: the ring's parts are skipped", file=sys.stderr)
    if state["data"] is not None:
        results.save(state["data"], args.out)
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
