"""The tiles of the Gluon forward that walks a block mask's lists (notebooks 10 and 14), against the teaching
forward and the dense kernel: the measurement behind :func:`flashref.triton.hopper.block_mask_config` and its
register cap (:func:`flashref.triton.hopper._occupancy_options`).

    python -m flashref.bench sparse-tiles       # an H100, about three minutes

For d = 64, 128 and 256, 16K tokens (B 1 x N 16K and B 4 x N 4K, 16 heads, fp16) and four masks of 128-token blocks
(a causal sliding window of 8 blocks, BigBird-like, causal, all-True), each candidate tile (block_m x block_n,
warps, stages; "ws": warp-specialized, "pp": with ping-pong) is timed twice: by ``do_bench`` (``ms``, the host
included where it is slower than the GPU) and kernel-only from CUDA-graph replay (``graph_ms``,
:func:`flashref.bench.features_bench.graph_time_us`). Each tile that the register cap applies to (at d = 64 the
one-warpgroup tiles that fit four programs an SM, the shipped one among them) runs with and without it
(``capped``). The teaching forward on the same mask (``kernel="triton"``) and, for the all-True and causal masks,
the dense forward without a mask are the references. Results go to ``book/data/sparse_tiles_bench.json``
(:func:`load_results`); :func:`table` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

from flashref.bench import results

#: Candidate tiles a head dim, in :func:`flashref.triton.hopper.hopper_forward`'s switches (no overlap, which
#: takes no block mask): tiles of one or two warpgroups here, warp-specialized ones below. The shipped tile is
#: among them.
CANDIDATES = {
    64: [dict(block_m=64, block_n=128, num_warps=4, stages=1), dict(block_m=64, block_n=128, num_warps=4, stages=2),
         dict(block_m=64, block_n=64, num_warps=4, stages=2), dict(block_m=64, block_n=64, num_warps=4, stages=3),
         dict(block_m=128, block_n=128, num_warps=8, stages=2), dict(block_m=128, block_n=64, num_warps=8, stages=2)],
    128: [dict(block_m=128, block_n=64, num_warps=8, stages=2), dict(block_m=128, block_n=64, num_warps=8, stages=3),
          dict(block_m=64, block_n=64, num_warps=4, stages=2), dict(block_m=64, block_n=64, num_warps=4, stages=3),
          dict(block_m=64, block_n=128, num_warps=4, stages=2), dict(block_m=128, block_n=128, num_warps=8, stages=2)],
    256: [dict(block_m=128, block_n=64, num_warps=8, stages=2), dict(block_m=64, block_n=64, num_warps=4, stages=2)],
}
#: Warp-specialized tiles (a producer warp, two consumer warpgroups of 64 rows), with and without ping-pong:
#: the dense forward's key tiles (64 keys at d = 256, where two stages of 128 would not fit in shared memory).
#: Every candidate names both switches, so that none inherits the shipped tile's.
for _d in CANDIDATES:
    CANDIDATES[_d] = [dict(t, warp_specialize=False, pingpong=False) for t in CANDIDATES[_d]]
    CANDIDATES[_d] += [dict(block_m=128, block_n=128 if _d <= 128 else 64, num_warps=4, stages=2,
                            warp_specialize=True, pingpong=pp, overlap=False) for pp in (False, True)]
SHAPES = [(1, 16, 16384), (4, 16, 4096)]
BLOCK = 128


def tile_name(cfg: dict) -> str:
    ws = (" ws" + (" pp" if cfg.get("pingpong") else "")) if cfg.get("warp_specialize") else ""
    return f"{cfg['block_m']}x{cfg['block_n']} w{cfg['num_warps']} s{cfg['stages']}{ws}"


def masks(n: int, device=None) -> dict:
    """The benchmark's masks of ``n`` blocks a side: ``{name: (bool mask (1, 1, n, n), causal)}``."""
    import torch

    from flashref import block_masks

    return {"sliding window": (block_masks.sliding_window(n, window=8, causal=True, device=device), True),
            "bigbird": (block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device=device), False),
            "causal": (block_masks.causal_blocks(n, device=device), True),
            "all-True": (torch.ones(1, 1, n, n, dtype=torch.bool, device=device), False)}


def _both(fn) -> tuple:
    """(ms by do_bench, ms kernel-only from CUDA-graph replay or None: the features bench's own timer)."""
    import torch
    import triton

    from flashref.bench.features_bench import _kernels_ms

    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), _kernels_ms(fn, [])


def cases(head_dims=(64, 128, 256)):
    """Yields a row a timing: ``{d, B, H, N, pattern, causal, density, impl, tile, capped, ms, graph_ms}``."""
    import torch

    from flashref import block_masks
    from flashref.bench.features_bench import _inputs
    from flashref.triton import flash_attention, hopper
    from flashref.triton.ops import visible_block_lists

    for d in head_dims:
        for B, H, N in SHAPES:
            q, k, v, _ = _inputs(B, H, H, N, d)
            n = block_masks.n_blocks(N, BLOCK)
            for pattern, (mask, causal) in masks(n, "cuda").items():
                base = dict(d=d, B=B, H=H, N=N, pattern=pattern, causal=causal, density=block_masks.density(mask))
                ms, graph = _both(lambda: flash_attention(q, k, v, causal=causal, block_mask=mask, check_finite=False,
                                                          kernel="triton"))
                yield dict(base, impl="teaching", tile=None, capped=None, ms=ms, graph_ms=graph)
                if pattern in ("all-True", "causal"):
                    ms, graph = _both(lambda: flash_attention(q, k, v, causal=causal, check_finite=False))
                    yield dict(base, impl="dense", tile=None, capped=None, ms=ms, graph_ms=graph)
                lists = (visible_block_lists(mask.expand(B, H, n, n)), BLOCK)
                shipped = hopper.block_mask_config(d, BLOCK)
                for tile in CANDIDATES[d]:
                    cfg = dict(shipped, **tile)
                    runs = [True, False] if hopper._occupancy_options(cfg, d) else [None]
                    for capped in runs:
                        uncapped = mock.patch.object(hopper, "_occupancy_options", lambda c, h: {})
                        with uncapped if capped is False else contextlib.nullcontext():
                            ms, graph = _both(lambda: hopper.launch_forward(q, k, v, causal, d ** -0.5, cfg,
                                                                            lists=lists))
                        yield dict(base, impl="gluon", tile=tile_name(cfg), capped=capped, ms=ms, graph_ms=graph,
                                   shipped=all(cfg[key] == shipped[key] for key in tile))
            del q, k, v
            torch.cuda.empty_cache()


def table(rows, field: str = "graph_ms") -> str:
    """A line a (d, shape, mask): the teaching forward's time (``field``), then each Gluon tile's as the teaching
    time over its own (above 1: the tile is faster), "*" on the shipped tile, "(no cap)" a tile run
    without its register cap; the dense kernel's time where measured."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["d"], r["B"], r["N"], r["pattern"]), []).append(r)
    lines = []
    for (d, B, N, pattern), got in groups.items():
        teach = next((r[field] for r in got if r["impl"] == "teaching"), None)
        cells = [f"d {d:3d} B {B:2d} N {N:6d} {pattern:15s} teaching {teach if teach is None else round(teach, 3)}"]
        for r in got:
            if r["impl"] == "gluon" and r[field] and teach:
                mark = ("*" if r.get("shipped") else "") + (" (no cap)" if r["capped"] is False else "")
                cells.append(f"{r['tile']}{mark} {teach / r[field]:.2f}")
            elif r["impl"] == "dense" and r[field]:
                cells.append(f"dense {r[field]:.3f} ms")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def load_results(path=None) -> dict:
    """The committed run, book/data/sparse_tiles_bench.json (or ``path``)."""
    return results.load("sparse_tiles_bench.json", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench sparse-tiles", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="book/data/sparse_tiles_bench.json")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256], choices=[64, 128, 256])
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("flashref.bench sparse-tiles needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    data = results.start(None, torch.cuda.get_device_name(), results.versions(),
                         "python -m flashref.bench sparse-tiles --head-dims " + " ".join(map(str, args.head_dims)),
                         dtype="float16")
    add = results.recorder(data, args.out)  # saved after each row
    for row in cases(tuple(args.head_dims)):
        add(row)
    print(table(data["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
