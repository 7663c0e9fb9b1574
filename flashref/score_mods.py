"""Score and mask modifications inside attention: a token-level sliding window, tanh soft-capping and ALiBi.

The rule, written once for the float64 reference (:mod:`flashref.reference`) and the tiled NumPy
attention (:mod:`flashref.numpy_flash`). The keywords and their meaning are those of FlashAttention's
``flash_attn_func``, with this course's top-left alignment of query i and key j:

- ``window_size = (left, right)``: query i sees keys ``i - left <= j <= i + right`` (-1: that side is
  unbounded; ``(w - 1, 0)`` is Mistral's causal window of w keys). It combines with ``causal`` (which is
  ``right = 0``) and with a block mask: a key is visible when every mask allows it.
- ``softcap = c > 0``: the scaled score s becomes ``c * tanh(s / c)`` (Gemma 2), so no score exceeds c in
  size; its derivative ``1 - tanh(s / c)^2`` enters the backward. 0 turns it off.
- ``alibi_slopes``: one slope a per head (shape ``(H,)`` or ``(B, H)``); ``-a * |i - j|`` is added to the
  (capped) score, a linear penalty on distance instead of position embeddings (Press et al., ALiBi).

So the score of query i and key j is ``cap(sm_scale * q_i . k_j) - a_h |i - j|``, then masked, then the
softmax. Kernels that fuse these modifications are checked against the reference that uses this rule.
"""

from __future__ import annotations

import numpy as np

from flashref.validation import check_alibi_slopes, check_softcap, check_window_size


class ScoreMods:
    """The checked modifications of one call; ``lead`` is the inputs' leading dims, ``()`` or ``(B, H)``."""

    def __init__(self, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, *, lead: tuple = (),
                 causal_right: int | None = None):
        self.left, self.right = check_window_size(window_size)
        #: the largest visible ``j - i`` (None: unbounded): the window's right side, tightened by a causal
        #: mask given as ``causal_right`` (a bottom-right causal mask is ``N_k - N_q``, possibly negative)
        self.max_offset = None if self.right < 0 else self.right
        if causal_right is not None:
            self.max_offset = causal_right if self.max_offset is None else min(self.max_offset, causal_right)
        self.softcap = check_softcap(softcap)
        #: float64, broadcastable against the scores: (B or 1, H, 1, 1), or (1, 1) for 2-D inputs
        self.slopes = None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, tuple(lead))

    @property
    def windowed(self) -> bool:
        return self.left >= 0 or self.max_offset is not None

    def window(self, rows: np.ndarray, cols: np.ndarray):
        """Boolean ``(len(rows), len(cols))``, True where query ``rows[a]`` may see key ``cols[b]``; None
        when there is no window."""
        if not self.windowed:
            return None
        offset = cols[None, :] - rows[:, None]          # j - i
        visible = np.ones(offset.shape, dtype=bool)
        if self.left >= 0:
            visible &= offset >= -self.left
        if self.max_offset is not None:
            visible &= offset <= self.max_offset
        return visible

    def tile_outside_window(self, q_range, k_range) -> bool:
        """Whether no query of rows ``[q_range)`` sees any key of ``[k_range)``: a tile a kernel skips."""
        (i0, i1), (j0, j1) = q_range, k_range
        return (self.left >= 0 and j1 - 1 < i0 - self.left) or \
            (self.max_offset is not None and j0 > i1 - 1 + self.max_offset)

    def modify(self, s: np.ndarray, rows: np.ndarray, cols: np.ndarray, slopes=None) -> np.ndarray:
        """The scaled scores ``s`` (``(..., len(rows), len(cols))``) capped and biased, in s's dtype.
        ``slopes`` overrides ``self.slopes`` when the caller has reshaped them (grouped heads)."""
        slopes = self.slopes if slopes is None else slopes
        if self.softcap > 0:
            c = s.dtype.type(self.softcap)
            s = c * np.tanh(s / c)
        if slopes is not None:
            distance = np.abs(rows[:, None] - cols[None, :]).astype(np.float64)
            s = (s - slopes * distance).astype(s.dtype, copy=False)
        return s

    def softcap_grad(self, ds: np.ndarray, s_raw: np.ndarray) -> np.ndarray:
        """dL/ds_raw from dL/ds, where s = c tanh(s_raw / c): times ``1 - tanh(s_raw / c)^2`` (ds unchanged
        without a softcap; the ALiBi bias does not depend on q or k)."""
        if self.softcap == 0:
            return ds
        t = np.tanh(s_raw / s_raw.dtype.type(self.softcap))
        return ds * (1 - t * t)

    @property
    def changes_scores(self) -> bool:
        return self.softcap > 0 or self.slopes is not None
