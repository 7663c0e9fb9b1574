"""Command line: ``python -m flashref.bench {numpy,gpu,hbm,features,mods,model,cupy,ring,decode,hopper,
hopper-profile,clocks,sparse-tiles,host,step-profile,flush} --help``."""

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suites = {"numpy": "flashref.bench.numpy_bench", "gpu": "flashref.bench.gpu_bench", "hbm": "flashref.bench.hbm_bench",
              "features": "flashref.bench.features_bench", "mods": "flashref.bench.mods_bench",
              "model": "flashref.bench.model_bench", "cupy": "flashref.bench.cupy_bench",
              "ring": "flashref.bench.ring_bench", "decode": "flashref.bench.decode_bench",
              "hopper": "flashref.bench.hopper_bench", "hopper-profile": "flashref.bench.hopper_profile",
              "clocks": "flashref.bench.clocks_bench",
              "sparse-tiles": "flashref.bench.sparse_tiles_bench", "host": "flashref.bench.host_bench",
              "step-profile": "flashref.bench.step_profile", "flush": "flashref.bench.flush_bench"}
    if not argv or argv[0] not in suites:
        print(f"usage: python -m flashref.bench {{{','.join(suites)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(suites[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
