"""Decoding benchmark: flash-decoding (keys split across programs) against the unsplit kernel, flashref's
forward kernel and PyTorch's attention backends, in one run (notebook ``13_beyond_one_gpu_and_decoding``).

    python -m flashref.bench decode               # the grid below (an H100: a few minutes)
    python -m flashref.bench decode --quick       # a smaller grid
    python -m flashref.bench decode --b 1 --impls sdpa-cudnn --num-splits 8 16 32 64 --out /tmp/splits.json
                                                  # flash_decode at fixed splits too: the data split_count needs

Decoding reads the whole KV cache once per generated token and does 1 FLOP per byte of it for each query
head sharing a K/V head (a multiply-add per fp16 number): it is bound by memory bandwidth, so the measure is
the bandwidth achieved, bytes of K and V read (plus q and o) over the time, and its fraction of the GPU's
peak (:func:`peak_bandwidth`: 3.35 TB/s for an H100 SXM).

Implementations, on the same inputs in the same run:

- ``flashref-decode``: :func:`flashref.triton.decode.flash_decode` on the dense cache (no ``cache_seqlens``, as
  the peers get it), the number of splits chosen from the SM count (recorded as ``num_splits``);
- ``flashref-decode num_splits=1``: the same kernel unsplit, the ablation: one program per (batch row, K/V
  head), as few as B * H_kv programs on 132 SMs;
- ``flashref-triton``: :func:`flashref.triton.flash_attention_forward`, the training kernel, which gives one
  program to each tile of 128 queries: with 1 to 16 queries, B * H programs, each reading its whole cache;
- ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``, ``sdpa-math``: ``scaled_dot_product_attention`` pinned
  to one backend with ``enable_gqa=True``; a backend that refuses the inputs is recorded with its message;
- ``sdpa causal_lower_right`` (N_q > 1 only): SDPA with ``torch.nn.attention.bias.causal_lower_right``, which
  dispatches to a kernel that knows bottom-right causality (the pinned backends get an explicit boolean mask,
  which the flash backend refuses).

Shapes: fp16, d = 128, H = 32 query heads on H_kv = 8 K/V heads (Llama-style grouped-query attention), and one
multi-head point (H_kv = 32); N_q = 1 (decoding one token) and N_q = 16 (speculative decoding or chunked
prefill; causal, aligned bottom-right: query i sees keys j <= N_k - 16 + i), N_k in {4K, 16K, 64K, 128K}, B in
{1, 4, 16}. Times are medians of :data:`ROUNDS` windows of ``triton.testing.do_bench`` per implementation, taken
in turn (each window a median itself; all of them kept as ``ms_rounds``); ``do_bench`` clears the L2 cache before
each call, so even a 16 MB cache is read from HBM; peak memory is ``torch.cuda.max_memory_allocated`` above the
inputs'.
Every row also holds the largest difference of its output from ``flashref-decode``'s. Out-of-memory is
recorded as "OOM". Results go to ``book/data/decode_bench.json`` with the device, library versions and
command; :func:`speedup_table` and :func:`plot` draw from that file (:func:`load_results`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

from flashref.bench import results
from flashref.bench.features_bench import _time, graph_time_us  # the suites' timers: do_bench's, and the kernels' alone

IMPLS = ["flashref-decode", "flashref-decode num_splits=1", "flashref-triton", "sdpa-flash", "sdpa-cudnn",
         "sdpa-efficient", "sdpa-math", "sdpa causal_lower_right"]
D, H, H_KV = 128, 32, 8
N_QS = (1, 16)
N_KS = (4096, 16384, 65536, 131072)
BATCHES = (1, 4, 16)
QUICK_N_KS = (4096, 65536)
QUICK_BATCHES = (1, 16)
#: the multi-head point: (H_kv, N_q, N_k, B)
MHA_POINT = (32, 1, 16384, 4)

#: Peak HBM bandwidth in bytes/s by device name (the first key the name contains, so a longer name that
#: contains a shorter one comes first: "GH200" before "H200"), from the vendors' data sheets;
#: :data:`DEFAULT_PEAK` (an H100 SXM) for a name not listed.
PEAKS = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "GH200": 4.0e12, "H200": 4.8e12,
         "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L4": 0.3e12, "T4": 0.32e12}
DEFAULT_PEAK = 3.35e12
DEVICE = "cuda"


# ---- counting and drawing: pure Python, tested on the CPU -------------------------------------------------

def peak_bandwidth(device_name: str) -> float:
    """The peak HBM bandwidth (bytes/s) of ``device_name`` from :data:`PEAKS`, else :data:`DEFAULT_PEAK`."""
    for key, peak in PEAKS.items():
        if key in (device_name or ""):
            return peak
    return DEFAULT_PEAK


def bytes_moved(B: int, H: int, H_kv: int, N_q: int, N_k: int, d: int, elem_bytes: int = 2) -> int:
    """The bytes one call must move at least: K and V read once (``2 B H_kv N_k d``), q read and o written
    (``2 B H N_q d``), in ``elem_bytes`` each. With grouped-query attention K and V are shared by H / H_kv
    query heads: read once, not once per query head."""
    return elem_bytes * (2 * B * H_kv * N_k * d + 2 * B * H * N_q * d)


def points(quick: bool = False, n_ks=None, batches=None) -> list[tuple]:
    """The grid, as (H_kv, N_q, N_k, B) tuples: every N_q, N_k and B at H_kv = 8, then the multi-head point."""
    n_ks = n_ks or (QUICK_N_KS if quick else N_KS)
    batches = batches or (QUICK_BATCHES if quick else BATCHES)
    grid = [(H_KV, n_q, n_k, b) for n_q in N_QS for b in batches for n_k in n_ks]
    return grid + [MHA_POINT]


def _ok(rows):
    return [r for r in rows if r.get("status", "ok") == "ok" and "ms" in r]


def _short(impl: str) -> str:
    """A column title of at most 10 characters."""
    return {"flashref-decode": "decode", "flashref-decode num_splits=1": "unsplit", "flashref-triton": "triton",
            "sdpa causal_lower_right": "lower-rt"}.get(impl, impl.removeprefix("sdpa-"))


def speedup_table(rows, base: str = "flashref-decode") -> str:
    """A text table, one line per point (N_q, H_kv, B, N_k): ``base``'s time, bandwidth and fraction of the
    peak, then its speedup over each other implementation (their time over its time; a status such as "OOM"
    or "refused" where one did not run)."""
    impls = [i for i in IMPLS if i != base and any(r["impl"] == i for r in rows)]
    get = {(r["impl"], r["N_q"], r["H_kv"], r["B"], r["N_k"]): r for r in rows}
    pts = sorted({(r["N_q"], r["H_kv"], r["B"], r["N_k"]) for r in rows})
    head = (f"{'N_q':>3s} {'H_kv':>4s} {'B':>3s} {'N_k':>7s} {'ms':>8s} {'GB/s':>7s} {'peak':>5s}  x faster than: "
            + " ".join(f"{_short(i):>9s}" for i in impls))
    lines = [head]
    for n_q, h_kv, b, n_k in pts:
        mine = get.get((base, n_q, h_kv, b, n_k), {})
        if "ms" in mine:
            lead = f"{mine['ms']:8.3f} {mine['gb_per_s']:7.0f} {mine['bw_fraction']:5.0%}"
        else:
            lead = f"{mine.get('status', '-')[:22]:>22s}"
        cells = []
        for i in impls:
            other = get.get((i, n_q, h_kv, b, n_k), {})
            if "ms" in other and "ms" in mine:
                cells.append(f"{other['ms'] / mine['ms']:9.2f}")
            else:
                cells.append(f"{_status_word(other.get('status', '-')):>9s}")
        lines.append(f"{n_q:3d} {h_kv:4d} {b:3d} {n_k:7d} {lead}                " + " ".join(cells))
    return "\n".join(lines)


def host_table(rows, impls=("flashref-decode", "sdpa-flash", "sdpa-cudnn"), n_q: int = 1, h_kv: int = H_KV) -> str:
    """A text table, one line per (B, N_k) of the points with ``n_q`` queries and ``h_kv`` K/V heads: for each of
    ``impls`` the GPU time per call as measured (``ms``, in microseconds) and the host time one call takes to
    return (``host_us``). Where the host time is the larger, a loop of such calls is bound by the CPU."""
    get = {(r["impl"], r["B"], r["N_k"]): r for r in _ok(rows) if r["N_q"] == n_q and r["H_kv"] == h_kv}
    pts = sorted({(b, n_k) for _, b, n_k in get})
    head = f"{'B':>3s} {'N_k':>7s}  " + "  ".join(f"{_short(i) + ' us, host':>16s}" for i in impls)
    lines = [head]
    for b, n_k in pts:
        cells = []
        for i in impls:
            r = get.get((i, b, n_k))
            cells.append(f"{r['ms'] * 1e3:7.0f}, {r['host_us']:6.0f}" if r and "host_us" in r else f"{'-':>16s}")
        lines.append(f"{b:3d} {n_k:7d}  " + "  ".join(f"{c:>16s}" for c in cells))
    return "\n".join(lines)


def graph_table(rows, impls=("flashref-decode", "sdpa-flash", "sdpa-cudnn"), n_q: int = 1, h_kv: int = H_KV) -> str:
    """A text table, one line per (B, N_k) as :func:`host_table`'s: each of ``impls``' time per call with the host
    taken out (``graph_us``, from CUDA-graph replay: :func:`graph_time_us`), then the peers' times over
    flashref's (above 1: flashref's kernels are the faster). Where ``do_bench``'s time and this one differ, the
    host set the pace of the timed calls."""
    get = {(r["impl"], r["B"], r["N_k"]): r for r in _ok(rows) if r["N_q"] == n_q and r["H_kv"] == h_kv}
    pts = sorted({(b, n_k) for _, b, n_k in get})
    base, peers = impls[0], impls[1:]
    lines = [f"{'B':>3s} {'N_k':>7s}  " + "  ".join(f"{_short(i) + ' graph us':>16s}" for i in impls) + "  "
             + "  ".join(f"{_short(i) + ' / ' + _short(base):>16s}" for i in peers)]
    for b, n_k in pts:
        us = [get.get((i, b, n_k), {}).get("graph_us") for i in impls]
        cells = [f"{u:16.1f}" if u is not None else f"{'-':>16s}" for u in us]
        ratios = [f"{u / us[0]:16.2f}" if u is not None and us[0] else f"{'-':>16s}" for u in us[1:]]
        lines.append(f"{b:3d} {n_k:7d}  " + "  ".join(cells + ratios))
    return "\n".join(lines)


def _status_word(status: str) -> str:
    if status == "OOM" or status == "-":
        return status
    return "refused" if status.startswith("refused") or "No available kernel" in status else status[:8]


def plot(data, path=None, n_q: int = 1, h_kv: int = H_KV, impls=None):
    """The fraction of peak bandwidth achieved against N_k, one panel per batch size B, one line per
    implementation, for the points with ``n_q`` queries and ``h_kv`` K/V heads; returns the figure (saved to
    ``path`` if given)."""
    import matplotlib.pyplot as plt

    rows = [r for r in _ok(data["results"]) if r["N_q"] == n_q and r["H_kv"] == h_kv]
    impls = impls or [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    batches = sorted({r["B"] for r in rows}) or [None]
    fig, axes = plt.subplots(1, len(batches), figsize=(max(6.5, 3.3 * len(batches)), 3.0), squeeze=False,
                             sharey=True)
    for ax, b in zip(axes[0], batches):
        for impl in impls:
            pts = sorted((r["N_k"], r["bw_fraction"]) for r in rows if r["impl"] == impl and r["B"] == b)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=impl,
                        lw=2.2 if impl == "flashref-decode" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"B = {b}", fontsize=9)
        ax.set_xlabel("N_k (keys in the cache)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("fraction of peak bandwidth", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4) or 1, fontsize=7, frameon=False)
    what = "decoding one query" if n_q == 1 else f"{n_q} queries, causal bottom-right"
    heads, d = (rows[0]["H"], rows[0]["d"]) if rows else (H, D)
    fig.suptitle(f"fp16, {what}, H = {heads}, H_kv = {h_kv}, d = {d}, on {data.get('device', '?')}", fontsize=9)
    fig.tight_layout(rect=(0, 0.14, 1, 0.93))
    if path:
        fig.savefig(path, dpi=110)
    return fig


def load_results(path=None) -> dict:
    """The committed run, book/data/decode_bench.json (or ``path``), read by :func:`flashref.bench.results.load`."""
    return results.load("decode_bench.json", path)


# ---- measuring --------------------------------------------------------------------------------------------

def _inputs(B, H, H_kv, N_q, N_k, d):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, H, N_q, d, device=DEVICE, dtype=torch.float16, generator=g)
    k, v = (torch.randn(B, H_kv, N_k, d, device=DEVICE, dtype=torch.float16, generator=g) for _ in range(2))
    return q, k, v


def bottom_right_mask(N_q: int, N_k: int, device=None):
    """The boolean ``attn_mask`` (True: attend) of bottom-right causality: query i sees keys j <= N_k - N_q + i."""
    import torch

    i = torch.arange(N_q, device=device)[:, None]
    j = torch.arange(N_k, device=device)[None, :]
    return j <= N_k - N_q + i


def split_impl(num_splits: int) -> str:
    """The name of flash_decode's row with ``num_splits`` fixed (the sweep of ``--num-splits``)."""
    return f"flashref-decode num_splits={num_splits}"


def implementations(N_q: int, N_k: int, causal: bool, seqlens, impls=IMPLS, splits=()) -> dict:
    """``{name: fn(q, k, v) -> o}`` for the names in ``impls`` that apply (``sdpa causal_lower_right`` only
    when causal), then one :func:`split_impl` per number in ``splits``. SDPA's pinned backends get the
    bottom-right mask as a boolean ``attn_mask`` when causal; their ``fn.backend()`` makes the ``sdpa_kernel``
    context to call them in (entered once around each timing window: entering it costs tens of microseconds of
    host time, which would be charged to the backend, not its kernel; a factory, since one such context can be
    entered only once)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashref.triton import flash_attention_forward
    from flashref.triton.decode import flash_decode

    window = (-1, N_k - N_q) if causal else (-1, -1)  # bottom-right causal as flashref's top-left window
    mask = bottom_right_mask(N_q, N_k, DEVICE) if causal else None
    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}

    def pinned(backend):
        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        fn.backend = functools.partial(sdpa_kernel, backend)  # entered around a timing, not inside each call
        return fn

    def lower_right(q, k, v):
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(N_q, N_k), enable_gqa=True)

    def split(num_splits=None):  # flash_decode with the rule's splits (None) or a fixed number
        return lambda q, k, v: flash_decode(q, k, v, seqlens, causal=causal, num_splits=num_splits,
                                            check_finite=False)

    fns = {"flashref-decode": split(), split_impl(1): split(1),
           "flashref-triton": lambda q, k, v: flash_attention_forward(q, k, v, window_size=window, check_finite=False,
                                                                      kernel="triton")[0],
           **{name: pinned(backend) for name, backend in backends.items()}}
    if causal:
        fns["sdpa causal_lower_right"] = lower_right
    chosen = {name: fns[name] for name in impls if name in fns}
    for s in splits:
        chosen.setdefault(split_impl(s), split(s))
    return chosen


def _backend(fn):
    """A fresh context to call ``fn`` in: its pinned SDPA backend, or nothing."""
    return fn.backend() if hasattr(fn, "backend") else contextlib.nullcontext()


def _status(exc) -> str:
    if results.is_oom(exc):
        return "OOM"
    text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return f"refused: {type(exc).__name__}: {text}"


def host_time_us(fn, calls: int = 100) -> float:
    """Microseconds of host time one call takes to return, launches queued but not waited for (the mean of
    ``calls`` calls in a row): the floor on a step's time that no GPU speed removes. In ``do_bench``, which
    clears the L2 cache on the GPU before each call, the host's next call is prepared while the GPU clears, so
    a host time below the clearing plus the kernels' time does not show in ``ms``."""
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


#: ``do_bench`` windows per implementation and point, taken in turn (A, B, C, A, B, C, ...): every implementation
#: is timed under the same drift of clocks and temperature, and the spread of its windows is recorded beside the
#: median (``ms_rounds``), so that a difference smaller than that spread reads as the noise it is.
ROUNDS = 3


def in_turn(timers: dict, windows: dict, rounds: int, on_error=lambda impl, exc: None) -> dict:
    """Extend each implementation's list of ``windows`` (its first already taken) to ``rounds``, one more window of
    each in turn: ``timers[impl]()`` takes one. One that raises (out of memory this time, say) keeps the windows it
    has, and ``on_error(impl, exc)`` runs; the others go on. Returns ``windows``."""
    for _ in range(rounds - 1):
        for impl, timer in timers.items():
            try:
                windows[impl].append(timer())
            except Exception as exc:  # noqa: BLE001
                on_error(impl, exc)
    return windows


def measure_point(H_kv: int, N_q: int, N_k: int, B: int, impls=IMPLS, heads: int = H, d: int = D, peak_bw=DEFAULT_PEAK,
                  splits=(), rounds: int = ROUNDS):
    """The rows of one point, one per implementation and one per fixed number of ``splits`` (a failure, out of
    memory included, is a row too). ``ms`` is the median of ``rounds`` do_bench windows per implementation, taken
    in turn after every implementation has run once (``ms_rounds``: all of them). Every implementation gets the same
    dense cache of N_k keys: flash_decode without ``cache_seqlens``, as SDPA gets it (a KV cache with lengths per
    row, :class:`flashref.triton.decode.KVCache`'s call, reads each length first: 0.5-0.9 us more at B 16 with 4K
    keys and at B 1, an A/B on the H100)."""
    import statistics

    import torch
    import triton

    from flashref.triton.decode import decode_plan

    causal = N_q > 1
    fields = dict(case="decode" if N_q == 1 else "chunk causal", B=B, H=heads, H_kv=H_kv, N_q=N_q, N_k=N_k, d=d,
                  causal=causal, bytes=bytes_moved(B, heads, H_kv, N_q, N_k, d))
    torch.cuda.empty_cache()
    try:
        q, k, v = _inputs(B, heads, H_kv, N_q, N_k, d)
        status = None
    except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
        status = _status(exc)
    if status is not None:
        torch.cuda.empty_cache()
        for impl in [*impls, *map(split_impl, splits)]:
            yield {**fields, "impl": impl, "status": status}
        return
    reference = None
    fns = implementations(N_q, N_k, causal, None, impls, splits)
    with torch.no_grad():  # a discarded round first: the first timing on freshly written inputs ran slow (an
        _time(lambda: fns["flashref-decode"](q, k, v), False, None)  # H100: 3.25 ms, then 2.74 ms, same kernel)
    rows, timed = [], {}  # timed: impl -> (fn, its do_bench windows) of those that ran
    for impl, fn in fns.items():
        row = {**fields, "impl": impl}
        if impl == "flashref-decode":
            row["num_splits"] = decode_plan(q, k)["num_splits"]
        if impl.startswith("flashref-decode num_splits="):
            row["num_splits"] = int(impl.rsplit("=", 1)[1])
        try:
            with torch.no_grad(), _backend(fn):
                out = fn(q, k, v)  # compiles (and autotunes flashref-triton) outside the timing
                if reference is None and impl == "flashref-decode":
                    reference = out
                elif reference is not None:
                    row["max_abs_diff_vs_decode"] = float((out.float() - reference.float()).abs().max())
                del out
                ms, peak = _time(lambda: fn(q, k, v), False, None)  # features_bench's: peak, then do_bench
                host_us = host_time_us(lambda: fn(q, k, v))
                graph_us = graph_time_us(lambda: fn(q, k, v))
            row.update(status="ok", peak_extra_bytes=peak, host_us=host_us, graph_us=graph_us)
            timed[impl] = (fn, [ms])
        except Exception as exc:  # noqa: BLE001 (a backend that refuses, or OOM, is recorded)
            row["status"] = _status(exc)
        torch.cuda.empty_cache()
        rows.append(row)
    def window(fn):
        with torch.no_grad(), _backend(fn):
            return triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")

    failed = {}  # impl -> the status of a later window that raised (its row keeps the windows it has)

    def on_error(impl, exc):
        failed[impl] = _status(exc)
        torch.cuda.empty_cache()

    in_turn({impl: (lambda fn=fn: window(fn)) for impl, (fn, _) in timed.items()},
            {impl: windows for impl, (_, windows) in timed.items()}, rounds, on_error=on_error)
    for row in rows:
        if row["impl"] in failed:
            row["rounds_status"] = failed[row["impl"]]
        if row["impl"] in timed:
            windows = timed[row["impl"]][1]
            ms = statistics.median(windows)
            row.update(ms=ms, ms_rounds=windows, gb_per_s=fields["bytes"] / (ms * 1e-3) / 1e9,
                       bw_fraction=fields["bytes"] / (ms * 1e-3) / peak_bw)
        yield row
    del q, k, v, reference, timed
    torch.cuda.empty_cache()


def describe(r) -> str:
    """One row as a line of text (the progress output)."""
    head = f"{r['impl']:28s} N_q={r['N_q']:<2d} H_kv={r['H_kv']:<2d} B={r['B']:<2d} N_k={r['N_k']:<6d}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')}"
    splits = f" splits={r['num_splits']}" if "num_splits" in r else ""
    return (f"{head} {r['ms']:8.4f} ms {r['gb_per_s']:7.0f} GB/s ({r['bw_fraction']:4.0%}) "
            f"peak+ {r['peak_extra_bytes'] / 2**20:7.1f} MiB host {r.get('host_us', float('nan')):5.0f} us "
            f"graph {r.get('graph_us') if r.get('graph_us') is not None else float('nan'):7.1f} us{splits}")


def point_key(row) -> tuple:
    """What a row measures: its point and implementation. With ``--append``, a row measured again replaces the
    saved one of the same key (a point timed again after a noisy window), and new keys are added."""
    return row["H_kv"], row["N_q"], row["N_k"], row["B"], row["impl"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashref.bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="book/data/decode_bench.json")
    p.add_argument("--quick", action="store_true", help=f"N_k in {QUICK_N_KS}, B in {QUICK_BATCHES}")
    p.add_argument("--n-k", nargs="+", type=int, default=None, metavar="N_K", help=f"cache lengths (default {N_KS})")
    p.add_argument("--b", nargs="+", type=int, default=None, metavar="B", help=f"batch sizes (default {BATCHES})")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, metavar="IMPL",
                   help="some of the implementations (default: all; flashref-decode always runs, first)")
    p.add_argument("--num-splits", nargs="+", type=int, default=[], metavar="S",
                   help="also time flash_decode with each fixed number of splits (a sweep for split_count)")
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (a run split over several calls; same GPU and versions); "
                        "a point and implementation measured again replaces its saved row")
    args = p.parse_args(argv)
    if any(s < 1 for s in args.num_splits):
        p.error(f"--num-splits must be positive, got {args.num_splits}")
    args.impls = ["flashref-decode"] + [i for i in IMPLS if i in args.impls and i != "flashref-decode"]
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flashref.bench decode needs a CUDA device", file=sys.stderr)
        return 2
    from tqdm.auto import tqdm

    device = torch.cuda.get_device_name()
    peak = peak_bandwidth(device)
    data = results.start(args.out if args.append else None, device, results.versions(),
                         results.command("decode", argv), dtype="float16", peak_bytes_per_s=peak)
    add = results.recorder(data, args.out, show=lambda r: tqdm.write(describe(r)), group=point_key)
    grid = points(args.quick, args.n_k, args.b)
    for h_kv, n_q, n_k, b in tqdm(grid, desc="decode bench"):
        for row in measure_point(h_kv, n_q, n_k, b, args.impls, peak_bw=peak, splits=args.num_splits):
            add(row)
    print(speedup_table(data["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
