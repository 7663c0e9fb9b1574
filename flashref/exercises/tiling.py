"""Checkers for the exercises of notebook ``03_tiled_forward``.

    from flashref.exercises import tiling as ex
    ex.check_causal_tiles(answer)

The expected values come from the package functions the notebook teaches
(:func:`flashref.numpy_flash.visited_tiles`, :func:`flashref.numpy_flash.tile_sram_bytes`), so the
exercises and the code cannot disagree.
"""

from __future__ import annotations

from flashref import numpy_flash
from flashref.exercises import Verdict, as_number, check_number, wrong

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

