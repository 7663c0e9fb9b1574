"""The Python side of the Triton kernels: checks, launches, autotuning, and the autograd Function.

Taught in notebooks ``07_triton_forward`` (the forward wrapper) and ``08_triton_backward``.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime.errors import OutOfResources

from flashref import validation
from flashref.triton import configs
from flashref.triton.backward import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_bwd_preprocess_kernel
from flashref.triton.forward import LOG2E, flash_fwd_kernel

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
MAX_HEAD_DIM = 256
DTYPES = ("float16", "bfloat16", "float32")
# Up to this length the first config that fits is launched without autotuning: timing configs on a
# problem this small measures launch overhead, and each config would cost a compile.
SMALL_N = 256


def _bucket(n: int) -> int:
    """Autotune once per power-of-two length bucket, not once per exact length."""
    return triton.next_power_of_2(max(int(n), 16))


def _autotuned(kernel, name: str):
    # dkdv may add into DQ atomically: the autotuner zeroes it before each trial and after the last one.
    extra = {"reset_to_zero": ["DQ"]} if name == "dkdv" else {}
    key = ["TUNE_N", "HEAD_DIM", "CAUSAL"] + (["ATOMIC_DQ"] if name == "dkdv" else [])
    return triton.autotune(configs=configs.autotune_configs(name), key=key,
                           prune_configs_by={"early_config_prune": configs.make_pruner(name)}, **extra)(kernel)


if not INTERPRETED:
    # TUNE_N (a power-of-two length bucket, unused by the kernels' arithmetic) is part of the autotuner's key.
    _TUNED = {"forward": _autotuned(flash_fwd_kernel, "forward"), "dkdv": _autotuned(flash_bwd_dkdv_kernel, "dkdv"),
              "dq": _autotuned(flash_bwd_dq_kernel, "dq")}


def _check(q, k, v, causal, sm_scale, check_finite=True):
    """The shared checks, plus what only the Triton kernels need: torch tensors on a usable device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    validation.check_bool("check_finite", check_finite)
    _, _, d = validation.check_attention_inputs(q, k, v, allowed_ndims=(4,), allowed_dtypes=DTYPES,
                                                max_head_dim=MAX_HEAD_DIM, finite=False)
    validation.check_causal(causal)
    scale = validation.check_sm_scale(sm_scale, d)
    if INTERPRETED:
        if q.device.type != "cpu":
            raise ValueError(f"Triton is running in its CPU interpreter (no CUDA device): q, k and v must be CPU "
                             f"tensors, got device {q.device}")
    else:
        if q.device.type != "cuda":
            raise ValueError(f"q, k and v must be CUDA tensors (a CUDA device is present, so the kernels are "
                             f"compiled for it), got device {q.device}")
        if q.dtype == torch.bfloat16 and torch.cuda.get_device_capability(q.device) < (8, 0):
            name = torch.cuda.get_device_name(q.device)
            raise TypeError(f"q, k and v have dtype bfloat16, which needs compute capability 8.0 or newer; "
                            f"{name} has {torch.cuda.get_device_capability(q.device)}: use float16")
    if check_finite:  # last: the one check that reads the data (validation's rule for bad values)
        validation.check_finite({"q": q, "k": k, "v": v})
    return d, scale


def _dot_mode(dtype) -> int:
    """How tl.dot multiplies (see forward._dot): under the interpreter in fp64, rounded once to fp32, so
    a recomputed score equals the forward's whatever the CPU's BLAS; on a GPU fp32 exactly (no TF32),
    fp16 and bf16 natively."""
    if INTERPRETED:
        return 2
    return 1 if dtype == torch.float32 else 0


def _strides(x):
    return tuple(x.stride())


# Tests may pin one config per kernel: {"forward": TileConfig, ...} (see fixed_configs).
_PINNED: dict = {}


class fixed_configs:
    """``with fixed_configs(forward=cfg, dkdv=cfg, dq=cfg):`` launch exactly these configs (no autotuning);
    the GPU tests use it to check every config the autotuner may choose."""

    def __init__(self, **cfgs):
        self.cfgs = cfgs

    def __enter__(self):
        self.saved = dict(_PINNED)
        _PINNED.update(self.cfgs)

    def __exit__(self, *exc):
        _PINNED.clear()
        _PINNED.update(self.saved)


def _launch(kernel, name, grid_rows, bh, *args, **meta):
    """Launch autotuned on a GPU, or one fixed config: when pinned, under the interpreter, for short
    sequences (``<= SMALL_N``) or when ``FLASHREF_TRITON_AUTOTUNE=0`` (then the first config that fits)."""
    q = args[0]
    if name in _PINNED:
        cfg = _PINNED[name]
    elif INTERPRETED:
        cfg = configs.INTERPRETER[name]
    elif not configs.autotune_enabled() or meta["TUNE_N"] <= SMALL_N:
        _launch_first_fit(kernel, name, grid_rows, bh, args, meta)
        return
    else:
        rows = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
        grid = lambda m: (triton.cdiv(grid_rows, m[rows]), bh)  # noqa: E731
        _TUNED[name][grid](*args, **meta)
        return
    _launch_config(kernel, name, grid_rows, bh, cfg, args, meta)


def _launch_config(kernel, name, grid_rows, bh, cfg, args, meta):
    configs.check_tile(name, cfg)
    block_rows = cfg.block_n if name == "dkdv" else cfg.block_m
    grid = (triton.cdiv(grid_rows, block_rows), bh)
    extra = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel[grid](*args, **meta, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **extra)


_FIRST_FIT = {}


def _launch_first_fit(kernel, name, grid_rows, bh, args, meta):
    """Launch the first candidate config the compiler accepts, and remember it. The shared-memory estimate
    prunes the candidates, but the compiler has the last word and its layout differs between Triton
    versions (seen: Triton 3.6 on an H100 keeping num_stages copies of K and V at d = 256, one more than
    the estimate), so a config that runs out of shared memory falls through to the next one."""
    q = args[0]
    key = (name, meta["BLOCK_D"], q.dtype, str(q.device), meta.get("CAUSAL"), meta.get("ATOMIC_DQ"),
           configs.t4_mode())
    cands = [_FIRST_FIT[key]] if key in _FIRST_FIT else \
        configs.device_candidates(name, meta["BLOCK_D"], q.element_size(), q.device)
    for i, cfg in enumerate(cands):
        try:
            _launch_config(kernel, name, grid_rows, bh, cfg, args, meta)
        except OutOfResources:
            if i == len(cands) - 1:
                raise
            continue
        _FIRST_FIT[key] = cfg
        return


def _forward(q, k, v, causal: bool, scale: float):
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse, m2, l2 = (torch.empty((B, H, N_q), dtype=torch.float32, device=q.device) for _ in range(3))
    _launch(flash_fwd_kernel, "forward", N_q, B * H, q, k, v, o, lse, m2, l2, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            H, N_q, N_k, scale * LOG2E,
            HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=causal,
            DOT=_dot_mode(q.dtype), TUNE_N=_bucket(max(N_q, N_k)))
    return o, lse, (m2, l2)


def _backward(q, k, v, o, stats, do, causal: bool, scale: float, deterministic: bool = True):
    """``stats`` = (m2, l2) from :func:`_forward` (base-2 row max and log2 of the row sum). ``deterministic``:
    dQ from its own kernel (bitwise reproducible); otherwise added atomically by the dK/dV kernel."""
    m2, l2 = stats
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    block_d = max(16, triton.next_power_of_2(d))
    delta = torch.empty((B, H, N_q), dtype=torch.float32, device=q.device)
    pre_m = 16 if INTERPRETED else 64
    flash_bwd_preprocess_kernel[(triton.cdiv(N_q, pre_m), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, N_q, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_m)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # Atomic dQ accumulates in fp32 (O(N d) more memory); the deterministic path passes a 1-element stand-in.
    dq_acc = torch.zeros(q.shape if not deterministic else (1, 1, 1, 1), dtype=torch.float32, device=q.device)
    meta = dict(HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, DOT=_dot_mode(q.dtype),
                TUNE_N=_bucket(max(N_q, N_k)))
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    _launch(flash_bwd_dkdv_kernel, "dkdv", N_k, B * H,
            q, k, v, do, dk, dv, dq_acc, m2, l2, delta, *common, *_strides(dk), *_strides(dv), *_strides(dq_acc),
            H, N_q, N_k, scale, scale * LOG2E, ATOMIC_DQ=not deterministic, **meta)
    if not deterministic:
        return dq_acc.to(q.dtype), dk, dv
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(flash_bwd_dq_kernel, "dq", N_q, B * H,
            q, k, v, do, dq, m2, l2, delta, *common, *_strides(dq),
            H, N_q, N_k, scale, scale * LOG2E, **meta)
    return dq, dk, dv


def flash_attention_forward(q, k, v, causal=False, sm_scale=None, *, check_finite=True):
    """FlashAttention forward without autograd: ``(o, lse)``; ``o`` like ``q``, ``lse`` of shape
    ``(B, H, N_q)`` in fp32 (natural log). fp32 inputs are computed in full fp32 (``input_precision="ieee"``:
    no TF32). ``check_finite`` as in :func:`flash_attention`. Notebook ``07_triton_forward``."""
    _, scale = _check(q, k, v, causal, sm_scale, check_finite)
    with torch.no_grad():
        o, lse, _ = _forward(q, k, v, causal, scale)
    return o, lse


def flash_attention_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, deterministic=True, *,
                             check_finite=True):
    """Gradients ``(dq, dk, dv)`` from the forward's ``o`` and ``lse``, recomputing P tile by tile.
    ``deterministic=False`` adds dQ atomically and skips the dQ kernel (measured slower on the H100; the last
    bits vary run to run). ``check_finite`` as in :func:`flash_attention`, for ``o``, ``lse`` and ``do``
    too. Notebook ``08_triton_backward``."""
    _, scale = _check(q, k, v, causal, sm_scale, check_finite)
    validation.check_bool("deterministic", deterministic)
    validation.check_same_shape("o", o, "q", q)
    validation.check_same_shape("do", do, "o", o)
    if do.dtype != q.dtype or o.dtype != q.dtype:
        raise TypeError(f"o and do must have the dtype of q ({q.dtype}), got {o.dtype} and {do.dtype}")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must have shape (B, H, N_q) = {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    if check_finite:
        validation.check_finite({"o": o, "lse": lse, "do": do})
    # From lse alone, P = exp2(s * log2(e) - lse * log2(e)): one rounding more than the autograd path,
    # which keeps the forward's max and sum apart (visible only for huge logits).
    with torch.no_grad():
        m2 = (lse.float() * LOG2E).contiguous()
        return _backward(q, k, v, o, (m2, torch.zeros_like(m2)), do, causal, scale, deterministic)


class FlashAttentionFunction(torch.autograd.Function):
    """``O = softmax(sm_scale Q K^T) V`` whose backward recomputes P from Q, K and the saved row
    statistics (the max m and the sum l of each row: lse = m + log l): O(N) extra memory."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, deterministic=True, check_finite=True):
        o, _, (m2, l2) = _forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, m2, l2)
        ctx.causal, ctx.sm_scale, ctx.deterministic, ctx.check_finite = causal, sm_scale, deterministic, check_finite
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, m2, l2 = ctx.saved_tensors
        if ctx.check_finite:
            validation.check_finite({"do (the gradient of o)": do})
        dq, dk, dv = _backward(q, k, v, o, (m2, l2), do, ctx.causal, ctx.sm_scale, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=False, sm_scale=None, deterministic=True, *, check_finite=True):
    """FlashAttention as a differentiable PyTorch op: ``o = flash_attention(q, k, v, causal, sm_scale)``.

    ``q``: ``(B, H, N_q, d)``, ``k`` and ``v``: ``(B, H, N_k, d)``, float16, bfloat16 (compute capability
    8.0+) or float32, any strides, ``d <= 256``. ``causal`` is top-left aligned (query i sees keys j <= i),
    as ``scaled_dot_product_attention(is_causal=True)``; ``sm_scale`` defaults to ``1/sqrt(d)``.
    ``deterministic`` (default True): the backward pass writes each gradient element from one program, so
    repeated runs agree bit for bit; False adds dQ with atomic additions instead, as FlashAttention-2 does,
    which saves two of the seven tile products but lets the last bits of dQ vary between runs (and on the
    H100 measured slower: notebook ``08_triton_backward``).
    ``check_finite`` (default True): refuse NaN or inf in q, k, v (and, in the backward, in dO) with a
    ``ValueError`` naming the argument (:mod:`flashref.validation`'s rule); the check reads the inputs once
    and synchronizes with the GPU once per call. False skips it, as the benchmarks do (PyTorch's attention
    does not check either), and non-finite inputs then give non-finite outputs.
    Notebooks ``07_triton_forward`` and ``08_triton_backward``.
    """
    _, scale = _check(q, k, v, causal, sm_scale, check_finite)
    validation.check_bool("deterministic", deterministic)
    return FlashAttentionFunction.apply(q, k, v, causal, scale, deterministic, check_finite)
