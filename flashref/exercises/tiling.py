"""Checkers for the exercises of notebook ``03_tiled_forward``.

    from flashref.exercises import tiling as ex
    ex.check_causal_tiles(answer)

The expected values come from the package functions the notebook teaches
(:func:`flashref.numpy_flash.visited_tiles`, :func:`flashref.numpy_flash.tile_sram_bytes`), so the
exercises and the code cannot disagree.
"""

from __future__ import annotations

import numpy as np

from flashref import numpy_flash, reference
from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, as_number, check_number, right, wrong


#: Exercise "causal tiles": N = 1024, 64 query rows and 128 keys a tile.
CAUSAL_N, CAUSAL_BLOCK_Q, CAUSAL_BLOCK_K = 1024, 64, 128

#: Exercise "SRAM of a tile set": 32 x 32 tiles, head dimension 128, inputs in fp16, scores in fp32.
SRAM_BLOCK, SRAM_D = 32, 128


def expected_causal_tiles() -> int:
    return len(numpy_flash.visited_tiles(CAUSAL_N, CAUSAL_N, CAUSAL_BLOCK_Q, CAUSAL_BLOCK_K, causal=True))


def check_causal_tiles(answer) -> Verdict:
    """Tiles a causal forward visits at N = 1024 with 64 x 128 tiles."""
    expected = expected_causal_tiles()
    n_q, n_k = CAUSAL_N // CAUSAL_BLOCK_Q, CAUSAL_N // CAUSAL_BLOCK_K
    if answer is not None and as_number(answer) == n_q * n_k:
        return wrong(f"{n_q * n_k} is every tile of the {n_q} x {n_k} grid; causal skips those above the diagonal.")
    if answer is not None and as_number(answer) == n_k * (n_k + 1) // 2:
        return wrong("that counts square tiles; here a tile is 64 query rows by 128 keys, so each key block "
                     "spans two query blocks.")
    return check_number(answer, expected, what="the number of tiles visited",
                        hint=f"Query block i (rows 64 i .. 64 i + 63) needs key blocks j with 128 j <= 64 i + 63.",
                        explain=f"Query blocks 2 t and 2 t + 1 each need key blocks 0..t: 2 (1 + ... + 8) = "
                                f"{expected} of the {n_q * n_k} tiles.")


def expected_tile_set_bytes() -> int:
    parts = numpy_flash.tile_sram_bytes(SRAM_BLOCK, SRAM_BLOCK, SRAM_D, itemsize=2, acc_itemsize=4)
    return parts["Q_i"] + parts["K_j"] + parts["V_j"] + parts["S_ij"]


def check_tile_set_bytes(answer) -> Verdict:
    """Bytes of Q_i, K_j, V_j (32 x 128, fp16) and S_ij (32 x 32, fp32) together."""
    expected = expected_tile_set_bytes()
    value = as_number(answer)
    if value == 3 * SRAM_BLOCK * SRAM_D * 2:
        return wrong("that is Q_i, K_j and V_j; add the 32 x 32 score tile S_ij in fp32.")
    if value == 3 * SRAM_BLOCK * SRAM_D * 2 + SRAM_BLOCK * SRAM_BLOCK * 2:
        return wrong("S_ij is kept in fp32 (4 bytes a score), not fp16.")
    if value is not None and value * 1024 == expected:
        return wrong("that is the right size in KiB; give it in bytes.")
    return check_number(answer, expected, what="the bytes of the tile set",
                        hint="Three 32 x 128 tiles of 2 bytes, plus 32 x 32 scores of 4 bytes.",
                        explain=f"3 * 32 * 128 * 2 + 32 * 32 * 4 = {expected} bytes = {expected / 1024:g} KiB, "
                                "a small part of an SM's shared memory.")



def _tiled_cases():
    rng = np.random.default_rng(21)
    r = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    return [("N_q = 10, N_k = 13, blocks of 4 queries and 5 keys", r(10, 4), r(13, 4), r(13, 4), 4, 5),
            ("one query and one key", r(1, 4), r(1, 4), r(1, 4), 4, 5),
            ("scores of size 1e3, N_q = 7, N_k = 20, blocks 3 and 6", r(7, 4) * 30, r(20, 4) * 30, r(20, 4), 3, 6),
            ("N = 512 in blocks of 32 (the N x N scores would be 2 MiB)", r(512, 4), r(512, 4), r(512, 4), 32, 32)]


def check_tiled_forward(fn) -> Verdict:
    """``fn(q, k, v, block_q, block_k)`` must return attention's O for (N, d) arrays, not causal, computed
    in the FlashAttention-2 order: per block of queries, a pass over the blocks of keys with a running max
    and sum, never holding more than a block_q x block_k tile of scores (checked with tracemalloc)."""
    import tracemalloc

    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (tiled_forward), not {type(fn).__name__}.")
    for name, q, k, v, bq, bk in _tiled_cases():
        want = reference.attention(q, k, v)
        try:
            tracemalloc.start()
            with np.errstate(all="ignore"):
                result = fn(q.copy(), k.copy(), v.copy(), bq, bk)
            peak = tracemalloc.get_traced_memory()[1]
            if result is None:
                return Verdict(False, UNWRITTEN)
            got = np.asarray(result, dtype=np.float64)
        except Exception as exc:  # noqa: BLE001
            return wrong(f"on the case {name}: your function raised {type(exc).__name__}: {exc}")
        finally:
            tracemalloc.stop()
        if got.shape != want.shape:
            return wrong(f"on the case {name}: the output has shape {got.shape}, expected {want.shape}.")
        if not np.allclose(got, want, rtol=1e-9, atol=1e-12):
            if not np.all(np.isfinite(got)):
                return wrong(f"on the case {name}: NaN or inf in the output. Subtract the running max before exp.")
            try:
                with np.errstate(all="ignore"):
                    one_block = np.asarray(fn(q.copy(), k.copy(), v.copy(), bq, k.shape[0]), dtype=np.float64)
            except Exception:  # noqa: BLE001
                one_block = None
            if one_block is not None and np.allclose(one_block, want, rtol=1e-9, atol=1e-12):
                return wrong(f"on the case {name}: right with one block of keys, wrong with several: when the "
                             "running max grows, multiply the running sum l and the accumulator by "
                             "exp(m_old - m_new) before adding the new block.")
            d = q.shape[-1]
            for scale, what in ((1.0, "not scaled"), (1.0 / d, "scaled by 1/d")):
                if np.allclose(got, reference.attention(q, k, v, sm_scale=scale), rtol=1e-9, atol=1e-12):
                    return wrong(f"on the case {name}: the scores are {what}. S = Q K^T / sqrt(d).")
            return wrong(f"on the case {name}: the output differs from the reference by up to "
                         f"{np.max(np.abs(got - want)):.3g}. Divide the accumulator by l once, at the end.")
        if q.shape[0] * k.shape[0] >= 512 * 512 and peak >= q.shape[0] * k.shape[0] * 8 // 2:
            return wrong(f"on the case {name}: right, but your function allocated {peak / 2**20:.1f} MiB at once: "
                         "the N x N scores (or half of them) existed. Keep one block_q x block_k tile at a time.")
    return right("Your tiled forward is exact on every case, and never held the N x N scores.")
