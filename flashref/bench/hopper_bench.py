"""FlashAttention-3's ideas on Hopper, one switch at a time, beside PyTorch's attention in the same run.

    python -m flashref.bench hopper            # the grid below, several minutes on an H100 (--parts runs some)

Forward only, fp16, B x N = 65536 tokens and H x d = 2048 (d = 64 and 128; N = 4K and 16K; causal and not),
plus the issue's d = 256 case (B 8, H 8, N 4096). For each point: SDPA's flash (FlashAttention-2) and cuDNN
backends, flashref's teaching Triton kernel (:func:`flashref.triton.flash_attention_forward`, autotuned), and
the Gluon kernel of :mod:`flashref.triton.hopper` in the steps of :data:`STEPS`, each adding one switch, then
its FP8 forward: on inputs already in e4m3 (``flashref-hopper-fp8``, how FlashAttention-3 reports it) and from
fp16 inputs, quantization included (``flashref-hopper-fp8+quantize``). Last, FP8's error (:func:`errors`): the
relative RMS error of O against float32 attention, on Gaussian inputs and on inputs with outliers, with and
without incoherent processing. Then what :func:`flashref.triton.flash_attention` makes of it: its forward with
``kernel="triton"`` against the Hopper forward over sequence lengths from 128 to 16K (:func:`dispatch_cases`, the
evidence for where ``kernel="auto"`` takes which), and forward + backward, ``kernel="auto"`` and ``"triton"``, beside
SDPA's backends on the grid (:func:`training_cases`), and the backward's kernels timed one by one, the Gluon ones in
the tiles they ship with and in the other kind (:func:`backward_kernel_cases`: the evidence for
:func:`flashref.triton.hopper_backward.default_config`). Results go to ``book/data/hopper_bench.json`` with the device,
versions and command (:func:`load_results`); ``--parts`` runs some of them, ``--head-dims`` the grid's points at
some head dims, and ``--append`` adds them to the file's rows in place of those it measures again.
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
    ("warp specialization: a producer warp, two consumer warpgroups",
     dict(warp_specialize=True, pingpong=False, overlap=False)),
    ("+ ping-pong between the consumers", dict(warp_specialize=True, pingpong=True, overlap=False)),
    ("warp specialization + overlap inside each consumer", dict(warp_specialize=True, pingpong=False, overlap=True)),
]
#: The FP8 forward's switches: warp-specialized, 128 keys a tile at every d (8-bit tiles take half the room).
FP8 = dict(warp_specialize=True, block_n=128, pingpong=True, overlap=False)
#: FP8's switches that its calls take (the rest are fixed by the FP8 kernel: warp-specialized, without overlap).
FP8_LAUNCH = {key: FP8[key] for key in ("stages", "pingpong") if key in FP8}
#: The steps measured at d = 256: steps 2 and 3 keep three stages of 128 x 128 K and V tiles, which do not fit its
#: shared memory (448 KB); step 1, one stage (192 KB), would fit but is not measured there.
STEPS_D256 = STEPS[3:]
GRID = [(d, N, causal) for d in (64, 128) for N in (4096, 16384) for causal in (False, True)]


def load_results() -> dict:
    """The committed run (``book/data/hopper_bench.json``)."""
    return results.load("hopper_bench.json")


def fp8_on_quantized(q, k, v, causal):
    """The ``flashref-hopper-fp8`` row's call: the FP8 forward on q, k, v quantized here, outside the call (how
    FlashAttention-3 reports FP8); ``hopper-profile`` profiles the same call."""
    from flashref.triton import hopper

    x = hopper.quantize_fp8(q, k, v, block_n=FP8["block_n"])
    return lambda: hopper.fp8_attention(x, causal, **FP8_LAUNCH)


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
        # flashref's calls without their pass over q, k and v for NaN (check_finite=False), as the peers run: it
        # ends with a host synchronization, none of it the kernel's work. Timed with it (the runs before), the calls
        # took 0.31-0.64 ms more at N = 4K, 9-42% of the kernel's time.
        impls.append(("flashref-triton", None,
                      lambda: flash_attention_forward(q, k, v, causal, check_finite=False, kernel="triton")))
        steps = STEPS if d <= 128 else STEPS_D256
        impls += [("flashref-hopper", (step, sw),
                   lambda sw=sw: hopper.hopper_forward(q, k, v, causal, check_finite=False, **sw))
                  for step, sw in steps]
        impls += [("flashref-hopper-fp8", ("FP8 (e4m3) on quantized inputs", FP8), fp8_on_quantized(q, k, v, causal)),
                  ("flashref-hopper-fp8+quantize", ("FP8 (e4m3), quantization included", FP8),
                   lambda: hopper.hopper_fp8_forward(q, k, v, causal, block_n=FP8["block_n"], check_finite=False,
                                                     **FP8_LAUNCH))]
        for impl, step, fn in impls:
            ms, peak = _time(fn, False, None)
            yield {"case": "fwd", "impl": impl, "step": step[0] if step else None,
                   "switches": hopper.config(d, **step[1]) if step else None,
                   "B": B, "H": H, "N": N, "d": d, "causal": causal, "ms": ms, "tflops": work / (ms * 1e-3) / 1e12,
                   "peak_extra_bytes": peak}
        del q, k, v
        torch.cuda.empty_cache()


#: The dispatch sweep: head dims and sequence lengths (B x N = 65536 tokens, H x d = 2048, as the grid).
DISPATCH_D = (64, 128, 256)
DISPATCH_N = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def dispatch_cases(head_dims=DISPATCH_D, lengths=DISPATCH_N):
    """Rows ``{case: "dispatch", impl, B, H, N, d, causal, ms, tflops}``: the forward of
    :func:`flashref.triton.flash_attention_forward` with ``kernel="triton"`` and with ``kernel="hopper"`` (the shipped
    defaults), causal and not, at every length: where the Hopper forward is faster, ``kernel="auto"`` takes it."""
    import torch

    from flashref.triton import flash_attention_forward

    for d in head_dims:
        for N in lengths:
            B, H = max(1, 65536 // N), 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
            for causal in (False, True):
                work = flops(B, H, N, N, d, causal)
                for kernel in ("triton", "hopper"):
                    ms, _ = _time(lambda: flash_attention_forward(q, k, v, causal, check_finite=False, kernel=kernel),
                                  False, None)
                    yield {"case": "dispatch", "impl": f"flashref-{kernel}", "B": B, "H": H, "N": N, "d": d,
                           "causal": causal, "ms": ms, "tflops": work / (ms * 1e-3) / 1e12}
            del q, k, v
            torch.cuda.empty_cache()


def training_cases(grid=GRID, d256=True):
    """Rows ``{case: "fwd+bwd", impl, forward, backward, B, H, N, d, causal, ms, tflops, peak_extra_bytes}`` at the
    grid's points: SDPA flash and cuDNN, and :func:`flashref.triton.flash_attention` with ``kernel="triton"`` and
    ``"auto"`` (``forward`` and ``backward`` name the kernels that ran: "hopper" or "triton")."""
    import torch

    from flashref.bench.features_bench import _fwd_bwd
    from flashref.triton import backward_kernel, flash_attention, forward_kernel

    points = [(65536 // N, 2048 // d, N, d, causal) for d, N, causal in grid]
    if d256:
        points += [(8, 8, 4096, 256, False), (8, 8, 4096, 256, True)]
    for B, H, N, d, causal in points:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        work = flops(B, H, N, N, d, causal, "fwd+bwd")
        impls = [(name, None, None, lambda q, k, v, fn=sdpa(name): fn(q, k, v, causal))
                 for name in ("sdpa-flash", "sdpa-cudnn")]
        impls += [(f"flashref-{kernel}", forward_kernel(q, k, v, causal, kernel=kernel),
                   backward_kernel(q, k, v, causal, kernel=kernel),
                   lambda q, k, v, kernel=kernel: flash_attention(q, k, v, causal, check_finite=False, kernel=kernel))
                  for kernel in ("triton", "auto")]
        # deterministic=False: on an H100 the one-kernel backward (dQ by TMA reduces), as SDPA's backends add dQ
        impls += [("flashref-auto-nondeterministic", forward_kernel(q, k, v, causal),
                   backward_kernel(q, k, v, causal, deterministic=False),
                   lambda q, k, v: flash_attention(q, k, v, causal, deterministic=False, check_finite=False))]
        for impl, forward, backward, fn in impls:
            ms, peak = _time(_fwd_bwd(fn, q, k, v, do), True, [q, k, v])
            yield {"case": "fwd+bwd", "impl": impl, "forward": forward, "backward": backward, "B": B, "H": H, "N": N,
                   "d": d, "causal": causal, "ms": ms, "tflops": work / (ms * 1e-3) / 1e12, "peak_extra_bytes": peak}
        del q, k, v, do
        torch.cuda.empty_cache()


#: The other dK/dV kernel of each head dim, timed beside the shipped one (hopper_backward.default_config says why
#: it is not shipped): at d = 64 the warp-specialized kernel, at d = 128 one warpgroup stepping 32 queries.
OTHER_DKDV = {64: ("gluon dK/dV warp-specialized", dict(block_m=64, block_n=128, num_warps=4, stages=2,
                                                        warp_specialize=True)),
              128: ("gluon dK/dV one warpgroup", dict(block_m=32, block_n=64, num_warps=4, stages=3))}


def backward_kernel_cases(grid=GRID, d256=True):
    """Rows ``{case: "bwd kernel", impl, B, H, N, d, causal, ms, tflops, matmuls}``: each backward kernel alone on
    the same inputs and row statistics (the teaching forward's), at the grid's points and the issue's d = 256 case:
    the Gluon dK/dV kernel in its shipped tiles and in :data:`OTHER_DKDV`'s (none at d = 256, where dK/dV is
    :mod:`flashref.triton.hopper_backward_wide`'s), the Gluon dQ kernel, the teaching dK/dV and dQ kernels, and at
    d = 64 and 128 the one-kernel backward (:mod:`flashref.triton.hopper_backward_fused`, ``deterministic=False``'s).
    TFLOP/s counts the kernel's own products (dK/dV four, dQ three, fused five), each 2 B H N^2 d FLOPs (half when
    causal):
    half of :func:`flops`'s forward pass, which has two."""
    import torch

    from flashref.triton import flash_attention_forward, hopper_backward, hopper_backward_fused, ops

    points = [(65536 // N, 2048 // d, N, d, causal) for d, N, causal in grid]
    if d256:
        points += [(8, 8, 4096, 256, False), (8, 8, 4096, 256, True)]
    for B, H, N, d, causal in points:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        scale = d ** -0.5
        with torch.no_grad():
            o, lse = flash_attention_forward(q, k, v, causal, check_finite=False, kernel="triton")
            m2, l2 = ops._stats_from_lse(lse)
            delta = ops._delta(o, do)
        feat = ops.Features(q, k, causal=causal, scale=scale, check_finite=False)

        def teaching(part):
            return lambda: ops._backward(q, k, v, o, (m2, l2), do, scale, True, feat, "triton", parts=(part,),
                                         delta=delta)

        kernels = {"gluon dK/dV": (4, lambda: hopper_backward.hopper_dkdv(q, k, v, do, m2, l2, delta, causal, scale))}
        if d in OTHER_DKDV:
            other_name, other_cfg = OTHER_DKDV[d]
            kernels[other_name] = (4, lambda: hopper_backward.hopper_dkdv(q, k, v, do, m2, l2, delta, causal, scale,
                                                                          other_cfg))
        kernels |= {"gluon dQ": (3, lambda: hopper_backward.hopper_dq(q, k, v, do, m2, l2, delta, causal, scale)),
                    "teaching dK/dV": (4, teaching("dkdv")), "teaching dQ": (3, teaching("dq"))}
        if d in hopper_backward_fused.HEAD_DIMS:  # (its time includes zeroing the fp32 dQ and the cast)
            kernels["gluon fused"] = (5, lambda: hopper_backward_fused.hopper_fused_backward(q, k, v, do, m2, l2, delta,
                                                                                            causal, scale))
        per_product = flops(B, H, N, N, d, causal) / 2
        for impl, (matmuls, fn) in kernels.items():
            ms, _ = _time(fn, False, None)
            yield {"case": "bwd kernel", "impl": impl, "B": B, "H": H, "N": N, "d": d, "causal": causal, "ms": ms,
                   "tflops": matmuls * per_product / (ms * 1e-3) / 1e12, "matmuls": matmuls}
        del q, k, v, do, o, lse, m2, l2, delta
        torch.cuda.empty_cache()


def backward_kernel_table(results) -> str:
    """TFLOP/s of each backward kernel alone, one line per point (see :func:`backward_kernel_cases`)."""
    rows = [r for r in results if r["case"] == "bwd kernel"]
    impls = list(dict.fromkeys(r["impl"] for r in rows if not r["impl"].startswith("gluon dK/dV ")))
    get = {(r["d"], r["N"], r["causal"], r["impl"]): r for r in rows}
    lines = [f"{'d':>3s} {'N':>6s} {'causal':>6s} " + " ".join(f"{i:>15s}" for i in impls)
             + f" {'other dK/dV':>12s}  (which)"]
    for d, N, causal in sorted({key[:3] for key in get}):
        cells = [f"{get[d, N, causal, i]['tflops']:15.0f}" if (d, N, causal, i) in get else f"{'-':>15s}"
                 for i in impls]
        other = next((r for key, r in get.items() if key[:3] == (d, N, causal) and key[3].startswith("gluon dK/dV ")),
                     None)
        tail = f" {other['tflops']:12.0f}  ({other['impl'][len('gluon dK/dV '):]})" if other else ""
        lines.append(f"{d:3d} {N:6d} {causal!s:>6s} " + " ".join(cells) + tail)
    return "\n".join(lines)


#: The error table's inputs: B, H, N, d and the share of Q and K entries given an outlier (std 10 more).
ERROR_SHAPE = (4, 8, 2048, 128)
OUTLIERS = 1e-3


def error_inputs(kind: str, seed: int = 0):
    """fp16 Q, K, V of :data:`ERROR_SHAPE` on the GPU: ``"randn"`` (standard normal) or ``"outliers"`` (as
    ``"randn"``, plus a share :data:`OUTLIERS` of Q's and K's entries drawn with std 10 more, as FlashAttention-3's
    error test does: the large activations real models have)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(ERROR_SHAPE, device="cuda", generator=g) for _ in range(3))
    if kind == "outliers":
        q, k = (x + (torch.rand(x.shape, device="cuda", generator=g) < OUTLIERS)
                * 10 * torch.randn(x.shape, device="cuda", generator=g) for x in (q, k))
    elif kind != "randn":
        raise ValueError(f"kind must be 'randn' or 'outliers', got {kind!r}")
    return q.half(), k.half(), v.half()


def rel_rms(o, ref) -> float:
    """||o - ref|| / ||ref||, in float32."""
    return float((o.float() - ref.float()).norm() / ref.float().norm())


def errors():
    """Rows ``{case: "error", inputs, impl, incoherent, rel_rms, B, H, N, d}``: O of plain fp16 attention, the fp16
    Gluon kernel, the FP8 kernel, and float32 attention of the e4m3 inputs themselves (the share of the error that
    the inputs' rounding makes), each against float32 attention of the fp16 inputs."""
    from flashref.torch_attention import plain_attention
    from flashref.triton import hopper

    B, H, N, d = ERROR_SHAPE
    for kind in ("randn", "outliers"):
        q, k, v = error_inputs(kind)
        ref = plain_attention(q.float(), k.float(), v.float())
        outs = [("plain-fp16", False, plain_attention(q, k, v)),
                ("flashref-hopper", False, hopper.hopper_forward(q, k, v)[0])]
        for incoherent in (False, True):
            o = hopper.hopper_fp8_forward(q, k, v, incoherent=incoherent)[0]
            outs.append(("flashref-hopper-fp8", incoherent, o))
            x = hopper.quantize_fp8(q, k, v, block_n=FP8["block_n"], incoherent=incoherent)
            outs.append(("e4m3-inputs-fp32", incoherent, plain_attention(*hopper.dequantize_fp8(x))))
        for impl, incoherent, o in outs:
            yield {"case": "error", "inputs": kind, "impl": impl, "incoherent": incoherent, "rel_rms": rel_rms(o, ref),
                   "B": B, "H": H, "N": N, "d": d}


PEERS = [("sdpa-flash", "SDPA flash (FlashAttention-2)"), ("sdpa-cudnn", "SDPA cuDNN"),
         ("flashref-triton", "teaching Triton kernel (notebook 7)")]
FP8_ROWS = [("flashref-hopper-fp8", "FP8, inputs already e4m3"),
            ("flashref-hopper-fp8+quantize", "FP8, quantizing included")]


def _points(results):
    return sorted({(r["d"], r["N"], r["causal"]) for r in results if r["case"] == "fwd"},
                  key=lambda p: (p[0], p[1], p[2]))


def _get(results, impl, point, step=None):
    for r in results:
        if r["case"] == "fwd" and r["impl"] == impl and (r["d"], r["N"], r["causal"]) == point and r["step"] == step:
            return r
    return None


def step_table(results) -> str:
    """TFLOP/s, one line per implementation or step (the peers, the Gluon kernel's :data:`STEPS`, FP8), one column
    per point (d, N, causal); "-" where a step was not run (the 128 x 128 steps at d = 256)."""
    points = _points(results)
    head = f"{'':64s}" + "".join(f"{f'd{d} {N // 1024}K' + (' c' if c else ''):>11s}" for d, N, c in points)
    lines = [head]

    def line(label, impl, step=None):
        cells = [(_get(results, impl, p, step) or {}).get("tflops") for p in points]
        lines.append(f"{label[:64]:64s}" + "".join(f"{c:11.0f}" if c else f"{'-':>11s}" for c in cells))

    for impl, label in PEERS:
        line(label, impl)
    for n, (step, _) in enumerate(STEPS, start=1):
        line(f"{n}. {step}", "flashref-hopper", step)
    for impl, label in FP8_ROWS:
        line(label, impl, next(r["step"] for r in results if r["case"] == "fwd" and r["impl"] == impl))
    return "\n".join(lines)


def default_row(results, point):
    """The Gluon kernel's row at ``point`` with the switches :func:`flashref.triton.hopper.default_config` ships."""
    from flashref.triton.hopper import default_config

    return next(r for r in results if r["case"] == "fwd" and r["impl"] == "flashref-hopper"
                and (r["d"], r["N"], r["causal"]) == point and r["switches"] == default_config(point[0]))


def goals_table(results) -> str:
    """Per point: the shipped defaults' TFLOP/s, over cuDNN's and over SDPA flash's, and FP8 (inputs already e4m3,
    and quantizing included) over the fp16 default: the issue's goals are >= 1.0x cuDNN, >= 1.0x flash, FP8 >= 1.5x."""
    lines = [f"{'d':>3s} {'N':>6s} {'causal':>6s} {'TFLOP/s':>8s} {'x cuDNN':>8s} {'x flash':>8s} {'FP8 x':>6s} "
             f"{'FP8+q x':>8s} {'FP8 TFLOP/s':>12s}"]
    for point in _points(results):
        mine = default_row(results, point)["tflops"]
        cudnn, flash = (_get(results, i, point)["tflops"] for i in ("sdpa-cudnn", "sdpa-flash"))
        fp8, fp8q = (next(r for r in results if r["case"] == "fwd" and r["impl"] == i
                          and (r["d"], r["N"], r["causal"]) == point)["tflops"] for i, _ in FP8_ROWS)
        d, N, causal = point
        lines.append(f"{d:3d} {N:6d} {causal!s:>6s} {mine:8.0f} {mine / cudnn:8.2f} {mine / flash:8.2f} "
                     f"{fp8 / mine:6.2f} {fp8q / mine:8.2f} {fp8:12.0f}")
    return "\n".join(lines)


def dispatch_table(results) -> str:
    """Per head dim and length: the forward's TFLOP/s with ``kernel="triton"`` and ``"hopper"`` and their ratio, not
    causal and causal (:func:`dispatch_cases`)."""
    get = {(r["d"], r["N"], r["causal"], r["impl"]): r["tflops"] for r in results if r["case"] == "dispatch"}
    lines = [f"{'d':>3s} {'N':>6s} | {'triton':>7s} {'hopper':>7s} {'x':>5s} | {'causal: triton':>14s} {'hopper':>7s} "
             f"{'x':>5s}"]
    for d, N in sorted({(d, N) for d, N, _, _ in get}):
        cells = []
        for causal in (False, True):
            t, h = get[d, N, causal, "flashref-triton"], get[d, N, causal, "flashref-hopper"]
            cells.append(f"{t:{14 if causal else 7}.0f} {h:7.0f} {h / t:5.2f}")
        lines.append(f"{d:3d} {N:6d} | " + " | ".join(cells))
    return "\n".join(lines)


def training_table(results) -> str:
    """Forward + backward TFLOP/s per point: SDPA flash and cuDNN, ``flash_attention`` with ``kernel="triton"`` and
    ``"auto"`` (the forward / backward it ran in brackets), and auto over cuDNN, flash and the teaching kernels;
    then auto with ``deterministic=False`` (where measured) and it over cuDNN."""
    get = {(r["d"], r["N"], r["causal"], r["impl"]): r for r in results if r["case"] == "fwd+bwd"}
    lines = [f"{'d':>3s} {'N':>6s} {'causal':>6s} {'flash':>6s} {'cuDNN':>6s} {'triton':>7s} {'auto':>6s} {'':17s} "
             f"{'x cuDNN':>7s} {'x flash':>7s} {'x triton':>8s} {'nondet':>6s} {'x cuDNN':>7s}"]
    for d, N, causal in sorted({key[:3] for key in get}):
        flash, cudnn, triton_, auto = (get[d, N, causal, i] for i in ("sdpa-flash", "sdpa-cudnn", "flashref-triton",
                                                                         "flashref-auto"))
        a = auto["tflops"]
        nondet = get.get((d, N, causal, "flashref-auto-nondeterministic"))
        tail = f" {nondet['tflops']:6.0f} {nondet['tflops'] / cudnn['tflops']:7.2f}" if nondet else ""
        lines.append(f"{d:3d} {N:6d} {causal!s:>6s} {flash['tflops']:6.0f} {cudnn['tflops']:6.0f} "
                     f"{triton_['tflops']:7.0f} {a:6.0f} {'(' + auto['forward'] + ' / ' + auto['backward'] + ')':17s} "
                     f"{a / cudnn['tflops']:7.2f} "
                     f"{a / flash['tflops']:7.2f} {a / triton_['tflops']:8.2f}" + tail)
    return "\n".join(lines)


ERROR_LABELS = {("plain-fp16", False): "plain attention in fp16", ("flashref-hopper", False): "Gluon kernel, fp16",
                ("e4m3-inputs-fp32", False): "e4m3 inputs, attention in fp32",
                ("flashref-hopper-fp8", False): "Gluon kernel, FP8",
                ("e4m3-inputs-fp32", True): "e4m3 inputs, incoherent, fp32",
                ("flashref-hopper-fp8", True): "Gluon kernel, FP8, incoherent"}


def error_table(results) -> str:
    """Relative RMS error of O against float32 attention, one line per implementation, one column per kind of
    inputs (:func:`error_inputs`)."""
    get = {(r["inputs"], r["impl"], r["incoherent"]): r["rel_rms"] for r in results if r["case"] == "error"}
    lines = [f"{'':34s}{'randn':>10s}{'outliers':>10s}"]
    for (impl, inc), label in ERROR_LABELS.items():
        lines.append(f"{label:34s}" + "".join(f"{get[kind, impl, inc]:10.1e}" for kind in ("randn", "outliers")))
    return "\n".join(lines)


def plot(data, point=(128, 16384, False)):
    """Two panels: TFLOP/s at ``point`` of the peers, each step and FP8 (bars); and each fp16 and FP8 variant's
    error on inputs with outliers against its speed there."""
    import matplotlib.pyplot as plt

    results = data["results"]
    rows = [(label, _get(results, impl, point)) for impl, label in PEERS]
    rows += [(f"{n}. {step}", _get(results, "flashref-hopper", point, step)) for n, (step, _) in enumerate(STEPS, 1)]
    rows += [(label, next(r for r in results if r["case"] == "fwd" and r["impl"] == impl
                          and (r["d"], r["N"], r["causal"]) == point)) for impl, label in FP8_ROWS]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    colours = ["0.6"] * len(PEERS) + ["tab:blue"] * len(STEPS) + ["tab:orange"] * len(FP8_ROWS)
    ax.barh(range(len(rows)), [r["tflops"] for _, r in rows], color=colours)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s (forward)")
    d, N, causal = point
    ax.set_title(f"d = {d}, N = {N}, {'causal' if causal else 'not causal'}, fp16 inputs", fontsize=9)
    errs = {(r["inputs"], r["impl"], r["incoherent"]): r["rel_rms"] for r in results if r["case"] == "error"}
    fp16 = default_row(results, point)["tflops"]
    fp8 = rows[-2][1]["tflops"]
    points = ((("flashref-hopper", False), fp16, "o"), (("flashref-hopper-fp8", False), fp8, "s"),
              (("flashref-hopper-fp8", True), fp8, "^"))
    for (impl, inc), speed, marker in points:
        ax2.scatter(speed, errs["outliers", impl, inc], marker=marker, s=60, label=ERROR_LABELS[impl, inc])
    ax2.set_yscale("log")
    ax2.set_xlabel("TFLOP/s (forward)")
    ax2.set_ylabel("relative RMS error of O (outliers)")
    ax2.legend(fontsize=7)
    ax2.set_title("error against speed", fontsize=9)
    fig.suptitle(data["device"], fontsize=9)
    fig.tight_layout()
    return fig


def _print(r):
    if r["case"] == "error":
        print(f"error {r['inputs']:8s} {r['impl']:20s} incoherent={r['incoherent']!s:5s} rel RMS {r['rel_rms']:.2e}")
        return
    what = f"{r['case']} {r['impl']}" + (f" [{r['step']}]" if r.get("step") else "")
    print(f"d={r['d']:<3d} N={r['N']:<5d} causal={r['causal']!s:5s} {what:62s} {r['ms']:8.3f} ms "
          f"{r['tflops']:6.1f} TFLOP/s", flush=True)


def _on(dims):
    """``grid`` and ``d256`` keywords for the grid's points at head dims ``dims`` (none, for all, when None)."""
    return {} if dims is None else dict(grid=[point for point in GRID if point[0] in dims], d256=256 in dims)


#: Each part's rows; the parts on the grid take ``dims`` (``--head-dims``), the error table and the dispatch
#: sweep do not.
PARTS = {"steps": lambda dims: cases(**_on(dims)), "errors": lambda dims: errors(),
         "dispatch": lambda dims: dispatch_cases(), "training": lambda dims: training_cases(**_on(dims)),
         "backward-kernels": lambda dims: backward_kernel_cases(**_on(dims))}
ON_THE_GRID = ("steps", "training", "backward-kernels")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashref.bench hopper", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="book/data/hopper_bench.json")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="which row types to measure (default: all): the forward steps with FP8, the error table, the "
                        "dispatch sweep, forward + backward through flash_attention, the backward's kernels alone")
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (same GPU and versions), replacing those of the parts "
                        "measured again")
    p.add_argument("--head-dims", nargs="+", type=int, choices=(64, 128, 256),
                   help="measure the grid's points at these head dims only (the parts on the grid: "
                        f"{', '.join(ON_THE_GRID)}); with --append they replace those head dims' rows")
    args = p.parse_args(argv)
    if args.head_dims and set(args.parts) - set(ON_THE_GRID):
        p.error(f"--head-dims applies to the parts {', '.join(ON_THE_GRID)}, got --parts {' '.join(args.parts)}")
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("flashref.bench hopper needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(),
                         results.command("hopper", [a for a in given if a != "--append"]), dtype="float16")
    # saved after each row; with --append a part's first row at a head dim replaces the saved rows of that part
    # (its case) and head dim
    add = results.recorder(data, args.out, show=_print, group=lambda row: (row.get("case"), row.get("d")))
    for part, rows in PARTS.items():
        if part in args.parts:
            for row in rows(args.head_dims):
                add(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
