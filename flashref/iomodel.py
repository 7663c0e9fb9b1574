"""A simulated two-level memory that counts the HBM traffic of standard and tiled attention.

Taught in notebooks/04_io_complexity.ipynb ("The model", "Exact counts and the closed forms").

The model is the one of Section 3.2 of the FlashAttention paper: a large slow memory (HBM) holds
Q, K, V and everything the algorithm writes; a small fast memory (SRAM) holds at most M elements,
and arithmetic happens only on what is in SRAM. Every element moved HBM -> SRAM is one *read*,
every element moved SRAM -> HBM one *write*; arithmetic is free. :class:`TwoLevelMemory` enforces
the capacity: holding more than M elements at once raises :class:`SRAMOverflowError`.

Two algorithms run through it, each in two modes:

- *execute* (:func:`simulate_standard`, :func:`simulate_tiled`): the arrays exist, the arithmetic is
  done on the tiles in SRAM, and the output can be checked against :mod:`flashref.reference`;
- *account* (:func:`account_standard`, :func:`account_tiled`): the very same loops run without data,
  so the moves of N = 16K are counted tile by tile without an N x N array.

Next to them stand the exact closed forms of this model (:func:`standard_io`, :func:`tiled_io`) and
the paper's orders of growth (:func:`standard_io_theta`, :func:`tiled_io_theta`): standard attention
needs Theta(N d + N^2) HBM accesses, FlashAttention Theta(N^2 d^2 / M), and (Proposition 3 of the
paper) no exact attention algorithm can do o(N^2 d^2 / M) HBM accesses for all M in [d, N d]; with a
block-sparse mask of density s the order is Theta(N d + N^2 d^2 s / M) (:func:`block_sparse_io_theta`,
Proposition 4).

Conventions: one head, ``q`` of shape (N_q, d), ``k`` and ``v`` of shape (N_k, d); causal is top-left
aligned (query i sees keys j <= i). Row statistics l and m live in HBM as (N_q, 1) arrays.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from flashref.validation import check_attention_inputs, check_causal, check_positive_int, check_sm_scale

# The on-chip row statistics of one step of Algorithm 1: m_i, l_i (loaded), m~_ij, l~_ij (of the new
# tile), m_i^new, l_i^new (the merged state).
_STATS_PER_ROW = 6


class SRAMOverflowError(ValueError):
    """A tile does not fit in the simulated SRAM: the algorithm asked for more than M elements."""


@dataclass(frozen=True)
class IOCount:
    """HBM traffic of one run, in elements (multiply by the bytes per element for bytes).

    ``flops`` counts the two matrix products (2 per multiply-add of Q K^T and P V); ``peak_sram`` is
    the most elements held in SRAM at once (None for closed forms, and ignored by ``==``).
    """

    reads: int
    writes: int
    flops: int
    peak_sram: int | None = field(default=None, compare=False)

    @property
    def total(self) -> int:
        """HBM accesses: reads plus writes."""
        return self.reads + self.writes


@dataclass(frozen=True)
class SimResult:
    """What an executed simulation returns: the output O, its log-sum-exp (tiled only) and the counts."""

    o: np.ndarray
    lse: np.ndarray | None
    io: IOCount


class BlockSizes(NamedTuple):
    """Block sizes of Algorithm 1, in the paper's order: B_c key rows, B_r query rows."""

    B_c: int
    B_r: int


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------

def _check_blocks(blocks, M: int, d: int) -> BlockSizes:
    if blocks is None:
        return block_sizes(M, d)
    if not isinstance(blocks, tuple) or len(blocks) != 2:
        raise TypeError(f"blocks must be a pair (B_c, B_r) or None, got {blocks!r}")
    return BlockSizes(check_positive_int("blocks B_c", blocks[0]), check_positive_int("blocks B_r", blocks[1]))


def _check_sizes(N, d, M, N_k):
    N, d, M = check_positive_int("N", N), check_positive_int("d", d), check_positive_int("M", M)
    N_k = N if N_k is None else check_positive_int("N_k", N_k)
    return N, N_k, d, M


# --------------------------------------------------------------------------------------------------
# The simulated memory
# --------------------------------------------------------------------------------------------------

class Tile:
    """A block held in SRAM: its data (None when only accounting) and its size in elements."""

    __slots__ = ("data", "size", "what")

    def __init__(self, data, size: int, what: str):
        self.data, self.size, self.what = data, size, what


class TwoLevelMemory:
    """HBM (unbounded) and SRAM (``M`` elements), counting every element moved between them.

    With ``execute=False`` HBM holds only shapes and tiles carry no data: the same algorithm code then
    counts its moves without allocating anything of size N x N.
    """

    def __init__(self, M: int, execute: bool = True):
        self.capacity = check_positive_int("M", M)
        self.execute = bool(execute)
        self.hbm: dict[str, np.ndarray | tuple[int, int]] = {}
        self.reads = self.writes = self.flops = 0
        self.used = self.peak = 0

    # HBM arrays --------------------------------------------------------------------------------
    def place(self, name: str, array) -> None:
        """Put an input (Q, K, V) in HBM. Free: the inputs start there."""
        if self.execute:
            self.hbm[name] = np.array(array, dtype=np.float64)
        else:
            self.hbm[name] = tuple(array) if isinstance(array, tuple) else tuple(np.shape(array))

    def allocate(self, name: str, shape: tuple[int, int]) -> None:
        """Reserve an HBM array to be written later (S, P, O of the standard algorithm). Free."""
        self.hbm[name] = np.empty(shape) if self.execute else tuple(shape)

    def fill(self, name: str, shape: tuple[int, int], value: float) -> None:
        """Initialize an HBM array (Algorithm 1, line 2): every element written counts."""
        self.hbm[name] = np.full(shape, value) if self.execute else tuple(shape)
        self.writes += shape[0] * shape[1]

    def array(self, name: str) -> np.ndarray:
        """The contents of an HBM array after an executed run (reading a result costs nothing)."""
        return self.hbm[name]

    def _region(self, name: str, rows, cols) -> tuple[tuple[int, int], tuple[int, int]]:
        shape = self.hbm[name] if isinstance(self.hbm[name], tuple) else self.hbm[name].shape
        cols = (0, shape[1]) if cols is None else cols
        for (lo, hi), n, axis in ((rows, shape[0], "rows"), (cols, shape[1], "cols")):
            if not 0 <= lo < hi <= n:
                raise IndexError(f"{name}[{axis} {lo}:{hi}] is outside its shape {shape}")
        return rows, cols

    # SRAM --------------------------------------------------------------------------------------
    def _hold(self, size: int, what: str) -> None:
        if self.used + size > self.capacity:
            raise SRAMOverflowError(
                f"SRAM overflow: {what} needs {size} elements but only {self.capacity - self.used} of "
                f"M = {self.capacity} are free ({self.used} in use)")
        self.used += size
        self.peak = max(self.peak, self.used)

    def load(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Tile:
        """Move ``name[rows, cols]`` from HBM into SRAM: one read per element."""
        (r0, r1), (c0, c1) = self._region(name, rows, cols)
        size, what = (r1 - r0) * (c1 - c0), f"{name}[{r0}:{r1}, {c0}:{c1}]"
        self._hold(size, what)
        self.reads += size
        return Tile(self.hbm[name][r0:r1, c0:c1].copy() if self.execute else None, size, what)

    def scratch(self, shape: tuple[int, int], what: str, value: float = 0.0) -> Tile:
        """A block that lives only on chip (a score tile, row statistics, an accumulator)."""
        size = shape[0] * shape[1]
        self._hold(size, what)
        return Tile(np.full(shape, value) if self.execute else None, size, what)

    def store(self, tile: Tile, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> None:
        """Move a tile from SRAM to ``name[rows, cols]`` in HBM: one write per element."""
        (r0, r1), (c0, c1) = self._region(name, rows, cols)
        if (r1 - r0) * (c1 - c0) != tile.size:
            raise ValueError(f"storing {tile.what} ({tile.size} elements) into {name}[{r0}:{r1}, {c0}:{c1}]")
        self.writes += tile.size
        if self.execute:
            self.hbm[name][r0:r1, c0:c1] = tile.data

    def free(self, *tiles: Tile) -> None:
        """Drop tiles from SRAM (nothing moves: freeing costs no traffic)."""
        for tile in tiles:
            self.used -= tile.size

    def flop(self, n: int) -> None:
        self.flops += n

    def counts(self) -> IOCount:
        return IOCount(self.reads, self.writes, self.flops, self.peak)


# --------------------------------------------------------------------------------------------------
# Block sizes: how each algorithm cuts its work to fit in M
# --------------------------------------------------------------------------------------------------

def block_sizes(M: int, d: int) -> BlockSizes:
    """The paper's block sizes (Algorithm 1, line 1): ``B_c = ceil(M / 4d)``, ``B_r = min(B_c, d)``."""
    M, d = check_positive_int("M", M), check_positive_int("d", d)
    B_c = -(-M // (4 * d))
    return BlockSizes(B_c, min(B_c, d))


@dataclass(frozen=True)
class TiledPlan:
    """How Algorithm 1 runs in M elements.

    K_j and V_j (B_c x d each) stay on chip for a whole outer iteration. The paper's constants are
    loose (four tiles of about M/4, plus S_ij of B_r x B_c on top), so the B_r rows of a query block
    are brought on chip ``rows_on_chip`` at a time: Q, O and S rows plus six statistics per row next
    to K_j, V_j. Each row of Q_i, O_i, l_i, m_i still moves once per visit of block (i, j), so the
    HBM traffic is exactly that of Algorithm 1 with blocks (B_c, B_r).
    """

    B_c: int
    B_r: int
    rows_on_chip: int


def tiled_plan(N_q: int, N_k: int, d: int, M: int, blocks=None) -> TiledPlan:
    """Block sizes and on-chip row group of Algorithm 1 for these sizes; ValueError if M is too small."""
    B_c, B_r = _check_blocks(blocks, M, d)
    c = min(B_c, N_k)  # the widest key block that actually occurs
    per_row = 2 * d + c + _STATS_PER_ROW
    room = M - 2 * c * d
    rows = min(B_r, N_q, room // per_row) if room > 0 else 0
    if rows < 1:
        raise ValueError(
            f"M = {M} is too small for the tiled algorithm with d = {d} and B_c = {B_c}: K_j and V_j "
            f"take 2*{c}*{d} = {2 * c * d} elements and one query row (Q, O, S and {_STATS_PER_ROW} "
            f"statistics) {per_row} more, {2 * c * d + per_row} in all")
    return TiledPlan(B_c, B_r, rows)


@dataclass(frozen=True)
class StandardPlan:
    """How Algorithm 0 streams through M elements.

    Steps 1 and 3 keep R = floor(M / 2(d + 1)) rows of Q (of the accumulator O) on chip: with one
    score (one P entry) per row they take about half of SRAM. K (P and V) stream past them C rows
    (columns) at a time, as many as fit in the other half. Step 2 normalizes ``softmax_rows`` whole rows
    of S at a time, or, when one row of N_k scores does not fit, a row in chunks of
    ``softmax_chunk`` in two passes (first the running max and sum, then P).
    """

    R: int
    C: int
    softmax_passes: int
    softmax_rows: int
    softmax_chunk: int


def standard_plan(N_q: int, N_k: int, d: int, M: int) -> StandardPlan:
    """The blocking of the standard algorithm for these sizes; ValueError if M is too small."""
    R = min(M // (2 * (d + 1)), N_q)
    if R < 1:
        raise ValueError(
            f"M = {M} is too small for the standard algorithm with d = {d}: a row of Q with its scores "
            f"takes half of SRAM, so M must be at least 2*(d + 1) = {2 * (d + 1)}")
    C = min((M - R * d) // (d + R), N_k)  # at least 1 whenever R >= 1
    if N_k + 2 <= M:  # a row of S and its max and sum fit
        return StandardPlan(R, C, 1, min(M // (N_k + 2), N_q), N_k)
    return StandardPlan(R, C, 2, 1, M - 2)


# --------------------------------------------------------------------------------------------------
# Algorithm 1 (tiled, FlashAttention)
# --------------------------------------------------------------------------------------------------

def _causal_mask(S: np.ndarray, rows, cols) -> None:
    """Top-left causal: query i sees keys j <= i; the others get -inf."""
    i = np.arange(rows[0], rows[1])[:, None]
    j = np.arange(cols[0], cols[1])[None, :]
    S[j > i] = -np.inf


def _finite_or_zero(m: np.ndarray) -> np.ndarray:
    """A row max of -inf (a row whose keys are all masked in this tile) is shifted by 0, so
    exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN."""
    return np.where(np.isfinite(m), m, 0.0)


def _tiled_step(mem: TwoLevelMemory, K: Tile, V: Tile, rows, cols, d: int, causal: bool, scale: float):
    """Lines 8-13 of Algorithm 1 for the query rows ``rows`` against the key block ``cols``."""
    n, c = rows[1] - rows[0], cols[1] - cols[0]
    Q = mem.load("Q", rows)
    S = mem.scratch((n, c), "S_ij")
    m_tile, l_tile = mem.scratch((n, 1), "m~_ij"), mem.scratch((n, 1), "l~_ij")
    mem.flop(2 * n * c * d)
    if mem.execute:
        S.data[:] = scale * (Q.data @ K.data.T)
        if causal:
            _causal_mask(S.data, rows, cols)
        m_tile.data[:] = S.data.max(axis=1, keepdims=True)
        S.data[:] = np.exp(S.data - _finite_or_zero(m_tile.data))  # P~_ij, in place of S_ij
        l_tile.data[:] = S.data.sum(axis=1, keepdims=True)
    m_i, l_i = mem.load("m", rows), mem.load("l", rows)
    m_new, l_new = mem.scratch((n, 1), "m_i^new"), mem.scratch((n, 1), "l_i^new")
    O = mem.load("O", rows)
    mem.flop(2 * n * c * d)
    if mem.execute:
        # Every row has seen key 0 in the first pass, so m_new is finite and no exp is of inf - inf.
        m_new.data[:] = np.maximum(m_i.data, m_tile.data)
        alpha, beta = np.exp(m_i.data - m_new.data), np.exp(m_tile.data - m_new.data)
        l_new.data[:] = alpha * l_i.data + beta * l_tile.data
        O.data[:] = (l_i.data * alpha * O.data + beta * (S.data @ V.data)) / l_new.data
    mem.store(O, "O", rows)
    mem.store(l_new, "l", rows)
    mem.store(m_new, "m", rows)
    mem.free(Q, S, m_tile, l_tile, m_i, l_i, m_new, l_new, O)


def _tiled(mem: TwoLevelMemory, N_q: int, N_k: int, d: int, plan: TiledPlan, causal: bool, scale: float):
    """Algorithm 1: outer loop over key blocks (K_j, V_j loaded once), inner loop over query blocks
    (Q_i, O_i, l_i, m_i loaded, O_i, l_i, m_i written back). Causal: blocks entirely above the
    diagonal are skipped, and key blocks that no query reaches are never loaded."""
    mem.fill("O", (N_q, d), 0.0)
    mem.fill("l", (N_q, 1), 0.0)
    mem.fill("m", (N_q, 1), -np.inf)
    for j0 in range(0, N_k, plan.B_c):
        if causal and j0 > N_q - 1:
            break
        cols = (j0, min(j0 + plan.B_c, N_k))
        K, V = mem.load("K", cols), mem.load("V", cols)
        for i0 in range(0, N_q, plan.B_r):
            i1 = min(i0 + plan.B_r, N_q)
            if causal and j0 > i1 - 1:  # every key of block j is after every query of block i
                continue
            for a in range(i0, i1, plan.rows_on_chip):
                _tiled_step(mem, K, V, (a, min(a + plan.rows_on_chip, i1)), cols, d, causal, scale)
        mem.free(K, V)


# --------------------------------------------------------------------------------------------------
# Algorithm 0 (standard attention)
# --------------------------------------------------------------------------------------------------

def _standard_scores(mem, N_q, N_k, d, plan: StandardPlan, scale):
    """Step 1: S = scale * Q K^T, written to HBM block by block."""
    for i0 in range(0, N_q, plan.R):
        rows = (i0, min(i0 + plan.R, N_q))
        Q = mem.load("Q", rows)
        for j0 in range(0, N_k, plan.C):
            cols = (j0, min(j0 + plan.C, N_k))
            K = mem.load("K", cols)
            S = mem.scratch((rows[1] - rows[0], cols[1] - cols[0]), "S_ij")
            mem.flop(2 * S.size * d)
            if mem.execute:
                S.data[:] = scale * (Q.data @ K.data.T)
            mem.store(S, "S", rows, cols)
            mem.free(K, S)
        mem.free(Q)


def _softmax_whole_rows(mem, N_q, plan: StandardPlan, causal):
    """Step 2 when rows fit: read rows of S, write rows of P (the causal mask is applied on chip)."""
    for i0 in range(0, N_q, plan.softmax_rows):
        rows = (i0, min(i0 + plan.softmax_rows, N_q))
        S = mem.load("S", rows)
        m, l = mem.scratch((rows[1] - rows[0], 1), "m"), mem.scratch((rows[1] - rows[0], 1), "l")
        if mem.execute:
            if causal:
                _causal_mask(S.data, rows, (0, S.data.shape[1]))
            m.data[:] = S.data.max(axis=1, keepdims=True)
            S.data[:] = np.exp(S.data - m.data)
            l.data[:] = S.data.sum(axis=1, keepdims=True)
            S.data /= l.data
        mem.store(S, "P", rows)
        mem.free(S, m, l)


def _softmax_long_rows(mem, N_q, N_k, plan: StandardPlan, causal):
    """Step 2 when a row of S is longer than SRAM: one pass for the running max m and sum l, a
    second to write P. The row is read twice, written once."""
    for i in range(N_q):
        row = (i, i + 1)
        m, l = mem.scratch((1, 1), "m", -np.inf), mem.scratch((1, 1), "l", 0.0)
        chunks = [(j0, min(j0 + plan.softmax_chunk, N_k)) for j0 in range(0, N_k, plan.softmax_chunk)]
        for cols in chunks:
            s = mem.load("S", row, cols)
            if mem.execute:
                if causal:
                    _causal_mask(s.data, row, cols)
                # The first chunk holds key 0, which every query sees, so m_new is finite.
                m_new = max(m.data[0, 0], s.data.max())
                l.data[0, 0] = l.data[0, 0] * np.exp(m.data[0, 0] - m_new) + np.exp(s.data - m_new).sum()
                m.data[0, 0] = m_new
            mem.free(s)
        for cols in chunks:
            s = mem.load("S", row, cols)
            if mem.execute:
                if causal:
                    _causal_mask(s.data, row, cols)
                s.data[:] = np.exp(s.data - m.data) / l.data
            mem.store(s, "P", row, cols)
            mem.free(s)
        mem.free(m, l)


def _standard_output(mem, N_q, N_k, d, plan: StandardPlan):
    """Step 3: O = P V, with the R x d accumulator O_i on chip while P_i and V stream past."""
    for i0 in range(0, N_q, plan.R):
        rows = (i0, min(i0 + plan.R, N_q))
        O = mem.scratch((rows[1] - rows[0], d), "O_i")
        for j0 in range(0, N_k, plan.C):
            cols = (j0, min(j0 + plan.C, N_k))
            P, V = mem.load("P", rows, cols), mem.load("V", cols)
            mem.flop(2 * P.size * d)
            if mem.execute:
                O.data += P.data @ V.data
            mem.free(P, V)
        mem.store(O, "O", rows)
        mem.free(O)


def _standard(mem, N_q, N_k, d, plan: StandardPlan, causal, scale):
    """Algorithm 0: S and P are materialized in HBM. Causal changes no count: S is computed and
    written in full and the mask is applied on chip while P is formed."""
    for name, shape in (("S", (N_q, N_k)), ("P", (N_q, N_k)), ("O", (N_q, d))):
        mem.allocate(name, shape)
    _standard_scores(mem, N_q, N_k, d, plan, scale)
    if plan.softmax_passes == 1:
        _softmax_whole_rows(mem, N_q, plan, causal)
    else:
        _softmax_long_rows(mem, N_q, N_k, plan, causal)
    _standard_output(mem, N_q, N_k, d, plan)


# --------------------------------------------------------------------------------------------------
# Public entry points: execute, account, closed forms
# --------------------------------------------------------------------------------------------------

def _prepare(q, k, v, M, causal, sm_scale):
    N_q, N_k, d = check_attention_inputs(q, k, v, allowed_ndims=(2,))
    check_causal(causal)
    scale = check_sm_scale(sm_scale, d)
    M = check_positive_int("M", M)
    mem = TwoLevelMemory(M, execute=True)
    for name, x in (("Q", q), ("K", k), ("V", v)):
        mem.place(name, np.asarray(x))
    return mem, N_q, N_k, d, M, scale


def simulate_standard(q, k, v, M: int, causal: bool = False, sm_scale=None) -> SimResult:
    """Run standard attention (Algorithm 0) through an SRAM of M elements; q (N_q, d), k, v (N_k, d).

    Returns the output O (float64) and the HBM traffic; ``lse`` is None (Algorithm 0 keeps none).
    """
    mem, N_q, N_k, d, M, scale = _prepare(q, k, v, M, causal, sm_scale)
    _standard(mem, N_q, N_k, d, standard_plan(N_q, N_k, d, M), causal, scale)
    return SimResult(mem.array("O"), None, mem.counts())


def simulate_tiled(q, k, v, M: int, causal: bool = False, sm_scale=None, blocks=None) -> SimResult:
    """Run FlashAttention's Algorithm 1 through an SRAM of M elements; q (N_q, d), k, v (N_k, d).

    ``blocks`` = (B_c, B_r) overrides the paper's block sizes. Returns O, lse = m + log l (both read
    from HBM at the end, free) and the HBM traffic.
    """
    mem, N_q, N_k, d, M, scale = _prepare(q, k, v, M, causal, sm_scale)
    _tiled(mem, N_q, N_k, d, tiled_plan(N_q, N_k, d, M, blocks), causal, scale)
    lse = (mem.array("m") + np.log(mem.array("l")))[:, 0]
    return SimResult(mem.array("O"), lse, mem.counts())


def _accounting_memory(N_q, N_k, d, M) -> TwoLevelMemory:
    mem = TwoLevelMemory(M, execute=False)
    for name, shape in (("Q", (N_q, d)), ("K", (N_k, d)), ("V", (N_k, d))):
        mem.place(name, shape)
    return mem


def account_standard(N: int, d: int, M: int, causal: bool = False, N_k: int | None = None) -> IOCount:
    """Count the moves of Algorithm 0 tile by tile, without data (N = N_q; N_k defaults to N)."""
    N, N_k, d, M = _check_sizes(N, d, M, N_k)
    check_causal(causal)
    mem = _accounting_memory(N, N_k, d, M)
    _standard(mem, N, N_k, d, standard_plan(N, N_k, d, M), causal, 1.0)
    return mem.counts()


def account_tiled(N: int, d: int, M: int, causal: bool = False, N_k: int | None = None, blocks=None) -> IOCount:
    """Count the moves of Algorithm 1 tile by tile, without data (N = N_q; N_k defaults to N)."""
    N, N_k, d, M = _check_sizes(N, d, M, N_k)
    check_causal(causal)
    mem = _accounting_memory(N, N_k, d, M)
    _tiled(mem, N, N_k, d, tiled_plan(N, N_k, d, M, blocks), causal, 1.0)
    return mem.counts()


def standard_io(N: int, d: int, M: int, causal: bool = False, N_k: int | None = None) -> IOCount:
    """Exact HBM accesses of Algorithm 0 in this model (N = N_q; N_k defaults to N).

    With R = min(floor(M / 2(d + 1)), N_q) query rows per block, T_R = ceil(N_q / R) blocks, and p = 1
    softmax pass over S when a row fits in SRAM (N_k + 2 <= M), else p = 2:

        reads  = N_q d + 2 T_R N_k d + (p + 1) N_q N_k      (Q once, K and V per block, S p times, P once)
        writes = 2 N_q N_k + N_q d                          (S, P, O)

    which is Theta(N d + N^2) when M is at least about d^2 (the K and V rereads are 4 N^2 d^2 / M).
    ``causal`` changes nothing: Algorithm 0 materializes the masked S and P in full.
    """
    N_q, N_k, d, M = _check_sizes(N, d, M, N_k)
    check_causal(causal)
    plan = standard_plan(N_q, N_k, d, M)
    T_R = -(-N_q // plan.R)
    p = plan.softmax_passes
    reads = N_q * d + 2 * T_R * N_k * d + (p + 1) * N_q * N_k
    writes = 2 * N_q * N_k + N_q * d
    return IOCount(reads, writes, 4 * N_q * N_k * d)


def tiled_io(N: int, d: int, M: int, causal: bool = False, N_k: int | None = None, blocks=None) -> IOCount:
    """Exact HBM accesses of Algorithm 1 in this model (N = N_q; N_k defaults to N).

    Not causal, with T_c = ceil(N_k / B_c) passes of the outer loop:

        reads  = 2 N_k d + T_c N_q (2 d + 2)      (K, V once; Q, O, l, m once per pass)
        writes = (T_c + 1) N_q (d + 2)            (O, l, m initialized, then written once per pass)

    about 12 N^2 d^2 / M, i.e. Theta(N^2 d^2 / M). Causal: pass j (keys from j0 = j B_c) visits only
    the query blocks from row floor(j0 / B_r) B_r on, and passes with j0 >= N_q are skipped.
    """
    N_q, N_k, d, M = _check_sizes(N, d, M, N_k)
    check_causal(causal)
    plan = tiled_plan(N_q, N_k, d, M, blocks)
    B_c, B_r = plan.B_c, plan.B_r
    if not causal:
        T_c = -(-N_k // B_c)
        return IOCount(2 * N_k * d + T_c * N_q * (2 * d + 2), (T_c + 1) * N_q * (d + 2), 4 * N_q * N_k * d)
    reads, writes, flops = 0, N_q * (d + 2), 0
    for j0 in range(0, min(N_k, N_q), B_c):
        cols = min(B_c, N_k - j0)
        rows = N_q - (j0 // B_r) * B_r  # query rows of the blocks that reach key j0
        reads += 2 * cols * d + rows * (2 * d + 2)
        writes += rows * (d + 2)
        flops += 4 * rows * cols * d
    return IOCount(reads, writes, flops)


def standard_io_theta(N: int, d: int) -> float:
    """The paper's order for standard attention (Theorem 2): N d + N^2."""
    return float(N) * d + float(N) ** 2


def tiled_io_theta(N: int, d: int, M: int) -> float:
    """The paper's order for FlashAttention (Theorem 2): N^2 d^2 / M. It is also the lower bound of
    Proposition 3: no exact attention algorithm does o(N^2 d^2 / M) HBM accesses for all M in [d, N d]."""
    return float(N) ** 2 * d ** 2 / M


def block_sparse_io_theta(N: int, d: int, M: int, s: float) -> float:
    """The paper's order for block-sparse FlashAttention (Proposition 4): N d + N^2 d^2 s / M, where ``s``
    is the fraction of the blocks of the mask that are nonzero. The N d term is reading the inputs and
    writing the output once, which no mask removes; the second is :func:`tiled_io_theta` scaled by ``s``,
    because a zero block's tiles are never loaded. Taught in notebook ``10_dropout_masks_sparsity``."""
    N, d, M = check_positive_int("N", N), check_positive_int("d", d), check_positive_int("M", M)
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not 0.0 <= float(s) <= 1.0:
        raise ValueError(f"s (the fraction of nonzero blocks) must be a number in [0, 1], got {s!r}")
    return float(N) * d + tiled_io_theta(N, d, M) * float(s)


def loglog_slope(x, y) -> float:
    """The slope of the least-squares line through (log x, log y): the fitted exponent of y ~ x^s."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


__all__ = [
    "IOCount", "SimResult", "BlockSizes", "SRAMOverflowError", "TwoLevelMemory", "Tile",
    "block_sizes", "TiledPlan", "tiled_plan", "StandardPlan", "standard_plan",
    "simulate_standard", "simulate_tiled", "account_standard", "account_tiled",
    "standard_io", "tiled_io", "standard_io_theta", "tiled_io_theta", "block_sparse_io_theta", "loglog_slope",
]
