"""What a timer's cache flush adds to the call it times: decoding after a dirty and after a clean L2.

    python -m flashref.bench flush      # a GPU with SDPA's cuDNN backend (an H100 or H200): about a minute

``triton.testing.do_bench`` empties the L2 cache before each call, so that every call reads its inputs from
HBM, by zeroing a 256 MiB buffer. Zeroing leaves the 50 MB L2 full of *dirty* lines: data written but not yet
in HBM. The call timed next evicts them as it reads its own inputs, and an evicted dirty line must first be
written back. So the call's time includes writes that are not its own, up to the L2's size: a few microseconds,
nothing beside a kernel of milliseconds, a fifth of a decoding step that reads a 64 MB KV cache. A flush that
*reads* the buffer leaves clean lines, which eviction drops for free.

Two measurements, at the decoding points of notebook 13 (one query, 32 query heads on 8 K/V heads, d = 128,
fp16, :data:`POINTS`):

- ``case: "time"``: each call's GPU time with the host taken out (CUDA-graph replay,
  :func:`flashref.bench.features_bench.graph_time_us`) after each flush (:data:`FLUSHES`), for flash-decoding
  and SDPA's cuDNN backend, :data:`ROUNDS` rounds taken in turn (``us``: their median);
- ``case: "writes"``: the bytes flash-decoding's kernels read from and write to HBM after each flush, counted
  by Nsight Compute with its own cache control off (``--cache-control none``: the flush's lines stay in the L2
  as they would). Left out when ncu is not installed.

:func:`fit` draws a line through the times, ``us = fixed + bytes / bandwidth``: the bandwidth a long call
streams at, and the fixed cost every call pays. Results go to ``book/data/flush_bench.json``
(:func:`load_results`); notebook 13 reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from flashref.bench import results
from flashref.bench.features_bench import FLUSHES, l2_flush  # the flushes graph_time_us can run, and how

DEFAULT_OUT = "book/data/flush_bench.json"
H, H_KV, D, N_Q = 32, 8, 128, 1
#: (B, N_k): cache sizes from 17 MB to 4.3 GB; two of them 268 MB and two 67 MB, in different shapes.
POINTS = [(1, 4096), (1, 16384), (1, 65536), (1, 131072), (4, 4096), (4, 65536), (16, 4096), (16, 65536)]
#: The points whose HBM traffic ncu counts.
COUNTED = [(1, 16384), (1, 65536)]
IMPLS = ("flashref-decode", "sdpa-cudnn")
ROUNDS = 3
REPLAYS = 30


# ---- pure Python: tested on the CPU --------------------------------------------------------------------------

def fit(rows, impl: str, flush: str) -> dict | None:
    """The least-squares line ``us = fixed_us + bytes / bandwidth`` through the ``"time"`` rows of ``impl`` after
    ``flush``: ``{fixed_us, tb_s, points}`` (``tb_s``: the bandwidth in TB/s, 1e12 bytes a second), or None with
    fewer than two cache sizes."""
    pts = [(r["bytes"], r["us"]) for r in rows
           if r.get("case") == "time" and r["impl"] == impl and r["flush"] == flush and r.get("us") is not None]
    if len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)  # us a byte
    return {"fixed_us": my - slope * mx, "tb_s": 1e-6 / slope, "points": n}


def _by_point(rows) -> dict:
    out = {}
    for r in rows:
        if r.get("case") == "time" and r.get("us") is not None:
            out.setdefault((r["B"], r["N_k"], r["bytes"]), {})[(r["impl"], r["flush"])] = r["us"]
    return out


def time_table(data: dict, impls=IMPLS) -> str:
    """One line a point: each implementation's microseconds after do_bench's flush (``zero``) and after a read
    (``read``), and what the dirty lines cost it (their difference); then each implementation's line
    (:func:`fit`) after each flush."""
    rows = data["results"]
    head = f"{'B':>3s} {'N_k':>7s} {'MB':>6s}"
    for impl in impls:
        head += f"   {impl + ' zero':>20s} {'read':>6s} {'dirty':>6s}"
    lines = [head]
    for (B, N_k, nbytes), got in sorted(_by_point(rows).items(), key=lambda kv: (kv[0][2], kv[0][0])):
        line = f"{B:3d} {N_k:7d} {nbytes / 1e6:6.0f}"
        for impl in impls:
            zero, read = got.get((impl, "zero")), got.get((impl, "read"))
            if zero is None or read is None:
                line += f"   {'-':>20s} {'-':>6s} {'-':>6s}"
            else:
                line += f"   {zero:20.1f} {read:6.1f} {zero - read:6.1f}"
        lines.append(line)
    lines.append("")
    for impl in impls:
        for flush in FLUSHES:
            line = fit(rows, impl, flush)
            if line is not None:
                lines.append(f"{impl:16s} after a {flush:4s} flush: {line['fixed_us']:5.1f} us a call + the cache "
                             f"at {line['tb_s']:.2f} TB/s ({line['points']} points)")
    return "\n".join(lines)


def writes_table(data: dict) -> str:
    """One line a counted point and flush: flash-decoding's HBM bytes read and written (all its kernels), and its
    kernels' time under ncu; empty when the run counted nothing."""
    rows = [r for r in data["results"] if r.get("case") == "writes"]
    if not rows:
        return ""
    lines = [f"{'B':>3s} {'N_k':>7s} {'flush':>5s} {'MB read':>8s} {'MB written':>11s} {'kernel us':>10s}"]
    for r in rows:
        lines.append(f"{r['B']:3d} {r['N_k']:7d} {r['flush']:>5s} {r['dram_read'] / 1e6:8.1f} "
                     f"{r['dram_write'] / 1e6:11.2f} {r['ns'] / 1e3:10.1f}")
    return "\n".join(lines)


def writes_rows(kernels_by_case: dict, cases: list) -> list[dict]:
    """The ``"writes"`` rows from ncu's kernels grouped by case (:func:`flashref.bench.hbm_bench.split_cases`):
    case ``i`` is ``cases[i]`` (``{B, N_k, flush}``); its kernels' bytes and times are summed."""
    out = []
    for i, case in enumerate(cases):
        kernels = kernels_by_case.get(i, [])
        if not kernels:
            continue
        out.append({"case": "writes", **case, "kernels": [k["name"] for k in kernels],
                    "dram_read": int(sum(k.get("dram__bytes_read.sum") or 0 for k in kernels)),
                    "dram_write": int(sum(k.get("dram__bytes_write.sum") or 0 for k in kernels)),
                    "ns": float(sum(k.get("gpu__time_duration.sum") or 0 for k in kernels))})
    return out


def load_results(path: str | None = None) -> dict:
    """The committed run (``book/data/flush_bench.json``), or ``path``'s."""
    return results.load("flush_bench.json", path)


# ---- on the GPU ---------------------------------------------------------------------------------------------

def _inputs(B: int, N_k: int):
    """The decoding benchmark's inputs at this point (same generator, seed and order of draws)."""
    from flashref.bench.decode_bench import _inputs

    return _inputs(B, H, H_KV, N_Q, N_k, D)


def _calls(N_k: int, impls=IMPLS) -> dict:
    """``{impl: fn(q, k, v)}`` from the decoding benchmark: flash-decoding on the dense cache, SDPA pinned to
    cuDNN (its ``fn.backend()`` the context to call it in)."""
    from flashref.bench.decode_bench import implementations

    return implementations(N_Q, N_k, False, None, impls=list(impls))


def times(points=POINTS, impls=IMPLS, rounds: int = ROUNDS):
    """The ``"time"`` rows: per point, implementation and flush, the median of ``rounds`` graph times (all kept
    as ``us_rounds``), the rounds taken in turn over the implementations and flushes."""
    import torch

    from flashref.bench.decode_bench import _backend, _status, bytes_moved
    from flashref.bench.features_bench import graph_time_us

    for B, N_k in points:
        fields = dict(case="time", B=B, H=H, H_kv=H_KV, N_q=N_Q, N_k=N_k, d=D,
                      bytes=bytes_moved(B, H, H_KV, N_Q, N_k, D))
        q, k, v = _inputs(B, N_k)
        calls = _calls(N_k, impls)
        got, status = {}, {}
        for rnd in range(rounds):
            for impl, fn in calls.items():
                for flush in FLUSHES:
                    if impl in status:
                        continue
                    try:
                        with torch.no_grad(), _backend(fn):
                            us = graph_time_us(lambda: fn(q, k, v), REPLAYS, flush=flush)
                    except Exception as exc:  # noqa: BLE001 (a backend that refuses is recorded)
                        status[impl] = _status(exc)
                        continue
                    got.setdefault((impl, flush), []).append(us)
        for impl in calls:
            for flush in FLUSHES:
                taken = [us for us in got.get((impl, flush), []) if us is not None]
                if impl in status or not taken:
                    yield {**fields, "impl": impl, "flush": flush, "status": status.get(impl, "not captured")}
                else:
                    yield {**fields, "impl": impl, "flush": flush, "status": "ok", "us": statistics.median(taken),
                           "us_rounds": taken}
        del q, k, v, calls
        torch.cuda.empty_cache()


def _child(cases_file: str) -> int:
    """Under ncu: for each case, flush the L2 its way, then one flash-decoding call after a marker launch
    (:func:`flashref.bench.hbm_bench.case_marker`), the profiler on around the two."""
    import torch

    from flashref.bench.hbm_bench import case_marker

    with open(cases_file) as f:
        cases = json.load(f)
    flushes = {kind: l2_flush(kind) for kind in FLUSHES}
    mark = case_marker()
    for i, case in enumerate(cases):
        q, k, v = _inputs(case["B"], case["N_k"])
        decode = _calls(case["N_k"], ["flashref-decode"])["flashref-decode"]
        decode(q, k, v)  # compiled before the profiled range
        flushes[case["flush"]]()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        mark(i)
        decode(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


def writes(points=COUNTED) -> list[dict]:
    """The ``"writes"`` rows, counted by ncu in a child process; [] when ncu is not installed."""
    from flashref.bench.hbm_bench import METRICS, ncu_path, parse_ncu_csv, split_cases

    ncu = ncu_path()
    if ncu is None:
        print("ncu not found: no HBM counts", file=sys.stderr)
        return []
    cases = [{"B": B, "N_k": N_k, "flush": flush} for B, N_k in points for flush in FLUSHES]
    metrics = [m for m in METRICS if m.startswith(("dram__", "gpu__"))]
    with tempfile.TemporaryDirectory() as tmp:
        cases_file, log = os.path.join(tmp, "cases.json"), os.path.join(tmp, "ncu.csv")
        with open(cases_file, "w") as f:
            json.dump(cases, f)
        cmd = [ncu, "--csv", "--print-units", "base", "--metrics", ",".join(metrics), "--cache-control", "none",
               "--clock-control", "none", "--profile-from-start", "off", "--log-file", log,
               sys.executable, "-m", "flashref.bench.flush_bench", "--child", cases_file]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(log):
            print(f"ncu exited {proc.returncode}: {proc.stderr[-2000:]}", file=sys.stderr)
            return []
        with open(log) as f:
            kernels = parse_ncu_csv(f.read())
    return writes_rows(split_cases(kernels), cases)


def _show(r: dict) -> None:
    if r["case"] == "time":
        took = f"{r['us']:8.1f} us" if r.get("status") == "ok" else r.get("status")
        print(f"B={r['B']:<2d} N_k={r['N_k']:<6d} {r['impl']:16s} after a {r['flush']} flush: {took}", flush=True)
    else:
        print(f"B={r['B']:<2d} N_k={r['N_k']:<6d} flash-decoding after a {r['flush']} flush: HBM read "
              f"{r['dram_read'] / 1e6:.1f} MB, written {r['dram_write'] / 1e6:.2f} MB", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench flush", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--no-counts", action="store_true", help="time only: leave ncu out")
    p.add_argument("--child", metavar="CASES", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child)
    import torch

    if not torch.cuda.is_available():
        print("flashref.bench flush needs a CUDA GPU", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    data = results.start(None, torch.cuda.get_device_name(), results.versions(), results.command("flush", given),
                         dtype="float16")
    add = results.recorder(data, args.out, show=_show)
    for row in times():
        add(row)
    if not args.no_counts:
        for row in writes():
            add(row)
    print(time_table(data))
    print(writes_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
