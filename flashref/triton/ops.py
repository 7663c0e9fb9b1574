"""The Python side of the Triton kernels: checks, launches, autotuning, and the autograd Function.

Taught in notebooks ``07_triton_forward`` (the forward wrapper) and ``08_triton_backward``.
"""

from __future__ import annotations

import contextlib

import functools
import importlib
import os
import weakref

import torch
import triton
from triton.runtime.errors import OutOfResources

from flashref import validation
from flashref.varlen import check_packed_shapes
from flashref.triton import configs, relaunch
from flashref.triton.backward import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_bwd_preprocess_kernel
from flashref.triton.forward import (DOT_FP64, DOT_IEEE, DOT_NATIVE, LOG2E, drop_threshold, dropout_mask_kernel,
                                      flash_fwd_kernel, visible_lists_kernel)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
MAX_HEAD_DIM = 256
DTYPES = ("float16", "bfloat16", "float32")
# Up to this length the first config that fits is launched without autotuning: timing configs on a
# problem this small measures launch overhead, and each config would cost a compile.
SMALL_N = 256


def _pow2(n: int) -> int:
    """The smallest power of two >= n (triton.next_power_of_2 in plain Python: Triton's version is a
    constexpr function, with a few microseconds of wrapping on every call)."""
    return 1 << (int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bucket(n: int) -> int:
    """Autotune once per power-of-two length bucket, not once per exact length."""
    return _pow2(max(int(n), 16))


# The launch arguments that select a compiled kernel (or say how long its loops are): autotuning keys on them.
_KEY_META = ("TUNE_N", "HEAD_DIM", "CAUSAL", "HAS_BM", "BLOCK_SIZE", "LIST_SIZE", "DROPOUT", "WINDOW", "SOFTCAP",
             "ALIBI", "VARLEN")


def _autotuned(kernel, name: str):
    # dkdv may add into DQ atomically: the autotuner zeroes it before each trial and after the last one.
    extra = {"reset_to_zero": ["DQ"]} if name == "dkdv" else {}
    key = list(_KEY_META) + (["ATOMIC_DQ", "ONE_HEAD", "D_SPLIT"] if name == "dkdv" else [])
    return triton.autotune(configs=configs.autotune_configs(name), key=key,
                           prune_configs_by={"early_config_prune": configs.make_pruner(name)}, **extra)(kernel)


if not INTERPRETED:
    # TUNE_N (a power-of-two length bucket, unused by the kernels' arithmetic) is part of the autotuner's key.
    _TUNED = {"forward": _autotuned(flash_fwd_kernel, "forward"), "dkdv": _autotuned(flash_bwd_dkdv_kernel, "dkdv"),
              "dq": _autotuned(flash_bwd_dq_kernel, "dq")}


# Calls whose q, k, v metadata (and causal, sm_scale, check_finite) passed _check's rules before: (d, scale). Every
# rule but the finiteness of the data is a function of this key, so a training loop's later calls skip them
# (measured 22-45 us of host time a call on the H100 machine's host).
_CHECKED: dict = {}
_CHECKED_MAX = 64


def _check_key(q, k, v, causal, sm_scale, check_finite):
    """What :func:`_check`'s rules read of a call, or None when it is not made of torch tensors (the full checks then
    say what is wrong). ``type(...)`` beside each scalar: ``causal=1`` must not pass as ``True`` did."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or q.is_nested or k.is_nested or v.is_nested:
        return None  # (a nested tensor has no .shape to read)
    return (*((x.shape, x.dtype, x.device, x.layout) for x in (q, k, v)), type(causal), causal, type(sm_scale),
            sm_scale, type(check_finite), check_finite)


def _check(q, k, v, causal, sm_scale, check_finite=True):
    """The shared checks, plus what only the Triton kernels need: torch tensors on a usable device. Returns
    ``(d, scale)``; the rules are checked once for each metadata key (:func:`_check_key`), the data at every call."""
    key = _check_key(q, k, v, causal, sm_scale, check_finite)
    try:
        checked = _CHECKED.get(key) if key is not None else None
    except TypeError:  # an unhashable sm_scale or causal: the full checks name it
        key = checked = None
    if checked is None:
        checked = _check_rules(q, k, v, causal, sm_scale, check_finite)
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.pop(next(iter(_CHECKED)))  # the oldest
            _CHECKED[key] = checked
    if check_finite:  # last: the one check that reads the data (validation's rule for bad values)
        validation.check_finite({"q": q, "k": k, "v": v})
    return checked


def _check_rules(q, k, v, causal, sm_scale, check_finite):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    validation.check_bool("check_finite", check_finite)
    _, _, d = validation.check_attention_inputs(q, k, v, allowed_ndims=(4,), allowed_dtypes=DTYPES,
                                                max_head_dim=MAX_HEAD_DIM, finite=False, gqa=True)
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
    return d, scale


class Features:
    """The optional parts of one call, checked: dropout (probability, seed), the block mask (an int8 tensor
    expanded to (B, H, ...) with stride 0 along broadcast dims, and its block size), the score
    modifications (window, softcap, ALiBi slopes) and, for a packed batch, its documents (``varlen``:
    ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, int32 tensors on q's device). ``q`` and
    ``k`` are the kernels' 4-D views (``(1, H, total, d)`` for a packed batch)."""

    def __init__(self, q, k, dropout_p=0.0, seed=None, block_mask=None, block_size=128, *, causal=False, scale=1.0,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, varlen=None, check_finite=True,
                 causal_align="top_left"):
        self.dropout_p = validation.check_dropout_p(dropout_p)
        self.seed = _call_seed(seed, self.dropout_p)
        self.block_size = validation.check_block_size(block_size)
        if self.block_size >= 2**31:  # the kernels take it as a 32-bit constant
            raise ValueError(f"block_size must be below 2**31 for the Triton kernels, got {self.block_size} (any size "
                             f"of at least max(N_q, N_k) gives the same one-block mask)")
        self.list_size = configs.list_size(self.block_size, INTERPRETED)  # the blocks of the kernels' lists
        B, H, N_q, _ = q.shape
        N_k = k.shape[2]
        self.device = q.device
        self.varlen = varlen
        self.batch = B if varlen is None else len(varlen[0]) - 1  # documents, for a packed batch
        self.rows_q = N_q if varlen is None else varlen[2]  # the longest sequence: the grid's rows
        self.rows_k = N_k if varlen is None else varlen[3]
        self._lists = {}
        if block_mask is None:
            self.block_mask = None
        else:
            self.block_mask = _checked_mask(block_mask, (B, H), N_q, N_k, self.block_size, q.device)
            self._given_mask = block_mask
        self._modifications(q, causal, causal_align, scale, window_size, softcap, alibi_slopes, N_q, N_k,
                            check_finite)

    def _modifications(self, q, causal, causal_align, scale, window_size, softcap, alibi_slopes, N_q, N_k,
                       check_finite):
        """The window as the kernels take it (key j visible from query i for ``i - win_left <= j <= i +
        win_right``; an unbounded side as N_q + N_k, beyond any offset; causal makes the right side 0), the
        softcap as ``cap_in = sm_scale / c`` and ``cap_out = c log2(e)``, and the ALiBi slopes times log2(e)
        in fp32 with strides (0 along the batch for one slope per head). A bottom-right causal mask with
        N_q != N_k is the window's right side ``N_k - N_q`` (negative when N_q > N_k: the first rows then see
        no key), and the kernels' CAUSAL (top-left) is off: ``self.causal`` is what they get."""
        left, right = validation.check_window_size(window_size)
        self.causal, bound = validation.split_causal(causal, causal_align, N_q, N_k)
        if bound is not None and self.varlen is not None:
            raise ValueError("causal_align='bottom_right' is not supported for packed batches (each document "
                             "would need its own offset): align causal top-left there")
        unbounded = N_q + N_k
        self.window = left >= 0 or right >= 0 or bound is not None
        self.win_left = left if left >= 0 else unbounded
        self.win_right = 0 if self.causal else (right if right >= 0 else unbounded)
        if bound is not None:
            self.win_right = min(self.win_right, bound)
        c = validation.check_softcap(softcap)
        self.softcap = c > 0
        self.cap_in, self.cap_out = (scale / c, c * LOG2E) if c > 0 else (0.0, 0.0)
        self.slopes2 = None
        if alibi_slopes is not None:
            H = q.shape[1]
            if not isinstance(alibi_slopes, torch.Tensor):
                raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (H,) or (B, H), got "
                                f"{type(alibi_slopes).__name__}")
            validation.check_dense("alibi_slopes", alibi_slopes)
            if not alibi_slopes.is_floating_point():
                raise TypeError(f"alibi_slopes must have a floating dtype, got {alibi_slopes.dtype}")
            if tuple(alibi_slopes.shape) not in ((H,), (self.batch, H)):
                what = "number of documents" if self.varlen is not None else "B"
                raise ValueError(f"alibi_slopes must have shape (H,) = ({H},) or ({what}, H) = ({self.batch}, {H}), "
                                 f"got {tuple(alibi_slopes.shape)}")
            if alibi_slopes.device != q.device:
                raise ValueError(f"alibi_slopes must be on q's device ({q.device}), got {alibi_slopes.device}")
            if check_finite:  # (both read the slopes: a copy to the host)
                validation.check_finite({"alibi_slopes": alibi_slopes})
                validation.check_float32_scale("alibi_slopes", float(alibi_slopes.detach().abs().max()))
            slopes2 = (alibi_slopes.detach().float() * LOG2E).reshape(-1, H)
            self.slopes2 = slopes2.expand(self.batch, H) if alibi_slopes.ndim == 1 else slopes2

    @property
    def meta(self) -> dict:
        masked = self.block_mask is not None
        return dict(HAS_BM=masked, BLOCK_SIZE=self.block_size if masked else 1,
                    LIST_SIZE=self.list_size if masked else 1,
                    DROPOUT=self.dropout_p > 0.0, WINDOW=self.window, SOFTCAP=self.softcap,
                    ALIBI=self.slopes2 is not None, VARLEN=self.varlen is not None)

    def args(self, q, transposed=False, list_size=None):
        """(BM, LISTS, 4 + 3 strides) for the kernels; one-element stand-ins when there is no mask. LISTS are
        the visible-block lists of each query block (of each key block when ``transposed``, for dK/dV), of
        blocks of ``list_size`` rows and keys (default ``self.list_size``; the Gluon kernels take the mask's
        own, ``block_size``)."""
        if self.block_mask is None:
            bm, lists = _stand_ins(q.device)[:2]
        else:
            bm = self.block_mask
            key = (transposed, list_size or self.list_size)
            if key not in self._lists:  # kept by autograd for the backward
                self._lists[key] = _lists_of(self._given_mask, bm, transposed, self.block_size, key[1])
            lists = self._lists[key]
        return bm, lists, (*bm.stride(), *lists.stride()[:3])

    def scalars(self) -> dict:
        """seed, the 16-bit drop threshold and keep_scale = 1 / (1 - dropout_p) as the kernels take them,
        and the score modifications' and the packed batch's arguments (stand-ins where unused)."""
        _, _, slopes, cu = _stand_ins(self.device)
        if self.slopes2 is not None:
            slopes = self.slopes2
        cu_q, cu_k = (cu, cu) if self.varlen is None else self.varlen[:2]
        return dict(seed=self.seed, drop_below=drop_threshold(self.dropout_p), keep_scale=1.0 / (1.0 - self.dropout_p),
                    ALIBI_SLOPES=slopes, CU_Q=cu_q, CU_K=cu_k, stride_ab=slopes.stride(0), stride_ah=slopes.stride(1),
                    win_left=self.win_left, win_right=self.win_right, cap_in=self.cap_in, cap_out=self.cap_out)


def _call_seed(seed, dropout_p: float) -> int:
    """The dropout seed of a call: ``seed`` checked, or with ``seed=None`` and dropout one drawn from torch's
    generator (so ``torch.manual_seed`` rules it); 0 without dropout."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise TypeError(f"seed must be None or an int in [0, 2**63), got {type(seed).__name__}: {seed!r}")
    if dropout_p > 0.0 and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return 0 if seed is None else seed


def _kept_for(store: dict, given: torch.Tensor, key: tuple, make, most: int = 16):
    """What ``make()`` gives for the caller's tensor ``given`` and ``key``, reused from an earlier call with the
    same tensor, unchanged since (its version counter): kept in ``store`` (the oldest forgotten past ``most``)
    while ``given`` lives. A model passes the same block mask at every step; only its first call pays."""
    key = (id(given), *key)
    kept = store.get(key)
    if kept is not None and kept[0]() is given and kept[1] == given._version:
        return kept[2]
    made = make()
    if len(store) >= most:
        store.pop(next(iter(store)))  # the oldest
    store[key] = (weakref.ref(given), given._version, made)
    weakref.finalize(given, store.pop, key, None)  # forgotten with the tensor
    return made


# Block masks checked for a call's shape and viewed as the kernels take them (their checks took about 30 us of
# host time a call).
_MASKS_KEPT: dict = {}


def _checked_mask(given, lead: tuple, N_q: int, N_k: int, block_size: int, device) -> torch.Tensor:
    """``given`` (the caller's bool block mask) checked for these shapes and ``device``, as an int8 view expanded
    to ``(*lead, ...)`` (stride 0 along broadcast dims, no copy)."""
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"block_mask must be a torch.Tensor of dtype bool, got {type(given).__name__}")

    def check_and_view():
        validation.check_dense("block_mask", given)
        validation.check_block_mask(given, lead, N_q, N_k, block_size)
        if given.device != device:
            raise ValueError(f"block_mask must be on q's device ({device}), got {given.device}")
        return given.view(torch.int8).expand(*lead, *given.shape[2:])

    return _kept_for(_MASKS_KEPT, given, (lead, N_q, N_k, block_size, device), check_and_view)


_STAND_INS: dict = {}


def _stand_ins(device):
    """One-element BM, LISTS, ALiBi slopes and cu_seqlens for calls without them (never read: HAS_BM, ALIBI
    and VARLEN are False), made once."""
    if device not in _STAND_INS:
        _STAND_INS[device] = (torch.ones((1, 1, 1, 1), dtype=torch.int8, device=device),
                              torch.zeros((1, 1, 1), dtype=torch.int32, device=device),
                              torch.zeros((1, 1), dtype=torch.float32, device=device),
                              torch.zeros((2,), dtype=torch.int32, device=device))
    return _STAND_INS[device]


def _stored_part(block_mask: torch.Tensor) -> torch.Tensor:
    """The part of a ``(B, H, n_i, n_j)`` block mask that memory holds: one batch (head) where that dim is
    broadcast (stride 0), so work on it is done once, not B (H) times."""
    B, H = block_mask.shape[:2]
    return block_mask[:1 if block_mask.stride(0) == 0 else B, :1 if block_mask.stride(1) == 0 else H]


def visible_block_lists(block_mask: torch.Tensor) -> torch.Tensor:
    """For each row i of a block mask ``(B, H, n_i, n_j)`` (int8 or bool, broadcast dims may have stride
    0): ``[count, j_1 < j_2 < ... < j_count, padding]``, int32 ``(B, H, n_i, n_j + 1)``, with stride 0
    kept along broadcast dims. The kernels walk these lists, so their loops meet only visible tiles
    (the same idea as FlexAttention's kv_num_blocks and kv_indices). One small kernel launch."""
    B, H, n_i, n_j = block_mask.shape
    own = _stored_part(block_mask)
    if own.dtype == torch.bool:
        own = own.view(torch.int8)
    lists = torch.zeros((*own.shape[:3], n_j + 1), dtype=torch.int32, device=own.device)
    chunk = 64 if INTERPRETED else 512
    visible_lists_kernel[(n_i, own.shape[0] * own.shape[1])](own, lists, *own.stride(), *lists.stride()[:3],
                                                              own.shape[1], n_j, CHUNK=chunk)
    return lists.expand(B, H, n_i, n_j + 1)


# The visible-block lists of recent masks (:func:`_kept_for`): about four times the bytes of the mask.
_LISTS_KEPT: dict = {}


def coarse_block_mask(block_mask: torch.Tensor, block_size: int, size: int) -> torch.Tensor:
    """The block mask ``(B, H, n_i, n_j)`` of blocks of ``block_size`` (int8 or bool, stride 0 along broadcast
    dims) seen in blocks of ``size``: int8 ``(B, H, ceil(n_i block_size / size), ceil(n_j block_size / size))``,
    1 where any block of ``block_mask`` that the coarse block overlaps is visible. Its lists are what the
    kernels walk when ``block_size`` does not hold their tiles whole: a coarse block holds them, so the tiles
    of hidden coarse blocks are never loaded, and a listed tile still takes the mask element by element."""
    B, H, n_i, n_j = block_mask.shape
    own = _stored_part(block_mask)

    def overlaps(n: int) -> torch.Tensor:  # (coarse blocks, blocks): 1 where their rows intersect
        c = torch.arange(_cdiv(n * block_size, size), device=own.device)[:, None]
        i = torch.arange(n, device=own.device)[None, :]
        return ((i * block_size < (c + 1) * size) & ((i + 1) * block_size > c * size)).float()

    counts = overlaps(n_i) @ (own != 0).float() @ overlaps(n_j).T  # visible blocks under each coarse block
    coarse = (counts > 0).to(torch.int8)
    return coarse.expand(B, H, *coarse.shape[2:])


def _lists_of(given, bm, transposed: bool, block_size: int, list_size: int) -> torch.Tensor:
    """visible_block_lists of ``bm`` (the int8 expansion of the caller's bool mask ``given``, transposed for
    the dK/dV kernel) in blocks of ``list_size`` (:func:`coarse_block_mask` when not ``block_size``), reused
    while ``given`` is unchanged and the expansion the same (:func:`_kept_for`)."""
    def make():
        blocks = bm if list_size == block_size else coarse_block_mask(bm, block_size, list_size)
        return visible_block_lists(blocks.transpose(-1, -2) if transposed else blocks)

    return _kept_for(_LISTS_KEPT, given, (transposed, list_size, tuple(bm.shape), tuple(bm.stride())), make)


def check_device(device) -> torch.device:
    """``device`` for tensors the kernels will read (:func:`dropout_mask`, :class:`~flashref.triton.KVCache`):
    under Triton's CPU interpreter the CPU, otherwise a CUDA device that is present; None is that default."""
    if device is None:
        device = "cpu" if INTERPRETED else "cuda"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch.device or a device string such as 'cuda' or 'cpu', got "
                         f"{type(device).__name__}: {device!r}") from None
    if INTERPRETED and dev.type != "cpu":
        raise ValueError(f"device must be 'cpu': Triton is running in its CPU interpreter (no CUDA device), got "
                         f"{str(dev)!r}")
    if not INTERPRETED and (dev.type != "cuda" or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device must be a CUDA device of this machine (cuda:0 .. cuda:"
                         f"{torch.cuda.device_count() - 1}: the kernels are compiled for it), got {str(dev)!r}")
    return dev


def dropout_mask(seed, B, H, N_q, N_k, dropout_p, device):
    """The boolean keep-mask ``(B, H, N_q, N_k)`` the kernels draw for ``seed``, bit for bit: True where an
    entry of P is kept (probability ``1 - dropout_p``). It runs the kernels' own random function, so tests
    can compare with the float64 reference exactly. Each entry is kept when its 16-bit random number is at
    least ``D = round(dropout_p * 2**16)``: the kept fraction is ``1 - dropout_p`` within 2**-17. A
    Philox-4x32-7 call, of ``(seed; j without bits 0 and 3, i without bits 0 and 3, b * H + h)``, gives eight
    such numbers to the sixteen entries (i, j) that differ in those bits: the entries two threads of a
    tensor-core tile hold. Entry (i, j) takes half ``i % 2`` of word ``2 (bit3(i) ^ bit3(j)) + j % 2``, so each
    number serves (i, j) and (i + 8, j ^ 8) for i with bit 3 clear; the second of the two reads it turned,
    ``(u + C) mod 2**16`` with ``C = flashref.triton.forward.pair_shift(D)``, which keeps both together as often
    as independent entries are, within 2**-17 (``flashref.triton.forward._keep``). Notebook
    ``10_dropout_masks_sparsity``."""
    p = validation.check_dropout_p(dropout_p)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise TypeError(f"seed must be an int in [0, 2**63), got {type(seed).__name__}: {seed!r}")
    for name, n in (("B", B), ("H", H), ("N_q", N_q), ("N_k", N_k)):
        validation.check_positive_int(name, n)
    device = check_device(device)
    keep = torch.empty((B, H, N_q, N_k), dtype=torch.int8, device=device)
    block = 16 if INTERPRETED else 64
    dropout_mask_kernel[(_cdiv(N_q, block), _cdiv(N_k, block), B * H)](keep, seed, drop_threshold(p), N_q, N_k,
                                                                                 BLOCK=block)
    return keep.bool()


def _dot_mode(dtype) -> int:
    """How tl.dot multiplies (see forward._dot): under the interpreter in fp64, rounded once to fp32, so
    a recomputed score equals the forward's whatever the CPU's BLAS; on a GPU fp32 exactly (no TF32),
    fp16 and bf16 natively."""
    if INTERPRETED:
        return DOT_FP64.value
    return DOT_IEEE.value if dtype == torch.float32 else DOT_NATIVE.value


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
        key = _tune_key(name, args, meta)
        cfg = _CHOSEN.get(key)
        if cfg is None:  # the first call of this key: the autotuner times the configs and launches the best
            rows = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
            grid = lambda m: (_cdiv(grid_rows, m[rows]) * meta.get("D_SPLIT", 1), bh)  # noqa: E731
            tuner = _TUNED[name]
            # Triton's autotuner remembers its best config per its own key, which does not see
            # FLASHREF_T4_CONFIGS; ours does, so let it tune afresh whenever ours has no answer.
            getattr(tuner, "cache", {}).clear()
            tuner[grid](*args, **meta)
            best = tuner.best_config
            _CHOSEN[key] = configs.TileConfig(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps,
                                              best.num_stages)
            return
    _launch_config(kernel, name, grid_rows, bh, cfg, args, meta)


# The config the autotuner chose, per key: later calls launch it directly. Triton's autotuner spends about
# 100 us of CPU time on every call (it rebuilds a dict of all ~60 arguments to find its key), as much as a
# small block-sparse forward takes on the GPU.
_CHOSEN: dict = {}


def _tune_key(name, args, meta) -> tuple:
    """What the autotuner keys on: its key arguments and the dtypes of the tensor arguments."""
    return (name, *(meta[m] for m in _KEY_META), meta.get("ATOMIC_DQ"), meta.get("ONE_HEAD"), meta.get("D_SPLIT"),
            args[0].device, configs.t4_mode(), tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))


def _launch_config(kernel, name, grid_rows, bh, cfg, args, meta):
    configs.check_tile(name, cfg)
    block_rows = cfg.block_n if name == "dkdv" else cfg.block_m
    grid = (_cdiv(grid_rows, block_rows) * meta.get("D_SPLIT", 1), bh)  # D_SPLIT programs share a dK/dV tile
    extra = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel[grid](*args, **meta, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **extra)


_FIRST_FIT = {}


def _launch_first_fit(kernel, name, grid_rows, bh, args, meta):
    """Launch the first candidate config the compiler accepts, and remember it. The shared-memory estimate
    prunes the candidates, but the compiler has the last word and its layout differs between Triton
    versions (seen: Triton 3.6 on an H100 keeping num_stages copies of K and V at d = 256, one more than
    the estimate), so a config that runs out of shared memory falls through to the next one.

    float32 inputs try the smallest tiles first: their products are IEEE fp32 on the CUDA cores, where a large
    tile buys nothing on a short sequence and costs compile time (for sm_90 at d = 64, causal: the forward's
    128 x 64 tile compiles in 5.5 s against 0.5 s for 32 x 16, the dK/dV kernel's 32 x 128 in 18 s against 1.2 s
    for 16 x 32, compiled on a 2-core CPU with :func:`flashref.triton.compile_check.compile_config`)."""
    q = args[0]
    key = (name, meta["BLOCK_D"], q.dtype, str(q.device), meta.get("ATOMIC_DQ"), meta.get("ONE_HEAD"),
           meta.get("D_SPLIT"), configs.t4_mode(), *(meta.get(m) for m in _KEY_META if m != "TUNE_N"))
    cands = [_FIRST_FIT[key]] if key in _FIRST_FIT else \
        configs.device_candidates(name, meta["BLOCK_D"], q.element_size(), q.device)
    if key not in _FIRST_FIT and q.dtype == torch.float32:
        cands = sorted(cands, key=lambda c: (c.block_m * c.block_n, c.num_stages))
    for i, cfg in enumerate(cands):
        try:
            _launch_config(kernel, name, grid_rows, bh, cfg, args, meta)
        except OutOfResources:
            if i == len(cands) - 1:
                raise
            continue
        _FIRST_FIT[key] = cfg
        return


#: ``kernel=`` of :func:`flash_attention` and :func:`flash_attention_forward`: ``"auto"`` takes the Hopper forward
#: wherever it can run, ``"triton"`` always the teaching kernel, ``"hopper"`` the Hopper one or a ValueError saying
#: why it cannot. Over lengths 128 to 16K, causal or not, the Hopper forward measured 1.06-1.54x the teaching one at
#: d = 128 and 256 and 1.01-1.22x at d = 64 (``python -m flashref.bench hopper``'s dispatch table, H100). The
#: backward follows (:func:`_backward_kernel`).
KERNELS = ("auto", "triton", "hopper")


@functools.cache
def _gluon_module(name: str):
    """``flashref.triton.<name>`` (``hopper``, ``hopper_backward`` or ``hopper_backward_fused``), imported on first
    need: it needs Triton's Gluon, which older Tritons (as a Colab runtime may have) lack. Returns the module, or
    the ImportError as the reason it cannot run."""
    try:
        return importlib.import_module(f"flashref.triton.{name}")
    except ImportError as e:  # no Gluon, or an older Gluon without the Hopper ops
        return e


def _hopper_refusal(q, k, v, feat: Features, backward: bool = False) -> str | None:
    """None when the Hopper forward (notebook ``14_flashattention3_on_hopper``) can take this checked call, else why
    it cannot: the teaching kernel takes it then. The Hopper forward takes a window (``window_size`` or a
    bottom-right causal mask), dropout (the teaching kernel's mask, bit for bit; not both) and a block mask
    (where :func:`_gluon_forward_takes_block_mask` says so). ``backward``: the
    same for the Gluon backward kernels, which also take ALiBi (their statistics come from either forward), a
    window (``hopper_backward(window=)``; which of them a window uses is :func:`_backward_kernel`'s choice) and a
    block mask (where :func:`_gluon_takes_block_mask` says so). Strided q, k, v are no reason: the Gluon kernels
    read them in place in a model's layout (:func:`_reads_in_place`), or contiguous copies (:func:`_rows`)."""
    if INTERPRETED or not q.is_cuda:
        return "runs on an sm_90 GPU, not in Triton's CPU interpreter"
    if configs.device_capability(q.device) != 90:  # wgmma and setmaxnreg are sm_90a's
        return f"needs an sm_90 (Hopper) GPU, got sm_{configs.device_capability(q.device)}"
    used = (("block_mask", feat.block_mask is not None and not backward and not _gluon_forward_takes_block_mask(q, feat)),
            ("softcap", feat.softcap),
            ("alibi_slopes", feat.slopes2 is not None and not backward), ("packed batches", feat.varlen is not None))
    features = [name for name, on in used if on]
    if features:
        return f"takes none of {', '.join(features)}"
    hopper = _gluon_module("hopper")
    if isinstance(hopper, ImportError):
        return f"needs Triton's Gluon with its Hopper ops, which this Triton {triton.__version__} lacks ({hopper})"
    if feat.dropout_p > 0.0 and (feat.window or q.shape[3] not in hopper.DROPOUT_HEAD_DIMS):
        return (f"takes dropout_p only without a window and at head dims {hopper.DROPOUT_HEAD_DIMS} (its dropout "
                f"runs the overlapped loop, which has neither)")
    return hopper.supported(q, k, v)


def _check_kernel(kernel) -> None:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")


# The dispatch's answers (_hopper_refusal's reason, _backward_kernel's choice) by what they read of a call
# (:func:`_dispatch_key`): a training loop asks the same question at every step, and the answer took 15-50 us of
# host time (device capability queries, the Gluon modules' checks) on the H100 machine's host.
_DISPATCH: dict = {}
_DISPATCH_MAX = 128


def _dispatch_key(q, k, v, feat: Features) -> tuple:
    """Everything of a checked call that :func:`_hopper_refusal` and :func:`_backward_kernel` read: shapes, dtype,
    device, and which features it uses (their values do not matter to the choice, only the block size does)."""
    return (q.shape, k.shape, v.shape, q.dtype, q.device, feat.block_mask is not None, feat.block_size, feat.softcap,
            feat.slopes2 is not None, feat.varlen is not None, feat.dropout_p > 0.0, feat.window, feat.causal)


def _remembered(key: tuple, answer):
    """The dispatch's answer for ``key``, computed by ``answer()`` the first time (the oldest forgotten past
    :data:`_DISPATCH_MAX`). Not remembered where a shape is symbolic (a custom op's fake call under dynamic shapes:
    a SymInt has no hash), asked afresh there."""
    try:
        hash(key)
    except TypeError:
        return answer()
    if key in _DISPATCH:
        return _DISPATCH[key]
    if len(_DISPATCH) >= _DISPATCH_MAX:
        _DISPATCH.pop(next(iter(_DISPATCH)))
    _DISPATCH[key] = found = answer()
    return found


def _forward_kernel(q, k, v, feat: Features, kernel: str) -> str:
    """``"hopper"`` or ``"triton"``: which forward runs this checked call with ``kernel=`` (see :data:`KERNELS`)."""
    _check_kernel(kernel)
    if kernel == "triton":
        return "triton"
    why = _remembered(("forward", *_dispatch_key(q, k, v, feat)), lambda: _hopper_refusal(q, k, v, feat))
    if kernel == "hopper":
        if why is not None:
            raise ValueError(f"kernel='hopper': the Hopper forward {why} (kernel='auto' falls back to the Triton "
                             f"kernel)")
        return "hopper"
    return "hopper" if why is None else "triton"


def _backward_kernel(q, k, v, feat: Features, kernel: str, deterministic: bool) -> str:
    """``"hopper"``, ``"hopper-fused"``, ``"hopper-ordered"`` or ``"triton"``: which backward runs this checked call.
    ``"triton"`` keeps the teaching kernels; ``"auto"`` and ``"hopper"`` take the Gluon dK/dV and dQ kernels
    (:mod:`flashref.triton.hopper_backward`) wherever the Hopper forward could run, and also with ALiBi, d is 64,
    128 or 256 and the gradients are to be deterministic (theirs are). With ``deterministic=False`` they take the
    one-kernel Gluon backward (``"hopper-fused"``, :mod:`flashref.triton.hopper_backward_fused`: dQ added by TMA
    reduces, measured 1.04-1.25x the two kernels' speed on an H100) at d = 64 and 128 with top-left causal masking
    or none (and dropout, its mask drawn after the first two products at d = 128: notebook
    ``10_dropout_masks_sparsity`` measures it), and the teaching kernel's atomic dQ for the rest at d <= 128
    without dropout (dropout that the one-kernel backward refuses, with ALiBi, runs the deterministic pair); at
    d = 256 the deterministic Gluon pair, which is faster there (H100, B 8, H 8, N 4K, fp16, fwd+bwd: 10.3 ms
    against the atomic dQ's 18.4; deterministic=False permits run-to-run variation, it does not ask for it). A
    window takes
    them too since they mask only the tiles at its edges (H100, causal window of 1024 keys, N = 8K, fp16: Gluon
    dK/dV 1.23 ms at d = 128 and 1.39 at d = 64 against the teaching kernel's 1.47 and 1.78; dQ 0.79 and 0.86
    against 0.92 and 0.98). Dropout (without a window) runs both Gluon kernels, with the forward's mask, or with
    ``deterministic=True`` at d = 64 and 128 (causal or not) the one-kernel backward with its dQ adds in a fixed
    order (``"hopper-ordered"``, :func:`_ordered_takes`), which draws the mask once, not twice. A block
    mask runs them where its blocks fit their tiles (:func:`_gluon_takes_block_mask`): they walk the visible-block
    lists the teaching kernels walk, as the Gluon forward does. At d = 256 they run with top-left causal masking
    or none (:data:`flashref.triton.hopper_backward.PLAIN_HEAD_DIMS`; dK/dV from the kernel whose warpgroups split
    the head dim, measured 1.60-1.66x the teaching dK/dV kernel's speed, dQ 1.04-1.05x: H100, B 8, H 8, N 4K,
    fp16)."""
    _check_kernel(kernel)
    if kernel == "triton":
        return "triton"
    return _remembered(("backward", bool(deterministic), *_dispatch_key(q, k, v, feat)),
                       lambda: _choose_backward(q, k, v, feat, deterministic))


def _choose_backward(q, k, v, feat: Features, deterministic: bool) -> str:
    """:func:`_backward_kernel`'s choice for ``kernel="auto"`` or ``"hopper"`` (the same for both)."""
    if _hopper_refusal(q, k, v, feat, backward=True) is not None:
        return "triton"
    if not deterministic and _fused_takes(q, k, v, feat):
        return "hopper-fused"
    if deterministic and _ordered_takes(q, k, v, feat):
        return "hopper-ordered"
    # At d = 256 the Gluon pair beats the teaching atomic dQ, and with dropout at any d it serves (see above)
    if not deterministic and q.shape[3] != 256 and feat.dropout_p == 0.0:
        return "triton"
    backward = _gluon_module("hopper_backward")
    if isinstance(backward, ImportError) or backward.supported(q, k, v) is not None:
        return "triton"
    if q.shape[3] in backward.PLAIN_HEAD_DIMS and _modifications(feat):
        return "triton"
    if feat.block_mask is not None and not _gluon_takes_block_mask(backward, q, feat):
        return "triton"
    return "hopper"


def _modifications(feat: Features) -> set:
    """What this call adds to top-left causal masking or none, of what the Gluon backward kernels take in part:
    ``"window"`` (a bottom-right causal mask with N_q != N_k is one), ``"alibi"``, ``"dropout"``, ``"block_mask"``."""
    used = (("window", feat.window), ("alibi", feat.slopes2 is not None), ("dropout", feat.dropout_p > 0.0),
            ("block_mask", feat.block_mask is not None))
    return {name for name, on in used if on}


def _fused_takes(q, k, v, feat: Features) -> bool:
    """Whether the one-kernel Gluon backward (:mod:`flashref.triton.hopper_backward_fused`) takes this call, which
    the Hopper backward could run: head dims 64 and 128, top-left causal masking or none, dropout (no window,
    ALiBi or block mask)."""
    fused = _gluon_module("hopper_backward_fused")
    if isinstance(fused, ImportError) or fused.supported(q, k, v) is not None:
        return False
    return not _modifications(feat) - ({"dropout"} if q.shape[3] in fused.DROPOUT_HEAD_DIMS else set())


def _ordered_takes(q, k, v, feat: Features) -> bool:
    """Whether ``deterministic=True`` runs the one-kernel Gluon backward with its dQ adds in a fixed order
    (:func:`flashref.triton.hopper_backward_fused.ordered_supported`): with dropout, where the atomic one would run.
    There it draws the mask once, where the pair draws it twice. Measured on an H200 (B 8, H 16, N 4K, fp16, p = 0.1,
    the backward alone, ``book/data/dropout_backward.json``), the ordered kernel against the pair: d = 64 1.17x,
    causal 1.07x; d = 128 1.19x and 1.11x. Without dropout it measured 1.00-1.08x; those calls keep the pair, which
    also reads a model's (B, N, H, d) projections in place (:func:`_reads_in_place`). Against the atomic kernel the
    ordered one runs at 0.90-0.96x (1.03x at d = 64 causal with dropout): the order costs up to a tenth. (The
    module's docstring has the table.)"""
    if feat.dropout_p == 0.0 or not _fused_takes(q, k, v, feat):
        return False
    fused = _gluon_module("hopper_backward_fused")
    return fused.ordered_supported(q.shape[2], k.shape[2], feat.causal, _sm_count(q.device)) is None


_SMS: dict = {}


def _sm_count(device) -> int:
    """The multiprocessors of ``device``'s GPU, asked once a GPU: the ordered backward's residency rule, the dK/dV
    kernel's split of a K/V group and flash-decoding's split of the keys count them."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _gluon_takes_block_mask(backward, q, feat: Features) -> bool:
    """Whether the Gluon backward kernels take this call's block mask: its blocks map onto both kernels' tiles
    (:func:`flashref.triton.hopper_backward.lists_fit`; the default block_size = 128 does), with causal or no
    mask besides (a window, ALiBi and dropout with a block mask keep the teaching kernels)."""
    d = q.shape[3]
    if _modifications(feat) - {"block_mask"}:
        return False
    return (backward.lists_fit(backward.default_config(d, "dkdv"), "dkdv", feat.block_size)
            and backward.lists_fit(backward.default_config(d, "dq"), "dq", feat.block_size))


def _gluon_forward_takes_block_mask(q, feat: Features) -> bool:
    """Whether the Gluon forward takes this call's block mask: without a window, dropout or ALiBi, where the mask's
    blocks hold :func:`flashref.triton.hopper.block_mask_config`'s tiles whole (the default block_size = 128 does)."""
    hopper = _gluon_module("hopper")
    if isinstance(hopper, ImportError) or feat.window or feat.dropout_p > 0.0 or feat.slopes2 is not None:
        return False
    return hopper.lists_fit(hopper.block_mask_config(q.shape[3], feat.block_size), "fwd", feat.block_size)


def _hopper_forward(q, k, scale: float, feat: Features, token: bool = False):
    """The Gluon forward of this checked call's signature (:class:`flashref.triton.hopper.ForwardLaunch`): its tile
    config as the measurements chose it for a block mask, dropout, or neither. ``token``: q, k, v are read in
    their (B, N, H, d) layout and o written in it (:func:`_reads_in_place`)."""
    hopper = _gluon_module("hopper")
    if feat.block_mask is not None:  # the loop that walks the lists of visible blocks, as the teaching kernel's
        cfg = hopper.block_mask_config(q.shape[3], feat.block_size)
        lists = feat.args(q, list_size=feat.block_size)[1]
        return hopper.ForwardLaunch(q, k, feat.causal, scale, cfg, lists=(lists, feat.block_size),
                                    token=token)
    dropout = feat.dropout_p > 0.0
    cfg = hopper.dropout_config(q.shape[3]) if dropout else hopper.default_config(q.shape[3])
    window = (feat.win_left, feat.win_right) if feat.window else None
    return hopper.ForwardLaunch(q, k, feat.causal, scale, cfg, window=window, dropout=dropout, token=token)


def _forward(q, k, v, scale: float, feat: Features, kernel: str = "triton", token: bool = False):
    if _forward_kernel(q, k, v, feat, kernel) == "hopper":
        return _hopper_forward(q, k, scale, feat, token)(q, k, v, _dropout_scalars(feat))
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    # A packed batch's o takes q's layout, (total_q, H, d), through the same view the kernel gets.
    o = torch.empty_like(q) if feat.varlen is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse, m2, l2 = torch.empty((3, B, H, N_q), dtype=torch.float32, device=q.device).unbind(0)  # one allocation
    bm, lists, bm_strides = feat.args(q)
    _launch(flash_fwd_kernel, "forward", feat.rows_q, feat.batch * H, q, k, v, o, lse, m2, l2, bm, lists,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), *bm_strides,
            H, N_q, N_k, scale * LOG2E, TUNE_N=_bucket(max(feat.rows_q, feat.rows_k)), GROUP=H // k.shape[1],
            **feat.scalars(), HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)), CAUSAL=feat.causal,
            DOT=_dot_mode(q.dtype), **feat.meta)
    return o, lse, (m2, l2)


def _rows(q, k, v):
    """q, k and v as the Gluon kernels read them when not in place (:func:`_reads_in_place`): contiguous, so that
    each is a (B * H * N, d) matrix whose rows their TMA copies fetch. Another strided one is copied first: read
    and written once, O(N d) traffic beside the attention's O(N^2 d) work. The copies are what the autograd
    Function saves, so the backward's kernels read them without copying again."""
    return q.contiguous(), k.contiguous(), v.contiguous()


def _reads_in_place(q, k, v, feat: Features, deterministic: bool, kernel: str, aligned: bool = True) -> bool:
    """Whether the Gluon kernels read this call's q, k, v where they lie, in the (B, N, H, d) layout of a model's
    projections (:func:`flashref.triton.hopper.token_major`: the three of one (B, N, 3, H, d) buffer, or each its own
    (B, N, H, d) tensor, seen as (B, H, N, d)), and write o, dQ, dK and dV in it, so that nothing is copied: the
    Gluon forward and its two-kernel backward run (d of 64 and 128; the one-kernel backward of
    ``deterministic=False`` and the d = 256 one read (B, H, N, d) rows only, so those calls copy as before).
    ``aligned=False``: by the strides alone (:func:`flashref.triton.hopper.token_major`)."""
    if q.shape[3] not in (64, 128) or _forward_kernel(q, k, v, feat, kernel) != "hopper":
        return False
    if _backward_kernel(q, k, v, feat, kernel, deterministic) != "hopper":
        return False
    hopper = _gluon_module("hopper")
    return all(hopper.token_major(x, aligned) for x in (q, k, v))


# ---- The custom op's calls (flashref.triton.custom_op): o's layout decided from strides alone ------------------
#
# Under torch.compile a custom op's outputs must have the strides its fake implementation gave them, and a fake
# tensor has shapes and strides but no address. So the layout of o is decided from the strides of q, k, v
# (:func:`compiled_layout`), and an input whose strides say token-major but whose address is not 16-byte aligned
# is copied into an aligned tensor of that layout before the in-place kernels read it.

def compiled_layout(q, k, v, causal: bool, scale: float) -> bool:
    """Whether :func:`custom_forward` gives o in the token-major layout (else contiguous): the answer of
    :func:`_reads_in_place` from strides alone, for the custom op's call (deterministic, no options)."""
    feat = Features(q, k, causal=causal, scale=scale, check_finite=False)
    return _reads_in_place(q, k, v, feat, True, "auto", aligned=False)


def _aligned_token(x):
    hopper = _gluon_module("hopper")
    return x if hopper.token_major(x) else hopper.empty_output(x, True).copy_(x)


def custom_forward(q, k, v, causal: bool, scale: float):
    """``(o, lse)`` as :func:`flash_attention_forward` gives them (no NaN check), with o in :func:`compiled_layout`'s
    layout: read in place, no copy of q, k, v, where it says token-major."""
    feat = Features(q, k, causal=causal, scale=scale, check_finite=False)
    token = compiled_layout(q, k, v, causal, scale)
    if token:
        q, k, v = (_aligned_token(x) for x in (q, k, v))
    with torch.no_grad():
        o, lse, _ = _forward(q, k, v, scale, feat, "auto", token)
    return o, lse


def custom_backward(q, k, v, o, lse, do, causal: bool, scale: float):
    """``(dq, dk, dv)`` as :func:`flash_attention_backward` gives them (deterministic, no NaN check): contiguous, or
    where :func:`compiled_layout` said token-major, q, k, v and dO read in place and the gradients written in their
    (B, N, H, d) layout."""
    feat = Features(q, k, causal=causal, scale=scale, check_finite=False)
    token = compiled_layout(q, k, v, causal, scale)
    if token:
        q, k, v, o = (_aligned_token(x) for x in (q, k, v, o))
    with torch.no_grad():
        return _backward(q, k, v, o, _stats_from_lse(lse), do, scale, True, feat, "auto", token=token)


def _token_do(do):
    """dO in the layout the in-place kernels read (:func:`_reads_in_place`): as it comes when it is already so
    (the gradient of a model's ``o.transpose(1, 2).reshape(...)`` is), else copied into it."""
    hopper = _gluon_module("hopper")
    if hopper.token_major(do):
        return do
    return hopper.empty_output(do, True).copy_(do)


def _dropout_scalars(feat: Features):
    """(seed, drop_below, keep_scale) as the Gluon kernels take them, or None without dropout."""
    if feat.dropout_p == 0.0:
        return None
    scalars = feat.scalars()
    return scalars["seed"], scalars["drop_below"], scalars["keep_scale"]


def _group_split(group: int, programs: int, device) -> int:
    """How many programs share one K/V tile in the dK/dV kernel: the smallest divisor of the group size that
    gives at least two programs per SM (1 when the K/V tiles alone are enough, as for multi-head attention
    and most GQA shapes; under the interpreter 2 whenever it can, so CI runs the split path)."""
    if group == 1:
        return 1
    if INTERPRETED:
        return 2 if group % 2 == 0 else 1
    sms = _sm_count(device)
    for s in range(1, group + 1):
        if group % s == 0 and programs * s >= 2 * sms:
            return s
    return group


PRE_M = 16 if INTERPRETED else 64  # rows of D per program of the preprocess kernel


def _delta(o, do, launch=None):
    """D = rowsum(dO * O), ``(B, H, N_q)`` in fp32: the preprocess kernel every backward starts with. ``launch``:
    :func:`_delta_launch`'s for this signature (a plan's), else the kernel is launched through
    :func:`flashref.triton.relaunch.launch`."""
    B, H, N_q, d = o.shape
    delta = torch.empty((B, H, N_q), dtype=torch.float32, device=o.device)
    args = (o, do, delta, *_strides(o), *_strides(do), H, N_q)
    if launch is None:
        launch = _delta_launch(B, H, N_q, d)
    launch(*args)
    return delta


def _delta_launch(B: int, H: int, N_q: int, d: int) -> relaunch.Bound:
    """The preprocess kernel's launch for o and dO of shape (B, H, N_q, d)."""
    return relaunch.Bound(flash_bwd_preprocess_kernel, (_cdiv(N_q, PRE_M), B * H), HEAD_DIM=d,
                          BLOCK_D=max(16, _pow2(d)), BLOCK_M=PRE_M)


_BOTH = ("dq", "dkdv")


def _backward(q, k, v, o, stats, do, scale: float, deterministic: bool, feat: Features, kernel: str = "triton", *,
              parts=_BOTH, delta=None, token: bool = False):
    """``stats`` = (m2, l2) from :func:`_forward` (base-2 row max and log2 of the row sum). ``deterministic``:
    dQ from its own kernel (bitwise reproducible); otherwise added atomically by the dK/dV kernel. ``kernel`` as
    in :func:`_backward_kernel`. ``parts``: which kernels run; ``("dq",)`` or ``("dkdv",)`` alone (deterministic
    only: only there are the two kernels separate) leaves the other gradients ``None`` (ring attention runs
    them in two rings). ``delta``: D from :func:`_delta` when the caller has it (``o`` is then not read).
    ``token``: q, k, v (and o) lie in the (B, N, H, d) layout the Gluon pair reads in place (:func:`_reads_in_place`);
    dO is brought to it."""
    m2, l2 = stats
    B, H, N_q, d = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    block_d = max(16, _pow2(d))
    parts = tuple(parts)
    want_dq, want_dkdv = "dq" in parts, "dkdv" in parts
    if parts not in (_BOTH, ("dq",), ("dkdv",)) or (not deterministic and parts != _BOTH):
        raise ValueError(f"parts must be {_BOTH}, ('dq',) or ('dkdv',) (alone only when deterministic), got {parts!r}")
    if delta is None:
        delta = _delta(o, do)
    dq = dk = dv = None
    choice = _backward_kernel(q, k, v, feat, kernel, deterministic)
    if choice == "hopper-ordered" and parts != _BOTH:  # one part alone: the pair's kernel of it
        choice = "hopper"
    if choice in ("hopper-fused", "hopper-ordered"):  # both parts in one kernel, dQ's adds in a fixed order or not
        fused = _gluon_module("hopper_backward_fused")
        return fused.hopper_fused_backward(q, k, v, do, m2, l2, delta, feat.causal, scale,
                                           dropout=_dropout_scalars(feat), ordered=choice == "hopper-ordered")
    side = _dq_stream(q.device) if deterministic and parts == _BOTH and _dq_beside(feat, choice) else None
    if side is not None:  # dQ beside dK/dV: see _dq_stream
        here = torch.cuda.current_stream(q.device)
        side.wait_stream(here)
    if token:
        do = _token_do(do)
    if choice != "triton":
        dq_launch, dkdv_launch = _hopper_backward(q, k, scale, feat, want_dq, want_dkdv, token)
        mods = dict(slopes2=feat.slopes2, dropout=_dropout_scalars(feat), shared={})  # shared: both kernels' TMA
        # descriptors, made once
    else:  # the teaching kernels' arguments (the Gluon kernels take theirs in hopper_backward)
        meta = dict(HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=feat.causal, DOT=_dot_mode(q.dtype),
                    TUNE_N=_bucket(max(feat.rows_q, feat.rows_k)), GROUP=H // H_kv, **feat.scalars(), **feat.meta)
        common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
        tail = (H, N_q, N_k, scale, scale * LOG2E)
    if want_dq and choice == "hopper":
        dq = dq_launch(q, k, v, do, m2, l2, delta, **mods)  # (one stream)
    elif deterministic and want_dq:
        # Allocated here, on the caller's stream (so are the block lists), whichever stream the kernel runs on.
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        bm_q, lists_q, bm_strides_q = feat.args(q)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _launch(flash_bwd_dq_kernel, "dq", feat.rows_q, feat.batch * H, q, k, v, do, dq, m2, l2, delta, bm_q,
                    lists_q, *common, *_strides(dq), *bm_strides_q, *tail, **meta)
    if want_dkdv:
        if choice == "hopper":
            dk, dv = dkdv_launch(q, k, v, do, m2, l2, delta, **mods)
        else:
            # Atomic dQ accumulates in fp32 (O(N d) more memory); the deterministic path passes a 1-element
            # stand-in.
            dq_acc = torch.zeros(q.shape if not deterministic else (1, 1, 1, 1), dtype=torch.float32,
                                 device=q.device)
            dk, dv = _dkdv(q, k, v, do, dq_acc, m2, l2, delta, feat, deterministic, common, tail, meta)
            if not deterministic:
                dq = dq_acc.to(q.dtype)
    if side is not None:
        here.wait_stream(side)  # what follows on this stream sees dQ
    return dq, dk, dv


def _hopper_backward(q, k, scale: float, feat: Features, want_dq: bool = True, want_dkdv: bool = True,
                     token: bool = False):
    """The Gluon dQ and dK/dV kernels of this checked call's signature (:class:`flashref.triton.hopper_backward.
    DqLaunch` and :class:`~flashref.triton.hopper_backward.DkdvLaunch`; None for a part not wanted), at their
    default tiles; ``token``: reading q, k, v and dO in place (:func:`_reads_in_place`)."""
    backward = _gluon_module("hopper_backward")
    mods = dict(window=(feat.win_left, feat.win_right) if feat.window else None, alibi=feat.slopes2 is not None,
                dropout=feat.dropout_p > 0.0, token=token)
    lists_dq = lists_dkdv = None
    if feat.block_mask is not None:  # the visible-block lists of query blocks, and of key blocks (transposed)
        lists_dq = (feat.args(q, list_size=feat.block_size)[1], feat.block_size)
        lists_dkdv = (feat.args(q, transposed=True, list_size=feat.block_size)[1], feat.block_size)
    dq = backward.DqLaunch(q, k, feat.causal, scale, **mods, lists=lists_dq) if want_dq else None
    dkdv = backward.DkdvLaunch(q, k, feat.causal, scale, **mods, lists=lists_dkdv) if want_dkdv else None
    return dq, dkdv


def _dq_beside(feat: Features, choice: str) -> bool:
    """Whether the backward launches its dQ kernel on a side stream beside the dK/dV kernel (see
    :func:`_dq_stream`): with a block mask on the teaching kernels. Measured for the other backwards
    too (H100, 16 shapes: windows, dense d = 64 to 256, GQA, softcap, dropout; Gluon and teaching kernels), side by
    side gave 0.98-1.04x, 1.01x at the median: within the runs' spread, so they keep one stream."""
    return choice == "triton" and feat.block_mask is not None


def _dkdv(q, k, v, do, dq_acc, m2, l2, delta, feat: Features, deterministic: bool, common, tail, meta):
    """(dk, dv) from the teaching dK/dV kernel (which also adds dQ into ``dq_acc`` when not deterministic)."""
    B, H, _, d = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    # Multi-query attention leaves few K/V tiles: SPLIT programs then share each one (partial sums in fp32).
    split = _group_split(H // H_kv, feat.batch * H_kv * _cdiv(feat.rows_k, 128), q.device)
    if split == 1:
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        dk, dv = (torch.empty((B, H_kv * split, N_k, d), dtype=torch.float32, device=k.device) for _ in range(2))
    bm, lists_t, bm_strides_t = feat.args(q, transposed=True)
    _launch(flash_bwd_dkdv_kernel, "dkdv", feat.rows_k, feat.batch * H_kv * split,
            q, k, v, do, dk, dv, dq_acc, m2, l2, delta, bm, lists_t, *common, *_strides(dk), *_strides(dv),
            *_strides(dq_acc), *bm_strides_t, *tail, ATOMIC_DQ=not deterministic, SPLIT=split,
            ONE_HEAD=H // H_kv == split, D_SPLIT=configs.column_split(meta["BLOCK_D"], deterministic, INTERPRETED),
            **meta)
    if split > 1:  # the partial sums, added in a fixed order: still bitwise reproducible
        dk = dk.view(B, H_kv, split, N_k, d).sum(2).to(k.dtype)
        dv = dv.view(B, H_kv, split, N_k, d).sum(2).to(v.dtype)
    return dk, dv


_DQ_STREAMS: dict = {}


def _dq_stream(device):
    """The CUDA stream on which a block-sparse backward launches its dQ kernel, beside the dK/dV kernel on
    the caller's stream (None on the CPU). A block mask with global tokens (BigBird's) gives a few programs
    of each kernel a whole row or column of blocks: one after the other, each kernel ends with a tail in
    which those few programs run alone; side by side, either kernel's programs fill the SMs the other's
    tail leaves idle. The two kernels only read what both need (Q, K, V, dO, the statistics, D), so the
    order between them does not matter, and each stays bitwise reproducible. The caller's stream waits
    for this one before the gradients are used, which also keeps CUDA-graph capture valid."""
    if device.type != "cuda":
        return None
    if device not in _DQ_STREAMS:
        _DQ_STREAMS[device] = torch.cuda.Stream(device)
    return _DQ_STREAMS[device]


_FEATURES_DOC = """
    Keywords shared by the forward, the backward and :func:`flash_attention` (notebook
    ``10_dropout_masks_sparsity``):

    - grouped-query attention needs no keyword: ``k`` and ``v`` may have ``H_kv`` heads where ``q`` has H,
      with ``H % H_kv == 0``; query head h uses K/V head ``h // (H // H_kv)`` (``enable_gqa=True``'s
      convention). K and V are never repeated in memory; dK and dV are summed over each group.
    - ``dropout_p``: each entry of P is dropped with this probability inside the kernel and the kept ones
      are scaled by ``1 / (1 - dropout_p)``; the backward regenerates the same mask from ``seed`` (Philox
      counters: nothing of size N^2 is stored; the drop probability is ``dropout_p`` rounded to 16 bits).
      ``seed=None`` draws one from torch's generator. :func:`dropout_mask` returns the mask a seed gives.
    - ``block_mask``: a bool tensor ``(B or 1, H or 1, ceil(N_q / block_size), ceil(N_k / block_size))``;
      block (i, j) False means the queries of block i never see the keys of block j. Combines with
      ``causal``. The kernels walk lists of the visible blocks, built from the mask by one small kernel on
      the first call with that mask tensor (kept while it lives and is not changed in place, so pass the same
      tensor at every step), and a hidden tile is never loaded. When ``block_size`` is a multiple of every
      kernel tile's sides (128 is, for every config), the lists are of the mask's own blocks and a listed tile
      is wholly visible. Otherwise they are of 128 x 128 blocks (:func:`coarse_block_mask`; 32 in the
      interpreter), listed where any mask block inside is visible, and a listed tile takes the mask element
      by element: the tiles of a hidden 128 x 128 block are never loaded. Where every tile is checked anyway
      (the causal diagonal, a window's edges, the last partial tile), no hidden tile is loaded. A query row
      that sees no key gets ``o = 0`` and ``lse = -inf``, and zero gradients: never NaN.

    Score and mask modifications, FlashAttention's keywords (:mod:`flashref.score_mods` has the rule, and
    :mod:`flashref.reference` the float64 oracle); each composes with all of the above:

    - ``window_size = (left, right)``: query i sees keys ``i - left <= j <= i + right`` (top-left aligned, as
      ``causal``; -1 leaves a side unbounded; ``(w - 1, 0)`` with ``causal`` is a sliding window of w keys).
      Key tiles wholly outside the window are never loaded, so time falls with the window.
    - ``softcap = c > 0``: the scaled score s becomes ``c * tanh(s / c)``; the backward multiplies dS by
      ``1 - tanh(s / c)^2``.
    - ``alibi_slopes``: a float tensor ``(H,)`` or ``(B, H)`` on q's device; ``-a_h * |i - j|`` is added to the
      (capped) score. It gets no gradient.
"""


def flash_attention_forward(q, k, v, causal=False, sm_scale=None, *, dropout_p=0.0, seed=None, block_mask=None,
                            block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, check_finite=True,
                            causal_align="top_left", kernel="auto"):
    """FlashAttention forward without autograd: ``(o, lse)``; ``o`` like ``q`` (contiguous), ``lse`` of shape
    ``(B, H, N_q)`` in fp32 (natural log; -inf for a row that sees no key). fp32 inputs are computed in full
    fp32 (``input_precision="ieee"``: no TF32). Pass ``seed`` with ``dropout_p`` to replay the same mask in
    :func:`flash_attention_backward`. ``causal_align``, ``check_finite`` and ``kernel`` as in
    :func:`flash_attention`. Notebook ``07_triton_forward``."""
    _, scale = _check(q, k, v, causal, sm_scale, check_finite)
    feat = Features(q, k, dropout_p, seed, block_mask, block_size, causal=causal, scale=scale,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, check_finite=check_finite,
                    causal_align=causal_align)
    with torch.no_grad():
        o, lse, _ = _forward(q, k, v, scale, feat, kernel)
    return o, lse


flash_attention_forward.__doc__ += _FEATURES_DOC


def _stats_from_lse(lse):
    """(m2, l2) for the backward from lse alone (fp32, or float64 as ring attention keeps it): the base-2
    lse * log2(e), taken in float64, split into m2 rounded to fp32 and l2 what the rounding left. The kernels
    take ``s * scale - m2 - l2`` in that order, so the pair keeps the precision one fp32 number would lose
    (at scores near 1e3, ~1e-4). A row with lse = -inf saw no key: m2 = 0 and l2 = +inf make its P exactly 0."""
    empty = torch.isneginf(lse)
    lse2 = lse.double() * LOG2E
    m2 = torch.where(empty, 0.0, lse2).float()
    l2 = torch.where(empty, float("inf"), lse2 - m2.double()).float()
    return m2.contiguous(), l2.contiguous()


def flash_attention_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, deterministic=True, *,
                             dropout_p=0.0, seed=None, block_mask=None, block_size=128, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, check_finite=True, causal_align="top_left",
                             kernel="auto"):
    """Gradients ``(dq, dk, dv)`` from the forward's ``o`` and ``lse``, recomputing P tile by tile.
    ``deterministic=False`` adds dQ atomically and skips the dQ kernel (the last bits vary run to run): on a
    Hopper GPU, the one-kernel Gluon backward where it applies (:func:`backward_kernel` says ``"hopper-fused"``), and at
    d = 256 the deterministic Gluon pair, faster there. With
    ``dropout_p`` the ``seed`` the forward used is required. ``check_finite`` as in :func:`flash_attention`, for
    ``o``, ``lse`` (which may be -inf) and ``do`` too; ``kernel`` as there, for the backward
    (:func:`backward_kernel` says which runs). The mask arguments (``causal``, ``causal_align``, ``window_size``,
    ``block_mask``, ``block_size``) and ``softcap``, ``alibi_slopes``, ``sm_scale`` must be the forward's: P is
    recomputed with the ones given, and nothing here can tell. Notebook ``08_triton_backward``."""
    _, scale = _check(q, k, v, causal, sm_scale, check_finite)
    validation.check_bool("deterministic", deterministic)
    if validation.check_dropout_p(dropout_p) > 0.0 and seed is None:
        raise ValueError("flash_attention_backward with dropout_p > 0 needs the seed the forward used "
                         "(a new one would draw a different mask)")
    feat = Features(q, k, dropout_p, seed, block_mask, block_size, causal=causal, scale=scale,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, check_finite=check_finite,
                    causal_align=causal_align)
    validation.check_same_shape("o", o, "q", q)
    validation.check_same_shape("do", do, "o", o)
    for name, x in (("o", o), ("do", do), ("lse", lse)):
        validation.check_tensor(name, x, q.device)
    if do.dtype != q.dtype or o.dtype != q.dtype:
        raise TypeError(f"o and do must have the dtype of q ({q.dtype}), got {o.dtype} and {do.dtype}")
    if not lse.dtype.is_floating_point:
        raise TypeError(f"lse must be a floating tensor (the forward's fp32 lse), got dtype {lse.dtype}")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must have shape (B, H, N_q) = {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    if check_finite:
        validation.check_finite({"o": o, "do": do})
        validation.check_finite({"lse": lse}, allow_neg_inf=True)
    with torch.no_grad():
        return _backward(q, k, v, o, _stats_from_lse(lse), do, scale, deterministic, feat, kernel)


flash_attention_backward.__doc__ += _FEATURES_DOC


class FlashAttentionFunction(torch.autograd.Function):
    """``O = dropout(softmax(sm_scale Q K^T)) V`` whose backward recomputes P from Q, K and the saved row
    statistics (the max m and the sum l of each row: lse = m + log l) and replays the dropout mask from
    its seed: O(N) extra memory. ``FlashAttentionFunction.apply`` takes positions only (autograd's rule), in the
    order of :meth:`forward`: ``q, k, v, causal, sm_scale, deterministic`` as :func:`flash_attention`, then
    ``check_finite``, then its other keyword-only arguments from ``dropout_p`` to ``kernel``; defaults and checks
    are :func:`flash_attention`'s."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, deterministic=True, check_finite=True, dropout_p=0.0,
                seed=None, block_mask=None, block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                causal_align="top_left", kernel="auto"):
        _, scale = _check(q, k, v, causal, sm_scale, check_finite)
        validation.check_bool("deterministic", deterministic)
        feat = Features(q, k, dropout_p, seed, block_mask, block_size, causal=causal, scale=scale,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, check_finite=check_finite,
                        causal_align=causal_align)
        token = _reads_in_place(q, k, v, feat, deterministic, kernel)
        if not token and _forward_kernel(q, k, v, feat, kernel) == "hopper":
            q, k, v = _rows(q, k, v)  # copied here once where strided, for the forward's and the backward's kernels
        o, _, (m2, l2) = _forward(q, k, v, scale, feat, kernel, token)
        ctx.save_for_backward(q, k, v, o, m2, l2)
        ctx.sm_scale, ctx.deterministic, ctx.check_finite, ctx.kernel = scale, deterministic, check_finite, kernel
        ctx.token = token
        ctx.feat = feat  # the seed, the block mask and the slopes: autograd keeps them for the backward
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, m2, l2 = ctx.saved_tensors
        if ctx.check_finite:
            validation.check_finite({"do (the gradient of o)": do})
        dq, dk, dv = _backward(q, k, v, o, (m2, l2), do, ctx.sm_scale, ctx.deterministic, ctx.feat, ctx.kernel,
                               token=ctx.token)
        return dq, dk, dv, *(None,) * 13


# ---- Step plans: a training loop's later calls on the Gluon path skip the host's work of the first ----------------
#
# On the H100 machine a forward + backward step of a sliding-window mask at B 4, H 16, N 4K, d 64 takes about 0.7 ms
# of GPU time and took 1.0-1.2 ms of host time (its checks, the Features of the call, the dispatch, configs, meta
# dicts, TMA descriptors, five launches through Triton, autograd): the host, not the GPU, set the step's time. A
# loop calls with the same shapes, strides, dtypes and options at every step, so a plan made from the first call
# keeps everything but the data, and the next calls only check the data (when check_finite), allocate, make their
# descriptors and launch the kernels Triton compiled for the first.

_PLANS: dict = {}
_PLANS_MAX = 64


class _NotPlanned(Exception):
    """A call that does not run the Gluon forward and a Gluon backward (the pair, or the one kernel with dQ's adds
    in any order or in a fixed one): it keeps the full path."""


def _plan_key(q, k, v, causal, sm_scale, deterministic, check_finite, dropout_p, seed, block_mask, block_size,
              window_size, softcap, alibi_slopes, causal_align, kernel):
    """Everything a call's checks, dispatch, kernels and Triton's specialization of their arguments depend on,
    except the data: each tensor's shape, strides, dtype, device and 16-byte alignment, the options with their types
    (``causal=1`` must not pass as ``True`` did), the block mask's identity and version; None for a call no plan
    takes (ALiBi slopes are data; not plain tensors; unhashable options)."""
    if alibi_slopes is not None or not (type(q) is type(k) is type(v) is torch.Tensor):
        return None
    try:
        key = (*((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0) for x in (q, k, v)),
               torch.cuda.current_device() if q.is_cuda else None, type(causal), causal, type(sm_scale), sm_scale,
               type(deterministic), deterministic, type(check_finite), check_finite, type(dropout_p), dropout_p,
               seed is None, None if block_mask is None else (id(block_mask), block_mask._version),
               type(block_size), block_size, type(window_size), window_size, type(softcap), softcap, causal_align,
               kernel)
        hash(key)
    except (TypeError, RuntimeError, AttributeError):  # unhashable; no strides or address (a sparse tensor, say)
        return None
    return key


def _planned(key, block_mask):
    """The plan kept for ``key`` (None when there is none yet, False for a signature no plan takes)."""
    kept = _PLANS.get(key)
    if kept is None or (block_mask is not None and kept[0]() is not block_mask):
        return None
    return kept[1]


def _keep_plan(key, block_mask, plan) -> None:
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.pop(next(iter(_PLANS)))  # the oldest
    if block_mask is None:
        _PLANS[key] = (None, plan)
        return
    _PLANS[key] = (weakref.ref(block_mask), plan)
    weakref.finalize(block_mask, _PLANS.pop, key, None)  # forgotten with the mask


def _int_width(n: int) -> int:
    """How Triton passes an integer argument: 32, 64 bits, or unsigned 64."""
    return 32 if -2**31 <= n < 2**31 else 64 if n < 2**63 else 65


#: The backward kernels a plan runs (:func:`_backward_kernel`'s names): the Gluon pair, and the one-kernel backward
#: with dQ's adds in any order (``deterministic=False``) or in a fixed one (``deterministic=True`` with dropout)
_PLANNED_BACKWARDS = ("hopper", "hopper-fused", "hopper-ordered")


class StepPlan:
    """The Gluon kernels of one call signature (:func:`_plan_key`), as :func:`flash_attention`'s first call of it
    chose and configured them: the forward (:class:`flashref.triton.hopper.ForwardLaunch`), D's preprocess, and dQ
    and dK/dV (:class:`flashref.triton.hopper_backward.DqLaunch`, :class:`~flashref.triton.hopper_backward.DkdvLaunch`)
    or the one-kernel backward (:func:`flashref.triton.hopper_backward_fused.hopper_fused_backward`). Made after that
    call succeeded, from the same arguments (its checks and dispatch answers are remembered by then); raises
    :class:`_NotPlanned` for a call that runs other kernels."""

    def __init__(self, q, k, v, causal, sm_scale, deterministic, check_finite, dropout_p, block_mask, block_size,
                 window_size, softcap, causal_align, kernel):
        _, scale = _check(q, k, v, causal, sm_scale, check_finite=False)
        feat = Features(q, k, dropout_p, 0, block_mask, block_size, causal=causal, scale=scale,
                        window_size=window_size, softcap=softcap, check_finite=False, causal_align=causal_align)
        backward = _backward_kernel(q, k, v, feat, kernel, deterministic)
        if _forward_kernel(q, k, v, feat, kernel) != "hopper" or backward not in _PLANNED_BACKWARDS:
            raise _NotPlanned
        B, H, N_q, d = q.shape
        self.check_finite, self.dropout_p = check_finite, feat.dropout_p
        scalars = feat.scalars()
        self.drop = (scalars["drop_below"], scalars["keep_scale"]) if feat.dropout_p > 0.0 else None
        self.seed_width = None  # the first planned call's (the compiled kernels take the seed in that width)
        self.token = _reads_in_place(q, k, v, feat, deterministic, kernel)
        self.fwd = _hopper_forward(q, k, scale, feat, self.token)
        self.delta = _delta_launch(B, H, N_q, d)
        self.dq = self.dkdv = self.fused = None
        if backward == "hopper":
            self.dq, self.dkdv = _hopper_backward(q, k, scale, feat, token=self.token)
        else:
            self.fused = functools.partial(_gluon_module("hopper_backward_fused").hopper_fused_backward,
                                           causal=feat.causal, scale=scale, ordered=backward == "hopper-ordered")

    def takes_seed(self, seed: int) -> bool:
        """Whether this call's seed goes in the width the plan's kernels were launched with (a drawn seed is below
        2**62: 64 bits but once in 2**31 draws)."""
        if self.drop is None:
            return True
        if self.seed_width is None:
            self.seed_width = _int_width(seed)
        return _int_width(seed) == self.seed_width

    def _dropout(self, seed):
        return None if self.drop is None else (seed, *self.drop)

    def forward(self, q, k, v, seed: int):
        """``(o, lse, (m2, l2))``, as :func:`_forward`."""
        if self.check_finite:
            validation.check_finite({"q": q, "k": k, "v": v})
        return self.fwd(q, k, v, self._dropout(seed))

    def backward(self, q, k, v, o, m2, l2, do, seed: int):
        """``(dq, dk, dv)``, as :func:`_backward`. dO is made contiguous and 16-byte aligned, or in place reading
        token-major (:func:`_token_do`), a copy where it is not, so that the kernels' arguments keep the
        specialization the plan's launches were compiled for."""
        if self.check_finite:
            validation.check_finite({"do (the gradient of o)": do})
        if self.token:
            do = _token_do(do)
        elif not do.is_contiguous() or do.data_ptr() % 16:
            do = do.clone(memory_format=torch.contiguous_format)
        delta = _delta(o, do, self.delta)
        if self.fused is not None:
            return self.fused(q, k, v, do, m2, l2, delta, dropout=self._dropout(seed))
        mods = dict(dropout=self._dropout(seed), shared={})  # shared: both kernels' TMA descriptors, made once
        dq = self.dq(q, k, v, do, m2, l2, delta, **mods)
        return (dq, *self.dkdv(q, k, v, do, m2, l2, delta, **mods))


class _PlannedAttention(torch.autograd.Function):
    """:class:`FlashAttentionFunction` for a call whose signature has a :class:`StepPlan`."""

    @staticmethod
    def forward(ctx, q, k, v, plan: StepPlan, seed: int):
        if not plan.token:
            q, k, v = _rows(q, k, v)
        o, _, (m2, l2) = plan.forward(q, k, v, seed)
        ctx.save_for_backward(q, k, v, o, m2, l2)
        ctx.plan, ctx.seed = plan, seed
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, m2, l2 = ctx.saved_tensors
        return (*ctx.plan.backward(q, k, v, o, m2, l2, do, ctx.seed), None, None)


def flash_attention(q, k, v, causal=False, sm_scale=None, deterministic=True, *, dropout_p=0.0, seed=None,
                    block_mask=None, block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    check_finite=True, causal_align="top_left", kernel="auto"):
    """FlashAttention as a differentiable PyTorch op: ``o = flash_attention(q, k, v, causal, sm_scale)``.

    ``q``: ``(B, H, N_q, d)``, ``k`` and ``v``: ``(B, H_kv, N_k, d)``, float16, bfloat16 (compute capability
    8.0+) or float32, any strides, ``d <= 256``. ``causal`` is top-left aligned (query i sees keys j <= i),
    as ``scaled_dot_product_attention(is_causal=True)``, or with ``causal_align="bottom_right"`` at the
    bottom-right corner (query i sees keys ``j <= i + N_k - N_q``, FlashAttention's convention: what decoding
    and chunked prefill need; notebook ``13_beyond_one_gpu_and_decoding``); ``sm_scale`` defaults to
    ``1/sqrt(d)``.
    ``deterministic`` (default True): the backward pass writes each gradient element from one program, so
    repeated runs agree bit for bit; False adds dQ with atomic additions instead, as FlashAttention-2 does,
    which saves two of the seven tile products but lets the last bits of dQ vary between runs (the teaching
    kernel's atomics measured slower on the H100, notebook ``08_triton_backward``; there, at head dims 64 and
    128 without a window, ALiBi or block mask, the one-kernel Gluon backward runs instead,
    its dQ added by TMA reduces, and at d = 256 the deterministic Gluon pair, which is faster there: notebook
    ``14_flashattention3_on_hopper``).
    ``check_finite`` (default True): refuse NaN or inf in q, k, v (and, in the backward, in dO) with a
    ``ValueError`` naming the argument (:mod:`flashref.validation`'s rule); the check reads the inputs once
    and synchronizes with the GPU once per call. False skips it, as the benchmarks do (PyTorch's attention
    does not check either), and non-finite inputs then give non-finite outputs.
    ``kernel`` (default ``"auto"``): which forward runs. ``"triton"`` is the teaching kernel of notebook
    ``07_triton_forward``, on every GPU and in the CPU interpreter. ``"hopper"`` is the Gluon forward of notebook
    ``14_flashattention3_on_hopper`` (:mod:`flashref.triton.hopper`): an sm_90 GPU, fp16 or bf16, d in 64, 128, 256,
    q, k, v with as many heads (those of a model's (B, N, H, d) layout read in place, o and the gradients then
    returned in that layout, with the two-kernel backward; other strided ones copied to contiguous ones first), none
    of the features below but a window, (at d = 64 and 128, without a window) dropout, or a block mask whose blocks
    hold its tiles (the default ``block_size=128`` does); a call it cannot take is a ``ValueError`` saying why.
    ``"auto"`` takes the Hopper forward where it can and the teaching kernel everywhere else (:func:`forward_kernel`
    says which). Both give the same o, lse and row statistics. The backward follows: under ``"auto"`` and
    ``"hopper"`` the Gluon dK/dV and dQ kernels of :mod:`flashref.triton.hopper_backward` run wherever they can (the
    Hopper forward's conditions, dropout's included, d = 64 or 128 with ``deterministic=True``, or 256 with causal
    masking or none; unlike the forward, they also take ``alibi_slopes``, and a block mask under the same
    condition), the teaching backward everywhere else (:func:`backward_kernel` says which). With dropout at d = 64
    and 128 (top-left causal masking or none) the one-kernel Gluon backward takes the pair's place where its visits
    can be ordered (:func:`flashref.triton.hopper_backward_fused.ordered_supported`), its dQ adds in a fixed order,
    so that it draws the mask once and stays bitwise reproducible. With ``deterministic=False``, the one-kernel Gluon
    backward where it applies, adding dQ in any order, and the teaching atomic dQ for the rest at d <= 128 without
    dropout.
    A training loop calls with the same shapes, strides, dtypes and options at every step: where the Gluon forward
    and a Gluon backward run, the first call of such a signature is checked and dispatched in full and leaves a plan
    (:class:`StepPlan`) that the later ones run, checking only their data (``check_finite``) and the seed.
    Notebooks ``07_triton_forward`` and ``08_triton_backward``.
    """
    key = _plan_key(q, k, v, causal, sm_scale, deterministic, check_finite, dropout_p, seed, block_mask, block_size,
                    window_size, softcap, alibi_slopes, causal_align, kernel)
    plan = _planned(key, block_mask) if key is not None else None
    if plan:  # a later call of a planned signature (see StepPlan)
        seed = _call_seed(seed, plan.dropout_p)
        if plan.takes_seed(seed):
            return _PlannedAttention.apply(q, k, v, plan, seed)
    o = FlashAttentionFunction.apply(q, k, v, causal, sm_scale, deterministic, check_finite, dropout_p, seed,
                                     block_mask, block_size, window_size, softcap, alibi_slopes, causal_align, kernel)
    if key is not None and plan is None:  # the first call of this signature, checked in full: plan the next ones
        try:
            plan = StepPlan(q, k, v, causal, sm_scale, deterministic, check_finite, dropout_p, block_mask, block_size,
                            window_size, softcap, causal_align, kernel)
        except _NotPlanned:
            plan = False
        _keep_plan(key, block_mask, plan)
    return o


def forward_kernel(q, k, v, causal=False, sm_scale=None, *, dropout_p=0.0, block_mask=None, block_size=128,
                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, causal_align="top_left", kernel="auto") -> str:
    """Which forward :func:`flash_attention` (and :func:`flash_attention_forward`) would run with these arguments:
    ``"hopper"`` or ``"triton"`` (see ``kernel`` there). Benchmarks record it beside each row. Checks as they do,
    without reading the data."""
    _, scale = _check(q, k, v, causal, sm_scale, check_finite=False)
    feat = Features(q, k, dropout_p, 0, block_mask, block_size, causal=causal, scale=scale, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, check_finite=False, causal_align=causal_align)
    return _forward_kernel(q, k, v, feat, kernel)


def backward_kernel(q, k, v, causal=False, sm_scale=None, deterministic=True, *, dropout_p=0.0, block_mask=None,
                    block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, causal_align="top_left",
                    kernel="auto") -> str:
    """Which backward :func:`flash_attention` (and :func:`flash_attention_backward`) would run with these
    arguments: ``"hopper"`` (the Gluon dK/dV and dQ kernels), ``"hopper-fused"`` (the one-kernel Gluon backward,
    with ``deterministic=False``), ``"hopper-ordered"`` (the same kernel with its dQ adds in a fixed order: with
    dropout and ``deterministic=True``) or ``"triton"`` (see ``kernel`` there). Checks as they do, without reading the
    data."""
    _, scale = _check(q, k, v, causal, sm_scale, check_finite=False)
    validation.check_bool("deterministic", deterministic)
    feat = Features(q, k, dropout_p, 0, block_mask, block_size, causal=causal, scale=scale, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, check_finite=False, causal_align=causal_align)
    return _backward_kernel(q, k, v, feat, kernel, deterministic)


flash_attention.__doc__ += _FEATURES_DOC


# --------------------------------------------------------------------------------------------------
# Packed variable-length batches (FlashAttention's flash_attn_varlen_func)
# --------------------------------------------------------------------------------------------------

def _packed_views(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_finite):
    """Check a packed batch and return the kernels' views ``(1, heads, total, d)`` of q, k and v, and the
    ``varlen`` tuple of :class:`Features` (cu_seqlens as int32 on q's device)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_packed_shapes(q, k, v)
    cus = []
    for name, cu, x in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.ndim != 1:
            got = type(cu).__name__
            if isinstance(cu, torch.Tensor):
                got += f" {cu.dtype} of shape {tuple(cu.shape)}"
            raise TypeError(f"{name} must be a 1-D torch.Tensor of int32 (or int64), got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {cu.device}")
        cus.append(cu.to(torch.int32).contiguous())
    if cus[0].shape[0] != cus[1].shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
                         f"{cus[0].shape[0] - 1} and {cus[1].shape[0] - 1}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        validation.check_positive_int(name, n)
    if check_finite:  # reads the offsets (one copy to the host): lengths >= 1, ends, and the longest document
        validation.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        validation.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    views = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    return views, (cus[0], cus[1], int(max_seqlen_q), int(max_seqlen_k))


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """:func:`flash_attention_varlen` as an autograd Function: the same kernels, cutting a packed batch into
    its documents."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, sm_scale=None,
                deterministic=True, check_finite=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
        validation.check_bool("check_finite", check_finite)
        (q4, k4, v4), packed = _packed_views(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             check_finite)
        _, scale = _check(q4, k4, v4, causal, sm_scale, False)
        if check_finite:  # on the packed tensors: an index in the caller's (total, H, d), not the kernels' view
            validation.check_finite({"q": q, "k": k, "v": v})
        validation.check_bool("deterministic", deterministic)
        feat = Features(q4, k4, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, varlen=packed, check_finite=check_finite)
        o4, lse, (m2, l2) = _forward(q4, k4, v4, scale, feat)
        ctx.save_for_backward(q, k, v, o4, m2, l2)
        ctx.sm_scale, ctx.deterministic, ctx.check_finite = scale, deterministic, check_finite
        ctx.feat = feat
        lse = lse[0]  # (H, total_q), as FlashAttention returns it
        ctx.mark_non_differentiable(lse)
        return o4[0].transpose(0, 1), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o4, m2, l2 = ctx.saved_tensors
        if ctx.check_finite:
            validation.check_finite({"do (the gradient of o)": do})
        q4, k4, v4, do4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, do))
        dq, dk, dv = _backward(q4, k4, v4, o4, (m2, l2), do4, ctx.sm_scale, ctx.deterministic, ctx.feat)
        return (*(x[0].transpose(0, 1) for x in (dq, dk, dv)), *(None,) * 11)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           sm_scale=None, deterministic=True, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_lse=False, check_finite=True):
    """FlashAttention over a packed batch of documents of different lengths, without padding, as
    FlashAttention's ``flash_attn_varlen_func``; differentiable.

    ``q``: ``(total_q, H, d)``; ``k`` and ``v``: ``(total_k, H_kv, d)`` (``H % H_kv == 0``); document b holds
    rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of k and
    v (``cu_seqlens_*``: int32 tensors ``[0, n_0, n_0 + n_1, ..., total]`` on q's device). No query sees a key
    of another document; within one, everything is :func:`flash_attention`'s: ``causal`` top-left aligned in
    each document, ``window_size``, ``softcap``, and ``alibi_slopes`` of shape ``(H,)`` or ``(documents, H)``.
    ``max_seqlen_q`` / ``max_seqlen_k``: the longest document, which sizes the launch grid (one program per
    BLOCK_M rows of the longest; programs past a shorter document's end visit no key tile and store nothing).
    Returns ``o`` like q (and ``lse`` of shape ``(H, total_q)``, fp32, natural log, when ``return_lse``). ``check_finite``
    (default True) also reads ``cu_seqlens`` on the host to check them (every document at least one row, the
    right total, the longest within ``max_seqlen``); False trusts them, as the benchmarks do. Dropout and
    block masks are not taken here. :mod:`flashref.varlen` and :func:`flashref.reference.attention_varlen` hold
    the NumPy side.
    """
    validation.check_bool("return_lse", return_lse)
    o, lse = FlashAttentionVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                causal, sm_scale, deterministic, check_finite, window_size, softcap,
                                                alibi_slopes)
    return (o, lse) if return_lse else o
