"""Command line: ``python -m flashref.bench [SUITE] [options]``; ``--help`` lists the suites, ``SUITE --help`` gives
a suite's options. With no suite it runs ``gpu``, the course's main benchmark (flashref's kernels against every
attention backend of PyTorch in one run)."""

import sys

# Each suite: its module, and what it measures in one line (its module's docstring says more).
SUITES = {
    "gpu": ("flashref.bench.gpu_bench",
            "the CuPy and Triton kernels beside every SDPA backend and plain PyTorch (nb 06-09)"),
    "numpy": ("flashref.bench.numpy_bench", "tiled NumPy against naive NumPy on the CPU: time and peak memory (nb 03)"),
    "cupy": ("flashref.bench.cupy_bench", "the CuPy CUDA C kernels beside SDPA's flash backend (nb 06)"),
    "hbm": ("flashref.bench.hbm_bench", "HBM bytes counted by Nsight Compute, kernel by kernel (nb 09)"),
    "features": ("flashref.bench.features_bench", "GQA, fused dropout and block-sparse against PyTorch's (nb 10)"),
    "mods": ("flashref.bench.mods_bench", "window, softcap, ALiBi and packed batches against PyTorch's (nb 12)"),
    "model": ("flashref.bench.model_bench", "the GPT of flashref.model trained with each attention (nb 11, 13)"),
    "step-profile": ("flashref.bench.step_profile", "a training step's GPU time, kernel by kernel (nb 11)"),
    "host": ("flashref.bench.host_bench", "the host's time a call, with and without step plans (nb 10)"),
    "ring": ("flashref.bench.ring_bench", "ring attention over the GPUs of one machine against one GPU (nb 13)"),
    "decode": ("flashref.bench.decode_bench", "flash-decoding against the unsplit kernel and SDPA (nb 13)"),
    "flush": ("flashref.bench.flush_bench", "what a timer's L2 flush adds to a decoding call (nb 13)"),
    "hopper": ("flashref.bench.hopper_bench", "FlashAttention-3's ideas on Hopper, one switch at a time (nb 14)"),
    "hopper-profile": ("flashref.bench.hopper_profile", "the Hopper kernels' hardware counters beside cuDNN's (nb 14)"),
    "clocks": ("flashref.bench.clocks_bench", "the SM clock and board power while each forward runs (nb 14)"),
    "sparse-tiles": ("flashref.bench.sparse_tiles_bench", "the Gluon forward's block-mask tile lists (nb 10, 14)"),
}
DEFAULT = "gpu"


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [f"usage: python -m flashref.bench [SUITE] [options]   (no SUITE: {DEFAULT})", "",
             "suites (SUITE --help gives its options):"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in SUITES.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0].startswith("-"):  # options alone go to the default suite
        print(f"flashref.bench: no suite named, running {DEFAULT!r} (--help lists the suites)", file=sys.stderr)
        argv = [DEFAULT] + argv
    if argv[0] not in SUITES:
        print(f"flashref.bench: unknown suite {argv[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(SUITES[argv[0]][0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
