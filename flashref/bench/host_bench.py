"""The host's time a call, with and without step plans: where the Python that launches a step, not the GPU,
sets its time.

    python -m flashref.bench host [--append]     # an H100: about half a minute

A block-sparse forward + backward at 4K tokens takes well under a millisecond on an H100's SMs, and at first
the host took longer than that to launch it: the checks, the dispatch, TMA descriptors, five launches through
Triton's launcher, autograd. ``flash_attention`` now plans a call signature's later calls from its first
(:class:`flashref.triton.ops.StepPlan`). Each :data:`CASES` point runs here with plans off (every call takes
the whole path, as a signature no plan takes does) and on, in :data:`ROUNDS` interleaved rounds, and a row
holds, for one of them: the host's time a call (``host_ms``: the median of :data:`BATCHES` batches of
:data:`CALLS` calls, the GPU synchronized before each batch and not inside it, so the batch measures the
launching only; ``host_min_ms`` the fastest batch), ``do_bench``'s median time a call (``ms``: host and GPU,
whichever is slower), and the kernels alone (``graph_ms``: the call replayed from a CUDA graph,
:func:`flashref.bench.features_bench.graph_time_us`; the same with plans on or off, measured once a point and
mode). fp16, ``check_finite=False`` as in the other benchmarks.

Results go to ``book/data/host_bench.json`` (:func:`load_results`); :func:`table` compares the two.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from flashref.bench import results

DEFAULT_OUT = "book/data/host_bench.json"
#: (pattern, B, H, N, d): a causal sliding window of 8 blocks, BigBird (window 3, one global, two random), a short
#: dense causal call, and dropout p = 0.1 with a given seed (the GPU, not the host, sets that one's time).
CASES = [("sliding window", 4, 16, 4096, 64), ("bigbird", 4, 16, 4096, 64), ("sliding window", 1, 16, 16384, 128),
         ("causal", 1, 2, 1024, 64), ("dropout", 8, 16, 4096, 64)]
MODES = ("fwd", "fwd+bwd")
ROUNDS = 2
BATCHES = 5
CALLS = 20


@contextlib.contextmanager
def plans(enabled: bool):
    """Step plans on (as ``flash_attention`` runs by default) or off inside the block: off, no call signature has a
    key, so every call takes the whole path. The plans kept are forgotten on entry and on exit, so a block starts
    from the first call of each signature."""
    from flashref.triton import ops

    key = ops._plan_key
    ops._PLANS.clear()
    if not enabled:
        ops._plan_key = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ops._plan_key = key
        ops._PLANS.clear()


def call_kwargs(pattern: str, N: int, device: str = "cuda") -> dict:
    """``flash_attention``'s keywords for a :data:`CASES` pattern at ``N`` tokens (128-token blocks)."""
    from flashref import block_masks

    n = block_masks.n_blocks(N, 128)
    kw = {"check_finite": False}
    if pattern == "sliding window":
        kw.update(causal=True, block_mask=block_masks.sliding_window(n, window=8, causal=True, device=device))
    elif pattern == "bigbird":
        kw.update(block_mask=block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device=device))
    elif pattern == "dropout":
        kw.update(dropout_p=0.1, seed=1)
    elif pattern == "causal":
        kw.update(causal=True)
    else:
        raise ValueError(f"pattern: {pattern!r} is not one of {sorted({c[0] for c in CASES})}")
    return kw


def host_ms(fn, tensors, batches: int = BATCHES, calls: int = CALLS) -> tuple[float, float]:
    """(median, fastest) over ``batches`` of the host's ms a call in a batch of ``calls`` calls of ``fn``, each
    batch started after the GPU has finished the previous one; ``tensors``' gradients are cleared before each
    call, as a training step's optimizer does."""
    import torch

    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            for x in tensors:
                x.grad = None
            fn()
        times.append((time.perf_counter() - started) / calls * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times), min(times)


def cases(points=CASES, rounds: int = ROUNDS):
    """Rows ``{case: "host", pattern, mode, plans, round, B, H, N, d, host_ms, host_min_ms, ms, graph_ms}``."""
    import torch
    import triton

    from flashref.bench.features_bench import _kernels_ms
    from flashref.triton import flash_attention

    for pattern, B, H, N, d in points:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        tensors = [x.requires_grad_() for x in (q, k, v)]
        kw = call_kwargs(pattern, N)

        def fwd():
            with torch.no_grad():
                return flash_attention(q, k, v, **kw)

        def step():
            flash_attention(q, k, v, **kw).backward(do)

        for mode, fn in zip(MODES, (fwd, step)):
            graph = _kernels_ms(fn, tensors)
            for rnd in range(rounds):
                for on in (False, True):
                    with plans(on):
                        for _ in range(5):
                            fn()  # compiled, tuned and (plans on) planned before any timing
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=tensors,
                                                     return_mode="median")
                        median, fastest = host_ms(fn, tensors)
                    yield {"case": "host", "pattern": pattern, "mode": mode, "plans": on, "round": rnd, "B": B,
                           "H": H, "N": N, "d": d, "host_ms": median, "host_min_ms": fastest, "ms": ms,
                           "graph_ms": graph}
        del q, k, v, do, tensors
        torch.cuda.empty_cache()


def load_results(path: str | None = None) -> dict:
    """The committed run (``book/data/host_bench.json``), or ``path``'s."""
    return results.load("host_bench.json", path)


def table(data: dict) -> str:
    """One line a point and mode: the host's ms a call with plans off and on (medians over the rounds; in
    brackets the range of the rounds), their ratio, ``do_bench``'s ms off and on, and the kernels alone."""
    by = {}
    for r in data["results"]:
        if r["case"] == "host":
            by.setdefault((r["pattern"], r["B"], r["H"], r["N"], r["d"], r["mode"]), {}).setdefault(
                r["plans"], []).append(r)

    def med(rows, field):
        return statistics.median(r[field] for r in rows)

    def span(rows, field):
        return f"{min(r[field] for r in rows):.2f}-{max(r[field] for r in rows):.2f}"

    lines = [f"{'pattern':15s} {'B':>2s} {'H':>3s} {'N':>6s} {'d':>4s} {'mode':8s} | {'host ms, off':>17s} "
             f"{'on':>17s} {'off/on':>6s} | {'do_bench off':>12s} {'on':>6s} | {'kernels':>7s}"]
    for key in sorted(by):
        pattern, B, H, N, d, mode = key
        off, on = by[key].get(False), by[key].get(True)
        if not off or not on:
            continue
        graph = [r["graph_ms"] for r in off + on if r.get("graph_ms") is not None]
        lines.append(f"{pattern:15s} {B:2d} {H:3d} {N:6d} {d:4d} {mode:8s} | "
                     f"{med(off, 'host_ms'):6.3f} ({span(off, 'host_ms'):>9s}) "
                     f"{med(on, 'host_ms'):6.3f} ({span(on, 'host_ms'):>9s}) "
                     f"{med(off, 'host_ms') / med(on, 'host_ms'):6.2f} | {med(off, 'ms'):12.3f} {med(on, 'ms'):6.3f} | "
                     + (f"{statistics.median(graph):7.3f}" if graph else f"{'-':>7s}"))
    return "\n".join(lines)


def _print(r: dict) -> None:
    print(f"{r['pattern']} B{r['B']} H{r['H']} N{r['N']} d{r['d']} {r['mode']:7s} plans={r['plans']!s:5s} round "
          f"{r['round']}: host {r['host_ms']:.3f} ms a call (fastest batch {r['host_min_ms']:.3f}), do_bench "
          f"{r['ms']:.3f} ms", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (same GPU and versions), replacing them")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("flashref.bench host needs an sm_90 (Hopper) GPU: step plans take the Hopper kernels' calls",
              file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(),
                         results.command("host", [a for a in given if a != "--append"]), dtype="float16")
    add = results.recorder(data, args.out, show=_print, group=lambda row: row["case"])
    for row in cases():
        add(row)
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
