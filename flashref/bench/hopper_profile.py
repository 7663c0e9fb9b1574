"""Where the Hopper kernels' time goes, read from the hardware: Nsight Compute's counters for flashref's Gluon
forward and backward kernels beside cuDNN's and FlashAttention-2's (SDPA's backends), at the goals table's shapes,
its FP8 forward beside its fp16 one, and its forward and one-kernel backward with dropout beside the same without.

    python -m flashref.bench hopper-profile [--parts fwd bwd fp8 dropout] [--append]    # an H100 with ncu: minutes

Notebook ``14_flashattention3_on_hopper`` reads the committed result, ``book/data/hopper_profile.json``, where the
forward and the backward miss cuDNN, and where FP8 misses 1.5x the fp16 forward; notebook
``10_dropout_masks_sparsity`` reads what dropout costs the kernels. The backward's rows profile flashref's dK/dV
and dQ kernels one at a time (and the dK/dV kernel a second time with its row statistics loaded from global memory,
:data:`IMPLS`), and the peers' whole backward. What is read, per kernel (the largest one a call launches;
:data:`METRICS`):

- the share of the SM's cycles that the tensor cores are busy (wgmma included), and that the FMA and ALU pipes
  are; the XU pipe's instructions (``MUFU.EX2``: the exponentials) against its peak rate;
- the share of cycles a warp scheduler issues an instruction (``issue_active``), and the warps resident;
- where the warps' cycles go: every ``smsp__warp_issue_stalled_*`` state this ncu knows, as a share of the
  warps' active cycles. A warp is in one state at a time (``selected``: it issues), so they add up to 100%.

ncu serializes launches and replays each kernel once per group of counters (caches flushed before each pass);
clocks are left as the GPU runs them (``--clock-control none``). The times in the file are ncu's, of the
profiled launch, not the benchmark's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from flashref.bench import results
from flashref.bench.hbm_bench import (case_marker, knows, metric_names, ncu_path, ncu_versions, parse_ncu_csv,
                                      split_cases)

DEFAULT_OUT = "book/data/hopper_profile.json"
PCT = ".avg.pct_of_peak_sustained_active"
#: Short name -> ncu metric. A name this ncu does not know is left out of the run (:func:`available`).
METRICS = {
    "ns": "gpu__time_duration.sum",
    # On Hopper the "hmma" pipe counter counts wgmma's cycles too (cuDNN's wgmma kernels read 70-80% on it).
    "tensor": "sm__pipe_tensor_op_hmma_cycles_active" + PCT,
    "xu": "sm__inst_executed_pipe_xu" + PCT,  # MUFU instructions issued, against the pipe's peak rate
    "fma": "sm__pipe_fma_cycles_active" + PCT,
    "alu": "sm__pipe_alu_cycles_active" + PCT,
    "issue_active": "smsp__issue_active" + PCT,
    "warps_active": "sm__warps_active" + PCT,
    "registers": "launch__registers_per_thread",
}
STALL_PREFIX, STALL_SUFFIX = "smsp__warp_issue_stalled_", "_per_warp_active"
# The goals table's shapes (hopper_bench's grid): B x N = 65536 tokens, H x d = 2048.
SHAPES = [(65536 // n, 2048 // d, n, d) for d in (64, 128) for n in (4096, 16384)]
#: Each part's implementations. The backward's: flashref's Gluon dK/dV kernel (its row statistics by TMA), the same
#: kernel loading them from global memory, the Gluon dQ kernel, and the peers' backward. FP8's: the fp16 forward and
#: the FP8 one on inputs already in e4m3 (hopper_bench's ``flashref-hopper-fp8`` row), side by side.
IMPLS = {"fwd": ("flashref-hopper", "sdpa-cudnn", "sdpa-flash"),
         "bwd": ("flashref-hopper dK/dV", "flashref-hopper dK/dV, statistics loaded", "flashref-hopper dQ",
                 "sdpa-cudnn", "sdpa-flash"),
         "fp8": ("flashref-hopper", "flashref-hopper fp8"),
         "dropout": ("flashref-hopper", "flashref-hopper dropout", "flashref-hopper fused",
                     "flashref-hopper fused dropout")}
PARTS = tuple(IMPLS)
#: FP8 adds hopper_bench's d = 256 point, the one head dim where FP8 reaches 1.5x the fp16 forward. Dropout's part
#: profiles the forward and the one-kernel backward (``deterministic=False``) with and without dropout at the
#: features bench's dropout shape (notebook 10: B 8, H 16, N 4K, d 64, p = 0.1).
SHAPES_OF = {"fwd": SHAPES, "bwd": SHAPES, "fp8": SHAPES + [(8, 8, 4096, 256)], "dropout": [(8, 16, 4096, 64)]}
DROPOUT_P, DROPOUT_SEED = 0.1, 7


def cases(parts=PARTS) -> list[dict]:
    return [dict(impl=impl, part=part, B=B, H=H, N=N, d=d, causal=causal)
            for part in parts for B, H, N, d in SHAPES_OF[part] for causal in (False, True) for impl in IMPLS[part]]


def part_of(row: dict) -> str:
    """A row's part, one of :data:`PARTS` (rows of the first runs, forward only, do not say)."""
    return row.get("part", "fwd")


def available(ncu: str) -> tuple[dict, list[str]]:
    """(:data:`METRICS` this ncu knows, every stall reason it knows as a metric name)."""
    names = metric_names(ncu)
    known = {short: m for short, m in METRICS.items() if knows(names, m)}
    stalls = sorted(n + ".pct" for n in names if n.startswith(STALL_PREFIX) and n.endswith(STALL_SUFFIX))
    return known, stalls


def _ready(case: dict, q, k, v, do):
    """The case's call, ready to run once: a forward, or one backward whose forward (and, for flashref's kernels, row
    statistics and D) were computed here, outside the profiled range."""
    from flashref.bench.gpu_bench import sdpa
    from flashref.triton import flash_attention_forward, hopper, hopper_backward, ops

    impl, causal = case["impl"], case["causal"]
    if impl == "flashref-hopper fp8":
        from flashref.bench.hopper_bench import fp8_on_quantized

        return fp8_on_quantized(q, k, v, causal)
    if part_of(case) in ("fp8", "dropout") and impl == "flashref-hopper":  # without the input checks' launches
        return lambda: hopper.hopper_forward(q, k, v, causal, check_finite=False)
    if part_of(case) == "dropout":
        return _dropout_call(impl, q, k, v, do, causal)
    if part_of(case) == "fwd":
        fn = (lambda q, k, v, causal: hopper.hopper_forward(q, k, v, causal)) if impl == "flashref-hopper" \
            else sdpa(impl)
        return lambda: fn(q, k, v, causal)
    if impl.startswith("flashref-hopper"):
        o, lse = flash_attention_forward(q, k, v, causal, check_finite=False)
        m2, l2 = ops._stats_from_lse(lse)
        delta = ops._delta(o, do)
        scale = q.shape[-1] ** -0.5
        if impl == "flashref-hopper dQ":
            return lambda: hopper_backward.hopper_dq(q, k, v, do, m2, l2, delta, causal, scale)
        tma = impl == "flashref-hopper dK/dV"
        return lambda: hopper_backward.hopper_dkdv(q, k, v, do, m2, l2, delta, causal, scale, stats_tma=tma)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    o = sdpa(impl)(qq, kk, vv, causal)
    return lambda: o.backward(do)


def _dropout_call(impl: str, q, k, v, do, causal: bool):
    """Dropout's part: the Gluon forward on :func:`~flashref.triton.hopper.dropout_config`'s tile (as
    ``flash_attention`` runs it), or the one-kernel backward with or without the mask, fed by the matching forward."""
    from flashref.triton import flash_attention_forward, hopper, hopper_backward_fused, ops
    from flashref.triton.forward import drop_threshold

    scale = q.shape[-1] ** -0.5
    dropout = (DROPOUT_SEED, drop_threshold(DROPOUT_P), 1 / (1 - DROPOUT_P)) if impl.endswith("dropout") else None
    if impl == "flashref-hopper dropout":
        cfg = hopper.dropout_config(q.shape[-1])
        return lambda: hopper.launch_forward(q, k, v, causal, scale, cfg, dropout=dropout)
    kw = dict(dropout_p=DROPOUT_P, seed=DROPOUT_SEED) if dropout else {}
    o, lse = flash_attention_forward(q, k, v, causal, check_finite=False, **kw)
    m2, l2 = ops._stats_from_lse(lse)
    delta = ops._delta(o, do)
    return lambda: hopper_backward_fused.hopper_fused_backward(q, k, v, do, m2, l2, delta, causal, scale,
                                                               dropout=dropout)


def child(case_file: str) -> int:
    """Under ncu: each case's call once outside the profiled range (compile, autotune, warm-up), then once inside
    it behind a marker launch."""
    import torch

    with open(case_file) as f:
        todo = json.load(f)
    marker = case_marker()
    for i, case in enumerate(todo):
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(case["B"], case["H"], case["N"], case["d"], device="cuda", dtype=torch.float16)
                       for _ in range(4))
        _ready(case, q, k, v, do)()
        run = _ready(case, q, k, v, do)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        marker(i)
        run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


def summarize(kernels: list[dict], known: dict, stalls: list[str]) -> dict:
    """The longest kernel of a call, its metrics under their short names and its stall reasons by name."""
    kernel = max(kernels, key=lambda k: k.get(METRICS["ns"]) or 0)
    row = {"kernel": kernel["name"][:120],
           "launches": [[k["name"][:60], k.get(METRICS["ns"])] for k in kernels]}  # the call's every kernel
    for short, metric in known.items():
        if kernel.get(metric) is not None:
            row[short] = kernel[metric]
    row["stalls"] = {s[len(STALL_PREFIX):-len(STALL_SUFFIX + ".pct")]: kernel[s] for s in stalls
                     if kernel.get(s) is not None}
    return row


def measure(todo: list[dict], ncu: str, log=None) -> list[dict]:
    known, stalls = available(ncu)
    with tempfile.TemporaryDirectory() as tmp:
        case_file, ncu_log = os.path.join(tmp, "cases.json"), os.path.join(tmp, "ncu.csv")
        with open(case_file, "w") as f:
            json.dump(todo, f)
        cmd = [ncu, "--csv", "--print-units", "base", "--metrics", ",".join([*known.values(), *stalls]),
               "--profile-from-start", "off", "--clock-control", "none", "--target-processes", "all",
               "--log-file", ncu_log, sys.executable, "-m", "flashref.bench.hopper_profile", "--child", case_file]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if log is not None:
            log.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        with open(ncu_log) as f:
            by_case = split_cases(parse_ncu_csv(f.read()))
    rows = []
    for i, case in enumerate(todo):
        kernels = by_case.get(i, [])
        rows.append(dict(case, **(summarize(kernels, known, stalls) if kernels else {"status": "not profiled"})))
    return rows


def load_results(path=None) -> dict:
    """The committed profile (``book/data/hopper_profile.json``), or the file at ``path``."""
    return results.load(os.path.basename(DEFAULT_OUT), path)


def top_stalls(row: dict, n: int = 3) -> list[tuple[str, float]]:
    """The row's n largest stall reasons, largest first."""
    return sorted(row.get("stalls", {}).items(), key=lambda kv: -kv[1])[:n]


def table(data: dict, part: str = "fwd") -> str:
    """Markdown: per shape and kernel of ``part`` (one of :data:`PARTS`), ncu's time, the pipes' busy shares, issue
    slots and the top stalls."""
    lines = ["| d | N | causal | kernel | us (ncu) | tensor cores | XU (exp2) | FMA | ALU | issue | top stalls |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        if "ns" not in r or part_of(r) != part:
            continue
        stalls = ", ".join(f"{name} {pct:.0f}%" for name, pct in top_stalls(r))
        cells = [f"{r.get(k, float('nan')):.0f}%" for k in ("tensor", "xu", "fma", "alu", "issue_active")]
        lines.append(f"| {r['d']} | {r['N'] // 1024}K | {'yes' if r['causal'] else 'no'} | {r['impl']} | "
                     f"{r['ns'] / 1e3:.0f} | " + " | ".join(cells) + f" | {stalls} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench hopper-profile", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the passes to profile")
    p.add_argument("--append", action="store_true",
                   help="keep the other parts' rows of the file at --out (replace only these parts')")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    ncu = ncu_path()
    if ncu is None:
        print("hopper-profile needs Nsight Compute (ncu) and an sm_90 GPU", file=sys.stderr)
        return 2
    import torch

    started = time.time()
    known, stalls = available(ncu)
    given = sys.argv[1:] if argv is None else argv
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), ncu_versions(ncu),
                         results.command("hopper-profile", [a for a in given if a != "--append"]),
                         dtype="float16", metrics=[*known.values(), *stalls],
                         ncu_options="--clock-control none, --profile-from-start off, caches flushed before each "
                                     "pass (ncu's default)")
    rows = measure(cases(args.parts), ncu, log=sys.stderr)
    data["results"] = [r for r in data["results"] if part_of(r) not in args.parts] + rows  # (--append keeps others)
    data["seconds"] = (data["seconds"] or 0) + time.time() - started
    results.save(data, args.out)
    for part in args.parts:
        print(table(data, part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
