"""The features benchmark's FlexAttention masks are exactly ours: the blocks Flex visits (full or partial)
are the visible blocks of our block mask, with and without causality, on an uneven length. (The timings
themselves run on the GPU: python -m flashref.bench features.)"""

from __future__ import annotations

import pytest
import torch

from flashref import block_masks
from flashref.bench.features_bench import flex_block_mask


@pytest.mark.parametrize("pattern, causal", [("bigbird", False), ("window", True), ("causal", True)])
def test_flex_visits_exactly_our_blocks(pattern, causal):
    N, bs = 77, 16
    n = block_masks.n_blocks(N, bs)
    mask = {"bigbird": block_masks.bigbird(n, window=2, n_global=1, n_random=1, seed=3),
            "window": block_masks.sliding_window(n, window=2, causal=True),
            "causal": block_masks.causal_blocks(n)}[pattern]
    fbm = flex_block_mask(mask, N, bs, causal, compile_mask=False)
    visited = fbm.to_dense()[0, 0].bool()
    want = mask[0, 0] & (block_masks.causal_blocks(n)[0, 0] if causal else True)
    assert torch.equal(visited, want)


def test_append_adds_to_a_run_of_the_same_machine_and_refuses_another(tmp_path):
    import json

    from flashref.bench.features_bench import start_results

    fresh = start_results(None, "GPU A", {"torch": "1"}, "cmd --parts gqa")
    assert fresh["results"] == [] and fresh["command"] == "cmd --parts gqa"
    path = tmp_path / "features.json"
    path.write_text(json.dumps({**fresh, "seconds": 12.0, "results": [{"case": "gqa fwd+bwd"}]}))
    more = start_results(str(path), "GPU A", {"torch": "1"}, "cmd --parts flex")
    assert more["results"] == [{"case": "gqa fwd+bwd"}] and more["seconds"] == 12.0
    assert more["command"] == "cmd --parts gqa; cmd --parts flex"
    with pytest.raises(ValueError, match="GPU B"):
        start_results(str(path), "GPU B", {"torch": "1"}, "cmd --parts flex")
    assert start_results(str(tmp_path / "absent.json"), "GPU A", {}, "c")["results"] == []
