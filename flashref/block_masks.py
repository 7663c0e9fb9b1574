"""Block-sparse mask patterns: the masks notebook ``10_dropout_masks_sparsity`` draws and the benchmark
times, in one place.

A block mask is a boolean tensor ``(B or 1, H or 1, n_q_blocks, n_k_blocks)``: block (i, j) True means the
queries of block i may see the keys of block j (``flashref.triton.flash_attention(..., block_mask=,
block_size=)`` and the float64 reference take it as is). Every pattern here returns ``(1, 1, n_q, n_k)``.
"""

from __future__ import annotations

import numbers

import torch

from flashref.validation import check_block_mask, check_block_size, check_bool, check_dense, check_positive_int


def _count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return int(n)


def n_blocks(N: int, block_size: int) -> int:
    """ceil(N / block_size): the blocks a side of N tokens."""
    return -(-check_positive_int("N", N) // check_block_size(block_size))


def _device(device):
    """``device`` checked: None (the CPU), or a device of this machine, named in the error when it is not."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch.device or a device string such as 'cuda' or 'cpu', got "
                         f"{type(device).__name__}: {device!r}") from None
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device must be a device of this machine, got {str(dev)!r}: torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def _grid(n_q_blocks, n_k_blocks, device):
    device = _device(device)
    n_q = check_positive_int("n_q_blocks", n_q_blocks)
    n_k = n_q if n_k_blocks is None else check_positive_int("n_k_blocks", n_k_blocks)
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return i, j


def causal_blocks(n_q_blocks: int, n_k_blocks: int | None = None, device=None) -> torch.Tensor:
    """Block j visible from block i when j <= i: the blocks top-left causal attention touches."""
    i, j = _grid(n_q_blocks, n_k_blocks, device)
    return (j <= i)[None, None]


def sliding_window(n_q_blocks: int, n_k_blocks: int | None = None, window: int = 4, causal: bool = True,
                   device=None) -> torch.Tensor:
    """A band of ``window`` blocks: causal, block i sees blocks i - window + 1 .. i; otherwise every block
    j with |i - j| < window (2 window - 1 blocks a row)."""
    window = check_positive_int("window", window)
    check_bool("causal", causal)
    i, j = _grid(n_q_blocks, n_k_blocks, device)
    band = (i - j < window) & (j - i < window)
    return (band & (j <= i) if causal else band)[None, None]


def bigbird(n_blocks: int, window: int = 3, n_global: int = 1, n_random: int = 2, seed: int = 0,
            device=None) -> torch.Tensor:
    """BigBird-like: a symmetric window (|i - j| < window), ``n_global`` global blocks (the first ones:
    they see every block and every block sees them), and ``n_random`` random key blocks a row drawn from a
    seeded CPU generator, so a seed gives the same mask on every device."""
    n = check_positive_int("n_blocks", n_blocks)
    device = _device(device)
    window, n_global, n_random = check_positive_int("window", window), _count("n_global", n_global), _count("n_random", n_random)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
    if not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64) (torch.Generator's range), got {seed}")
    i, j = _grid(n, None, "cpu")
    mask = (i - j < window) & (j - i < window)
    mask[:n_global, :] = True
    mask[:, :n_global] = True
    if n_random:
        g = torch.Generator().manual_seed(int(seed))
        picks = torch.rand(n, n, generator=g).argsort(dim=1)[:, :min(n_random, n)]
        mask[torch.arange(n)[:, None], picks] = True
    return mask[None, None].to(device) if device is not None else mask[None, None]


def density(block_mask: torch.Tensor) -> float:
    """The fraction of blocks that are visible."""
    if not hasattr(block_mask, "shape") or "bool" not in str(getattr(block_mask, "dtype", "")):
        raise TypeError(f"block_mask must be a boolean array or tensor, got {type(block_mask).__name__}"
                        + (f" of dtype {block_mask.dtype}" if hasattr(block_mask, "dtype") else ""))
    check_dense("block_mask", block_mask)
    if (block_mask.numel() if hasattr(block_mask, "numel") else block_mask.size) == 0:
        raise ValueError(f"block_mask is empty (shape {tuple(block_mask.shape)}): it has no density")
    return float(torch.as_tensor(block_mask).float().mean())


def visible_pairs(block_mask: torch.Tensor, N_q: int, N_k: int, block_size: int, causal: bool = False) -> torch.Tensor:
    """The exact number of (query, key) pairs a block mask leaves visible, per leading (B, H) entry
    (int64, shape ``block_mask.shape[:2]``): ragged last blocks clipped at N_q and N_k, and with ``causal``
    only key <= query (top-left). Benchmark FLOPs are counted on these pairs (4 d per pair forward)."""
    N_q, N_k, bs = check_positive_int("N_q", N_q), check_positive_int("N_k", N_k), check_block_size(block_size)
    check_bool("causal", causal)
    check_dense("block_mask", block_mask)
    bm = torch.as_tensor(block_mask)
    check_block_mask(bm, tuple(bm.shape[:2]) if bm.dim() == 4 else (1, 1), N_q, N_k, bs)  # the kernels' own rule
    n_q, n_k = bm.shape[2:]
    k_start = torch.arange(n_k, dtype=torch.int64) * bs
    k_end = torch.clamp(k_start + bs, max=N_k)
    q = torch.arange(N_q, dtype=torch.int64)
    if causal:  # keys of block j that query q sees: those <= q
        per_query = torch.clamp(torch.minimum(q[:, None] + 1, k_end[None, :]) - k_start[None, :], min=0)
    else:
        per_query = (k_end - k_start)[None, :].expand(N_q, n_k)
    per_block = torch.zeros(n_q, n_k, dtype=torch.int64).index_add_(0, q // bs, per_query)  # (n_q, n_k)
    return (bm.to("cpu").to(torch.int64) * per_block).sum(dim=(-1, -2))
