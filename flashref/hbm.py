"""HBM traffic of the GPU kernels as launched: what each kernel asks of memory, tile by tile.

``flashref.iomodel`` counts the traffic of the algorithms with an SRAM of M elements. The kernels fix
their tiles instead (BLOCK_M query rows, BLOCK_N key rows), so their traffic follows from the loops of
``flashref.triton``: every program loads its own tile once and walks the tiles of the other side that
it does not skip. These functions count those loads and stores in bytes, per kernel launch, for one
call on (B, H, N_q, N_k, d). Two numbers bracket what the hardware's DRAM counters can show:

- ``requested``: every load and store the kernel issues, as if no cache stood between SRAM and HBM.
  This is the IO model's count, with the kernel's own tile sizes.
- ``compulsory``: every byte the kernel touches, once. A GPU's L2 cache (50 MB on an H100) serves the
  repeated K/V reads of programs of the same head that run at the same time, so the measured traffic
  of the flash kernels falls between the two; plain attention's N x N matrices outgrow any L2, and it
  moves about ``requested`` bytes.

Masked rows (past N_q or N_k) are never loaded, so they are not counted. Element sizes: ``elem`` bytes
for Q, K, V, O and the gradients (2 for fp16/bf16, 4 for fp32); the per-row statistics (lse, m, log2 l,
D) are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashref.kernel_tiles import keys_visited
from flashref.validation import check_positive_int

STAT = 4  # bytes of one fp32 per-row statistic


@dataclass(frozen=True)
class Traffic:
    """Bytes read and written by one kernel launch: as issued (``requested``) and touched once (``compulsory``)."""
    kernel: str
    read: int
    write: int
    compulsory_read: int
    compulsory_write: int

    @property
    def total(self) -> int:
        return self.read + self.write

    @property
    def compulsory(self) -> int:
        return self.compulsory_read + self.compulsory_write


def _check(B, H, N_q, N_k, d, block_m, block_n, elem):
    for name, value in (("B", B), ("H", H), ("N_q", N_q), ("N_k", N_k), ("d", d), ("block_m", block_m),
                        ("block_n", block_n), ("elem", elem)):
        check_positive_int(name, value)


def _rows(start: int, stop: int, n: int) -> int:
    """How many of the rows [start, stop) exist (are < n)."""
    return max(0, min(stop, n) - start)


def flash_forward(B, H, N_q, N_k, d, block_m, block_n, causal=False, elem=2) -> Traffic:
    """``flash_fwd_kernel``: each program loads its Q tile once and the K and V rows it does not skip
    (causal: keys left of its last row), and stores its O tile and three fp32 numbers per row (lse,
    m, log2 l)."""
    _check(B, H, N_q, N_k, d, block_m, block_n, elem)
    read = write = touched_keys = 0
    for start_m in range(0, N_q, block_m):
        rows = _rows(start_m, start_m + block_m, N_q)
        keys = keys_visited(start_m, block_m, N_k, causal)
        read += rows * d * elem + 2 * keys * d * elem
        write += rows * (d * elem + 3 * STAT)
        touched_keys = max(touched_keys, keys)
    return Traffic("flash_fwd", B * H * read, B * H * write,
                   B * H * (N_q + 2 * touched_keys) * d * elem, B * H * write)


def flash_backward(B, H, N_q, N_k, d, dkdv_blocks, dq_blocks, causal=False, elem=2) -> list:
    """The three launches of the deterministic backward: ``flash_bwd_preprocess`` (D = rowsum(dO * O)),
    ``flash_bwd_dkdv`` (one program per K/V tile walks the query rows it does not skip, loading Q, dO and
    three statistics per row) and ``flash_bwd_dq`` (one program per Q tile walks the K/V rows it does not
    skip). ``dkdv_blocks`` and ``dq_blocks`` are each kernel's (BLOCK_M, BLOCK_N)."""
    (dkdv_m, dkdv_n), (dq_m, dq_n) = dkdv_blocks, dq_blocks
    _check(B, H, N_q, N_k, d, min(dkdv_m, dq_m), min(dkdv_n, dq_n), elem)
    row_q = 2 * d * elem + 3 * STAT  # Q, dO, and m, log2 l, D of one query row

    pre = Traffic("flash_bwd_preprocess", B * H * 2 * N_q * d * elem, B * H * N_q * STAT,
                  B * H * 2 * N_q * d * elem, B * H * N_q * STAT)

    read = 0
    for start_n in range(0, N_k, dkdv_n):
        keys = _rows(start_n, start_n + dkdv_n, N_k)
        first_query = start_n if causal else 0
        read += 2 * keys * d * elem + _rows(first_query, N_q, N_q) * row_q
    dkdv_write = B * H * 2 * N_k * d * elem
    dkdv = Traffic("flash_bwd_dkdv", B * H * read, dkdv_write,  # the program of keys 0.. reads every query row
                   B * H * (2 * N_k * d * elem + N_q * row_q), dkdv_write)

    read = touched_keys = 0
    for start_m in range(0, N_q, dq_m):
        rows = _rows(start_m, start_m + dq_m, N_q)
        keys = keys_visited(start_m, dq_m, N_k, causal)
        read += rows * row_q + 2 * keys * d * elem
        touched_keys = max(touched_keys, keys)
    dq_write = B * H * N_q * d * elem
    dq = Traffic("flash_bwd_dq", B * H * read, dq_write,
                 B * H * (N_q * row_q + 2 * touched_keys * d * elem), dq_write)
    return [pre, dkdv, dq]


def standard_forward(B, H, N_q, N_k, d, causal=False, elem=2) -> list:
    """Plain attention as ``flashref.bench.gpu_bench`` runs it in PyTorch, kernel by kernel: S = Q K^T,
    S * scale, (causal: S masked with a boolean N x N mask), P = softmax(S), O = P V. Each matrix product
    is counted as reading its operands once (cuBLAS tiles them, and L2 serves the rest); every N x N
    matrix is written by one kernel and read by the next. The mask's own construction (three small
    boolean kernels) is left out."""
    _check(B, H, N_q, N_k, d, 1, 1, elem)
    bh, nn = B * H, N_q * N_k * elem
    kernels = [("matmul QK^T", (N_q + N_k) * d * elem, nn), ("scale S", nn, nn)]
    if causal:
        kernels.append(("masked_fill S", nn + N_q * N_k, nn))  # the mask is one byte per element
    kernels += [("softmax", nn, nn), ("matmul PV", nn + N_k * d * elem, N_q * d * elem)]
    return [Traffic(name, bh * r, bh * w, bh * r, bh * w) for name, r, w in kernels]


def total(traffic) -> int:
    """Requested bytes of one launch or a list of launches."""
    return sum(t.total for t in ([traffic] if isinstance(traffic, Traffic) else traffic))
