"""Where a training step's GPU time goes, kernel by kernel: the GPT of notebook ``11_attention_in_a_model`` with
SDPA's attention and with flashref's, eager and replayed from CUDA graphs (``torch.compile(mode=
"reduce-overhead")``), profiled over a few steps.

    python -m flashref.bench step-profile [--T 4096] [--batch 4] [--append]     # a GPU: about a minute

``python -m flashref.bench model --parts speed`` measures attention's share of a step and which kernels did the
attention; this names every kernel of the whole step, with its GPU time a step, and adds them up by kind
(:func:`kernel_group`): attention's own kernels, the copies (most of them change a tensor's layout), matrix
products, and the rest. Two models that differ only in their attention differ mostly in the first two groups,
so the table says how much of a gap between them is the attention kernels and how much the copies around them
(flashref's kernels read and write contiguous (B, H, N, d) rows, where a model's projections give (B, N, H, d)
buffers).

A row (one attention and mode): ``step_ms`` (wall clock a step, model_bench's timing), ``kernels_us`` (the GPU
time of every kernel a step), ``groups`` (microseconds a step of each group) and ``top`` (the
:data:`TOP` longest kernels as ``[name, microseconds a step, group]``). Results go to
``book/data/step_profile.json`` (:func:`load_results`)."""

from __future__ import annotations

import argparse
import sys

from flashref.bench import model_bench, results

DEFAULT_OUT = "book/data/step_profile.json"
ATTENTIONS = ("sdpa", "flashref")
MODES = ("eager", "reduce-overhead")
STEPS = 5  # profiled steps, after model_bench's timed ones
TOP = 20
GROUPS = ("attention", "copies", "matrix products", "other")

#: Substrings of kernel names, per group, tried in this order (the first match wins; case ignored). Attention:
#: flashref's Gluon (``hopper_*``) and teaching (``flash_fwd``/``flash_bwd``, the D = rowsum(dO * O) pass
#: included) kernels and the backward's padded statistics, SDPA's cuDNN, flash and efficient kernels with cuDNN's
#: helpers. Copies: PyTorch's copy kernel (``.contiguous()``, a transpose's or reshape's copy; not the dtype
#: casts of autocast, which are other kernels) and Inductor's fused kernels whose name says they transpose, clone
#: or concatenate. Matrix products: cuBLAS and its Hopper kernels (``nvjet``), CUTLASS.
PATTERNS = (
    ("attention", ("hopper_", "flash_fwd", "flash_bwd", "flash_decode", "_padded_stats", "sdpa", "fmha",
                   "flash_attn", "compute_dot_do_o", "convert_dq")),
    ("copies", ("direct_copy_kernel", "transpose", "clone", "fused_cat", "_cat_")),
    ("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "splitkreduce")),
)


def kernel_group(name: str) -> str:
    """The group of :data:`GROUPS` a kernel named ``name`` counts in (:data:`PATTERNS`; "other" when none
    matches). Matching ignores case."""
    lower = name.lower()
    for group, parts in PATTERNS:
        if any(part.lower() in lower for part in parts):
            return group
    return "other"


def summarize(kernels: dict) -> dict:
    """``kernels`` ({name: microseconds a step}) as a row's ``kernels_us``, ``groups`` and ``top``."""
    groups = dict.fromkeys(GROUPS, 0.0)
    for name, us in kernels.items():
        groups[kernel_group(name)] += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP]
    return {"kernels_us": sum(kernels.values()), "groups": groups,
            "top": [[name[:160], us, kernel_group(name)] for name, us in top]}


def profile_step(attention: str, mode: str, T: int, B: int, steps: int = STEPS) -> dict:
    """One row: the model with ``attention``, ``mode`` "eager" or a ``torch.compile`` mode, batch ``B`` of ``T``
    tokens; each kernel's GPU time is summed over ``steps`` profiled steps under the CPU event that launched it
    (a CUDA graph's replay lists the graph's kernels under its launch), so no kernel counts twice."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = model_bench._trainer(model_bench._build(attention, T), B, T, compiled=None if mode == "eager" else mode)
    ms = model_bench._step_time(step)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == DeviceType.CPU:
            for kernel in event.kernels:
                kernels[kernel.name] = kernels.get(kernel.name, 0.0) + kernel.duration / steps
    del step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"attention": attention, "mode": mode, "T": T, "batch": B, "step_ms": ms, **summarize(kernels)}


def cases(T: int, B: int):
    for attention in ATTENTIONS:
        for mode in MODES:
            yield profile_step(attention, mode, T, B)


def table(data: dict) -> str:
    """One line a row: wall-clock ms a step, the kernels' GPU ms, and each group's."""
    head = f"{'attention':9} {'mode':16} {'T':>6} {'B':>3} {'step ms':>8} {'kernels ms':>11} " + " ".join(
        f"{g:>16}" for g in GROUPS)
    lines = [head]
    for r in data["results"]:
        lines.append(f"{r['attention']:9} {r['mode']:16} {r['T']:6} {r['batch']:3} {r['step_ms']:8.2f} "
                     f"{r['kernels_us'] / 1e3:11.2f} " + " ".join(f"{r['groups'][g] / 1e3:16.2f}" for g in GROUPS))
    return "\n".join(lines)


def load_results(path: str | None = None) -> dict:
    """The committed run (``book/data/step_profile.json``), or the file at ``path``."""
    return results.load("step_profile.json", path)


def _print(r: dict) -> None:
    groups = ", ".join(f"{g} {us / 1e3:.2f}" for g, us in r["groups"].items())
    print(f"{r['attention']} {r['mode']} T {r['T']} B {r['batch']}: step {r['step_ms']:.2f} ms, kernels "
          f"{r['kernels_us'] / 1e3:.2f} ms ({groups})", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench step-profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--T", type=int, default=4096, help="tokens a sequence (default 4096)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"sequences a step (default {model_bench.TOKENS} tokens a step, as the model bench)")
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (same GPU and versions), replacing those of the same "
                        "attention, mode and length")
    args = p.parse_args(argv)
    if args.T < 1 or (args.batch is not None and args.batch < 1):
        p.error(f"--T and --batch must be positive, got {args.T} and {args.batch}")
    import torch

    if not torch.cuda.is_available():
        print("flashref.bench step-profile needs a CUDA device", file=sys.stderr)
        return 2
    B = args.batch or max(1, model_bench.TOKENS // args.T)
    given = sys.argv[1:] if argv is None else argv
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(),
                         results.command("step-profile", [a for a in given if a != "--append"]),
                         dtype="bfloat16 autocast")
    add = results.recorder(data, args.out, show=_print, group=lambda row: (row["attention"], row["mode"], row["T"]))
    for row in cases(args.T, B):
        add(row)
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
