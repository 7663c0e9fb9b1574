"""HBM traffic counted by the hardware: every kernel of every attention implementation under Nsight Compute.

    python -m flashref.bench hbm            # the whole grid and the block-size sweep (an H100: minutes)
    python -m flashref.bench hbm --quick    # N in {1K, 4K, 16K}, d = 64, a short sweep

Notebook ``09_measured_io`` plots the committed result, ``book/data/hbm_bench.json``.

What is measured. Each case (an implementation, a pass, a shape) runs in a child process under ``ncu``,
which reads, for every kernel launched between ``torch.cuda.profiler.start()`` and ``stop()``:

- ``dram__bytes_read.sum``, ``dram__bytes_write.sum``: bytes between HBM and the L2 cache;
- ``lts__t_sectors_srcunit_tex_op_read.sum`` / ``_write.sum``: 32-byte sectors between the SMs and the
  L2, the traffic a kernel asks of memory before the L2 serves any of it (what ``flashref.hbm`` calls
  ``requested``);
- ``gpu__time_duration.sum``: the kernel's time under the profiler.

ncu serializes the launches and, by default, flushes the caches before each kernel, so every kernel
starts with a cold L2: reads include everything it needs from HBM, and a kernel's last writes may still sit
in the 50 MB L2 when it ends (they are then not counted as DRAM writes). Clocks are left as the GPU runs
them (``--clock-control none``). Whole-call times are measured apart from ncu, with ``do_bench``.

Implementations: ``plain`` (matmul, softmax, matmul in PyTorch, forward and backward through autograd,
kernel by kernel), ``flashref-triton`` (forward; backward: its three launches), ``sdpa-flash``,
``cupy-tiled`` and ``cupy-mma`` (forward). Triton tiles are pinned (:data:`TRITON_TILES`), so the counts
can be set beside :mod:`flashref.hbm`'s with the same tiles. The Figure 2 sweep runs the Triton forward
over (BLOCK_M, BLOCK_N) at one shape and reads each config's registers, spills and shared memory from the
compiled kernel.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from flashref.bench import results
from flashref.bench.results import flops

METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
           "lts__t_sectors_srcunit_tex_op_write.sum", "gpu__time_duration.sum"]
SHORT = {"dram__bytes_read.sum": "dram_read", "dram__bytes_write.sum": "dram_write",
         "lts__t_sectors_srcunit_tex_op_read.sum": "l2_read_sectors",
         "lts__t_sectors_srcunit_tex_op_write.sum": "l2_write_sectors", "gpu__time_duration.sum": "ns"}
MARKER = "hbm_case_marker"  # a tiny kernel launched first in each case's profiled range: it splits the log

FULL_N = [1024, 2048, 4096, 8192, 16384]
QUICK_N = [1024, 4096, 16384]
B, H = 1, 16  # 16 heads of one sequence: plain attention's N x N matrices stay within memory at N = 16K
IMPLS = {"plain": ("fwd", "bwd"), "flashref-triton": ("fwd", "bwd"), "sdpa-flash": ("fwd", "bwd"),
         "cupy-tiled": ("fwd",), "cupy-mma": ("fwd",)}
# Triton configs pinned per head dim (block_m, block_n, warps, stages), so the model can use the same tiles:
# the H100 candidates the autotuner lists first, except dK/dV at d = 128, where 32 x 128 with 4 warps holds
# dK and dV (2 x 128 x 128 fp32) in 128 threads and spills (measured apart: SPILL_CASE).
TRITON_TILES = {64: {"forward": (128, 64, 4, 3), "dkdv": (32, 128, 4, 3), "dq": (128, 32, 4, 3)},
                128: {"forward": (128, 64, 4, 3), "dkdv": (64, 128, 8, 3), "dq": (128, 32, 4, 3)}}
SPILL_CASE = {"kind": "spill", "impl": "flashref-triton", "mode": "bwd", "B": B, "H": H, "N": 4096, "d": 128,
              "causal": False, "tiles": {"forward": (128, 64, 4, 3), "dkdv": (32, 128, 4, 3), "dq": (128, 32, 4, 3)}}
SWEEP_SHAPE = {"B": 4, "H": 16, "N": 4096, "d": 64, "causal": False}
SWEEP_TILES = [(16, 16), (32, 16), (32, 32), (64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64),
               (128, 128), (256, 32), (256, 64), (256, 128)]


def cases(quick: bool = False) -> list[dict]:
    """Every measurement: the grid of implementations, passes and shapes, then the block-size sweep."""
    ns, ds = (QUICK_N, [64]) if quick else (FULL_N, [64, 128])
    grid = [{"kind": "grid", "impl": impl, "mode": mode, "B": B, "H": H, "N": n, "d": d, "causal": causal}
            for d in ds for causal in (False, True) for n in ns for impl, modes in IMPLS.items() for mode in modes]
    for case in grid:
        if case["impl"] == "flashref-triton":
            case["tiles"] = TRITON_TILES[case["d"]]
    tiles = SWEEP_TILES[::3] if quick else SWEEP_TILES
    sweep = [{"kind": "sweep", "impl": "flashref-triton", "mode": "fwd", **SWEEP_SHAPE, "block_m": bm, "block_n": bn}
             for bm, bn in tiles]
    for case in sweep:
        case["tiles"] = {"forward": _sweep_config(case)}
    return grid + sweep + ([] if quick else [SPILL_CASE])


# --------------------------------------------------------------------------------------------------
# The child: runs cases with the profiler range around exactly the launches to count
# --------------------------------------------------------------------------------------------------

def _sweep_config(case) -> tuple:
    bm, bn = case["block_m"], case["block_n"]
    return (bm, bn, 8 if bm >= 256 else 4, 2 if bm * bn >= 256 * 64 else 3)


def _pinned(case):
    """The Triton configs this case launches: ``{kernel: TileConfig}`` (none for the other implementations)."""
    from flashref.triton.configs import TileConfig

    return {name: TileConfig(*spec) for name, spec in case.get("tiles", {}).items()}


def _runner(case):
    """``(prepare, run)``: prepare() makes the inputs and runs everything that must stay outside the
    profiled range (compilation, autotuning, the forward whose backward is counted); run() is the call
    whose kernels are counted."""
    import torch

    from flashref.bench.gpu_bench import implementation

    fn = implementation(case["impl"])
    shape = (case["B"], case["H"], case["N"], case["d"])
    state = {}

    def prepare():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
        grad = case["mode"] == "bwd"
        for x in (q, k, v):
            x.requires_grad_(grad)
        state.clear()
        state.update(q=q, k=k, v=v, do=do)
        if grad:
            state["o"] = fn(q, k, v, case["causal"])
        torch.cuda.synchronize()

    def run():
        if case["mode"] == "bwd":
            state["o"].backward(state["do"], retain_graph=True)
        else:
            with torch.no_grad():
                fn(state["q"], state["k"], state["v"], case["causal"])

    return prepare, run


def case_marker():
    """A one-element Triton kernel named MARKER: its launch opens each case in ncu's log (:func:`split_cases`).
    Returns ``mark(i)``, which launches it with the case's index."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def hbm_case_marker(X, i):
        tl.store(X, i)

    buf = torch.zeros(1, device="cuda", dtype=torch.int32)
    assert hbm_case_marker.__name__ == MARKER
    return lambda i: hbm_case_marker[(1,)](buf, i)


def _resources(case) -> dict:
    """``{kernel: {registers, spills, shared}}``: registers per thread, bytes spilled to local memory and
    shared memory of each Triton kernel the case launches, compiled for this GPU as a launch compiles it."""
    import torch

    from flashref.triton.compile_check import compile_config

    major, minor = torch.cuda.get_device_capability()
    kernels = ["forward"] if case["mode"] == "fwd" else ["dkdv", "dq"]
    out = {}
    for name, config in _pinned(case).items():
        if name in kernels:
            compiled = compile_config(name, config, 10 * major + minor, case["d"], causal=case["causal"])
            compiled._init_handles()
            out[name] = {"registers": int(compiled.n_regs), "spills": int(compiled.n_spills),
                         "shared": int(compiled.metadata.shared)}
    return out


def child(case_file: str, result_file: str, profile: bool) -> int:
    """Run every case of ``case_file``: under ncu (``profile``), one profiled call each; otherwise time each
    call with do_bench and record peak memory. Results (one JSON line per case) go to ``result_file``."""
    import torch
    import triton

    from flashref.triton.ops import fixed_configs

    with open(case_file) as f:
        todo = json.load(f)
    mark = case_marker()
    mark(0)
    for i, case in enumerate(todo):
        row = {"index": i}
        try:
            with fixed_configs(**_pinned(case)):
                prepare, run = _runner(case)
                prepare()
                run()  # compile, and warm every cache outside the count
                prepare()
                if profile:
                    torch.cuda.profiler.start()
                    mark(i)
                    run()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                else:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    run()
                    torch.cuda.synchronize()
                    row["peak_extra_bytes"] = int(torch.cuda.max_memory_allocated() - base)
                    row["ms"] = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                    if case.get("tiles"):
                        try:
                            row["resources"] = _resources(case)
                        except Exception as exc:  # noqa: BLE001 (the timing stands without the report)
                            row["resources_error"] = f"{type(exc).__name__}: {exc}"[:200]
            row["status"] = "ok"
            row["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        except Exception as exc:  # noqa: BLE001 (a case that cannot run is recorded, the rest go on)
            oom = "out of memory" in str(exc).lower() or "OutOfResources" in type(exc).__name__
            row["status"] = ("OOM" if "memory" in str(exc).lower() else "out of resources") if oom else \
                f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        with open(result_file, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


# --------------------------------------------------------------------------------------------------
# The parent: ncu's log, split into cases
# --------------------------------------------------------------------------------------------------

def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's ``--csv --print-units base`` log as a list of kernels in launch order:
    ``{"id": int, "name": str, <metric>: float, ...}``. Lines before the CSV header (ncu's own messages and
    the program's output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID", "").isdigit():
            continue
        kernel = kernels.setdefault(int(row["ID"]), {"id": int(row["ID"]), "name": row["Kernel Name"]})
        value = row["Metric Value"].replace(",", "")
        try:
            kernel[row["Metric Name"]] = float(value)
        except ValueError:
            kernel[row["Metric Name"]] = None  # "n/a": the metric does not exist for this kernel
    return [kernels[i] for i in sorted(kernels)]


def split_cases(kernels: list[dict]) -> dict[int, list[dict]]:
    """Group the kernels after each marker launch: ``{case index: [kernel, ...]}``. The marker's own store
    writes the case index, but the index is read from the order: the n-th marker opens the n-th range."""
    out: dict[int, list[dict]] = {}
    current = None
    markers = 0
    for kernel in kernels:
        if MARKER in kernel["name"]:
            current = markers
            markers += 1
            out[current] = []
        elif current is not None:
            out[current].append(kernel)
    return out


def summarize(kernel: dict) -> dict:
    """One kernel's counters, named short; L2 sectors in bytes (32 each)."""
    row = {"name": kernel["name"]}
    for metric, short in SHORT.items():
        value = kernel.get(metric)
        if value is not None and short.startswith("l2_"):
            row[short.replace("_sectors", "_bytes")] = int(value * 32)
        elif value is not None:
            row[short] = int(value) if short != "ns" else float(value)
    return row


def ncu_path() -> str | None:
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)


def metric_names(ncu: str) -> set[str]:
    """The base names of the metrics this GPU's ncu knows (``ncu --query-metrics``). A metric asked for is one of
    them and a roll-up, ``dram__bytes_read`` + ``.sum``: :func:`knows`."""
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def knows(names: set[str], metric: str) -> bool:
    """Whether ``metric`` (a base name and its roll-up, ``sm__issue_active.avg.pct_of_peak_sustained_active``) is
    one of :func:`metric_names`' ``names``: a name ncu does not know would fail the whole run."""
    return metric.split(".", 1)[0] in names


def available_metrics(ncu: str) -> list[str]:
    """The METRICS this GPU's ncu knows."""
    names = metric_names(ncu)
    return [m for m in METRICS if knows(names, m)]


def _run_child(todo, profile, ncu=None, metrics=(), log=None):
    with tempfile.TemporaryDirectory() as tmp:
        case_file, result_file = os.path.join(tmp, "cases.json"), os.path.join(tmp, "results.jsonl")
        with open(case_file, "w") as f:
            json.dump(todo, f)
        cmd = [sys.executable, "-m", "flashref.bench.hbm_bench", "--child", case_file, result_file]
        env = dict(os.environ)
        if profile:
            ncu_log = os.path.join(tmp, "ncu.csv")
            cmd = [ncu, "--csv", "--print-units", "base", "--metrics", ",".join(metrics), "--profile-from-start",
                   "off", "--clock-control", "none", "--target-processes", "all", "--log-file", ncu_log,
                   *cmd, "--profile"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if log is not None:
            log.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        done = []
        if os.path.exists(result_file):
            with open(result_file) as f:
                done = [json.loads(line) for line in f if line.strip()]
        kernels = []
        if profile and os.path.exists(ncu_log):
            with open(ncu_log) as f:
                kernels = parse_ncu_csv(f.read())
        return proc.returncode, done, kernels


def ncu_versions(ncu):
    """:func:`flashref.bench.results.versions`, and ncu's and the driver's."""
    v = results.versions()
    v["ncu"] = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip()
    return v


def measure(todo, ncu, metrics, chunk=24, progress=True, log=None, checkpoint=None):
    """Profile and time ``todo`` in chunks of cases (one child process each, so one failure costs one chunk);
    ``checkpoint(rows)`` after each chunk, so a run cut short keeps what it measured."""
    from tqdm.auto import tqdm

    rows = [dict(case) for case in todo]
    bar = tqdm(total=2 * len(todo), desc="hbm bench", disable=not progress)
    for lo in range(0, len(todo), chunk):
        part = todo[lo:lo + chunk]
        code, done, kernels = _run_child(part, True, ncu, metrics, log)
        by_case = split_cases(kernels)
        for r in done:
            row = rows[lo + r["index"]]
            row["profile_status"] = r["status"] if code == 0 or r["status"] != "ok" else f"ncu exit {code}"
            row["kernels"] = [summarize(k) for k in by_case.get(r["index"], [])]
        bar.update(len(part))
        code, done, _ = _run_child(part, False, log=log)
        for r in done:
            row = rows[lo + r["index"]]
            row.update({k: v for k, v in r.items() if k != "index"})
        bar.update(len(part))
        if checkpoint is not None:
            checkpoint(rows)
    bar.close()
    return rows


_CASE_KEYS = ("kind", "impl", "mode", "B", "H", "N", "d", "causal", "block_m", "block_n", "tiles")


def _key(case) -> tuple:
    """A case's identity; the tiles (tuples in code, lists once saved) compared as text."""
    return tuple(json.dumps(case.get(k), sort_keys=True) for k in _CASE_KEYS)


def _measured(path) -> dict:
    """The cases of a saved run that were measured (profiled and timed): ``{key: row}``."""
    if not os.path.exists(path):
        return {}
    rows = results.load(os.path.basename(path), path)["results"]
    return {_key(r): r for r in rows if r.get("status") == "ok" and r.get("kernels")}


# --------------------------------------------------------------------------------------------------
# Reading a saved run (notebook 09_measured_io)
# --------------------------------------------------------------------------------------------------

# Kernels that are not the attention itself: CuPy's entry point checks its inputs for NaN and inf first
# (three small reductions per input); they are kept in the data and left out of the attention's counts.
INPUT_CHECK_KERNELS = ("cupy_isfinite", "cupy_cub_all")
# H100 SXM: dense fp16 tensor-core peak and HBM3 bandwidth, from NVIDIA's datasheet.
H100_PEAK_FLOPS, H100_HBM_BYTES_PER_S = 989e12, 3.35e12


def load_results(path=None) -> dict:
    """The committed run, book/data/hbm_bench.json (or ``path``), read by :func:`flashref.bench.results.load`
    (on Colab: the copy in the course repository)."""
    return results.load("hbm_bench.json", path)


def find(data: dict, impl: str, mode: str, N: int, d: int, causal: bool = False, kind: str = "grid", **tiles) -> dict:
    """The one measured case with these parameters (``block_m=``, ``block_n=`` for the sweep)."""
    want = {"kind": kind, "impl": impl, "mode": mode, "N": N, "d": d, "causal": causal, **tiles}
    rows = [r for r in data["results"] if all(r.get(k) == v for k, v in want.items())]
    if len(rows) != 1:
        raise KeyError(f"{len(rows)} cases match {want}")
    return rows[0]


def attention_kernels(row: dict) -> list[dict]:
    """The kernels of a case, without the CuPy input checks."""
    return [k for k in row["kernels"] if not k["name"].startswith(INPUT_CHECK_KERNELS)]


def totals(row: dict) -> dict:
    """Bytes (DRAM read/write, L2 read/write) and nanoseconds summed over the attention kernels of a case."""
    keys = ("dram_read", "dram_write", "l2_read_bytes", "l2_write_bytes", "ns")
    out = {k: sum(kernel.get(k, 0) for kernel in attention_kernels(row)) for k in keys}
    out["dram"] = out["dram_read"] + out["dram_write"]
    out["l2"] = out["l2_read_bytes"] + out["l2_write_bytes"]
    return out


def kernel_flops(kernel: dict, B: int, H: int, N: int, d: int, causal: bool) -> float:
    """The floating-point work of one measured kernel (a row of a case's ``kernels``), counted from its
    name, not read from a counter: a matrix product of PyTorch's plain path is 2 N^2 d per head (cuBLAS
    computes the whole product, causal or not); the fused kernels compute as many N x N x d products as
    they hold (forward 2, dK/dV 4, dQ 3, SDPA's fused backward 5), halved when causal; an element-wise or
    softmax kernel is one FLOP per element it writes (its fp16 output bytes / 2, which also covers PyTorch
    splitting one operation over 2^31 elements into several launches): a few operations per element would
    change nothing, these kernels sit far left on the roofline. Small kernels (the backward's
    D = rowsum(dO * O), copies, fills) count 0."""
    name = kernel["name"]
    product = flops(B, H, N, N, d, causal) / 2  # the forward's count (results.flops) holds two products
    products = {"flash_fwd_kernel": 2, "flash_tiled_forward": 2, "flash_mma_forward": 2,
                "flash_bwd_dkdv_kernel": 4, "flash_bwd_dq_kernel": 3, "flash_bwd_dq_dk_dv": 5}
    for key, count in products.items():
        if key in name:
            return count * product
    if "nvjet" in name or "gemm" in name:
        return flops(B, H, N, N, d, False) / 2
    if any(key in name for key in ("SoftMax", "masked_", "AUnaryFunctor", "BinaryFunctor")):
        return kernel.get("l2_write_bytes", 0) / 2
    return 0.0


def add_resources(path) -> int:
    """Compile, for this GPU, the Triton kernels of every saved case that has tiles but no resource report,
    and record registers, spills and shared memory (a property of the compiled code, so no re-measurement)."""
    import torch

    data = results.load(os.path.basename(path), path)
    if torch.cuda.get_device_name() != data["device"]:
        print(f"{path} was measured on {data['device']}, this is {torch.cuda.get_device_name()}", file=sys.stderr)
        return 2
    added = 0
    for row in data["results"]:
        if row.get("tiles") and "resources" not in row:
            row["resources"] = _resources(row)
            added += 1
    results.save(data, path)
    print(f"added the resource report to {added} cases of {path}")
    return 0


def _previous_runs(path) -> list:
    if not os.path.exists(path):
        return []
    old = results.load(os.path.basename(path), path)
    return old.get("runs") or [{"command": old.get("command"), "cases": len(old["results"]), "started": None}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench hbm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"N in {QUICK_N}, d = 64, a third of the sweep")
    p.add_argument("--out", default="book/data/hbm_bench.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep the cases --out already holds; measure the rest")
    p.add_argument("--resources", action="store_true",
                   help="only add the compiler's resource report to saved Triton cases that lack it (no profiling)")
    p.add_argument("--child", nargs=2, metavar=("CASES", "RESULTS"), help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(*args.child, profile=args.profile)

    import torch

    if args.resources:
        return add_resources(args.out)
    ncu = ncu_path()
    if not torch.cuda.is_available() or ncu is None:
        print("flashref.bench hbm needs a CUDA device and Nsight Compute (ncu) on the PATH", file=sys.stderr)
        return 2
    metrics = available_metrics(ncu)
    start = time.time()
    todo = cases(args.quick)
    data = results.start(None, torch.cuda.get_device_name(), ncu_versions(ncu),
                         "python -m flashref.bench hbm" + (" --quick" if args.quick else ""),
                         capability=list(torch.cuda.get_device_capability()),
                         l2_bytes=int(torch.cuda.get_device_properties(0).L2_cache_size),
                         python=platform.python_version(), dtype="float16", metrics=metrics,
                         ncu_options="--cache-control all (default: caches flushed before each kernel), "
                                     "--clock-control none, --profile-from-start off",
                         triton_tiles=TRITON_TILES, complete=False)

    done = _measured(args.out) if args.resume else {}
    rest = [case for case in todo if _key(case) not in done]
    this_run = {"command": data["command"] + (" --resume" if args.resume else ""), "cases": len(rest),
                "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    data["runs"] = (_previous_runs(args.out) if args.resume else []) + [this_run]

    def checkpoint(rows):
        ordered = [done.get(_key(case)) or next(r for r in rows if _key(r) == _key(case)) for case in todo
                   if _key(case) in done or any(_key(r) == _key(case) for r in rows)]
        results.save({**data, "results": ordered, "seconds": time.time() - start}, args.out)

    with open(os.path.splitext(args.out)[0] + ".log", "a" if args.resume else "w") as log:
        rows = measure(rest, ncu, metrics, progress=not args.no_progress, log=log, checkpoint=checkpoint)
    data["complete"] = all(r.get("status") == "ok" and r.get("kernels") for r in rows)
    checkpoint(rows)
    data["seconds"] = time.time() - start
    rows = _measured(args.out)
    ok = sum(r.get("status") == "ok" and bool(r.get("kernels")) for r in rows.values())
    print(f"wrote {args.out}: {ok} of {len(todo)} cases measured, in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
