"""FP8 (e4m3) inputs for attention, as FlashAttention-3 makes them: per-block scales and incoherent processing.

e4m3 keeps 3 mantissa bits and numbers up to :data:`FP8_MAX` = 448. A tensor is cut into blocks of rows, each
divided by its own scale, amax / 448, so that its largest value lands on 448 and the rest keep as many bits
as e4m3 has; x = x8 * scale. One outlier stretches its block's scale and flattens the block's other values
toward zero. Incoherent processing multiplies Q and K by the same random orthogonal matrix M first
(:func:`random_rotation`): (Q M)(K M)^T = Q K^T, while an outlier in one channel is spread over all of them.

Here are the numerics in torch operations, on any device: the reference the FP8 kernel's fused quantizer is
checked against bit for bit (:func:`flashref.triton.hopper.quantize_fp8`). Taught in notebook
``14_flashattention3_on_hopper``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 448.0  # the largest e4m3 number
FP8_Q_ROWS = 64  # query rows a Q scale covers: one consumer warpgroup's rows in the Hopper kernel


class Fp8Inputs(NamedTuple):
    """Q, K (e4m3, (B, H, N, d)) and V^T (e4m3, (B, H, d, N_k rounded up to 16)) with their scales: x = x8 * scale,
    one scale per FP8_Q_ROWS query rows, per block_n keys, and per head for V. What
    :func:`flashref.triton.hopper.fp8_attention` takes."""
    q: torch.Tensor
    k: torch.Tensor
    vt: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    block_n: int


def random_rotation(d: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """A random orthogonal d x d matrix, H diag(s) / sqrt(d) (H the Walsh-Hadamard matrix, s random signs): the
    incoherent processing of FlashAttention-3. (Q M)(K M)^T = Q K^T, while an outlier in one channel of Q or K is
    spread over all d channels, so a block's scale no longer has to stretch to fit it."""
    if d & (d - 1):
        raise ValueError(f"random_rotation needs a power-of-two d, got {d}")
    H = torch.ones(1, 1, dtype=torch.float32)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
    return (H * signs[None, :] / d ** 0.5).to(device)


def block_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / FP8_MAX, correctly rounded to float32 on every device (a float64 quotient rounded once: CUDA's
    tensor / scalar multiplies by the reciprocal, one unit in the last place off at times); 1 where amax is 0
    (an all-zero block: any scale is exact)."""
    scale = (amax.double() / FP8_MAX).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_blocks(x: torch.Tensor, rows: int):
    """``(x8, scale)``: x (B, H, N, d) in e4m3 with one scale per ``rows`` rows of a head (the last block may be
    short), ``scale`` (B, H, ceil(N / rows)) in float32, x ~ x8 * scale row by row."""
    B, H, N, d = x.shape
    pad = -N % rows
    blocks = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(B, H, (N + pad) // rows, rows, d)
    scale = block_scale(blocks.abs().amax(dim=(-1, -2)))
    x8 = (blocks / scale[..., None, None]).to(torch.float8_e4m3fn).view(B, H, N + pad, d)[:, :, :N]
    return x8.contiguous(), scale.contiguous()


def head_scale(v: torch.Tensor) -> torch.Tensor:
    """One scale a head of v (B, H, N, d): :func:`block_scale` of the head's amax."""
    B, H, N, d = v.shape
    lo, hi = torch.aminmax(v.reshape(B, H, N * d), dim=-1)  # one pass, no |V| temporary
    return block_scale(torch.maximum(-lo, hi)).contiguous()


def padded_keys(N: int) -> int:
    """V^T's row length for N keys: N rounded up to 16 (the rows of a TMA copy are 16-byte aligned)."""
    return N + -N % 16


def quantize_v_transposed(v: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """V^T in e4m3, (B, H, d, N rounded up to 16) (the rows of a TMA copy are 16-byte aligned), the padding 0."""
    N = v.shape[2]
    vt = (v.float() / v_scale[..., None, None]).to(torch.float8_e4m3fn).transpose(-1, -2)
    return torch.nn.functional.pad(vt.view(torch.uint8), (0, padded_keys(N) - N)).view(torch.float8_e4m3fn).contiguous()


def dequantize(x: Fp8Inputs):
    """float32 (Q, K, V) that ``x`` stands for: each 8-bit value times its block's scale (Q and K rotated if
    ``x`` was quantized with ``incoherent``, which leaves attention as it was). Plain attention of these in
    float32 is the FP8 kernel's baseline: the error of e4m3 inputs alone."""
    def rows(x8, scale, n):
        return x8.float() * scale.repeat_interleave(n, dim=-1)[..., : x8.shape[2], None]

    N_k = x.k.shape[2]
    v = x.vt[..., :N_k].float().transpose(-1, -2) * x.v_scale[..., None, None]
    return rows(x.q, x.q_scale, FP8_Q_ROWS), rows(x.k, x.k_scale, x.block_n), v
