"""Attention written with PyTorch's own operations: the baselines the kernels are measured against, and
two approximate methods the FlashAttention paper compares exact attention with.

- :func:`plain_attention`: ``softmax(sm_scale Q K^T) V`` with S and P materialized in HBM, as a model
  written without a fused kernel does it (and as autograd then stores P for the backward).
- :func:`sdpa_attention`: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's fused backends.
- :func:`local_attention`: a causal sliding window of ``window`` keys, computed in chunks so that its
  FLOPs and memory grow as N * window, not N^2 (Longformer's and the paper's "local attention").
- :func:`performer_attention`: FAVOR+ (Choromanski et al., 2021): positive random features make
  ``exp(q . k)`` a dot product of feature vectors, so causal attention becomes a running sum (linear in N).

Shapes ``(B, H, N, d)``; ``sm_scale`` defaults to ``1/sqrt(d)``. Notebook ``11_attention_in_a_model``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashref.validation import check_positive_int


def make_qkv(B, H, N_q, N_k, d, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    """Seeded random ``(q, k, v, do)`` of shapes ``(B, H, N_q, d)``, ``(B, H, N_k, d)`` twice and ``(B, H, N_q,
    d)``, standard normal (q times ``scale``, for large logits), drawn on the CPU so every device gets the same
    numbers. The inputs of the tests and of notebooks ``07_triton_forward`` and ``08_triton_backward``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, H, N_q, d, generator=g) * scale).to(device=device, dtype=dtype)
    k = torch.randn(B, H, N_k, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, H, N_k, d, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(B, H, N_q, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def _scale(q, sm_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


def plain_attention(q, k, v, causal=False, sm_scale=None):
    """Standard attention in PyTorch operations: S = sm_scale Q K^T and P = softmax(S) are whole N_q x N_k
    tensors (causal: top-left aligned, query i sees keys j <= i)."""
    S = torch.matmul(q, k.transpose(-1, -2)) * _scale(q, sm_scale)
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~visible, float("-inf"))
    P = torch.softmax(S, dim=-1)
    return torch.matmul(P.to(v.dtype), v)


def sdpa_attention(q, k, v, causal=False, sm_scale=None):
    """PyTorch's ``scaled_dot_product_attention``: it picks a fused backend (FlashAttention-2, cuDNN,
    memory-efficient) when the inputs allow, or its math fallback."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def local_attention(q, k, v, window=256, sm_scale=None):
    """Causal sliding-window attention: query i sees the ``window`` keys ``i - window < j <= i``.

    The sequence is cut into chunks of ``window`` queries; each chunk scores against its own keys and the
    previous chunk's (``2 * window`` keys, the band masked inside), so S has N x 2 window entries, not N^2.
    Exact attention when ``window >= N``."""
    check_positive_int("window", window)
    B, H, N, d = q.shape
    w = min(window, N)
    pad = (-N) % w  # padded keys come after every real query: the causal band never reaches them
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    n = (N + pad) // w
    qc = q.reshape(B, H, n, w, d)

    def with_previous(x):  # (B, H, n, 2w, d): chunk c-1 (zeros before the first) then chunk c
        xc = x.reshape(B, H, n, w, d)
        return torch.cat([F.pad(xc, (0, 0, 0, 0, 1, 0))[:, :, :-1], xc], dim=3)

    kc, vc = with_previous(k), with_previous(v)
    S = torch.matmul(qc, kc.transpose(-1, -2)) * _scale(q, sm_scale)  # (B, H, n, w, 2w)
    i = torch.arange(w, device=q.device)[:, None]  # query within its chunk; its key column is i + w
    j = torch.arange(2 * w, device=q.device)[None, :]
    band = (j > i) & (j <= i + w)  # keys i + w - window + 1 ... i + w in chunk coordinates
    first = band & (j >= w)  # the first chunk has no previous one
    visible = torch.stack([first] + [band] * (n - 1)) if n > 1 else first[None]
    S = S.masked_fill(~visible, float("-inf"))
    O = torch.matmul(torch.softmax(S, dim=-1).to(vc.dtype), vc)
    return O.reshape(B, H, n * w, d)[:, :, :N]


def performer_features(d: int, m: int, generator=None, device=None) -> torch.Tensor:
    """FAVOR+'s ``m`` random feature directions for head dimension ``d``, ``(m, d)``: blocks of orthogonal
    rows (fewer samples for the same variance), each row scaled to the norm of a Gaussian vector."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        G = torch.randn(d, d, generator=generator)
        Qm, _ = torch.linalg.qr(G)
        blocks.append(Qm.T)
    W = torch.cat(blocks)[:m]
    norms = torch.randn(m, d, generator=generator).norm(dim=1, keepdim=True)
    return (W * norms).to(device)


def _phi(x, W, is_query):
    """Positive random features: phi(x) = exp(W x - |x|^2 / 2 - c) / sqrt(m), with E[phi(q) . phi(k)] =
    exp(q . k) (times a constant that cancels). ``c`` keeps exp from overflowing: a per-row max for
    queries (it cancels in each row's normalization), one max over all keys for keys (it cancels too)."""
    proj = torch.matmul(x, W.T)
    sq = 0.5 * (x * x).sum(-1, keepdim=True)
    c = proj.amax(-1, keepdim=True) if is_query else proj.amax(dim=(-2, -1), keepdim=True)
    return torch.exp(proj - sq - c.detach()) / math.sqrt(W.shape[0]) + 1e-6


def performer_attention(q, k, v, features, causal=True, chunk=64, sm_scale=None):
    """FAVOR+ attention with the random ``features`` of :func:`performer_features`: an unbiased estimate of
    softmax attention whose cost is linear in N. Causal: chunks of ``chunk`` queries take the keys of
    their own chunk directly (a small masked product) and every earlier key through a running sum of
    phi(k)^T v over the chunks before. Computed in fp32 (the features are exponentials)."""
    dtype = q.dtype
    s4 = _scale(q, sm_scale) ** 0.5  # q . k * sm_scale = (s4 q) . (s4 k)
    W = features.to(device=q.device, dtype=torch.float32)
    qf = _phi(q.float() * s4, W, True)
    kf = _phi(k.float() * s4, W, False)
    vf = v.float()
    if not causal:
        num = torch.matmul(qf, torch.matmul(kf.transpose(-1, -2), vf))
        den = torch.matmul(qf, kf.sum(-2, keepdim=True).transpose(-1, -2))
        return (num / den).to(dtype)
    B, H, N, d = q.shape
    m = W.shape[0]
    c = min(chunk, N)
    pad = (-N) % c
    if pad:  # padded keys (phi = 0) come after every real query; padded queries get phi = 1 (no 0 / 0)
        kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (kf, vf))
        qf = F.pad(qf, (0, 0, 0, pad), value=1.0)
    n = (N + pad) // c
    qf, kf, vf = qf.reshape(B, H, n, c, m), kf.reshape(B, H, n, c, m), vf.reshape(B, H, n, c, d)
    A = torch.matmul(qf, kf.transpose(-1, -2)).tril()  # within the chunk: keys j <= i
    kv = torch.matmul(kf.transpose(-1, -2), vf)  # (B, H, n, m, d): one chunk's phi(k)^T v
    state = torch.cumsum(kv, dim=2) - kv  # the chunks before
    z = kf.sum(-2)
    zs = torch.cumsum(z, dim=2) - z
    num = torch.matmul(A, vf) + torch.matmul(qf, state)
    den = A.sum(-1) + (qf * zs[..., None, :]).sum(-1)
    return (num / den[..., None]).reshape(B, H, n * c, d)[:, :, :N].to(dtype)
