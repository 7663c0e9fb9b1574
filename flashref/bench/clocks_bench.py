"""The SM clock and the board's power while each forward runs back to back: cycles, not only milliseconds.

    python -m flashref.bench clocks [--append]     # an H100 with nvidia-smi: about two minutes

A kernel's time is the cycles it takes over the clock it gets. An H100 SXM runs up to 1980 MHz but holds its
board under 700 W: a kernel that draws more power at a given clock is clocked lower. So two kernels can take
the same time in different numbers of cycles, and a kernel that needs fewer cycles than another can still be
slower, which Nsight Compute's one-launch-at-a-time profile (``python -m flashref.bench hopper-profile``) does
not see. Here ``nvidia-smi`` samples ``clocks.sm`` and ``power.draw`` every :data:`SAMPLE_MS` ms in the
background while one implementation is timed by ``do_bench`` windows for :data:`SECONDS` seconds; a row holds
the median time a call, the median clock and power (the samples of the first 0.3 s left out) and the cycles a
call takes, time x clock. Forward only, fp16, the goals table's points at N = 4K (:data:`POINTS`): flashref's
Hopper forward at its defaults, SDPA's cuDNN and flash backends, in :data:`ROUNDS` interleaved rounds.

Results go to ``book/data/clocks_bench.json`` (:func:`load_results`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from flashref.bench import results

DEFAULT_OUT = "book/data/clocks_bench.json"
POINTS = [(d, 4096, causal) for d in (64, 128) for causal in (False, True)]
IMPLS = ("flashref-hopper", "sdpa-cudnn", "sdpa-flash")
SECONDS = 3.0
SAMPLE_MS = 20
ROUNDS = 2
#: Samples dropped from the start of each window: the clock settles after the GPU leaves idle.
SETTLE_S = 0.3


def parse_samples(text: str, skip: int = 0) -> list[tuple[float, float]]:
    """``(MHz, W)`` pairs from ``nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits``
    output, one line a sample, after the first ``skip``; lines that do not hold two numbers (``[N/A]``, an
    error) are left out."""
    samples = []
    for line in text.strip().splitlines()[skip:]:
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz, watts = float(parts[0]), float(parts[1])
        except (IndexError, ValueError):
            continue
        samples.append((mhz, watts))
    return samples


def sampled(fn, seconds: float = SECONDS) -> dict:
    """Time ``fn`` by ``do_bench`` windows for ``seconds`` while nvidia-smi samples the clock and the power:
    ``{ms, sm_mhz, watts, samples}`` (medians). Raises RuntimeError when nvidia-smi gives no sample."""
    import triton

    log = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        time.sleep(SETTLE_S)
        started, times = time.time(), []
        while time.time() - started < seconds:
            times.append(triton.testing.do_bench(fn, warmup=5, rep=300))
    finally:
        log.terminate()
    samples = parse_samples(log.communicate()[0], skip=int(SETTLE_S * 1000 / SAMPLE_MS))
    if not samples:
        raise RuntimeError("nvidia-smi gave no clock or power sample")
    return {"ms": statistics.median(times), "sm_mhz": statistics.median(m for m, _ in samples),
            "watts": statistics.median(w for _, w in samples), "samples": len(samples)}


def _forward(impl: str, causal: bool):
    from flashref.bench.gpu_bench import sdpa
    from flashref.triton import hopper

    if impl == "flashref-hopper":
        return lambda q, k, v: hopper.hopper_forward(q, k, v, causal, check_finite=False)
    fn = sdpa(impl)
    return lambda q, k, v: fn(q, k, v, causal)


def cases(points=POINTS, impls=IMPLS, rounds: int = ROUNDS):
    """Rows ``{case: "clocks", impl, round, B, H, N, d, causal, ms, tflops, sm_mhz, watts, mcycles, samples}``,
    the implementations interleaved within each round."""
    import torch

    for d, N, causal in points:
        B, H = 65536 // N, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        work = results.flops(B, H, N, N, d, causal)
        fns = {impl: _forward(impl, causal) for impl in impls}
        for fn in fns.values():
            fn(q, k, v)  # compiled and tuned before any window
        torch.cuda.synchronize()
        for rnd in range(rounds):
            for impl, fn in fns.items():
                got = sampled(lambda: fn(q, k, v))
                yield {"case": "clocks", "impl": impl, "round": rnd, "B": B, "H": H, "N": N, "d": d,
                       "causal": causal, **got, "tflops": work / (got["ms"] * 1e-3) / 1e12,
                       "mcycles": got["ms"] * got["sm_mhz"] / 1e3}  # ms x MHz / 1e3: millions of cycles
        del q, k, v
        torch.cuda.empty_cache()


def load_results(path: str | None = None) -> dict:
    """The committed run (``book/data/clocks_bench.json``), or ``path``'s."""
    return results.load("clocks_bench.json", path)


def table(data: dict, against: str = "sdpa-cudnn") -> str:
    """One line a point and implementation: the medians over the rounds of the time a call, the clock, the
    power and the cycles a call; and ``against``'s time and cycles over this one's (above 1: this one is
    faster, or needs fewer cycles)."""
    rows = [r for r in data["results"] if r["case"] == "clocks"]
    by = {}
    for r in rows:
        by.setdefault((r["d"], r["N"], r["causal"], r["impl"]), []).append(r)

    def med(key, field):
        return statistics.median(r[field] for r in by[key])

    lines = [f"{'d':>3s} {'N':>6s} {'causal':>6s} {'impl':16s} {'ms':>7s} {'MHz':>6s} {'W':>5s} {'Mcycles':>8s}"
             f"   {'time x':>6s} {'cycles x':>8s}  (x {against})"]
    for key in sorted(by, key=lambda k: (k[0], k[1], k[2], k[3] != "flashref-hopper", k[3])):
        d, N, causal, impl = key
        base = (d, N, causal, against)
        ratio = ""
        if base in by:
            ratio = f"   {med(base, 'ms') / med(key, 'ms'):6.2f} {med(base, 'mcycles') / med(key, 'mcycles'):8.2f}"
        lines.append(f"{d:3d} {N:6d} {causal!s:>6s} {impl:16s} {med(key, 'ms'):7.3f} {med(key, 'sm_mhz'):6.0f} "
                     f"{med(key, 'watts'):5.0f} {med(key, 'mcycles'):8.2f}{ratio}")
    return "\n".join(lines)


def _print(r: dict) -> None:
    print(f"d={r['d']:<3d} N={r['N']:<5d} causal={r['causal']!s:5s} round {r['round']} {r['impl']:16s} "
          f"{r['ms']:7.3f} ms  SM {r['sm_mhz']:5.0f} MHz  {r['watts']:4.0f} W  {r['mcycles']:6.2f} Mcycles",
          flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench clocks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (same GPU and versions), replacing them")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("flashref.bench clocks needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(),
                         results.command("clocks", [a for a in given if a != "--append"]), dtype="float16")
    add = results.recorder(data, args.out, show=_print, group=lambda row: row["case"])
    for row in cases():
        add(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
