"""The teaching helpers of notebook 06: excerpt markers in the CUDA sources, and the figures
(flashref.cupy.teaching, flashref.cupy.figures). CPU only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from flashref.cupy import config, figures, teaching

matplotlib.use("Agg")
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_cupy_kernel.ipynb"


@pytest.mark.parametrize("kernel", config.KERNELS)
def test_markers_are_balanced_and_unique(kernel):
    """excerpt_spans raises on an unclosed, unopened, doubled or malformed marker: it must not here."""
    spans = teaching.excerpt_spans(kernel)
    assert spans, f"{kernel} has no excerpt markers"
    lines = config.source(kernel).splitlines()
    opened = [line for line in lines if re.match(r"^\s*// \[excerpt: ", line)]
    closed = [line for line in lines if re.match(r"^\s*// \[/excerpt: ", line)]
    assert len(opened) == len(closed) == len(spans)
    for name, (start, end) in spans.items():
        body = teaching.excerpt(kernel, name)
        assert body.strip() and start < end, name
        assert "[excerpt" not in body and "[/excerpt" not in body, name


def _notebook_excerpts():
    nb = json.loads(NOTEBOOK.read_text())
    calls = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            calls += re.findall(r"show_cuda\(\s*\"(\w+)\"\s*(?:,\s*\"([\w-]+)\")?\s*\)", "".join(cell["source"]))
    return calls


def test_the_notebook_names_exist():
    calls = _notebook_excerpts()
    assert len(calls) >= 10
    for kernel, name in calls:
        assert kernel in config.KERNELS
        if name:
            teaching.excerpt(kernel, name)   # raises if missing


def test_missing_name_lists_the_names():
    with pytest.raises(ValueError, match=r"flash_mma.cu has no excerpt 'nope'; it has: constants, mma,"):
        teaching.excerpt("mma", "nope")
    with pytest.raises(ValueError, match="kernel must be one of"):
        teaching.excerpt("naive", "scores")


def test_unbalanced_markers_are_reported(monkeypatch):
    bad = {"unclosed": "// [excerpt: a]\nx\n", "unopened": "x\n// [/excerpt: a]\n",
           "twice": "// [excerpt: a]\n// [/excerpt: a]\n// [excerpt: a]\n// [/excerpt: a]\n",
           "malformed": "// [excerpt a]\n"}
    messages = {"unclosed": "never closed", "unopened": "not opened", "twice": "second time", "malformed": "malformed"}
    for case, text in bad.items():
        monkeypatch.setattr(teaching, "source", lambda kernel, text=text: text)
        with pytest.raises(ValueError, match=messages[case]):
            teaching.excerpt_spans("tiled")


def test_listing_is_the_source_without_markers():
    text = teaching.listing("wmma")
    assert "flash_wmma_forward" in text and "[excerpt" not in text
    assert len(text.splitlines()) == len(config.source("wmma").rstrip().splitlines()) - 2 * len(
        teaching.excerpt_spans("wmma"))


def test_bank_conflict_ways():
    assert teaching.bank_conflict_ways([tx * 64 for tx in range(16)]) == 16
    assert teaching.bank_conflict_ways([tx * 65 for tx in range(16)]) == 1
    assert teaching.bank_conflict_ways([7] * 32) == 1   # a broadcast


def test_accumulator_layout_is_ptx_s():
    """mma.sync's documented m16n8 fp32 accumulator layout: lane 4g + t holds rows g and g + 8, columns
    2t and 2t + 1 (and so does the kernel's epilogue and softmax)."""
    owner = figures.mma_fragment_owner("C")
    for lane in range(32):
        g, t = divmod(lane, 4)
        held = {(int(r), int(c)) for r, c in zip(*np.nonzero(owner == lane))}
        assert held == {(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)}
    # the A operand is two accumulator tiles side by side: P_ij goes from S_ij's registers to A unmoved
    assert np.array_equal(figures.mma_fragment_owner("A"), np.hstack([owner, owner]))
    b = figures.mma_fragment_owner("B")
    assert all(np.sum(b == lane) == 4 for lane in range(32)) and b[0, 1] == 4 and b[2, 0] == 1
    with pytest.raises(ValueError, match="operand"):
        figures.mma_fragment_owner("D")


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [ax.get_title() for ax in fig.axes]


def test_fragment_layout_figure_labels_every_lane():
    fig = figures.fragment_layout_figure()
    assert len(fig.axes) == 3
    for ax, operand in zip(fig.axes, "ABC"):
        owner = figures.mma_fragment_owner(operand)
        labels = [t.get_text() for t in ax.texts]
        assert len(labels) == owner.size and sorted(set(labels), key=int) == [str(n) for n in range(32)]
        assert labels == [str(lane) for lane in owner.ravel()]


def test_memory_path_figure_shows_every_tile():
    fig = figures.memory_path_figure()
    assert len(fig.axes) == 3
    for ax, kernel in zip(fig.axes, ("tiled", "wmma", "mma")):
        texts = [t.get_text() for t in ax.texts]
        for level in figures.LEVELS:
            assert level in texts
            for name, _ in figures.TILE_HOMES[kernel][level]:
                assert name in texts, (kernel, level, name)
    homes = {k: {name: level for level, tiles in v.items() for name, _ in tiles} for k, v in figures.TILE_HOMES.items()}
    assert homes["tiled"]["$S_{ij}$"] == "registers" and homes["wmma"]["$S_{ij}$"] == "shared memory"
    assert homes["wmma"]["$O_i$"] == "shared memory" and homes["mma"]["$O_i$"] == "registers"


def test_warp_partition_figure():
    fig = figures.warp_partition_figure(warps=4)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 2 and "split-K" in titles[0] and "split-Q" in titles[1]
    texts = _texts(fig)
    assert all(f"warp {n}" in texts for n in range(4))
    assert any("__syncthreads" in t for t in texts)
