"""FlashAttention-3's ideas on Hopper, one switch at a time, beside PyTorch's attention in the same run.

    python -m flashref.bench hopper            # the grid below, about 3 minutes on an H100

Forward only, fp16, B x N = 65536 tokens and H x d = 2048 (d = 64 and 128; N = 4K and 16K; causal and not),
plus the issue's d = 256 case (B 8, H 8, N 4096). For each point: SDPA's flash (FlashAttention-2) and cuDNN
backends, flashref's teaching Triton kernel (:func:`flashref.triton.flash_attention_forward`, autotuned), and
the Gluon kernel of :mod:`flashref.triton.hopper` in the steps of :data:`STEPS`, each adding one switch.
Results go to ``book/data/hopper_bench.json`` with the device, versions and command (:func:`load_results`).
"""

from __future__ import annotations

import argparse
import sys

from flashref.bench import results
from flashref.bench.gpu_bench import sdpa
from flashref.bench.features_bench import _time  # one timer for the suites: peak memory, then do_bench
from flashref.bench.results import flops

#: The Gluon kernel's steps: (name, switches of :func:`flashref.triton.hopper.hopper_forward`).
STEPS = [
    ("TMA + wgmma, one K/V tile at a time",
     dict(block_m=128, block_n=128, num_warps=8, stages=1, warp_specialize=False)),
    ("+ a ring of 3 TMA stages", dict(block_m=128, block_n=128, num_warps=8, stages=3, warp_specialize=False)),
    ("+ intra-warpgroup overlap, as written",
     dict(block_m=128, block_n=128, num_warps=8, stages=3, overlap=True, warp_specialize=False)),
    ("smaller programs, several an SM", dict(warp_specialize=False)),
    ("warp specialization: a producer warp, two consumer warpgroups", dict(warp_specialize=True, pingpong=False)),
    ("+ ping-pong between the consumers", dict(warp_specialize=True, pingpong=True)),
]
#: The steps measured at d = 256 (the 128 x 128 tiles of the first three do not fit its shared memory).
STEPS_D256 = STEPS[3:]
GRID = [(d, N, causal) for d in (64, 128) for N in (4096, 16384) for causal in (False, True)]


def load_results() -> dict:
    """The committed run (``book/data/hopper_bench.json``)."""
    return results.load("hopper_bench.json")


def cases(grid=GRID, d256=True):
    """Rows ``{case, impl, step, switches, B, H, N, d, causal, ms, tflops, peak_extra_bytes}`` of every point
    of ``grid``."""
    import torch

    from flashref.triton import flash_attention_forward, hopper

    points = [(65536 // N, 2048 // d, N, d, causal) for d, N, causal in grid]
    if d256:
        points += [(8, 8, 4096, 256, False), (8, 8, 4096, 256, True)]
    for B, H, N, d, causal in points:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        work = flops(B, H, N, N, d, causal)
        impls = [(name, None, lambda fn=sdpa(name): fn(q, k, v, causal)) for name in ("sdpa-flash", "sdpa-cudnn")]
        impls.append(("flashref-triton", None, lambda: flash_attention_forward(q, k, v, causal)))
        steps = STEPS if d <= 128 else STEPS_D256
        impls += [("flashref-hopper", (step, sw), lambda sw=sw: hopper.hopper_forward(q, k, v, causal, **sw))
                  for step, sw in steps]
        for impl, step, fn in impls:
            ms, peak = _time(fn, False, None)
            yield {"case": "fwd", "impl": impl, "step": step[0] if step else None,
                   "switches": hopper.config(d, **step[1]) if step else None,
                   "B": B, "H": H, "N": N, "d": d, "causal": causal, "ms": ms, "tflops": work / (ms * 1e-3) / 1e12,
                   "peak_extra_bytes": peak}
        del q, k, v
        torch.cuda.empty_cache()


def _print(r):
    what = r["impl"] + (f" [{r['step']}]" if r["step"] else "")
    print(f"d={r['d']:<3d} N={r['N']:<5d} causal={r['causal']!s:5s} {what:62s} {r['ms']:8.3f} ms "
          f"{r['tflops']:6.1f} TFLOP/s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench hopper", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="book/data/hopper_bench.json")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("flashref.bench hopper needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    data = results.start(None, torch.cuda.get_device_name(), results.versions(), results.command("hopper", argv),
                         dtype="float16")
    add = results.recorder(data, args.out, show=_print)  # saved after each row: a run cut short keeps what it measured
    for row in cases():
        add(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
