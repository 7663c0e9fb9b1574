"""Input checks shared by every implementation.

Each implementation calls :func:`check_attention_inputs` first, so a bad input gets the same clear
``ValueError`` or ``TypeError`` everywhere, naming the argument, what was expected and what came,
instead of a silent wrong answer or an opaque kernel crash. The checks only read ``shape``, ``ndim``,
``dtype`` and ``device``, so they serve NumPy, CuPy and torch arrays alike.

The rule for bad values, the same in every public function (NumPy, CuPy and Triton):

- **Data must be finite.** NaN or +-inf in ``q``, ``k``, ``v``, ``o`` or ``do`` is a ``ValueError`` that
  names the argument and the first bad element (:func:`check_finite`), never NaN rows or a warning. The
  one exception is a score given to the ``online_softmax`` functions, where ``-inf`` is the mask. On a
  GPU the check reads the inputs once and synchronizes once per call; ``check_finite=False`` skips it
  (SciPy's convention), as the benchmarks do, and then non-finite inputs give non-finite outputs.
- **Shapes, dtypes and devices** are checked as :func:`check_attention_inputs` says; every axis is
  non-empty.
- **sm_scale** is None (``1/sqrt(d)``) or a finite real number > 0.
- **NumPy implementations take NumPy arrays** (and, for scores, Python numbers and lists); a torch or
  CuPy array is a ``TypeError`` that says how to convert it, rather than an implicit device copy.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

_NAMES = ("q", "k", "v")


def _describe_dtype(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


def check_bool(name: str, value) -> bool:
    """A flag such as ``causal`` must be a plain bool (a tensor or a string here is almost always a mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)}: {value!r}")
    return value


def _type_name(value) -> str:
    """The type's name, qualified where it is not a builtin (``numpy.bool``, not ``bool``, for np.True_)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def check_causal(causal) -> bool:
    """``causal`` must be a plain bool."""
    return check_bool("causal", causal)


CAUSAL_ALIGNS = ("top_left", "bottom_right")


def check_causal_align(causal_align) -> str:
    """``causal_align``: where the causal diagonal sits when ``N_q != N_k``. ``"top_left"`` (the course's
    default, as ``scaled_dot_product_attention(is_causal=True)``): query i sees keys ``j <= i``.
    ``"bottom_right"`` (FlashAttention's since 2.1, what decoding and chunked prefill need): query i sees
    keys ``j <= i + N_k - N_q``, so the last query sees every key; when ``N_q > N_k`` the first ``N_q - N_k``
    rows see no key (o = 0, lse = -inf)."""
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    return causal_align


def split_causal(causal: bool, causal_align: str, N_q: int, N_k: int) -> tuple[bool, int | None]:
    """How every implementation applies a causal mask: ``(top_left, bound)``. A top-left mask (or a
    bottom-right one with ``N_q == N_k``: the same mask) stays ``top_left = causal``, with its own fast
    rule (diagonal tiles masked, tiles above skipped) and ``bound = None``. A bottom-right mask with
    ``N_q != N_k`` becomes ``top_left = False`` and ``bound = N_k - N_q``, a bound on ``j - i``: the right
    side of a local window (:class:`flashref.score_mods.ScoreMods`), so the window's rules mask and skip
    its tiles (a negative bound leaves the first ``N_q - N_k`` rows without a key)."""
    check_causal_align(causal_align)
    if causal and causal_align == "bottom_right" and N_q != N_k:
        return False, N_k - N_q
    return causal, None


#: The largest sm_scale, softcap or ALiBi slope taken: the kernels compute in float32 and multiply each by
#: log2(e) (exp2 is their exponential), so a larger one would be inf there and its output NaN.
MAX_SCALE = float(np.finfo(np.float32).max) / math.log2(math.e)
#: The smallest softcap > 0 taken: the kernels divide scores by it (1/softcap), which must stay finite in float32.
MIN_SOFTCAP = float(np.finfo(np.float32).tiny)


def check_float32_scale(name: str, largest: float) -> None:
    """A multiplier of the scores (``sm_scale``, an ALiBi slope; ``largest`` is its greatest magnitude) must stay
    finite in the kernels' float32 once multiplied by log2(e): :data:`MAX_SCALE`."""
    if largest > MAX_SCALE:
        raise ValueError(f"{name} must lie within +-{MAX_SCALE:.4g} (times log2(e) it must stay finite in float32, "
                         f"the kernels' arithmetic), got {largest:.4g}")


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """Return the softmax scale: ``1/sqrt(d)`` when ``sm_scale`` is None, else a finite real number > 0
    (0 would make every row uniform and a negative scale would turn the softmax into a softmin: both are
    mistakes far more often than intent)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}: {sm_scale!r}")
    try:
        sm_scale = float(sm_scale)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"sm_scale must be a finite number > 0 (or None for 1/sqrt(d)), got {sm_scale}") from None
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a finite number > 0 (or None for 1/sqrt(d)), got {sm_scale}")
    check_float32_scale("sm_scale", sm_scale)
    return sm_scale


def _framework(x) -> str:
    module = type(x).__module__
    return "torch" if module.startswith("torch") else "cupy" if module.startswith("cupy") else "numpy"


def check_numpy(name: str, x, *, array_like: bool = False):
    """NumPy implementations take NumPy arrays: a torch tensor or CuPy array is refused with the way to
    convert it (an implicit conversion would hide a device copy, or fail on a GPU tensor). With
    ``array_like``, Python numbers and lists pass too (the online-softmax functions take scores so)."""
    kind = _framework(x)
    if kind == "torch":
        raise TypeError(f"{name} must be a NumPy array, got a torch.Tensor: pass {name}.detach().cpu().numpy() "
                        f"(or use flashref.triton for torch tensors)")
    if kind == "cupy":
        raise TypeError(f"{name} must be a NumPy array, got a CuPy array: pass {name}.get() "
                        f"(or use flashref.cupy for CuPy arrays)")
    if not isinstance(x, np.ndarray) and not array_like:
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if isinstance(x, np.ndarray) and type(x) is not np.ndarray:  # np.matrix, masked arrays: other arithmetic
        raise TypeError(f"{name} must be a plain NumPy array, got {_type_name(x)}: pass np.asarray({name})")
    return x


def check_finite(arrays: dict, *, allow_neg_inf: bool = False) -> None:
    """Raise ``ValueError`` naming the first argument in ``{name: array}`` that holds NaN or inf (or, with
    ``allow_neg_inf``, NaN or +inf) and the index of its first such element. NumPy, CuPy or torch arrays;
    torch tensors are reduced on their device and synchronized once for all of them. An empty array, and an
    integer or boolean torch tensor, holds no NaN or inf: it passes (its dtype is the caller's to check)."""
    arrays = {name: x for name, x in arrays.items() if x is not None and not _cannot_be_non_finite(x)}
    if not arrays:
        return
    kind = _framework(next(iter(arrays.values())))
    if kind == "torch":
        import torch

        if allow_neg_inf:  # -inf is allowed, so the norm cannot tell: look at the elements
            oks = [(x.detach().isfinite() | (x.detach() == float("-inf"))).all() for x in arrays.values()]
        else:  # one read of each tensor and no temporary: the infinity norm is NaN or inf exactly when an element is
            oks = [torch.isfinite(torch.linalg.vector_norm(x.detach().reshape(-1), float("inf")).float())
                   for x in arrays.values()]
        finite = torch.stack(oks).tolist()  # one synchronization for all of them
    else:
        xp = np if kind == "numpy" else __import__("cupy")
        finite = [bool(xp.all(_ok(xp, x, allow_neg_inf))) for x in arrays.values()]
    for (name, x), ok in zip(arrays.items(), finite):
        if not ok:
            _raise_not_finite(name, x, allow_neg_inf)


def _cannot_be_non_finite(x) -> bool:
    """An empty array, an integer or boolean torch tensor (whose infinity norm torch refuses to take), or a
    NumPy or CuPy array of neither floats nor complex numbers (strings have no isfinite): the dtype is the
    caller's to check, with a message naming it."""
    if math.prod(getattr(x, "shape", (1,))) == 0:
        return True
    dtype = getattr(x, "dtype", None)
    if _framework(x) == "torch":
        return not (dtype.is_floating_point or dtype.is_complex)
    return getattr(dtype, "kind", "f") not in "fc"


def _ok(xp, x, allow_neg_inf):
    return (xp.isfinite(x) | xp.isneginf(x)) if allow_neg_inf else xp.isfinite(x)


def _raise_not_finite(name, x, allow_neg_inf):
    """Only on the error path: find the first bad element to name it."""
    if _framework(x) == "torch":
        bad = (~(x.isfinite() | (x == float("-inf")))) if allow_neg_inf else ~x.isfinite()
        index = tuple(int(i) for i in bad.nonzero()[0].tolist())
        value = float(x[index])
    else:
        xp = np if _framework(x) == "numpy" else __import__("cupy")
        bad = ~_ok(xp, x, allow_neg_inf)
        index = tuple(int(i) for i in np.unravel_index(int(xp.argmax(bad.ravel())), x.shape))
        value = float(x[index])
    allowed = "finite or -inf (a masked score)" if allow_neg_inf else "finite (no NaN or inf)"
    shown = "NaN" if math.isnan(value) else "+inf" if value > 0 else "-inf"
    raise ValueError(f"{name} must be {allowed}, got {shown} at index {index}")


def check_dense(name: str, x) -> None:
    """A torch tensor must be dense (strided): a sparse or otherwise laid-out tensor has no rows and strides
    for a kernel to read, and torch's own errors on it name no argument."""
    layout = getattr(x, "layout", None)
    if layout is not None and _framework(x) == "torch" and str(layout) != "torch.strided":
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {layout}")
    if getattr(x, "is_nested", False):  # (a nested tensor's layout reads strided too)
        raise TypeError(f"{name} must be a dense tensor, got a nested tensor: for sequences of different lengths, "
                        f"pack them end to end (flash_attention_varlen)")


def check_tensor(name: str, x, device=None, *, like: str = "q") -> None:
    """An argument of the torch (GPU) functions: a dense torch.Tensor, on ``device`` (the device of the
    argument named ``like``) when given."""
    if _framework(x) != "torch" or not hasattr(x, "layout"):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_dense(name, x)
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on {like}'s device ({device}), got {x.device}")


def check_attention_inputs(q, k, v, *, allowed_ndims=(2, 4), allowed_dtypes=None, max_head_dim=None,
                           numpy=False, finite=True, gqa=False):
    """Check q, k, v for attention; return ``(N_q, N_k, d)``.

    Expected: q of shape ``(..., N_q, d)``, k of shape ``(..., N_k, d)``, v of shape ``(..., N_k, d)``,
    the same leading (batch, head) dimensions, the same dtype and the same device, and
    ``N_q, N_k, d >= 1`` and ``B, H, H_kv >= 1`` (every axis non-empty). With ``gqa``, 4-D k and v may have
    ``H_kv`` heads where q has H, if ``H % H_kv == 0`` (grouped-query attention). ``allowed_ndims`` is
    ``(2, 4)`` for NumPy (``(N, d)`` or ``(B, H, N, d)``) and ``(4,)`` for the GPU kernels.
    ``allowed_dtypes`` is a collection of dtype names. ``numpy``: only NumPy arrays (:func:`check_numpy`);
    ``finite``: no NaN or inf (:func:`check_finite`), checked last.
    """
    arrays = dict(zip(_NAMES, (q, k, v)))
    for name, x in arrays.items():
        if numpy:
            check_numpy(name, x)
        check_dense(name, x)  # first: a nested tensor's .shape raises
        if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
            raise TypeError(f"{name} must be an array or tensor, got {type(x).__name__}")
        if x.ndim not in allowed_ndims:
            shapes = " or ".join("(B, H, N, d)" if n == 4 else "(N, d)" if n == 2 else f"{n}-d" for n in allowed_ndims)
            raise ValueError(f"{name} must have shape {shapes}, got {x.ndim}-d shape {tuple(x.shape)}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k and v must have the same rank, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if gqa and q.ndim == 4 and tuple(k.shape[:2]) == tuple(v.shape[:2]) and k.shape[0] == q.shape[0] \
            and k.shape[1] != q.shape[1]:
        H, H_kv = int(q.shape[1]), int(k.shape[1])
        if H_kv < 1 or H % H_kv:
            raise ValueError(f"k and v must have a number of heads H_kv that divides q's H = {H} (grouped-query "
                             f"attention), got H_kv = {H_kv}: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    elif not (tuple(q.shape[:-2]) == tuple(k.shape[:-2]) == tuple(v.shape[:-2])):
        raise ValueError(f"q, k and v must share their batch and head dimensions, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    N_q, d = int(q.shape[-2]), int(q.shape[-1])
    N_k = int(k.shape[-2])
    if k.shape[-1] != d:
        raise ValueError(f"k must have the head dimension of q (d = {d}), got k.shape {tuple(k.shape)}")
    if v.shape[-2] != N_k:
        raise ValueError(f"v must have as many rows as k (N_k = {N_k}), got v.shape {tuple(v.shape)}")
    if v.shape[-1] != d:
        raise ValueError(f"v must have the head dimension of q (d = {d}), got v.shape {tuple(v.shape)}")
    for name, n in (("q", N_q), ("k", N_k)):
        if n < 1:
            raise ValueError(f"{name} is an empty sequence (N = 0, shape {tuple(arrays[name].shape)}); attention "
                             f"needs N >= 1")
    if d < 1:
        raise ValueError(f"head dimension d must be at least 1, got q.shape {tuple(q.shape)}")
    for name, x in arrays.items():
        if any(n < 1 for n in x.shape[:-2]):
            raise ValueError(f"{name} must not be empty: its batch and head axes (B, H) need at least 1 entry each, "
                             f"got shape {tuple(x.shape)}")
    if max_head_dim is not None and d > max_head_dim:
        raise ValueError(f"head dimension d = {d} is larger than this implementation supports ({max_head_dim})")
    dtypes = [_describe_dtype(x) for x in (q, k, v)]
    if len(set(dtypes)) != 1:
        raise TypeError(f"q, k and v must have the same dtype, got {', '.join(dtypes)}")
    if allowed_dtypes is not None and dtypes[0].replace("torch.", "") not in allowed_dtypes:
        raise TypeError(f"q, k and v must have dtype {' or '.join(allowed_dtypes)}, got {dtypes[0]}")
    devices = [str(getattr(x, "device", "cpu")) for x in (q, k, v)]
    if len(set(devices)) != 1:
        raise ValueError(f"q, k and v must be on the same device, got {', '.join(devices)}")
    if finite:
        check_finite(arrays)
    return N_q, N_k, d


def check_same_shape(name: str, x, like_name: str, like) -> None:
    """``x`` (for example ``do``) must have the shape of ``like`` (for example ``o``)."""
    if not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array or tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(x.shape)}")


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` itself (not to something larger: NumPy would also
    broadcast extra leading dimensions, and the result would silently grow them)."""
    target = tuple(int(n) for n in target)
    try:
        return np.broadcast_shapes(tuple(shape), target) == target
    except ValueError:
        return False


def check_broadcasts_to(name: str, x, shape: tuple) -> None:
    """``x`` (a mask) must broadcast to ``shape`` itself (:func:`broadcasts_to`)."""
    if not broadcasts_to(tuple(x.shape), shape):
        raise ValueError(f"{name} must broadcast to {tuple(int(n) for n in shape)}, got shape {tuple(x.shape)}")


def check_dropout_p(dropout_p) -> float:
    """``dropout_p`` must be a real number in [0, 1): the probability that an entry of P is dropped."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__}: {dropout_p!r}")
    try:
        p = float(dropout_p)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}") from None
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return p


def check_dropout_mask(dropout_mask, p: float, shape: tuple, who: str):
    """The NumPy implementations' dropout: a boolean keep-mask (True = kept) broadcastable to ``shape``, given
    with the ``p`` (already checked) it was drawn with, or None with p = 0. ``who`` says why a p > 0 needs a
    mask. Returns the mask, or None."""
    if dropout_mask is None:
        if p > 0.0:
            raise ValueError(f"dropout_p = {p} needs the dropout_mask it was drawn with: {who} "
                             "(flashref.triton.dropout_mask gives the kernels' mask for a seed)")
        return None
    if p == 0.0:
        raise ValueError("dropout_mask was given with dropout_p = 0.0: pass the p the mask was drawn with")
    check_numpy("dropout_mask", dropout_mask)
    if dropout_mask.dtype != np.bool_:
        raise TypeError(f"dropout_mask must be a boolean keep-mask (True = kept), got dtype {dropout_mask.dtype}")
    check_broadcasts_to("dropout_mask", dropout_mask, shape)
    return dropout_mask


def check_positive_int(name: str, value) -> int:
    """A size or count: an integer (Python or NumPy, not a bool) of at least 1, returned as an int. A
    TypeError names the argument when it is not an integer, a ValueError when it is below 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def check_block_size(block_size) -> int:
    """``block_size`` of a block mask: a positive int."""
    return check_positive_int("block_size", block_size)


def check_block_mask(block_mask, lead: tuple, N_q: int, N_k: int, block_size):
    """A block mask for inputs with leading dims ``lead`` (``()`` or ``(B, H)``): boolean, of shape
    ``(ceil(N_q / block_size), ceil(N_k / block_size))`` after ``(B or 1, H or 1)`` when ``lead`` is
    ``(B, H)``. Returns it (NumPy or torch, as given)."""
    bs = check_block_size(block_size)
    rows, cols = -(-N_q // bs), -(-N_k // bs)
    if not hasattr(block_mask, "shape") or not hasattr(block_mask, "dtype"):
        raise TypeError(f"block_mask must be a boolean array or tensor, got {type(block_mask).__name__}")
    if "bool" not in str(block_mask.dtype):
        raise TypeError(f"block_mask must be boolean (True = the block is visible), got dtype {block_mask.dtype}")
    shape = tuple(block_mask.shape)
    want = f"({', '.join(['B or 1', 'H or 1'][:len(lead)] + [str(rows), str(cols)])})"
    ok = len(shape) == len(lead) + 2 and shape[-2:] == (rows, cols) and \
        all(s_ in (1, n) for s_, n in zip(shape[:-2], lead))
    if not ok:
        raise ValueError(f"block_mask must have shape {want} for N_q = {N_q}, N_k = {N_k} and block_size = {bs} "
                         f"(ceil(N / block_size) blocks a side), got {shape}")
    return block_mask


def check_window_size(window_size) -> tuple[int, int]:
    """``window_size = (left, right)``: query i sees keys ``i - left <= j <= i + right``; -1 leaves that side
    unbounded (FlashAttention's convention). Two integers >= -1."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of integers >= -1 (-1: unbounded), got "
                        f"{type(window_size).__name__}: {window_size!r}")
    sides = []
    for side, n in zip(("left", "right"), window_size):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"window_size's {side} side must be an integer >= -1, got {type(n).__name__}: {n!r}")
        if n < -1:
            raise ValueError(f"window_size's {side} side must be >= -1 (-1: unbounded), got {n}")
        sides.append(int(n))
    return sides[0], sides[1]


def check_softcap(softcap) -> float:
    """``softcap`` c: scores become ``c * tanh(s / c)``; 0 turns it off. A finite real number >= 0."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number >= 0 (0: off), got {type(softcap).__name__}: {softcap!r}")
    try:
        c = float(softcap)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}") from None
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {c}")
    if c != 0 and not MIN_SOFTCAP <= c <= MAX_SCALE:
        raise ValueError(f"softcap must be 0 (off) or between {MIN_SOFTCAP:.4g} and {MAX_SCALE:.4g} (the kernels "
                         f"compute s / softcap and softcap * log2(e) in float32), got {c}")
    return c


def check_alibi_slopes(alibi_slopes, lead: tuple):
    """ALiBi slopes, one per head: shape ``(H,)`` or ``(B, H)`` for inputs with leading dims ``lead = (B, H)``,
    ``()`` or ``(1,)`` for 2-D inputs; finite. Returned as a float64 NumPy array shaped to broadcast against
    the scores, ``(B or 1, H, 1, 1)`` (``(1, 1)`` for 2-D inputs)."""
    if hasattr(alibi_slopes, "detach"):  # a torch tensor
        check_dense("alibi_slopes", alibi_slopes)
        alibi_slopes = alibi_slopes.detach().cpu().numpy()
    slopes = np.asarray(alibi_slopes)
    if slopes.dtype.kind not in "fiu":
        raise TypeError(f"alibi_slopes must be an array of real numbers, got {type(alibi_slopes).__name__} "
                        f"of dtype {slopes.dtype}")
    slopes = slopes.astype(np.float64)
    if len(lead) == 2:
        B, H = lead
        if slopes.shape not in ((H,), (B, H)):
            raise ValueError(f"alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), got {slopes.shape}")
        shaped = slopes.reshape((-1 if slopes.ndim == 2 else 1), H, 1, 1)
    else:
        if slopes.size != 1 or slopes.ndim > 1:
            raise ValueError(f"alibi_slopes must be one number (shape () or (1,)) for 2-D inputs, got shape {slopes.shape}")
        shaped = slopes.reshape(1, 1)
    check_finite({"alibi_slopes": shaped})
    check_float32_scale("alibi_slopes", float(np.abs(shaped).max()))
    return shaped


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_seqlen=None) -> np.ndarray:
    """Cumulative sequence lengths of a packed batch (FlashAttention's ``cu_seqlens``): a 1-D integer array
    ``[0, n_0, n_0 + n_1, ..., total]`` with every length ``n_b >= 1``. Returned as int64 NumPy.
    ``max_seqlen``, when given, must be at least the longest length."""
    if hasattr(cu_seqlens, "detach"):  # a torch tensor
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    cu = np.asarray(cu_seqlens)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D array of integers, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with at least two entries [0, ..., total], got shape {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed length {total}, got {cu[0]} ... {cu[-1]}")
    lengths = np.diff(cu)
    if (lengths < 1).any():
        b = int(np.argmax(lengths < 1))
        raise ValueError(f"{name} holds an empty (or negative) sequence: document {b} has length {int(lengths[b])}; "
                         "every document needs at least one token")
    if max_seqlen is not None:
        longest = int(lengths.max())
        if check_positive_int(name.replace("cu_seqlens", "max_seqlen"), max_seqlen) < longest:
            raise ValueError(f"{name.replace('cu_seqlens', 'max_seqlen')} = {max_seqlen} is shorter than the longest "
                             f"document of {name} ({longest})")
    return cu
