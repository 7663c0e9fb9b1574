"""Packed variable-length batches (FlashAttention's ``cu_seqlens``): documents of different lengths laid end to
end in one ``(total, heads, d)`` array, with no padding.

Document b holds rows ``cu_seqlens[b]:cu_seqlens[b + 1]``. The helpers here cut a packed batch into its
documents and put results back, for the NumPy implementations' ``*_varlen`` functions
(:func:`flashref.reference.attention_varlen`, :func:`flashref.numpy_flash.flash_attention_varlen_forward`),
which run each document through their ordinary ``(1, H, n, d)`` path: no query ever meets a key of another
document.
"""

from __future__ import annotations

import numpy as np

from flashref import validation


def check_packed_shapes(q, k, v):
    """Check the shapes of a packed batch as the caller gave it (NumPy arrays or torch tensors): ``q`` of
    ``(total_q, H, d)``, ``k`` and ``v`` of ``(total_k, H_kv, d)``, ``H % H_kv == 0``. Checked before any
    document is cut out, so that a message shows the caller's shapes, not a document's slice of them."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape (total, heads, d) for a packed batch, got {x.ndim}-d shape "
                             f"{tuple(x.shape)}")
    validation.check_same_shape("v", v, "k", k)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have the head dimension of q (d = {q.shape[2]}), got k.shape {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k and v must have a number of heads H_kv that divides q's H = {q.shape[1]} (grouped-query "
                         f"attention), got H_kv = {k.shape[1]}: shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")


def documents(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None):
    """Check a packed batch (NumPy ``q`` of shape ``(total_q, H, d)``, ``k`` and ``v`` of ``(total_k, H_kv, d)``);
    return each document's ``((q_start, q_stop), (k_start, k_stop))``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        validation.check_numpy(name, x)
    check_packed_shapes(q, k, v)
    validation.check_finite({"q": q, "k": k, "v": v})
    cu_q = validation.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    cu_k = validation.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
                         f"{len(cu_q) - 1} and {len(cu_k) - 1}")
    return [((int(a), int(b)), (int(c), int(d))) for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]


def unpack(x, rows):
    """Rows ``[start, stop)`` of a packed ``(total, heads, d)`` array as ``(1, heads, n, d)``."""
    return np.swapaxes(x[rows[0]:rows[1]], 0, 1)[None]


def pack(packed, x, rows) -> None:
    """Write ``x`` of shape ``(1, heads, n, d)`` (or ``(1, heads, n)``: an lse, into ``(heads, total)``) back
    into the packed array at rows ``[start, stop)``."""
    if x.ndim == 3:
        packed[:, rows[0]:rows[1]] = x[0]
    else:
        packed[rows[0]:rows[1]] = np.swapaxes(x[0], 0, 1)


def document_slopes(alibi_slopes, b, n_docs, H):
    """Document b's ALiBi slopes: a ``(B, H)`` array (B = ``n_docs``, the number of documents) holds one row per
    document, an ``(H,)`` array serves all (H: q's heads). Any other shape is refused here, naming B and H."""
    if alibi_slopes is None:
        return None
    validation.check_dense("alibi_slopes", alibi_slopes)
    slopes = np.asarray(alibi_slopes.detach().cpu() if hasattr(alibi_slopes, "detach") else alibi_slopes)
    if slopes.shape not in ((H,), (n_docs, H)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({H},) or (number of documents, H) = "
                         f"({n_docs}, {H}), got {slopes.shape}")
    return slopes[b] if slopes.ndim == 2 else slopes
