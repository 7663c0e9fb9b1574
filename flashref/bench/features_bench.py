"""The kernel's features against PyTorch's own, in one run: grouped-query attention, fused dropout, and
block-sparse attention against its own dense time.

    python -m flashref.bench features            # the points below

- GQA: H = 32 query heads sharing H_kv = 8 or 1 K/V heads, against ``scaled_dot_product_attention(...,
  enable_gqa=True)`` on its flash and cuDNN backends; forward + backward; peak memory.
- Dropout p = 0.1 against SDPA's flash backend with the same ``dropout_p``, and against flashref
  without dropout; forward + backward, with the deterministic backward and with ``deterministic=False`` (the
  "atomic dQ" rows, with dropout and without: one backward kernel draws the mask instead of two, on an H100 at
  d = 64 the one-kernel Gluon backward), and the teaching kernels (``kernel="triton"``) with dropout beside the
  Gluon ones that an H100 runs.
- Dropout's cost (``--parts dropout-cost``, not in the default run): forward + backward with p = 0.1 and
  without, for SDPA's flash, cuDNN and memory-efficient backends and flashref's two backward paths, timed in
  turns in one run, at d = 64 and 128; and the fraction of P each keeps, counted over 16.8M entries
  (:func:`kept_fraction`): what each pays for dropout, and how finely it draws its numbers.
  ``book/data/dropout_cost.json`` is such a run (``--out book/data/dropout_cost.json``).
- What Philox's rounds cost (``--parts dropout-rounds``, not in the default run): flashref's rows of the
  dropout-cost part again with its kernels compiled for 0, 2, 4, 7 (the shipped count) and 10 rounds, each count
  in a process of its own (``--philox-rounds`` picks others); at 0 rounds what is left is the mask's cost without
  a generator. ``book/data/dropout_rounds.json`` is such a run.
- The backward alone with dropout (``--parts dropout-backward``, not in the default run, an sm_90 GPU's): the
  Gluon pair, the one-kernel backward and the same kernel with its dQ adds in a fixed order, with p = 0.1 and
  without, timed in turns (:func:`dropout_backward_cases`). ``book/data/dropout_backward.json`` is such a run.
- Block-sparse: a causal sliding window of ``w`` blocks of 128 keys, time against density (visible
  blocks / all blocks) next to the dense kernel's time, and an all-True mask against no mask; forward and
  forward + backward, each side through the default dispatch, with ``graph_ms`` beside ``ms``.
- Block-sparse against FlexAttention (``torch.compile(flex_attention)`` with ``create_block_mask``) on the
  same masks (:mod:`flashref.block_masks`: a causal sliding window, BigBird-like, causal), N = 4K to 64K;
  peak memory of each forward + backward. Flex builds its BlockMask once, outside the timing, as its
  users do; flashref takes the same boolean mask tensor at every call and builds its lists of visible
  blocks on the first (one small kernel launch), as a model would. Each row also has ``graph_ms``: the
  same call's GPU time with the host taken out (:func:`graph_time_us`), since a call near a millisecond can
  take less time on the GPU than in the Python that launches it.

FLOPs are counted on the visible (query, key) pairs only (4 d per pair forward, 2.5x that backward:
:func:`flashref.bench.results.pair_flops` of :func:`flashref.block_masks.visible_pairs`, notebook
``10_dropout_masks_sparsity``). fp16 unless a row says ``dtype``. Results go to
``book/data/features_bench.json`` with the device, library versions and command (:func:`load_results` reads
them back); ``--parts`` runs some of them (gqa, dropout, sparse, flex, dropout-cost, dropout-rounds,
dropout-backward), and ``--append`` adds them to the file's rows in place of those it measures again (one run split
over several calls of the same machine). The whole run takes about 8 minutes on an H100, most of it compiling Flex.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

from flashref.bench import results
from flashref.bench.gpu_bench import sdpa
from flashref.bench.results import flops, pair_flops


def _time(fn, needs_grad, tensors):
    import torch
    import triton

    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=tensors if needs_grad else None,
                                 return_mode="median")
    return ms, int(peak)


#: The L2 flushes :func:`graph_time_us` can run before a call: do_bench's (zeroing: dirty lines), or a read.
FLUSHES = ("zero", "read")


def l2_flush(kind: str = "zero"):
    """A function that empties the L2 cache ``kind``'s way (one of :data:`FLUSHES`) through a 256 MiB buffer of
    its own, do_bench's size: ``"zero"`` zeroes it, as ``do_bench`` does (the L2 is left full of dirty lines),
    ``"read"`` sums it (clean lines, which a later call drops for free)."""
    import torch

    if kind not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {kind!r}")
    buffer = torch.zeros(256 * 2**20, dtype=torch.int8, device="cuda")
    if kind == "zero":
        return buffer.zero_
    words, total = buffer.view(torch.float32), torch.empty((), device="cuda")
    return lambda: torch.sum(words, dim=0, out=total)


def graph_time_us(fn, replays: int = 20, flush: str = "zero") -> float | None:
    """Microseconds of GPU time one call takes with the host taken out: the call captured in a CUDA graph behind
    a flush of the L2 cache, replayed, minus a graph of the flush alone (medians of ``replays``). ``ms`` is what a
    loop of calls gets, host included where the host is slower than the GPU; this is what the kernels take, the
    figure to compare kernels by where one call is short (and what a loop captured in a CUDA graph, a decoding
    loop say, would see). None when the call cannot be captured.

    ``flush="zero"`` empties the L2 as ``do_bench`` does before each call, by zeroing a 256 MiB buffer: the L2 is
    left full of dirty lines, which the call's own reads must write back to HBM as they evict them (a few
    microseconds on an H200, counted in the call's time). ``"read"`` sums a buffer of the same size instead: the L2 is
    left full of clean lines, dropped for free (:mod:`flashref.bench.flush_bench` measures the difference)."""
    import torch

    empty_l2 = l2_flush(flush)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's capture recipe asks
            empty_l2()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs = {"flush": torch.cuda.CUDAGraph(), "both": torch.cuda.CUDAGraph()}
        with torch.cuda.graph(graphs["flush"]):
            empty_l2()
        with torch.cuda.graph(graphs["both"]):
            empty_l2()
            fn()
    except RuntimeError:  # a backend that cannot be captured
        torch.cuda.synchronize()
        return None

    def replay_ms(graph):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        times = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    gpu_us = (replay_ms(graphs["both"]) - replay_ms(graphs["flush"])) * 1e3
    del graphs, empty_l2
    return gpu_us


def _inputs(B, H, H_kv, N, d, dtype="float16"):
    import torch

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, N, d, device="cuda", dtype=dt, generator=g)
    k, v = (torch.randn(B, H_kv, N, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
    do = torch.randn(B, H, N, d, device="cuda", dtype=dt, generator=g)
    for x in (q, k, v):
        x.requires_grad_(True)
    return q, k, v, do


def _row(name, impl, B, H, H_kv, N, d, causal, ms, peak, work, **extra):
    return {"case": name, "impl": impl, "B": B, "H": H, "H_kv": H_kv, "N": N, "d": d, "causal": causal,
            "ms": ms, "tflops": work / (ms * 1e-3) / 1e12, "peak_extra_bytes": peak, **extra}


def _fwd_bwd(fn, q, k, v, do):
    return lambda: fn(q, k, v).backward(do)


def gqa_cases(N=4096, d=128, B=2, H=32):
    from flashref.triton import flash_attention

    rows = []
    for H_kv in (8, 1):
        for causal in (False, True):
            q, k, v, do = _inputs(B, H, H_kv, N, d)
            work = flops(B, H, N, N, d, causal, "fwd+bwd")
            peers = {"flashref-triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, check_finite=False),
                     "sdpa-flash": lambda q, k, v: sdpa("sdpa-flash", enable_gqa=True)(q, k, v, causal),
                     "sdpa-cudnn": lambda q, k, v: sdpa("sdpa-cudnn", enable_gqa=True)(q, k, v, causal)}
            for impl, fn in peers.items():
                try:
                    ms, peak = _time(_fwd_bwd(fn, q, k, v, do), True, [q, k, v])
                    rows.append(_row("gqa fwd+bwd", impl, B, H, H_kv, N, d, causal, ms, peak, work))
                except Exception as exc:  # noqa: BLE001 (a backend that refuses is recorded)
                    rows.append({"case": "gqa fwd+bwd", "impl": impl, "H_kv": H_kv, "causal": causal,
                                 "status": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
    return rows


def dropout_cases(N=4096, head_dims=(64,), B=8, H=16, p=0.1):
    """Rows of the dropout part, yielded one by one (a run cut short keeps those measured)."""
    from flashref.triton import flash_attention

    for d, causal in itertools.product(head_dims, (False, True)):
        q, k, v, do = _inputs(B, H, H, N, d)
        work = flops(B, H, N, N, d, causal, "fwd+bwd")
        peers = {"flashref-triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, dropout_p=p, seed=1,
                                                                    check_finite=False),
                 "flashref-triton no dropout": lambda q, k, v: flash_attention(q, k, v, causal=causal,
                                                                               check_finite=False),
                 # the teaching kernels (kernel="triton") with dropout: what the Gluon ones replace on an H100
                 "flashref-triton teaching": lambda q, k, v: flash_attention(
                     q, k, v, causal=causal, dropout_p=p, seed=1, check_finite=False, kernel="triton"),
                 # deterministic=False, dQ added by one backward kernel that draws the mask once, not twice (on
                 # an H100 at d = 64 the one-kernel Gluon backward; the teaching kernel's atomics elsewhere),
                 # with dropout and without
                 "flashref-triton atomic dQ": lambda q, k, v: flash_attention(
                     q, k, v, causal=causal, dropout_p=p, seed=1, deterministic=False, check_finite=False),
                 "flashref-triton no dropout atomic dQ": lambda q, k, v: flash_attention(
                     q, k, v, causal=causal, deterministic=False, check_finite=False),
                 "sdpa-flash": lambda q, k, v: sdpa("sdpa-flash", dropout_p=p)(q, k, v, causal)}
        for impl, fn in peers.items():
            ms, peak = _time(_fwd_bwd(fn, q, k, v, do), True, [q, k, v])
            yield _row("dropout fwd+bwd", impl, B, H, H, N, d, causal, ms, peak, work, dropout_p=p)


#: flashref's two backward paths with dropout: deterministic, and one kernel (``deterministic=False``)
FLASHREF_DROPOUT_IMPLS = ("flashref-triton", "flashref-triton atomic dQ")
#: What the dropout-cost part runs, each with dropout and without: SDPA's three fused backends and flashref's two
#: backward paths
DROPOUT_COST_IMPLS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", *FLASHREF_DROPOUT_IMPLS)


def _with_dropout(impl: str, causal: bool, p: float):
    """``fn(q, k, v)`` of one of :data:`DROPOUT_COST_IMPLS` with ``dropout_p=p`` (0: the same call without)."""
    from flashref.triton import flash_attention

    if impl.startswith("sdpa"):
        return lambda q, k, v: sdpa(impl, dropout_p=p)(q, k, v, causal)
    atomic = impl.endswith("atomic dQ")
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, dropout_p=p, seed=1 if p else None,
                                           deterministic=not atomic, check_finite=False)


def _interleaved_ms(calls: dict, tensors, rounds: int) -> dict:
    """Median do_bench ms of each call, every call timed once a round, ``rounds`` rounds: the calls share
    whatever drifts during the run (clocks, the host), where timing one after another would give the later ones
    a different GPU (seen on an H200: a 2-4% "gain" that was only the order)."""
    import triton

    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=tensors,
                                                      return_mode="median"))
    return {key: statistics.median(t) for key, t in times.items()}


def kept_fraction(attention, p: float, N_q: int = 4096, N_k: int = 64, B: int = 1, H: int = 16, draws: int = 4,
                  device: str = "cuda") -> dict:
    """The fraction of P's entries that ``attention(q, k, v, seed)`` keeps under dropout ``p``, counted. Every key
    is the same vector, so every score of a row is the same and P = 1 / N_k exactly; V is the identity (key j
    holds 1 in column j, d = N_k), so O[i, j] = Z[i, j] / (N_k (1 - p)): not 0 exactly where entry (i, j) is
    kept, whatever the scale. ``draws`` calls (seeds 0, 1, ...) of B x H x N_q x N_k entries each. Returns
    ``kept``, ``entries`` and ``std_error``, the binomial standard error of ``kept`` (four of them off is no
    accident); and ``scale``, what the kept entries are multiplied by, times 1 - p (1: by 1 / (1 - p), within
    fp16's rounding of O), so that ``kept * scale / (1 - p)`` is the expected O over the O without dropout."""
    import torch

    q = torch.randn(B, H, N_q, N_k, device=device, dtype=torch.float16)
    k = torch.randn(B, H, 1, N_k, device=device, dtype=torch.float16).expand(B, H, N_k, N_k).contiguous()
    v = torch.eye(N_k, device=device, dtype=torch.float16).expand(B, H, N_k, N_k).contiguous()
    kept, total = 0, 0.0
    for seed in range(draws):
        with torch.no_grad():
            o = attention(q, k, v, seed)
        kept += int((o != 0).sum())
        total += float(o.double().sum())
    entries = draws * B * H * N_q * N_k
    frac = kept / entries
    return {"kept": frac, "entries": entries, "std_error": (frac * (1 - frac) / entries) ** 0.5,
            "scale": total / kept * N_k * (1 - p)}


def _seeded(impl: str, p: float):
    """``attention(q, k, v, seed)`` of an implementation, drawing its mask from ``seed`` (SDPA: torch's generator
    seeded with it)."""
    import torch

    from flashref.triton import flash_attention

    if impl.startswith("sdpa"):
        def attention(q, k, v, seed):
            torch.manual_seed(seed)
            return sdpa(impl, dropout_p=p)(q, k, v, False)
        return attention
    return lambda q, k, v, seed: flash_attention(q, k, v, dropout_p=p, seed=seed, check_finite=False)


def dropout_cost_cases(N=4096, head_dims=(64, 128), B=8, H=16, p=0.1, rounds=5, impls=DROPOUT_COST_IMPLS,
                       kept=True):
    """What dropout costs each implementation, in one run (the dropout-cost part): forward + backward of every
    one of ``impls`` (:data:`DROPOUT_COST_IMPLS`) with ``dropout_p=p`` and without (``ms`` and ``ms_no_dropout``,
    interleaved: :func:`_interleaved_ms`), and with ``kept`` the fraction of P each one keeps
    (:func:`kept_fraction`), which says how finely it draws: ``1 - p`` exactly, or ``1 - p`` rounded to the
    random numbers' bits."""
    for d, causal in itertools.product(head_dims, (False, True)):
        q, k, v, do = _inputs(B, H, H, N, d)
        work = flops(B, H, N, N, d, causal, "fwd+bwd")
        calls, failed = {}, {}
        for impl, drop in itertools.product(impls, (p, 0.0)):
            call = _fwd_bwd(_with_dropout(impl, causal, drop), q, k, v, do)
            try:
                call()
                calls[impl, drop] = call
            except Exception as exc:  # noqa: BLE001 (a backend that refuses is recorded)
                failed[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        ms = _interleaved_ms(calls, [q, k, v], rounds)
        for impl in impls:
            if impl in failed:
                yield {"case": "dropout cost fwd+bwd", "impl": impl, "d": d, "causal": causal, "status": failed[impl]}
                continue
            yield _row("dropout cost fwd+bwd", impl, B, H, H, N, d, causal, ms[impl, p], None, work, dropout_p=p,
                       ms_no_dropout=ms[impl, 0.0], ratio=ms[impl, 0.0] / ms[impl, p])
        del q, k, v, do
    for impl in impls if kept else ():
        if impl.endswith("atomic dQ"):  # the same forward, the same mask
            continue
        try:
            yield {"case": "dropout kept fraction", "impl": impl, "dropout_p": p, **kept_fraction(_seeded(impl, p), p)}
        except Exception as exc:  # noqa: BLE001
            yield {"case": "dropout kept fraction", "impl": impl, "dropout_p": p,
                   "status": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


#: The dropout-backward part's kernels: the deterministic pair (the Gluon dQ and dK/dV kernels, which draw the mask
#: twice), the one-kernel backward with dQ added in any order (``deterministic=False``'s) and in a fixed order
#: (``deterministic=True``'s with dropout)
DROPOUT_BACKWARD_IMPLS = ("gluon pair", "gluon fused", "gluon fused ordered")


def _backward_alone(impl: str, q, k, v, do, causal: bool, p: float):
    """``fn()`` running one of :data:`DROPOUT_BACKWARD_IMPLS` on the forward's statistics and (p > 0) its mask."""
    from flashref.triton import flash_attention_forward, ops

    scale = q.shape[3] ** -0.5
    feat = ops.Features(q, k, dropout_p=p, seed=1234 if p else None, causal=causal, scale=scale, check_finite=False)
    o, lse = flash_attention_forward(q, k, v, causal, dropout_p=p, seed=1234 if p else None, check_finite=False)
    stats, delta = ops._stats_from_lse(lse), ops._delta(o, do)
    if impl == "gluon pair":  # each part alone runs the pair's kernel of it, whatever the dispatch picks for both
        return lambda: [ops._backward(q, k, v, o, stats, do, scale, True, feat, "hopper", parts=(part,), delta=delta)
                        for part in ("dq", "dkdv")]
    fused = ops._gluon_module("hopper_backward_fused")
    drop = ops._dropout_scalars(feat)
    return lambda: fused.hopper_fused_backward(q, k, v, do, *stats, delta, causal, scale, dropout=drop,
                                               ordered=impl.endswith("ordered"))


def dropout_backward_cases(N=4096, head_dims=(64, 128), B=8, H=16, p=0.1, rounds=5):
    """The backward alone (the dropout-backward part, an sm_90 GPU's): each of :data:`DROPOUT_BACKWARD_IMPLS` with
    the forward's mask at ``dropout_p=p`` and without, all six calls timed in turns (:func:`_interleaved_ms`), at
    ``head_dims``, causal and not. What the fixed order of dQ's adds costs (ordered against any order), and what
    drawing the mask once gains (ordered against the pair): ``deterministic=True`` takes the ordered kernel with
    dropout (:func:`flashref.triton.ops._ordered_takes`). TFLOP/s counts the backward's 2.5 forward passes."""
    for d, causal in itertools.product(head_dims, (False, True)):
        q, k, v, do = _inputs(B, H, H, N, d)
        calls = {(impl, drop): _backward_alone(impl, q, k, v, do, causal, drop)
                 for impl, drop in itertools.product(DROPOUT_BACKWARD_IMPLS, (p, 0.0))}
        ms = _interleaved_ms(calls, None, rounds)
        work = flops(B, H, N, N, d, causal, "bwd")
        for (impl, drop), t in ms.items():
            yield _row("dropout backward", impl, B, H, H, N, d, causal, t, None, work, dropout_p=drop)
        del q, k, v, do, calls


def dropout_backward_table(rows) -> str:
    """The dropout-backward part as text: per head dim, causality and ``dropout_p``, each kernel's ms, then the
    ordered kernel's speed over the pair's and over the unordered one's (above 1: the ordered one is faster)."""
    rows = [r for r in rows if r.get("case") == "dropout backward"]
    if not rows:
        return "this run has no dropout-backward rows"
    get = {(r["d"], r["causal"], r["dropout_p"], r["impl"]): r["ms"] for r in rows}
    lines = [f"{'d':>4} {'causal':>6} {'p':>4} " + " ".join(f"{i:>20}" for i in DROPOUT_BACKWARD_IMPLS)
             + f" {'ordered / pair':>15} {'ordered / fused':>16}"]
    for d, causal, drop in sorted({key[:3] for key in get}):
        ms = [get.get((d, causal, drop, i)) for i in DROPOUT_BACKWARD_IMPLS]
        cells = " ".join(f"{t:20.3f}" if t is not None else f"{'-':>20}" for t in ms)
        pair, fused, ordered = ms
        speed = [f"{a / ordered:.2f}x" if a is not None and ordered is not None else "-" for a in (pair, fused)]
        lines.append(f"{d:4} {causal!s:>6} {drop:4.2f} {cells} {speed[0]:>15} {speed[1]:>16}")
    return "\n".join(lines)


def dropout_cost_table(rows) -> str:
    """The dropout-cost part as text: per implementation, head dim and causality, the step's ms without dropout
    and with it, what dropout adds (ms) and the ratio (time without over time with: 1 would be free); then each
    implementation's kept fraction against 1 - p, in standard errors, the scale of its kept entries (times 1 - p)
    and the expected O it gives over the O without dropout (1: unbiased)."""
    cost = [r for r in rows if r.get("case") == "dropout cost fwd+bwd"]
    kept = [r for r in rows if r.get("case") == "dropout kept fraction"]
    if not cost and not kept:
        return "this run has no dropout-cost rows"
    lines = [f"{'implementation':26} {'d':>4} {'causal':>6} {'ms, p = 0':>10} {'ms, p':>8} {'added':>7} {'ratio':>6}"]
    for r in sorted(cost, key=lambda r: (r["d"], r["causal"], DROPOUT_COST_IMPLS.index(r["impl"]))):
        if "ms" not in r:
            lines.append(f"{r['impl']:26} {r['d']:4} {r['causal']!s:>6} {r['status'][:40]}")
            continue
        lines.append(f"{r['impl']:26} {r['d']:4} {r['causal']!s:>6} {r['ms_no_dropout']:10.2f} {r['ms']:8.2f} "
                     f"{r['ms'] - r['ms_no_dropout']:7.2f} {r['ratio']:6.2f}")
    if kept:
        lines.append("")
        lines.append(f"{'implementation':26} {'kept':>9} {'1 - p':>7} {'off, std errors':>16} {'entries':>11} "
                     f"{'scale':>7} {'E[O] / O':>9}")
    for r in kept:
        if "kept" not in r:
            lines.append(f"{r['impl']:26} {r['status'][:60]}")
            continue
        off = (r["kept"] - (1 - r["dropout_p"])) / r["std_error"]
        lines.append(f"{r['impl']:26} {r['kept']:9.5f} {1 - r['dropout_p']:7.4f} {off:16.1f} {r['entries']:11d} "
                     f"{r['scale']:7.4f} {r['kept'] * r['scale'] / (1 - r['dropout_p']):9.4f}")
    return "\n".join(lines)


def windows(N, block, device=None):
    """The masks of the block-sparse cases: ``(w, mask, visible pairs a head, density)`` of a causal sliding
    window of ``w`` blocks (:func:`flashref.block_masks.sliding_window`), for w = every block, 32, 8, 2."""
    from flashref import block_masks

    n = block_masks.n_blocks(N, block)
    for w in (n, 32, 8, 2):
        mask = block_masks.sliding_window(n, window=w, causal=True, device=device)
        visible_pairs = int(block_masks.visible_pairs(mask.cpu(), N, N, block, causal=True)[0, 0])
        yield w, mask, visible_pairs, block_masks.density(mask)


def sparse_cases(N=16384, d=64, B=1, H=16, block=128):
    """flashref's time against the density of a causal sliding window (:func:`windows`), and at density 1 an
    all-True mask against no mask at all, forward and forward + backward. Both sides take the package's default
    dispatch (the Hopper kernels on an H100), so density 1 measures what the lists of visible blocks cost a user;
    each row carries ``graph_ms`` beside ``ms``, the kernels alone (:func:`_kernels_ms`)."""
    import torch

    from flashref import block_masks
    from flashref.triton import flash_attention

    rows = []
    q, k, v, do = _inputs(B, H, H, N, d)
    n = block_masks.n_blocks(N, block)

    def timed(case, mode, causal, work, **kw):
        def run(kw=kw, mode=mode):
            o = flash_attention(q, k, v, causal=causal, check_finite=False, **kw)
            if mode != "fwd":
                o.backward(do)
        ms, peak = _time(run, mode != "fwd", [q, k, v])
        graph_ms = _kernels_ms(run, [q, k, v] if mode != "fwd" else [])
        return _row(case, "flashref-triton", B, H, H, N, d, causal, ms, peak, work, graph_ms=graph_ms)

    for w, mask, visible_pairs, density in windows(N, block, q.device):
        for mode in ("fwd", "fwd+bwd"):
            rows.append(dict(timed(f"block-sparse {mode}", mode, True, pair_flops(B, H, visible_pairs, d, mode),
                                   block_mask=mask, block_size=block), window_blocks=w, density=density))
        for mode in ("fwd", "fwd+bwd"):
            if w == n:  # the dense kernel, causal: the reference time for density 1
                rows.append(timed(f"dense {mode}", mode, True, flops(B, H, N, N, d, True, mode)))
    for mode in ("fwd", "fwd+bwd"):  # density 1 without causality: an all-True mask against the dense kernel
        mask = torch.ones(1, 1, n, n, dtype=torch.bool, device=q.device)
        work = flops(B, H, N, N, d, False, mode)
        for kw in (dict(block_mask=mask, block_size=block), {}):
            row = timed(f"{'block-sparse' if kw else 'dense'} {mode}", mode, False, work, **kw)
            rows.append(dict(row, window_blocks=n if kw else None, density=1.0))
    return rows


_FLEX = None


def _flex():
    """flex_attention compiled once; every new shape compiles again, so the recompile limit is raised (past
    it Dynamo would fall back to the slow eager path without saying so)."""
    global _FLEX
    if _FLEX is None:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = 4096
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_block_mask(block_mask, N, block_size, causal, compile_mask=True):
    """FlexAttention's BlockMask for exactly our boolean block mask (and top-left causal): its mask_mod reads
    the block tensor, so both kernels see the same visible entries. Built with ``create_block_mask``,
    compiled (``compile_mask``) so that it never holds the N x N mask (at 64K tokens that is 32 GiB)."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = block_mask[0, 0]

    def mask_mod(b, h, q_idx, kv_idx):
        visible = bm[q_idx // block_size, kv_idx // block_size]
        return visible & (q_idx >= kv_idx) if causal else visible

    return create_block_mask(mask_mod, None, None, N, N, device=block_mask.device, BLOCK_SIZE=block_size,
                             _compile=compile_mask)


# (N, d, dtype, B, H) of the FlexAttention comparison
FLEX_GRID = [(4096, 64, "float16", 4, 16), (16384, 64, "float16", 1, 16), (65536, 64, "float16", 1, 8),
             (16384, 128, "float16", 1, 16), (16384, 64, "bfloat16", 1, 16)]


def _kernels_ms(run, tensors) -> float | None:
    """Milliseconds of GPU time of ``run`` (a forward, or a forward + backward into fresh gradients of
    ``tensors``) with the host taken out (:func:`graph_time_us`); None when it cannot be captured in a graph."""
    def call():
        for x in tensors:
            x.grad = None
        run()

    try:
        us = graph_time_us(call)
    except Exception:  # noqa: BLE001 (a backend that refuses capture in its own way: the row keeps its ms)
        import torch

        torch.cuda.synchronize()
        return None
    return None if us is None else us / 1e3


def flex_cases(grid=None, block=128):
    """flashref against FlexAttention on the same block masks, forward and forward + backward: yields each
    row as it is measured (the command line saves it at once: a run cut short keeps what it measured)."""
    import torch

    from flashref import block_masks
    from flashref.triton import flash_attention

    grid = grid or FLEX_GRID
    for N, d, dtype, B, H in grid:
        q, k, v, do = _inputs(B, H, H, N, d, dtype)
        n = block_masks.n_blocks(N, block)
        patterns = {"sliding window": (block_masks.sliding_window(n, window=8, causal=True, device="cuda"), True),
                    "bigbird": (block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device="cuda"), False),
                    "causal": (block_masks.causal_blocks(n, device="cuda"), True)}
        for pattern, (mask, causal) in patterns.items():
            pairs = int(block_masks.visible_pairs(mask.cpu(), N, N, block, causal=causal)[0, 0])
            extra = dict(pattern=pattern, density=block_masks.density(mask), pair_fraction=pairs / (N * N), dtype=dtype)
            try:
                fbm = flex_block_mask(mask, N, block, causal)
            except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
                yield {"case": "flex block mask", "impl": "flex", "N": N, "d": d, **extra,
                       "status": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                continue
            impls = {"flashref-triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, block_mask=mask,
                                                                        block_size=block, check_finite=False),
                     "flex": lambda q, k, v: _flex()(q, k, v, block_mask=fbm)}
            for impl, fn in impls.items():
                for mode in ("fwd", "fwd+bwd"):
                    work = pair_flops(B, H, pairs, d, mode)
                    try:
                        if mode == "fwd":
                            def run(fn=fn):
                                with torch.no_grad():
                                    return fn(q, k, v)
                        else:
                            run = _fwd_bwd(fn, q, k, v, do)
                        ms, peak = _time(run, mode != "fwd", [q, k, v])
                        graph_ms = _kernels_ms(run, [q, k, v])
                        yield _row(f"sparse vs flex {mode}", impl, B, H, H, N, d, causal, ms, peak, work,
                                   graph_ms=graph_ms, **extra)
                    except Exception as exc:  # noqa: BLE001
                        yield {"case": f"sparse vs flex {mode}", "impl": impl, "N": N, "d": d, **extra,
                               "status": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        del q, k, v, do
        torch.cuda.empty_cache()


def flex_table(rows) -> str:
    """The FlexAttention comparison as text: a line per pass, mask, N, d and dtype, with each side's time (ms,
    do_bench: host included) and Flex's over flashref's (above 1: flashref is faster), then the same ratio of
    the kernels alone (``graph_ms``; "-" where a run did not measure it or a call could not be captured)."""
    table = {}
    for r in rows:
        if r.get("case", "").startswith("sparse vs flex"):
            key = (r["case"].split()[-1], r.get("pattern", "-"), r["N"], r["d"], r.get("dtype", "float16"))
            table.setdefault(key, {})[r["impl"]] = r
    if not any("flex" in got for got in table.values()):
        return "this run has no FlexAttention rows"

    def ratio(got, field):
        f, o = (got.get(i, {}).get(field) for i in ("flex", "flashref-triton"))
        return f"{f / o:10.2f}" if f is not None and o is not None else f"{'-':>10}"

    def ms(got, impl):
        r = got.get(impl, {})
        return f"{r['ms']:10.3f}" if "ms" in r else f"{r.get('status', '-')[:10]:>10}"

    lines = [f"{'pass':8} {'pattern':15} {'N':>6} {'d':>4} {'dtype':9} {'density':>7} | {'flashref':>10} "
             f"{'flex':>10} {'flex/ours':>10} | {'kernels':>10}",
             f"{'':55}| {'ms':>10} {'ms':>10} {'':10} | {'flex/ours':>10}"]
    for (mode, pattern, N, d, dtype), got in sorted(table.items()):
        density = next(iter(got.values())).get("density", float("nan"))
        lines.append(f"{mode:8} {pattern:15} {N:6} {d:4} {dtype:9} {density:7.3f} | {ms(got, 'flashref-triton')} "
                     f"{ms(got, 'flex')} {ratio(got, 'ms')} | {ratio(got, 'graph_ms')}")
    return "\n".join(lines)


#: The counts of rounds the dropout-rounds part compiles: none (the counters, compares and selects alone: what
#: the mask costs without a generator), the shipped 7 (FlashAttention-2's, the fewest that Random123 found to
#: pass BigCrush), 10 (Random123's and cuRAND's default) and two between
PHILOX_ROUNDS_SWEPT = (0, 2, 4, 7, 10)

# What each child process of the dropout-rounds part runs: the dropout-cost part's flashref rows, one JSON line
# each, with the count of rounds its kernels were compiled with.
_ROUNDS_CHILD = """
import json
from flashref.bench import features_bench
from flashref.triton.forward import PHILOX_ROUNDS
for row in features_bench.dropout_cost_cases(impls=features_bench.FLASHREF_DROPOUT_IMPLS, kept=False):
    print(json.dumps({**row, "philox_rounds": PHILOX_ROUNDS.value}), flush=True)
"""


def dropout_rounds_cases(rounds=PHILOX_ROUNDS_SWEPT, child=_ROUNDS_CHILD):
    """What Philox's rounds cost (the dropout-rounds part): the dropout-cost part's flashref rows (forward +
    backward with p = 0.1 and without, interleaved) once for each count of ``rounds``. The count is compiled into
    the kernels and read once at import (``FLASHREF_PHILOX_ROUNDS``, :func:`flashref.triton.forward.philox_rounds`),
    so each count runs ``child`` in a Python process of its own. Rows ``dropout rounds fwd+bwd`` carry
    ``philox_rounds``, the count the child's kernels were built with (a child that fails gives one row with its
    last line of error). Time falls with the rounds; what is left at 0 is the mask's cost without a generator."""
    import json
    import os
    import subprocess

    for n in rounds:
        env = {**os.environ, "FLASHREF_PHILOX_ROUNDS": str(n)}
        run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            yield {**json.loads(line), "case": "dropout rounds fwd+bwd"}
        if run.returncode != 0 or not lines:
            last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}, no rows"])[-1]
            yield {"case": "dropout rounds fwd+bwd", "philox_rounds": n, "status": f"child failed: {last[:160]}"}


def _added(row) -> str:
    """'+ms added (ratio)' of a dropout-rounds row, '-' where there is none."""
    return "-" if row is None else f"+{row['ms'] - row['ms_no_dropout']:.2f} ({row['ratio']:.2f})"


def dropout_rounds_table(rows) -> str:
    """The dropout-rounds part as text: for each implementation, head dim and causality, what dropout adds to the
    step (ms) and the ratio (time without over time with) at each count of Philox's rounds."""
    cost = [r for r in rows if r.get("case") == "dropout rounds fwd+bwd" and "ms" in r]
    if not cost:
        return "this run has no dropout-rounds rows"
    counts = sorted({r["philox_rounds"] for r in cost})
    head = "".join(f"{f'{n} rounds':>16}" for n in counts)
    lines = [f"{'implementation':26} {'d':>4} {'causal':>6} {'ms, p = 0':>10}{head}"]
    by_point = {}
    for r in cost:
        by_point.setdefault((r["d"], r["causal"], r["impl"]), {})[r["philox_rounds"]] = r
    for (d, causal, impl), got in sorted(by_point.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                            FLASHREF_DROPOUT_IMPLS.index(kv[0][2]))):
        base = statistics.median(r["ms_no_dropout"] for r in got.values())
        cells = "".join(f"{_added(got.get(n)):>16}" for n in counts)
        lines.append(f"{impl:26} {d:4} {causal!s:>6} {base:10.2f}{cells}")
    return "\n".join(lines)


def _print(r):
    if "kept" in r:
        print(f"{r['case']:22} {r['impl']:28} kept {r['kept']:.5f} of {r['entries']} entries "
              f"(standard error {r['std_error']:.1e}), scaled by {r['scale']:.4f} / (1 - p)", flush=True)
        return
    extra = f" density {r['density']:.3f}" if "density" in r else ""
    extra += f" (without dropout {r['ms_no_dropout']:.3f} ms)" if "ms_no_dropout" in r else ""
    peak = f" peak+ {r['peak_extra_bytes'] / 2**20:8.1f} MiB" if r.get("peak_extra_bytes") is not None else ""
    what = f" {r.get('pattern', '')} N={r.get('N')} d={r.get('d')} {r.get('dtype', '')}"
    print(f"{r['case']:22} {r['impl']:28} H_kv={r.get('H_kv')} causal={r.get('causal')!s:5}{what}"
          + (f" {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s{peak}{extra}" if "ms" in r else f" {r.get('status')}"),
          flush=True)


def load_results(path=None) -> dict:
    """The committed run, book/data/features_bench.json (or ``path``), read by
    :func:`flashref.bench.results.load` (on Colab: the copy in the course repository)."""
    return results.load("features_bench.json", path)


#: The cases each part's rows are named by
PART_CASES = {"gqa": ("gqa fwd+bwd",), "dropout": ("dropout fwd+bwd",),
              "dropout-cost": ("dropout cost fwd+bwd", "dropout kept fraction"),
              "dropout-rounds": ("dropout rounds fwd+bwd",), "dropout-backward": ("dropout backward",),
              "sparse": ("block-sparse fwd", "block-sparse fwd+bwd", "dense fwd", "dense fwd+bwd"),
              "flex": ("sparse vs flex fwd", "sparse vs flex fwd+bwd", "flex block mask")}


def measures(row: dict) -> tuple:
    """What a row measures, as :func:`flashref.bench.results.recorder` groups rows: its part, and for the
    FlexAttention comparison its length too (``--flex-n``), for the dropout-rounds part its count of rounds
    (``--philox-rounds``). ``--append`` replaces the saved rows of each group a run measures again."""
    part = next((name for name, cases in PART_CASES.items() if row.get("case") in cases), None)
    return part, row.get("N") if part == "flex" else row.get("philox_rounds") if part == "dropout-rounds" else None


#: Where a run's results go unless ``--out`` says otherwise
OUT = "book/data/features_bench.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=OUT)
    p.add_argument("--parts", nargs="+", default=["gqa", "dropout", "sparse", "flex"],  # dropout-*: their own files
                   choices=["gqa", "dropout", "sparse", "flex", "dropout-cost", "dropout-rounds", "dropout-backward"])
    p.add_argument("--flex-n", nargs="+", type=int, default=None, metavar="N",
                   help="only these sequence lengths of the FlexAttention comparison (4096 16384 65536)")
    p.add_argument("--philox-rounds", nargs="+", type=int, default=None, metavar="R",
                   help="the dropout-rounds part's counts of rounds (default: "
                        + " ".join(map(str, PHILOX_ROUNDS_SWEPT)) + ")")
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (a run split over several calls; same GPU and versions), "
                        "replacing those of the parts (and --flex-n lengths) measured again")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flashref.bench features needs a CUDA device", file=sys.stderr)
        return 2
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(),
                         "python -m flashref.bench features --parts " + " ".join(args.parts)
                         + (f" --flex-n {' '.join(map(str, args.flex_n))}" if args.flex_n else "")
                         + (f" --philox-rounds {' '.join(map(str, args.philox_rounds))}" if args.philox_rounds else "")
                         + (f" --out {args.out}" if args.out != OUT else ""), dtype="float16")
    grid = [g for g in FLEX_GRID if args.flex_n is None or g[0] in args.flex_n]
    if not grid and "flex" in args.parts:
        p.error(f"--flex-n {args.flex_n}: none of the comparison's lengths {sorted({g[0] for g in FLEX_GRID})}")
    parts = {"gqa": gqa_cases, "dropout": dropout_cases, "sparse": sparse_cases, "flex": lambda: flex_cases(grid),
             "dropout-cost": dropout_cost_cases, "dropout-backward": dropout_backward_cases,
             "dropout-rounds": lambda: dropout_rounds_cases(args.philox_rounds or PHILOX_ROUNDS_SWEPT)}
    add = results.recorder(data, args.out, show=_print, group=measures)  # saved after each row
    for name in args.parts:
        for r in parts[name]():
            add(r)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
