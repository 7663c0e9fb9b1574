"""The kernel's score and mask modifications and its packed variable-length path against PyTorch's own, in one
run: a causal sliding window, tanh soft-capping, ALiBi, and documents of different lengths.

    python -m flashref.bench mods                # the points below

- ``window``: Mistral's causal sliding window of w = 1024 keys (``window_size=(1023, 0)``, ``causal=True``)
  against FlexAttention (``torch.compile(flex_attention)``, a ``mask_mod`` for causal + window and its
  ``create_block_mask``) and against ``scaled_dot_product_attention`` with the window as a boolean
  ``attn_mask`` (SDPA picks its backend: the flash one takes no mask), next to flashref's dense causal time.
- ``softcap``: ``softcap = 30`` (Gemma 2 caps its attention scores at 50; the cost is the same), causal,
  against Flex with a ``score_mod`` ``c * tanh(s / c)`` and against plain PyTorch (matmul, tanh, softmax,
  matmul), which holds the N x N scores and runs out of memory at the longest lengths (recorded as OOM).
- ``alibi``: the geometric ALiBi slopes ``2^(-8 h / H)`` (:func:`alibi_slopes`), causal, against Flex with a
  ``score_mod`` ``s - a_h |i - j|`` and against SDPA with the bias as a float ``attn_mask`` of shape
  ``(1, H, N, N)`` (the causal mask folded in as -inf: SDPA takes no ``is_causal`` beside a mask).
- ``window-kernels``: the window's backward kernel by kernel (mode ``bwd``), each timed alone on the same
  inputs and row statistics: the teaching dK/dV and dQ kernels, the Gluon ones of the Hopper chapter (on an
  sm_90 GPU), the D = rowsum(dO * O) pre-pass, and Flex's whole backward. ``matmuls`` is the tile products a
  visible pair costs in each (dK/dV 4, dQ 3, Flex's 7), and TFLOP/s counts those. What ``flash_attention``'s
  choice of backward kernels for a window rests on (``flashref.triton.ops._backward_kernel``).
- ``varlen``: 64K tokens of documents with log-normal lengths (mean 1K, at most 8K, seeded:
  :func:`document_lengths`), causal: ``flash_attention_varlen`` on the packed batch against
  ``flash_attention`` and SDPA's flash backend on the batch padded to the longest document (B = documents,
  N = longest); tokens/s counts real tokens only, and ``padded_work_ratio`` is the (query, key) pairs the
  padded batch computes over those of the packed one. FlashAttention's own ``flash_attn_varlen_func`` joins
  when ``flash_attn`` is installed.

Shapes: fp16, H d = 2048 (H = 16 at d = 128, H = 32 at d = 64), B N = 32K tokens for N = 4K, 8K, 16K at
d = 128; the window also at N = 8K, d = 64; varlen at d = 128 and 64. A row is one implementation in one mode,
forward or forward + backward, with its time and peak memory. FLOPs are counted on the visible
(query, key) pairs only (:func:`visible_pairs`, 4 d a pair forward, 2.5x that backward:
:func:`flashref.bench.results.pair_flops`); for the padded varlen peers, on the real documents' pairs, so the
padding's wasted work shows as a lower rate. Flex builds its BlockMask once, outside the timing, as its users
do; so do the SDPA masks. Results go to ``book/data/mods_bench.json`` with the device, library versions and
command (:func:`load_results` reads them back); ``--parts`` runs some of them (window, window-kernels,
softcap, alibi, varlen), ``--n`` some lengths, and ``--append`` adds them to the file's rows in place of those it measures
again (one run split over several calls of the same machine). The whole run is sized to take under 6 minutes
on an H100, most of it compiling Flex and autotuning the kernels.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys

import numpy as np

from flashref.bench import results
from flashref.bench.features_bench import _flex, _fwd_bwd, _inputs, _row, _time
from flashref.bench.gpu_bench import sdpa
from flashref.bench.results import pair_flops
from flashref.validation import check_window_size

PARTS = ("window", "window-kernels", "softcap", "alibi", "varlen")
MODES = ("fwd", "fwd+bwd")
WINDOW = (1023, 0)   # Mistral: each query sees itself and the 1023 keys before it
SOFTCAP = 30.0
#: (N, d, B, H) of the window, softcap and ALiBi parts: B N = 32K tokens, H d = 2048
GRID = [(4096, 128, 8, 16), (8192, 128, 4, 16), (16384, 128, 2, 16)]
WINDOW_EXTRA = [(8192, 64, 4, 32)]
#: (tokens, H, d) of the varlen part, and its documents: log-normal lengths, mean 1K, at most 8K
VARLEN_GRID = [(65536, 16, 128), (65536, 32, 64)]
DOCS = dict(mean=1024, max_len=8192, min_len=16, sigma=1.0, seed=0)


# ---- counting: pure Python, tested on the CPU --------------------------------------------------------------

def visible_pairs(N_q: int, N_k: int, window_size=(-1, -1), causal: bool = False) -> int:
    """The (query, key) pairs a head computes under a token window and ``causal`` (flashref's top-left rule,
    :mod:`flashref.score_mods`): query i sees keys ``max(0, i - left) <= j <= min(N_k - 1, i + right)``, and
    ``j <= i`` when causal. One interval a row, so a sum over the N_q rows, not the N_q x N_k mask."""
    left, right = check_window_size(window_size)
    i = np.arange(int(N_q), dtype=np.int64)
    last = np.full_like(i, int(N_k) - 1)
    if right >= 0:
        last = np.minimum(last, i + right)
    if causal:
        last = np.minimum(last, i)
    first = np.maximum(i - left, 0) if left >= 0 else np.zeros_like(i)
    return int(np.clip(last - first + 1, 0, None).sum())


def alibi_slopes(H: int) -> list[float]:
    """ALiBi's slopes (Press et al.): ``2^(-8 h / H)`` for h = 1..H when H is a power of two; otherwise those
    of the power of two below H, then every other slope of the one above, as the paper's code does."""
    if H < 1:
        raise ValueError(f"H must be a positive int, got {H!r}")
    below = 2 ** math.floor(math.log2(H))
    geometric = [2.0 ** (-8.0 * h / below) for h in range(1, below + 1)]
    return geometric if below == H else geometric + alibi_slopes(2 * below)[0::2][:H - below]


def document_lengths(total: int, mean: int = 1024, max_len: int = 8192, min_len: int = 16, sigma: float = 1.0,
                     seed: int = 0) -> list[int]:
    """Seeded document lengths that sum to ``total``: log-normal draws with the given ``mean`` (before
    clipping) and shape ``sigma``, clipped to ``[min_len, max_len]`` (pretraining corpora: many short
    documents, a long tail), drawn until the total is reached; the last document takes what is left."""
    if not 1 <= min_len <= max_len or total < 1:
        raise ValueError(f"need total >= 1 and 1 <= min_len <= max_len, got {total}, {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # a log-normal's mean is exp(mu + sigma^2 / 2)
    lengths, left = [], int(total)
    while left:
        n = min(int(np.clip(round(rng.lognormal(mu, sigma)), min_len, max_len)), left)
        lengths.append(n)
        left -= n
    return lengths


def cu_seqlens(lengths) -> list[int]:
    """FlashAttention's cumulative lengths ``[0, n_0, n_0 + n_1, ..., total]``."""
    return [0] + np.cumsum(lengths).tolist()


def padded_work_ratio(lengths, causal: bool = True) -> float:
    """Pairs the batch padded to its longest document computes (every document as long as the longest) over
    the pairs of the packed batch (each document its own square)."""
    longest = max(lengths)
    padded = len(lengths) * visible_pairs(longest, longest, causal=causal)
    return padded / sum(visible_pairs(n, n, causal=causal) for n in lengths)


def pad_documents(x, lengths, N: int):
    """A packed ``(total, H, d)`` tensor as the padded batch ``(n_docs, H, N, d)``: document b in rows
    ``0..n_b - 1`` of batch entry b, zeros after. With causal attention the padding, after every real token,
    is never seen by a real query, so no key mask is needed."""
    import torch

    n = torch.as_tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(n, 0) - n
    doc = torch.repeat_interleave(torch.arange(len(lengths)), n)   # the document of each packed row
    rows = doc * N + torch.arange(x.shape[0]) - starts[doc]         # its row in the padded batch
    out = x.new_zeros(len(lengths) * N, *x.shape[1:])
    out[rows.to(x.device)] = x
    return out.reshape(len(lengths), N, *x.shape[1:]).transpose(1, 2).contiguous()


# ---- the peers' modifications, as each library spells them -----------------------------------------------

def flex_mask_mod(window_size=(-1, -1), causal: bool = False):
    """FlexAttention's ``mask_mod`` for flashref's token window and causality; None when nothing is masked."""
    left, right = check_window_size(window_size)
    if not causal and left < 0 and right < 0:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (q_idx - kv_idx <= left) if left >= 0 else (q_idx >= 0)
        if right >= 0:
            visible = visible & (kv_idx - q_idx <= right)
        return visible & (q_idx >= kv_idx) if causal else visible

    return mask_mod


def flex_score_mod(softcap: float = 0.0, slopes=None):
    """FlexAttention's ``score_mod`` of flashref's rule: the (scaled) score capped, then the ALiBi bias."""
    if not softcap and slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap:
            score = softcap * score.div(softcap).tanh()
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    return score_mod


def flex_block_mask(mask_mod, N: int, device, block_size: int = 128):
    """The BlockMask of ``mask_mod``, made once; compiled only past 16K tokens, where the N x N evaluation
    the uncompiled path does would not fit."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, None, None, N, N, device=device, BLOCK_SIZE=block_size, _compile=N > 16384)


def sdpa_window_mask(N_q: int, N_k: int, window_size=(-1, -1), causal: bool = False, device=None):
    """The boolean ``attn_mask`` (True: attend) of a token window and causality, ``(N_q, N_k)``."""
    import torch

    left, right = check_window_size(window_size)
    offset = torch.arange(N_k, device=device)[None, :] - torch.arange(N_q, device=device)[:, None]  # j - i
    visible = torch.ones(N_q, N_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible & (offset <= 0) if causal else visible


def alibi_bias(slopes, N_q: int, N_k: int, causal: bool, dtype):
    """The float ``attn_mask`` ``(1, H, N_q, N_k)``: ``-a_h |i - j|``, and -inf above the diagonal when causal.
    Filled a head at a time so the float32 distances are the only other N_q x N_k tensor."""
    import torch

    i = torch.arange(N_q, device=slopes.device)[:, None]
    j = torch.arange(N_k, device=slopes.device)[None, :]
    distance = (i - j).abs().to(torch.float32)
    bias = torch.empty(1, slopes.shape[0], N_q, N_k, dtype=dtype, device=slopes.device)
    for h in range(slopes.shape[0]):
        bias[0, h] = -slopes[h] * distance
    if causal:
        bias.masked_fill_(j > i, float("-inf"))
    return bias


def softcap_attention(q, k, v, causal: bool, softcap: float, sm_scale=None):
    """Plain PyTorch with a soft cap: S = c tanh(sm_scale Q K^T / c) and P = softmax(S) held whole, as a model
    without a fused kernel runs Gemma 2's attention."""
    import torch

    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    S = torch.matmul(q, k.transpose(-1, -2)) * scale
    S = softcap * torch.tanh(S / softcap)
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(S, dim=-1).to(v.dtype), v)


# ---- measuring --------------------------------------------------------------------------------------------

def _status(exc) -> str:
    return "OOM" if results.is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _attempt(step):
    """``(step(), None)``, or ``(None, status)`` when it raises: "OOM" or the error's first line. The status is
    taken inside the except clause and the cache emptied after it, once the traceback (and the frames holding
    the failed call's tensors) is gone."""
    import torch

    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
        status = _status(exc)
    torch.cuda.empty_cache()
    return None, status


def _measure(fields: dict, impl: str, make, inputs, do, work_pairs: int, tokens: int | None = None):
    """Rows of one implementation, forward and forward + backward. ``make()`` builds what the peer holds across
    calls (a BlockMask, a bias) and returns ``fn(q, k, v)``; its failures, out of memory included, are rows too.
    ``work_pairs``: the visible pairs a head over the whole batch (B times a sequence's, or the documents' sum)."""
    import torch

    B, H, N, d = fields["B"], fields["H"], fields["N"], fields["d"]
    info = {k: v for k, v in fields.items() if k not in ("B", "H", "N", "d", "causal")}
    fn, status = _attempt(make)
    for mode in MODES:
        case = f"{fields['part']} {mode}"
        if fn is not None:
            if mode == "fwd":
                def run(fn=fn):
                    with torch.no_grad():
                        return fn(*inputs)
            else:
                run = _fwd_bwd(fn, *inputs, do)
            timed, status = _attempt(lambda: _time(run, mode != "fwd", list(inputs)))
        if status is not None:
            yield {"case": case, "impl": impl, **fields, "mode": mode, "status": status}
            continue
        ms, peak = timed
        row = _row(case, impl, B, H, H, N, d, fields["causal"], ms, peak, pair_flops(1, H, work_pairs, d, mode),
                   mode=mode, **info)
        if tokens is not None:
            row["tokens_per_s"] = tokens / (ms * 1e-3)
        yield row
    del fn
    torch.cuda.empty_cache()


def _grid(grid, lengths):
    return [g for g in grid if lengths is None or g[0] in lengths]


def window_cases(lengths=None):
    """flashref's sliding window against Flex's and SDPA's masks; flashref's dense causal beside them."""
    import torch

    from flashref.triton import flash_attention

    mask_mod = flex_mask_mod(WINDOW, causal=True)
    for N, d, B, H in _grid(GRID + WINDOW_EXTRA, lengths):
        q, k, v, do = _inputs(B, H, H, N, d)
        pairs = visible_pairs(N, N, WINDOW, causal=True)
        fields = dict(part="window", B=B, H=H, N=N, d=d, causal=True, window_size=list(WINDOW),
                      pair_fraction=pairs / (N * N))
        impls = {"flashref-triton": lambda: lambda q, k, v: flash_attention(q, k, v, causal=True, window_size=WINDOW,
                                                                            check_finite=False),
                 # the teaching kernels in both directions: what kernel="auto" chose before the Hopper forward
                 # took windows, and what backs that choice (flashref-triton's forward is the Hopper one there)
                 "flashref-triton teaching": lambda: lambda q, k, v: flash_attention(
                     q, k, v, causal=True, window_size=WINDOW, check_finite=False, kernel="triton"),
                 "flex": lambda: _flex_fn(flex_block_mask(mask_mod, N, "cuda")),
                 "sdpa attn_mask": lambda: _sdpa_mask_fn(sdpa_window_mask(N, N, WINDOW, True, "cuda"))}
        for impl, make in impls.items():
            yield from _measure(fields, impl, make, (q, k, v), do, B * pairs)
        dense = {**fields, "window_size": [-1, -1], "pair_fraction": visible_pairs(N, N, causal=True) / (N * N)}
        yield from _measure(dense, "flashref-triton no window",
                            lambda: lambda q, k, v: flash_attention(q, k, v, causal=True, check_finite=False,
                                                                    kernel="triton"),
                            (q, k, v), do, B * visible_pairs(N, N, causal=True))
        del q, k, v, do
        torch.cuda.empty_cache()


def window_kernel_cases(lengths=None):
    """Rows of the ``window-kernels`` part: the window's backward kernels one by one (see the module's doc)."""
    import torch

    from flashref.triton import flash_attention_forward, ops

    mask_mod = flex_mask_mod(WINDOW, causal=True)
    for N, d, B, H in _grid(GRID + WINDOW_EXTRA, lengths):
        q, k, v, do = _inputs(B, H, H, N, d)
        pairs = B * visible_pairs(N, N, WINDOW, causal=True)
        fields = dict(part="window-kernels", B=B, H=H, N=N, d=d, causal=True, window_size=list(WINDOW), mode="bwd")
        scale = d ** -0.5
        with torch.no_grad():
            o, lse = flash_attention_forward(q, k, v, causal=True, window_size=WINDOW, check_finite=False,
                                             kernel="triton")
            m2, l2 = ops._stats_from_lse(lse)
            delta = ops._delta(o, do)
        feat = ops.Features(q, k, causal=True, scale=scale, window_size=WINDOW, check_finite=False)
        win = (feat.win_left, feat.win_right)

        def teaching(part):
            return lambda: ops._backward(q, k, v, o, (m2, l2), do, scale, True, feat, "triton", parts=(part,),
                                         delta=delta)

        kernels = {"teaching dK/dV": (4, teaching("dkdv")), "teaching dQ": (3, teaching("dq"))}
        gluon = ops._gluon_module("hopper_backward") if ops.configs.device_capability(q.device) == 90 else None
        if gluon is not None and not isinstance(gluon, ImportError) and gluon.supported(q, k, v) is None:
            kernels["gluon dK/dV"] = (4, lambda: gluon.hopper_dkdv(q, k, v, do, m2, l2, delta, True, scale, window=win))
            kernels["gluon dQ"] = (3, lambda: gluon.hopper_dq(q, k, v, do, m2, l2, delta, True, scale, window=win))
        kernels["D pre-pass"] = (0, lambda: ops._delta(o, do))
        flex_o, status = _attempt(lambda: _flex_fn(flex_block_mask(mask_mod, N, "cuda"))(q, k, v))
        if flex_o is not None:
            kernels["flex backward"] = (7, lambda: torch.autograd.grad(flex_o, (q, k, v), do, retain_graph=True))
        else:
            yield {"case": "window bwd", "impl": "flex backward", **fields, "status": status}
        for impl, (matmuls, fn) in kernels.items():
            timed, status = _attempt(lambda: _time(fn, False, None))
            if status is not None:
                yield {"case": "window bwd", "impl": impl, **fields, "status": status}
                continue
            ms, peak = timed
            yield _row("window bwd", impl, B, H, H, N, d, True, ms, peak, matmuls * 2 * d * H * pairs,
                       **{k_: v_ for k_, v_ in fields.items() if k_ not in ("B", "H", "N", "d", "causal")},
                       matmuls=matmuls)
        del q, k, v, do, o, lse, m2, l2, delta, flex_o, kernels
        torch.cuda.empty_cache()


def _flex_fn(block_mask, score_mod=None):
    return lambda q, k, v: _flex()(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _sdpa_mask_fn(mask):
    import torch

    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def softcap_cases(lengths=None, softcap=SOFTCAP):
    """flashref's fused soft cap against Flex's score_mod and plain PyTorch, causal."""
    import torch

    from flashref.triton import flash_attention

    causal_mod, score_mod = flex_mask_mod(causal=True), flex_score_mod(softcap=softcap)
    for N, d, B, H in _grid(GRID, lengths):
        q, k, v, do = _inputs(B, H, H, N, d)
        pairs = visible_pairs(N, N, causal=True)
        fields = dict(part="softcap", B=B, H=H, N=N, d=d, causal=True, softcap=softcap)
        impls = {"flashref-triton": lambda: lambda q, k, v: flash_attention(q, k, v, causal=True, softcap=softcap,
                                                                            check_finite=False),
                 "flex": lambda: _flex_fn(flex_block_mask(causal_mod, N, "cuda"), score_mod),
                 "plain": lambda: lambda q, k, v: softcap_attention(q, k, v, True, softcap)}
        for impl, make in impls.items():
            yield from _measure(fields, impl, make, (q, k, v), do, B * pairs)
        del q, k, v, do
        torch.cuda.empty_cache()


def alibi_cases(lengths=None):
    """flashref's fused ALiBi bias against Flex's score_mod and SDPA's float attn_mask, causal."""
    import torch

    from flashref.triton import flash_attention

    causal_mod = flex_mask_mod(causal=True)
    for N, d, B, H in _grid(GRID, lengths):
        slopes = torch.tensor(alibi_slopes(H), dtype=torch.float32, device="cuda")
        score_mod = flex_score_mod(slopes=slopes)
        q, k, v, do = _inputs(B, H, H, N, d)
        pairs = visible_pairs(N, N, causal=True)
        fields = dict(part="alibi", B=B, H=H, N=N, d=d, causal=True, alibi_slopes="2^(-8 h / H), h = 1..H")
        impls = {"flashref-triton": lambda: lambda q, k, v: flash_attention(q, k, v, causal=True, alibi_slopes=slopes,
                                                                            check_finite=False),
                 "flex": lambda: _flex_fn(flex_block_mask(causal_mod, N, "cuda"), score_mod),
                 "sdpa attn_mask": lambda: _sdpa_mask_fn(alibi_bias(slopes, N, N, True, q.dtype))}
        for impl, make in impls.items():
            yield from _measure(fields, impl, make, (q, k, v), do, B * pairs)
        del q, k, v, do
        torch.cuda.empty_cache()


def _flash_attn_varlen():
    """FlashAttention's own ``flash_attn_varlen_func``, or None where ``flash_attn`` does not import."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 (a broken install is no peer)
        return None
    return flash_attn_varlen_func


def varlen_cases(grid=None, docs=None):
    """The packed batch against the padded one, causal: tokens/s of real tokens, forward and forward + backward."""
    import torch

    from flashref.triton import flash_attention, flash_attention_varlen

    docs = {**DOCS, **(docs or {})}
    for total, H, d in grid or VARLEN_GRID:
        lengths = document_lengths(total, **docs)
        N, n_docs = max(lengths), len(lengths)
        cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        packed = [torch.randn(total, H, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4)]
        padded = [pad_documents(x, lengths, N) for x in packed]
        for x in packed[:3] + padded[:3]:
            x.requires_grad_(True)
        pairs = sum(visible_pairs(n, n, causal=True) for n in lengths)
        fields = dict(part="varlen", B=n_docs, H=H, N=N, d=d, causal=True, tokens=total,
                      mean_len=total / n_docs, min_len=min(lengths), documents=docs,
                      padded_work_ratio=padded_work_ratio(lengths, causal=True))
        def packed_fn(q, k, v, cu=cu, N=N):
            return flash_attention_varlen(q, k, v, cu, cu, N, N, causal=True, check_finite=False)

        impls = {"flashref-triton varlen": (lambda: packed_fn, packed),
                 "flashref-triton padded": (lambda: lambda q, k, v: flash_attention(q, k, v, causal=True,
                                                                                    check_finite=False,
                                                                                    kernel="triton"), padded),
                 "sdpa-flash padded": (lambda: lambda q, k, v: sdpa("sdpa-flash")(q, k, v, True), padded)}
        flash_attn = _flash_attn_varlen()
        if flash_attn is not None:
            impls["flash-attn varlen"] = (lambda: lambda q, k, v: flash_attn(q, k, v, cu, cu, N, N, causal=True),
                                          packed)
        else:
            yield {"case": "varlen", "impl": "flash-attn varlen", **fields, "status": "flash_attn not installed"}
        for impl, (make, (q, k, v, do)) in impls.items():
            yield from _measure(fields, impl, make, (q, k, v), do, pairs, tokens=total)
        del packed, padded, impls, q, k, v, do
        torch.cuda.empty_cache()


def _print(r):
    window = lambda: f"window={r.get('window_size')}"  # noqa: E731
    what = {"window": window, "window-kernels": window, "softcap": lambda: f"softcap={r.get('softcap')}",
            "alibi": lambda: "alibi", "varlen": lambda: f"docs={r.get('B')} pad x{r.get('padded_work_ratio', 0):.2f}"}
    mod = what.get(r.get("part"), str)()
    head = f"{r['case']:16} {r['impl']:26} B={r.get('B')} H={r.get('H')} N={r.get('N')} d={r.get('d')} {mod:22}"
    if "ms" not in r:
        print(f"{head} {r.get('status')}", flush=True)
        return
    rate = f" {r['tokens_per_s'] / 1e6:7.2f} Mtok/s" if "tokens_per_s" in r else ""
    print(f"{head} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s peak+ {r['peak_extra_bytes'] / 2**20:8.1f} MiB{rate}",
          flush=True)


#: The window's backward kernels as :func:`window_kernel_cases` names them, and the backwards they assemble:
#: (dK/dV kernel, dQ kernel), each with the D pre-pass. ``flash_attention`` runs "teaching" with kernel="triton"
#: and "gluon" on an H100; "gluon dQ" is the mix it ran while the Gluon dK/dV kernel masked every tile.
WINDOW_KERNELS = ("teaching dK/dV", "teaching dQ", "gluon dK/dV", "gluon dQ", "D pre-pass", "flex backward")
WINDOW_BACKWARDS = {"teaching": ("teaching dK/dV", "teaching dQ"), "gluon dQ": ("teaching dK/dV", "gluon dQ"),
                    "gluon": ("gluon dK/dV", "gluon dQ")}


def window_kernel_table(rows) -> str:
    """The ``window-kernels`` rows as a table: each kernel's time (ms) at each (N, d), then each backward
    assembled from them (:data:`WINDOW_BACKWARDS`, the D pre-pass included) as Flex's time over its own: above
    1, that backward is faster than Flex's. "-" where a kernel was not measured."""
    times = {}
    for r in rows:
        if r.get("part") == "window-kernels" and "ms" in r:
            times.setdefault((r["N"], r["d"]), {})[r["impl"]] = r["ms"]
    short = {"teaching dK/dV": "T dK/dV", "teaching dQ": "T dQ", "gluon dK/dV": "G dK/dV", "gluon dQ": "G dQ",
             "D pre-pass": "D", "flex backward": "Flex"}
    lines = [f"{'N':>6} {'d':>4} " + " ".join(f"{short[k]:>8}" for k in WINDOW_KERNELS) + "   Flex / ours: "
             + " ".join(f"{name:>9}" for name in WINDOW_BACKWARDS)]
    for (N, d), t in sorted(times.items()):
        cells = " ".join(f"{t[k]:8.3f}" if k in t else f"{'-':>8}" for k in WINDOW_KERNELS)
        ratios = []
        for dkdv, dq in WINDOW_BACKWARDS.values():
            parts = (dkdv, dq, "D pre-pass", "flex backward")
            ratios.append(f"{t['flex backward'] / (t[dkdv] + t[dq] + t['D pre-pass']):9.2f}"
                          if all(p in t for p in parts) else f"{'-':>9}")
        lines.append(f"{N:6} {d:4} {cells}               " + " ".join(ratios))
    return "\n".join(lines)


def measures(row: dict) -> tuple:
    """What a row measures, as :func:`flashref.bench.results.recorder` groups rows: its part and length (a
    varlen row's N is its longest document, not one of ``--n``: the part alone). ``--append`` replaces the
    saved rows of each group a run measures again."""
    return row.get("part"), None if row.get("part") == "varlen" else row.get("N")


def load_results(path=None) -> dict:
    """The committed run, book/data/mods_bench.json (or ``path``), read by :func:`flashref.bench.results.load`."""
    return results.load("mods_bench.json", path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashref.bench mods", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="book/data/mods_bench.json")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--n", nargs="+", type=int, default=None, metavar="N",
                   help="only these sequence lengths of the window, window-kernels, softcap and alibi parts "
                        "(4096 8192 16384)")
    p.add_argument("--append", action="store_true",
                   help="add to the rows already in --out (a run split over several calls; same GPU and versions), "
                        "replacing those of the parts and lengths measured again")
    args = p.parse_args(argv)
    if args.n is not None and not _grid(GRID + WINDOW_EXTRA, args.n) and set(args.parts) - {"varlen"}:
        p.error(f"--n {args.n}: none of the lengths {sorted({g[0] for g in GRID + WINDOW_EXTRA})}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flashref.bench mods needs a CUDA device", file=sys.stderr)
        return 2
    command = ("python -m flashref.bench mods --parts " + " ".join(args.parts)
               + (f" --n {' '.join(map(str, args.n))}" if args.n else ""))
    data = results.start(args.out if args.append else None, torch.cuda.get_device_name(), results.versions(),
                         command, dtype="float16")
    parts = {"window": lambda: window_cases(args.n), "window-kernels": lambda: window_kernel_cases(args.n),
             "softcap": lambda: softcap_cases(args.n),
             "alibi": lambda: alibi_cases(args.n), "varlen": varlen_cases}
    add = results.recorder(data, args.out, show=_print, group=measures)  # saved after each row
    for name in args.parts:
        for r in parts[name]():
            add(r)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
