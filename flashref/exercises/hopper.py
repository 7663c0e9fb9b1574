"""Checkers for the exercises of notebook ``14_flashattention3_on_hopper``.

    from flashref.exercises import hopper as ex
    ex.check_exp_ratio(answer)              # a number: exponentials' time over the products', FP8, d = 64
    ex.check_quantize_blocks(quantize)      # the reader's function: per-block e4m3 quantization
    ex.check_dq_reduce_ratio(answer)        # a number: the one-kernel backward's reduce traffic over dQ's bytes

All run without a GPU: the first is arithmetic on the data-sheet rates of :mod:`flashref.hopper_timeline`,
the second compares with :func:`flashref.fp8.quantize_blocks` in torch on the CPU, the third is arithmetic on
the tiles of :mod:`flashref.triton.hopper_backward_fused`.
"""

from __future__ import annotations

from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, check_number, right, wrong
from flashref.hopper_timeline import tile_seconds

#: Exercise "exponentials": one 128 x 128 tile at head dim 64, products in FP8.
EXP_TILE = dict(block_m=128, block_n=128, d=64, fp8=True)

#: Exercise "reduces": one head of the one-kernel backward (N_q = N_k = N): each program holds this many keys
#: (:func:`flashref.triton.hopper_backward_fused.default_config`'s ``block_n``) and adds its fp32 share of every
#: query row's dQ by TMA reduce.
FUSED_DQ = dict(N=4096, d=64, keys_per_program=128)

#: Exercise "quantize": (B, H, N, d, rows a scale covers, what the case holds).
QUANTIZE_CASES = [(1, 2, 203, 64, 64, "uneven N"), (2, 1, 64, 32, 16, "an outlier"),
                  (1, 1, 40, 16, 16, "an all-zero block")]


def check_exp_ratio(answer) -> Verdict:
    """How many times longer a tile's exponentials take than its two products (S = Q K^T and P V) on an H100,
    for :data:`EXP_TILE`, at the rates of :data:`flashref.hopper_timeline.H100`."""
    t = tile_seconds(EXP_TILE["block_m"], EXP_TILE["block_n"], EXP_TILE["d"], fp8=EXP_TILE["fp8"])
    return check_number(answer, t["softmax"] / (t["S"] + t["PV"]), what="the ratio", rel=0.02,
                        hint="Count 4 * 128 * 128 * 64 FLOPs for the two products at 1979 TFLOP/s, and 128 * 128 "
                             "exponentials at 3.9 T a second (both for the whole GPU: the SM count cancels).",
                        explain="The exponentials take twice as long as the products: at d = 64 in FP8 the softmax, "
                                "not the tensor cores, sets the pace. The goals table's FP8 column shows it: "
                                "FP8's gain over fp16 is smallest at d = 64 and largest at d = 256.")


def _case(B, H, N, d, rows, what, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, N, d, generator=g)
    if what == "an outlier":
        x[0, 0, 3, 5] = 300.0
    if what == "an all-zero block":
        x[..., rows:2 * rows, :] = 0.0
    return x


def check_quantize_blocks(fn) -> Verdict:
    """``fn(x, rows) -> (x8, scale)``: x (B, H, N, d) float32; ``x8`` e4m3 (``torch.float8_e4m3fn``) of x's shape,
    ``scale`` (B, H, ceil(N / rows)) float32, one per ``rows`` rows of a head (the last block may be short), such
    that x is about x8 times its row's scale and each block's largest magnitude lands on 448."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself, not {type(fn).__name__}.")
    import torch  # here, not at the top: the other two checkers are arithmetic and need no torch

    from flashref import fp8

    for seed, (B, H, N, d, rows, what) in enumerate(QUANTIZE_CASES):
        x = _case(B, H, N, d, rows, what, seed)
        try:
            got = fn(x.clone(), rows)
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            return wrong(f"your function raised {type(exc).__name__}: {exc}")
        if got is None:
            return Verdict(False, UNWRITTEN)
        if not isinstance(got, tuple) or len(got) != 2:
            return wrong("return a pair (x8, scale).")
        x8, scale = got
        want8, want_scale = fp8.quantize_blocks(x, rows)
        case = f"N = {N}, {rows} rows a scale ({what})"
        if not isinstance(x8, torch.Tensor) or x8.dtype != torch.float8_e4m3fn:
            return wrong(f"x8 should be a torch.float8_e4m3fn tensor, got {getattr(x8, 'dtype', type(x8).__name__)}.")
        try:
            scale = torch.as_tensor(scale, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 (what came back is not a tensor of numbers)
            return wrong(f"scale should be a float32 tensor of shape {tuple(want_scale.shape)}, got "
                         f"{type(scale).__name__} ({type(exc).__name__}: {exc}).")
        if x8.shape != x.shape or scale.shape != want_scale.shape:
            return wrong(f"for {case}: x8 should have shape {tuple(x.shape)} and scale {tuple(want_scale.shape)}, "
                         f"got {tuple(x8.shape)} and {tuple(scale.shape)}. A short last block has a scale too.")
        if not (torch.isfinite(scale).all() and torch.isfinite(x8.float()).all()):
            return wrong(f"for {case} your x8 or scale holds NaN or inf: an all-zero block has amax 0; give it "
                         "any nonzero scale (1 will do), its values are 0 either way.")
        nonzero = want_scale != 1.0
        if not torch.allclose(scale[nonzero], want_scale[nonzero], rtol=1e-6, atol=0):
            return wrong(f"for {case} the scales are off: a block's scale is its largest |x| over 448, so that "
                         "value lands on e4m3's largest number.")
        a, b = x8.float(), want8.float()
        # rounded the same way (to nearest, e4m3 does it when casting) up to a last-bit tie here and there
        off = (a - b).abs() > 2**-3 * torch.maximum(a.abs(), b.abs()) + 2**-9
        if off.any() or (a != b).float().mean() > 1e-3:
            return wrong(f"for {case}, {int((a != b).sum())} of {a.numel()} values of x8 differ from x / scale "
                         "rounded to e4m3: divide each row by its own block's scale, then cast.")
    return right("Per-block scaling keeps each block's values as precise as e4m3 allows; the outlier case shows "
                 "the price of one large value: its block's other values lose most of their bits.")


def check_dq_reduce_ratio(answer) -> Verdict:
    """How many times the bytes of dQ itself (fp16, written once, as the dQ kernel of the two-kernel backward writes
    it) the one-kernel backward's TMA reduces carry into the L2 cache for one head of :data:`FUSED_DQ`."""
    c = FUSED_DQ
    reduce_bytes = (c["N"] // c["keys_per_program"]) * c["N"] * c["d"] * 4
    return check_number(answer, reduce_bytes / (c["N"] * c["d"] * 2), what="the ratio", rel=1e-6,
                        hint="Each of the N / 128 programs adds a share of every query row: N x d numbers of 4 bytes "
                             "each; dQ itself is N x d numbers of 2 bytes.",
                        explain="Every row of dQ is added to N_k / 128 times in fp32: 2 N_k / 128 times its own "
                                "bytes, growing with the sequence. The L2 cache does the additions beside the tensor "
                                "cores, and on the H100 they measured 4-8% of the time of a variant of the fused "
                                "kernel (flashref.triton.hopper_backward_fused's docstring), less than the two "
                                "products the dQ kernel recomputes.")
