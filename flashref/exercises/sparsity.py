"""Checkers for the exercises of notebook ``10_dropout_masks_sparsity``.

    from flashref.exercises import sparsity as ex
    ex.check_sink_window_mask(sink_window)   # a block mask the reader writes
    ex.check_dropout_mask_bytes(answer)
    ex.check_gqa_cache_saved(answer)

They need neither torch nor triton: a mask may be a torch tensor or a NumPy array, and is compared as a
NumPy array.
"""

from __future__ import annotations

import numpy as np

from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, bool_mask, read_number, right, wrong


#: Exercise "sink window": (n_blocks, window) cases the reader's function is checked on.
SINK_CASES = [(8, 3), (1, 1), (5, 8), (12, 1), (16, 4)]

#: Exercise "dropout mask bytes": a keep-mask of B x H x N x N entries, one byte each (torch.bool).
MASK_B, MASK_H, MASK_N, MASK_D = 4, 12, 8192, 64

#: Exercise "KV cache": a larger Llama-like model, fp16, one sequence of GQA_N tokens.
GQA_LAYERS, GQA_H, GQA_H_KV, GQA_D, GQA_N, GQA_BYTES = 80, 64, 8, 128, 4096, 2

GiB = 2**30


# --------------------------------------------------------------------------------------------------
# A block mask: sliding window with an attention sink
# --------------------------------------------------------------------------------------------------

def _window(n: int, window: int) -> np.ndarray:
    """Query block i sees key blocks i - window + 1 .. i."""
    gap = np.arange(n)[:, None] - np.arange(n)[None, :]
    return (gap >= 0) & (gap < window)


def sink_window(n_blocks: int, window: int) -> np.ndarray:
    """The exercise's pattern, as a NumPy bool array (1, 1, n_blocks, n_blocks): query block i sees the
    ``window`` key blocks ending at its own (i - window + 1 .. i) and key block 0, the sink."""
    mask = _window(n_blocks, window)
    mask[:, 0] = True
    return mask[None, None]


def _blocks(cells) -> str:
    shown = ", ".join(f"({i}, {j})" for i, j in cells[:6])
    return shown + (f" and {len(cells) - 6} more" if len(cells) > 6 else "")


def check_sink_window_mask(fn) -> Verdict:
    """``fn(n_blocks, window)`` must return the bool block mask (1, 1, n_blocks, n_blocks) in which query
    block i sees key blocks i - window + 1 .. i (its own included) and key block 0 (the sink)."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (sink_window), not {type(fn).__name__}.")
    for n, w in SINK_CASES:
        case = f"n_blocks = {n}, window = {w}"
        try:
            got = fn(n, w)
        except Exception as exc:  # noqa: BLE001 (a reader's bug must not stop the notebook)
            return wrong(f"on {case} your function raised {type(exc).__name__}: {exc}")
        if got is None:
            return Verdict(False, UNWRITTEN)
        got, problem = bool_mask(got, "the block is visible")
        if problem:
            return wrong(problem)
        want = sink_window(n, w)
        if got.shape == want.shape[2:]:
            return wrong(f"on {case} the mask has shape {got.shape}; the kernels take (B or 1, H or 1, n, n): "
                         "add the two leading dimensions (mask[None, None]).")
        if got.shape != want.shape:
            return wrong(f"on {case} the mask should have shape {want.shape}, got {got.shape}.")
        if np.array_equal(got, want):
            continue
        g, t = got[0, 0], want[0, 0]
        future = [(int(i), int(j)) for i, j in zip(*np.nonzero(np.triu(g, 1)))]
        if future:
            return wrong(f"on {case} query blocks see later key blocks: {_blocks(future)}. The pattern is causal: "
                         "block (i, j) with j > i stays False.")
        if not g[:, 0].all() and np.array_equal(g | _sink_column(n), t):
            rows = [int(i) for i in np.nonzero(~g[:, 0])[0]]
            return wrong(f"on {case} key block 0, the sink, is missing from query blocks {rows[:8]}: every query "
                         "block sees it, however far back it lies.")
        for other in (w - 1, w + 1):
            if other >= 1 and np.array_equal(g, sink_window(n, other)[0, 0]):
                return wrong(f"on {case} each query block sees {other} blocks of the window instead of {w}: the "
                             f"window of {w} blocks ends at the query block itself, key blocks i - {w - 1} .. i.")
        missing = [(int(i), int(j)) for i, j in zip(*np.nonzero(t & ~g))]
        extra = [(int(i), int(j)) for i, j in zip(*np.nonzero(g & ~t))]
        said = []
        if missing:
            said.append(f"blocks {_blocks(missing)} should be True")
        if extra:
            said.append(f"blocks {_blocks(extra)} should be False")
        return wrong(f"on {case} the mask differs in {len(missing) + len(extra)} blocks (query block, key block): "
                     + "; ".join(said) + ".")
    return right("Every query block sees its window and the sink: the kernels skip every other tile.")


def _sink_column(n: int) -> np.ndarray:
    column = np.zeros((n, n), dtype=bool)
    column[:, 0] = True
    return column


# --------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------

def dropout_mask_bytes(B: int, H: int, N: int) -> int:
    """Bytes of a stored keep-mask of one byte per entry of P: B H N^2."""
    return B * H * N * N


def check_dropout_mask_bytes(answer) -> Verdict:
    """Bytes of a stored dropout keep-mask, one byte per entry (torch.bool), for B = 4, H = 12, N = 8192."""
    value, unready = read_number(answer, "the answer (a number of bytes)")
    if unready is not None:
        return unready
    expected = dropout_mask_bytes(MASK_B, MASK_H, MASK_N)
    qkv = 3 * MASK_B * MASK_H * MASK_N * MASK_D * 2
    close = lambda x: np.isclose(value, x, rtol=1e-6, atol=0.0)  # noqa: E731
    if close(expected):
        return right(f"B H N^2 = {expected / GiB:.0f} GiB for one layer, written by the forward and read again by "
                     f"the backward: {expected / qkv:.0f}x the bytes of Q, K and V together (fp16, d = {MASK_D}). "
                     "The kernel keeps a seed and recomputes each bit where it needs it.")
    if close(expected / GiB) or close(expected / 1e9):
        return wrong("the answer is asked in bytes, not in GiB or GB.")
    if close(expected / (MASK_B * MASK_H)) or close(expected / MASK_H) or close(expected / MASK_B):
        return wrong(f"every (batch, head) pair draws its own mask: there are B H = {MASK_B * MASK_H} of them.")
    if close(expected / 8):
        return wrong("that packs the mask to one bit an entry; torch.bool, as the question says, takes one byte. "
                     "(Packed, it is still N^2 bits a head.)")
    if close(expected * 2) or close(expected * 4):
        return wrong("a keep-mask is boolean, one byte an entry, not an fp16 or fp32 number.")
    if close(MASK_B * MASK_H * MASK_N * MASK_D) or close(qkv / 3) or close(qkv):
        return wrong("that is the size of Q, K or V (N d a head); the mask has one entry per (query, key) pair, "
                     "N^2 a head.")
    return wrong(f"{value:,.0f} bytes is not it. The mask has an entry for every entry of P: B H N x N, one byte "
                 "each.")


def kv_cache_bytes(layers: int, H_kv: int, d: int, N: int, elem: int = 2) -> int:
    """Bytes of the K and V cache of one sequence of N tokens: two tensors (K, V) of H_kv heads of d
    numbers per token, in every layer."""
    return 2 * layers * H_kv * d * N * elem


def check_gqa_cache_saved(answer) -> Verdict:
    """Bytes of KV cache that grouped-query attention (8 K/V heads) saves against multi-head attention (64)
    for one sequence of 4096 tokens of an 80-layer model with d = 128, fp16."""
    value, unready = read_number(answer, "the answer (a number of bytes)")
    if unready is not None:
        return unready
    mha = kv_cache_bytes(GQA_LAYERS, GQA_H, GQA_D, GQA_N, GQA_BYTES)
    gqa = kv_cache_bytes(GQA_LAYERS, GQA_H_KV, GQA_D, GQA_N, GQA_BYTES)
    expected = mha - gqa
    close = lambda x: np.isclose(value, x, rtol=1e-6, atol=0.0)  # noqa: E731
    if close(expected):
        return right(f"{mha / GiB:g} GiB with {GQA_H} K/V heads, {gqa / GiB:g} GiB with {GQA_H_KV}: "
                     f"{expected / GiB:g} GiB saved per sequence, {expected // GQA_N // 1024:,} KiB for every token. "
                     f"Decoding reads the whole cache for each new token, so it also reads {GQA_H // GQA_H_KV}x fewer "
                     "bytes.")
    if close(gqa):
        return wrong(f"{value / GiB:g} GiB is the cache GQA keeps; the question asks what it saves against "
                     f"{GQA_H} K/V heads.")
    if close(mha):
        return wrong(f"{value / GiB:g} GiB is the whole multi-head cache; subtract what GQA keeps.")
    if close(expected / GiB) or close(expected / 1e9):
        return wrong("the answer is asked in bytes, not in GiB or GB.")
    if close(expected / 2):
        return wrong("that is half: both K and V are cached (two tensors a layer), and fp16 takes 2 bytes a number.")
    if close(expected / GQA_LAYERS):
        return wrong(f"that is one layer; each of the {GQA_LAYERS} layers has its own cache.")
    if close(expected / GQA_N):
        return wrong(f"that is one token; the sequence has {GQA_N}.")
    if close(expected * 2):
        return wrong("fp16 is 2 bytes a number, not 4.")
    return wrong(f"{value:,.0f} bytes is not it. The cache holds K and V: 2 x layers x H_kv x d x N numbers of 2 "
                 "bytes; compute it for H_kv = 64 and H_kv = 8 and subtract.")
