"""The kernel inside a model: the GPT of :mod:`flashref.model` trained and timed with each attention.

    python -m flashref.bench model                    # every part, about 10 minutes on an H100
    python -m flashref.bench model --quick            # fewer steps and lengths, to try it out
    python -m flashref.bench model --parts speed maxlen --append

Parts (each a list of rows in ``book/data/model_bench.json``, saved with the device, versions and command):

- ``train``: the same model, seed and batches (6 layers, 6 heads of 64, 384 wide, 256 characters, batch
  64, 1,000 AdamW steps in bf16 autocast) with ``plain``, ``sdpa`` twice (its backward adds dQ in a
  nondeterministic order: the second run is the noise floor) and ``flashref``; and at 1,024 characters
  (batch 16) with ``flashref``, ``local`` (a window of 256) and ``performer`` (128 random features). Loss at
  every step, validation loss every 100, a sample of generated text.
- ``compile``: step time eager against ``torch.compile`` for the ``flashref`` and ``sdpa`` models (1,024
  characters), and the graph breaks ``torch._dynamo.explain`` counts.
- ``speed``: step time and tokens/s at N = 512 to 16K with N x batch = 16K tokens a step, for ``plain``,
  ``sdpa`` and ``flashref``, with the share of GPU time spent in attention (torch profiler: kernels launched
  inside the attention's forward and backward) and peak memory.
- ``maxlen``: the longest sequence (batch 1) each of ``plain``, ``sdpa`` and ``flashref`` trains at, by
  doubling N until a step runs out of memory, with the peak memory of each length.
- ``approx``: causal attention alone (6 heads of 64, 16K tokens, bf16), forward + backward, exact
  (``flashref``, ``sdpa``, ``plain``) against ``local`` and ``performer``, N = 256 to 16K, with the
  approximations' relative error against exact attention on the same random inputs.

- ``generate``: the ``flashref`` model (256 characters) trained briefly (600 steps), then made to write: a
  sample with the KV cache, and tokens/s at B = 1, 16 and 64 sequences of a 10-character prompt plus 246
  new characters (the model's context of 256), regenerating the whole context each step (``kv_cache=False``)
  against keeping its keys and values (``kv_cache=True``, flash-decoding), with the share of draws on which the
  two agree
  (notebook ``13_beyond_one_gpu_and_decoding``).

Notebook ``11_attention_in_a_model`` draws its plots from the file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from flashref.bench import results

OUT = "book/data/model_bench.json"
TOKENS = 16384  # tokens a step in the speed part, and in the attention-alone timings
TRAIN = dict(n_layer=6, n_head=6, n_embd=384)
SPEED_N = [512, 1024, 2048, 4096, 8192, 16384]
APPROX_N = [256, 512, 1024, 2048, 4096, 8192, 16384]


def _unless_oom(row: dict, measure) -> dict:
    """``row`` with status "ok" and what ``measure()`` returns, or status "OOM" when the GPU ran out of memory
    (a result: how far each variant goes). Any other failure is raised. What ``measure`` built is freed."""
    import torch

    try:
        row.update(status="ok", **measure())
    except Exception as exc:  # noqa: BLE001 (only out-of-memory is caught: it is re-raised otherwise)
        if not results.is_oom(exc):
            raise
        row.update(status="OOM")
    torch.cuda.empty_cache()
    return row


def _corpus():
    from flashref import model

    text = model.load_shakespeare()
    tok = model.CharTokenizer(text)
    train, val = model.split(tok.encode(text))
    return tok, train, val


def _build(attention, block_size, seed=0, device="cuda", **over):
    import torch

    from flashref import model

    torch.manual_seed(seed)
    cfg = model.GPTConfig(block_size=block_size, attention=attention, **{**TRAIN, **over})
    return model.GPT(cfg).to(device)


def train_runs(steps=1000, quick=False, device="cuda"):
    """The loss curves of the exactness runs and of the approximations' runs (rows of part "train")."""
    import torch

    from flashref import model

    tok, train, val = _corpus()
    runs = [("plain", 256, 64, {}), ("sdpa", 256, 64, {}), ("sdpa", 256, 64, {}), ("flashref", 256, 64, {}),
            ("flashref", 1024, 16, {}), ("local", 1024, 16, {"window": 256}),
            ("performer", 1024, 16, {"features": 128})]
    seen = set()
    for attention, T, B, over in runs:
        run = 2 if (attention, T) in seen else 1
        seen.add((attention, T))
        gpt = _build(attention, T, device=device, **over)
        log = model.train(gpt, model.Batches(train, B, T, seed=0), steps, lr=1e-3, warmup=min(100, steps // 10),
                          val=model.Batches(val, B, T, seed=1), eval_every=max(1, steps // 10), eval_iters=20)
        final = model.evaluate(gpt, model.Batches(val, B, T, seed=2), iters=50)
        row = {"part": "train", "attention": attention, "run": run, "T": T, "batch": B, "steps": steps, **over,
               "loss": log["loss"], "val": log["val"], "final_val": final,
               "median_step_ms": sorted(log["ms"])[len(log["ms"]) // 2]}
        if attention == "flashref" and T == 1024:
            row["approx_error"] = approximation_error(gpt, model.Batches(val, B, T, seed=3).next(device)[0])
        if attention == "flashref" and T == 256:
            g = torch.Generator().manual_seed(0)
            start = tok.encode("\n")[None].to(device)
            row["sample"] = tok.decode(gpt.generate(start, 300 if not quick else 60, top_k=None, generator=g)[0])
        yield row
        del gpt
        torch.cuda.empty_cache()


@contextlib.contextmanager
def captured_attention_inputs():
    """Inside, every attention call of :mod:`flashref.model` appends its (q, k, v) to the yielded list."""
    from flashref import model

    seen, attend = [], model.attend

    def recording(name, q, k, v, *args, **kw):
        seen.append((q.detach(), k.detach(), v.detach()))
        return attend(name, q, k, v, *args, **kw)

    model.attend = recording
    try:
        yield seen
    finally:
        model.attend = attend


def approximation_error(gpt, x, window=256, features=128) -> dict:
    """Relative error ||O - O_exact|| / ||O_exact|| of local and Performer attention on the queries, keys and
    values a trained model computes for the tokens ``x``, per layer (exact: fp32)."""
    import torch

    from flashref import model, torch_attention

    with torch.no_grad(), captured_attention_inputs() as seen:
        with model.autocast(x.device):
            gpt(x)
    W = torch_attention.performer_features(seen[0][0].shape[-1], features, generator=torch.Generator().manual_seed(0))
    out = {"local": [], "performer": [], "window": window, "features": features}
    with torch.no_grad():
        for q, k, v in seen:
            q, k, v = q.float(), k.float(), v.float()
            exact = torch_attention.sdpa_attention(q, k, v, causal=True)
            for name, o in (("local", torch_attention.local_attention(q, k, v, window=window)),
                            ("performer", torch_attention.performer_attention(q, k, v, W.to(q.device)))):
                out[name].append(float((o - exact).norm() / exact.norm()))
    return out


def _step_time(step, steps=10, warmup=3):
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / steps


def _trainer(gpt, B, T, device="cuda", compiled=None):
    """One training step of ``gpt`` on fixed random tokens (the data does not change the step's time);
    ``compiled``: None (eager) or a ``torch.compile`` mode ("default", "reduce-overhead": CUDA graphs)."""
    import torch

    from flashref import model

    opt = model.make_optimizer(gpt)
    x = torch.randint(0, gpt.cfg.vocab_size, (B, T), device=device)
    fwd = gpt if compiled is None else torch.compile(gpt, mode=compiled)

    def step():
        with model.autocast(device):
            _, loss = fwd(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def compile_cases(T=1024, B=16, modes=("default", "reduce-overhead")):
    """Eager against compiled step time (``torch.compile``'s default mode, and "reduce-overhead", which
    replays the step's kernels as CUDA graphs), and the graph breaks ``torch._dynamo.explain`` counts."""
    import torch

    for attention in ("flashref", "sdpa"):
        gpt = _build(attention, T)
        x = torch.randint(0, gpt.cfg.vocab_size, (B, T), device="cuda")
        explain = torch._dynamo.explain(gpt)(x, x)
        torch._dynamo.reset()
        row = {"part": "compile", "attention": attention, "T": T, "batch": B, "eager_ms": _step_time(_trainer(gpt, B, T)),
               "graph_breaks": explain.graph_break_count, "graphs": explain.graph_count,
               "break_reasons": [str(r.reason)[:200] for r in explain.break_reasons]}
        for mode in modes:
            start = time.perf_counter()
            step = _trainer(gpt, B, T, compiled=mode)
            step()
            torch.cuda.synchronize()
            row[f"compile_s[{mode}]"] = time.perf_counter() - start
            row[f"compiled_ms[{mode}]"] = _step_time(step)
            step = None
            torch._dynamo.reset()
        yield row
        del gpt
        torch.cuda.empty_cache()


class _Marked:
    """Attention wrapped so that its forward and its backward run inside profiler ranges named
    ``attention`` and ``attention_backward``: the profiler then sums the GPU time of the kernels each
    launched. The inner graph is built under enable_grad and differentiated in the backward."""

    @staticmethod
    def make():
        import torch
        from torch.profiler import record_function

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, name, window, features, q, k, v):
                from flashref import model

                with torch.enable_grad(), record_function("attention"):
                    inner = [t.detach().requires_grad_() for t in (q, k, v)]
                    o = model._ATTEND(name, *inner, window=window, features=features)
                ctx.inner, ctx.o = inner, o
                return o.detach()

            @staticmethod
            def backward(ctx, do):
                with record_function("attention_backward"):
                    grads = torch.autograd.grad(ctx.o, ctx.inner, do)
                return (None, None, None, *grads)

        return Fn


@contextlib.contextmanager
def marked_attention():
    """Inside, every attention call of :mod:`flashref.model` runs in the profiler's named ranges."""
    from flashref import model

    Fn = _Marked.make()
    model._ATTEND = model.attend
    model.attend = lambda name, q, k, v, window=128, features=None: Fn.apply(name, window, features, q, k, v)
    try:
        yield
    finally:
        model.attend = model._ATTEND
        del model._ATTEND


def attention_share(step, steps=3) -> dict:
    """GPU time of the attention ranges and of every kernel over ``steps`` profiled steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with marked_attention():
        step()  # warm: the marked path builds its graph differently
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    # Each kernel is listed under the CPU op that launched it; a named range's device time counts the kernels
    # of every op inside it. (GPU-side copies of the ranges are left out: they would count twice.)
    from torch.autograd import DeviceType

    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    marked = [e for e in cpu if e.name in ("attention", "attention_backward")]
    att = sum(e.device_time_total for e in marked)
    total = sum(k.duration for e in cpu for k in e.kernels)
    kernels = {}  # which kernels did the attention's work (SDPA's backend shows in their names)

    def walk(e):
        for kn in e.kernels:
            kernels[kn.name] = kernels.get(kn.name, 0.0) + kn.duration
        for child in e.cpu_children:
            walk(child)

    for e in marked:
        walk(e)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
    return {"attention_gpu_us": att / steps, "total_gpu_us": total / steps, "attention_share": att / total,
            "attention_kernels": [name[:120] for name, _ in top]}


def speed_cases(ns=SPEED_N, attentions=("plain", "sdpa", "flashref"), compiled_ns=(1024, 4096, 16384)):
    """Rows of part "speed": eager steps with their attention share, and at ``compiled_ns`` the same model
    compiled with CUDA graphs."""
    import torch
    from tqdm.auto import tqdm

    for T in tqdm(ns, desc="speed"):
        B = max(1, TOKENS // T)
        for attention in attentions:
            torch.cuda.empty_cache()

            def measure():
                step = _trainer(_build(attention, T), B, T)
                step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ms = _step_time(step)
                return dict(step_ms=ms, tokens_per_s=B * T / (ms * 1e-3),
                            peak_bytes=int(torch.cuda.max_memory_allocated()), **attention_share(step))

            yield _unless_oom({"part": "speed", "attention": attention, "T": T, "batch": B}, measure)
        if T in compiled_ns:
            yield from _compiled_speed(T, B, attentions)


def _compiled_speed(T, B, attentions, mode="reduce-overhead"):
    """Rows of part "speed" for the model compiled with CUDA graphs: the step's GPU time without the CPU's
    launch overhead (no profile: the marked ranges would not survive compilation)."""
    import torch

    for attention in attentions:
        if attention == "plain":
            continue

        def measure():
            step = _trainer(_build(attention, T), B, T, compiled=mode)
            step()
            torch.cuda.synchronize()
            ms = _step_time(step)
            return dict(step_ms=ms, tokens_per_s=B * T / (ms * 1e-3))

        row = _unless_oom({"part": "speed", "attention": attention, "T": T, "batch": B, "compiled": mode}, measure)
        torch._dynamo.reset()
        yield row


def maxlen_cases(attentions=("plain", "sdpa", "flashref"), start=4096, cap=1 << 20):
    """Rows of part "maxlen": one per (variant, length) tried, status "ok" with the peak memory or "OOM".
    The Triton kernels launch their first fitting config here (no autotuning at every new length)."""
    import torch

    saved = os.environ.get("FLASHREF_TRITON_AUTOTUNE")
    os.environ["FLASHREF_TRITON_AUTOTUNE"] = "0"
    try:
        for attention in attentions:
            T = start
            while T <= cap:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

                def measure():
                    step = _trainer(_build(attention, T), 1, T)
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    return dict(peak_bytes=int(torch.cuda.max_memory_allocated()), step_s=time.perf_counter() - t0)

                row = _unless_oom({"part": "maxlen", "attention": attention, "T": T, "batch": 1}, measure)
                yield row
                if row["status"] != "ok":
                    break
                T *= 2
    finally:
        if saved is None:
            os.environ.pop("FLASHREF_TRITON_AUTOTUNE", None)
        else:
            os.environ["FLASHREF_TRITON_AUTOTUNE"] = saved


def approx_cases(ns=APPROX_N, H=6, d=64, window=256, features=128):
    """Rows of part "approx": forward + backward time of causal attention alone, and the relative error
    ||O - O_exact|| / ||O_exact|| of the approximations on the same inputs (fp32 exact reference)."""
    import torch
    import triton

    from flashref import model, torch_attention

    W = torch_attention.performer_features(d, features, generator=torch.Generator().manual_seed(0)).cuda()
    for T in ns:
        B = max(1, TOKENS // T)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, T, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        with torch.no_grad():
            exact = torch_attention.sdpa_attention(q.float(), k.float(), v.float(), causal=True)
        for attention in ("flashref", "sdpa", "plain", "local", "performer"):
            row = {"part": "approx", "attention": attention, "T": T, "batch": B, "H": H, "d": d}
            if attention == "local":
                row["window"] = window
            if attention == "performer":
                row["features"] = features
            xs = [x.detach().requires_grad_() for x in (q, k, v)]

            def run():
                model.attend(attention, *xs, window=window, features=W).backward(do)

            def measure():
                with torch.no_grad():
                    o = model.attend(attention, q, k, v, window=window, features=W)
                error = float((o.float() - exact).norm() / exact.norm())
                return dict(rel_error=error, ms=triton.testing.do_bench(run, warmup=25, rep=100, grad_to_none=xs,
                                                                        return_mode="median"))

            yield _unless_oom(row, measure)


def amdahl(share: float, kernel_speedup: float) -> float:
    """The whole step's speed-up when a part taking ``share`` of the time gets ``kernel_speedup`` faster."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    if kernel_speedup <= 0:
        raise ValueError(f"kernel_speedup must be positive, got {kernel_speedup}")
    return 1.0 / ((1.0 - share) + share / kernel_speedup)


def generate_cases(train_steps=600, batches=(1, 16, 64), prompt="ROMEO:\nO, ", new_tokens=None, device="cuda"):
    """Rows of part "generate": the flashref model trained ``train_steps`` steps, a sample written with the
    KV cache, then per batch size the wall time of generating ``new_tokens`` characters (default: up to
    ``block_size``) after ``prompt`` with and without the cache, as tokens/s (new tokens of all sequences
    over the seconds, the sampling on the CPU included in both), and how many of the drawn characters the
    two runs share (bf16: the two paths round differently, so one draw may differ and the texts part ways
    from there; the CPU tests check they agree exactly in fp32)."""
    import torch

    from flashref import model

    tok, train, val = _corpus()
    T = 256
    gpt = _build("flashref", T, device=device)
    model.train(gpt, model.Batches(train, 64, T, seed=0), train_steps, lr=1e-3, warmup=min(100, train_steps // 10))
    gpt.eval()
    final = model.evaluate(gpt, model.Batches(val, 64, T, seed=2), iters=20)
    start = tok.encode(prompt)[None].to(device)
    new_tokens = new_tokens or T - start.shape[1]
    sample = gpt.generate(start, T - start.shape[1], generator=torch.Generator().manual_seed(0), kv_cache=True)
    yield {"part": "generate", "case": "sample", "train_steps": train_steps, "final_val": final,
           "prompt": prompt, "text": tok.decode(sample[0])}
    for B in batches:
        idx = start.expand(B, -1).contiguous()
        row = {"part": "generate", "case": "speed", "batch": B, "prompt_tokens": start.shape[1],
               "new_tokens": new_tokens}
        outs = {}
        for cached in (False, True):
            gpt.generate(idx, 4, generator=torch.Generator().manual_seed(1), kv_cache=cached)  # compiles, warms
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs[cached] = gpt.generate(idx, new_tokens, generator=torch.Generator().manual_seed(1), kv_cache=cached)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            name = "cached" if cached else "recompute"
            row[f"{name}_s"] = seconds
            row[f"{name}_tokens_per_s"] = B * new_tokens / seconds
        row["speedup"] = row["cached_tokens_per_s"] / row["recompute_tokens_per_s"]
        same = outs[False][:, start.shape[1]:] == outs[True][:, start.shape[1]:]
        row["agreement"] = float(same.float().mean())
        row["identical_prefix"] = int(same.all(0).int().cumprod(0).sum())  # draws alike in every sequence
        yield row
    del gpt
    torch.cuda.empty_cache()


def load_results(path=None) -> dict:
    """The committed run, book/data/model_bench.json (or ``path``), read by :func:`flashref.bench.results.load`
    (on Colab: the copy in the course repository)."""
    return results.load("model_bench.json", path)


def rows(data, part, **match) -> list:
    """The rows of ``part`` whose fields equal ``match``."""
    return [r for r in data["results"] if r["part"] == part and all(r.get(k) == v for k, v in match.items())]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=OUT)
    parts = ["train", "compile", "speed", "maxlen", "approx", "generate"]
    p.add_argument("--parts", nargs="+", default=parts, choices=parts)
    p.add_argument("--quick", action="store_true", help="100 training steps, three lengths: a try, not the data")
    p.add_argument("--append", action="store_true", help="add to the rows already in --out (same GPU and versions)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flashref.bench model needs a CUDA device", file=sys.stderr)
        return 2
    command = "python -m flashref.bench model --parts " + " ".join(args.parts) + (" --quick" if args.quick else "")
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(), command,
                         dtype="bfloat16 autocast")
    data["quick"] = bool(args.quick) or data.get("quick", False)
    quick_n = [512, 4096, 16384]
    cases = {"train": lambda: train_runs(100 if args.quick else 1000, args.quick),
             "compile": compile_cases,
             "speed": lambda: speed_cases(quick_n if args.quick else SPEED_N, compiled_ns=(4096,) if args.quick else
                                          (1024, 4096, 16384)),
             "maxlen": lambda: maxlen_cases(cap=1 << 17 if args.quick else 1 << 20),
             "approx": lambda: approx_cases(quick_n if args.quick else APPROX_N),
             "generate": lambda: generate_cases(100 if args.quick else 600, (1, 16) if args.quick else (1, 16, 64))}

    def show(r):
        print(json.dumps({k: v for k, v in r.items() if k not in ("loss", "val")})[:400], flush=True)

    # saved after each row (a run cut short keeps it); a part measured again replaces its rows in an appended file
    add = results.recorder(data, args.out, show=show, indent=None, group=lambda row: row["part"])
    for name in args.parts:
        for r in cases[name]():
            add(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
