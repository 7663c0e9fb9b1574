"""The mods benchmark's pure-Python parts, on the CPU: its visible-pair count against brute force, its document
lengths, the padded batch and its wasted work, the peers' masks and score mods (FlexAttention's, SDPA's, plain
PyTorch's) against the float64 reference's rule, the FLOPs a row divides by, and its command line. (The timings
themselves run on the GPU: python -m flashref.bench mods.)"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from flashref import reference as ref
from flashref.bench import mods_bench, results
from flashref.bench.mods_bench import (alibi_slopes, cu_seqlens, document_lengths, padded_work_ratio, pad_documents,
                                       visible_pairs)


def _brute_pairs(N_q, N_k, window_size, causal):
    left, right = window_size
    return sum(1 for i in range(N_q) for j in range(N_k)
               if (left < 0 or j >= i - left) and (right < 0 or j <= i + right) and (not causal or j <= i))


WINDOWS = [(-1, -1), (0, 0), (3, 0), (0, 2), (2, 5), (5, -1), (-1, 3), (100, 100)]


@pytest.mark.parametrize("window_size", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_is_the_brute_force_count(window_size, causal):
    for N_q, N_k in [(1, 1), (7, 7), (13, 5), (5, 13), (32, 32), (40, 17)]:
        assert visible_pairs(N_q, N_k, window_size, causal) == _brute_pairs(N_q, N_k, window_size, causal), (N_q, N_k)


def test_visible_pairs_of_the_benchmarked_masks():
    N = 4096
    assert visible_pairs(N, N, causal=True) == N * (N + 1) // 2
    assert visible_pairs(N, N) == N * N
    # Mistral's window of 1024 keys: a causal triangle over the first 1024 queries, then 1024 keys each
    assert visible_pairs(N, N, mods_bench.WINDOW, causal=True) == 1024 * 1025 // 2 + (N - 1024) * 1024
    with pytest.raises(ValueError, match="window_size"):
        visible_pairs(8, 8, (-2, 0))


def test_alibi_slopes_are_the_papers():
    assert alibi_slopes(8) == [2.0 ** -h for h in range(1, 9)]
    assert alibi_slopes(16) == pytest.approx([2.0 ** (-h / 2) for h in range(1, 17)], rel=1e-15)
    # not a power of two: those of 8 heads, then every other slope of 16 (the odd halves)
    odd_halves = [2.0 ** -(h - 0.5) for h in (1, 2, 3, 4)]
    assert alibi_slopes(12) == pytest.approx([2.0 ** -h for h in range(1, 9)] + odd_halves)
    assert alibi_slopes(1) == [2.0 ** -8]
    with pytest.raises(ValueError):
        alibi_slopes(0)


def test_document_lengths_are_seeded_sum_to_the_total_and_respect_the_bounds():
    lengths = document_lengths(65536, **mods_bench.DOCS)
    assert lengths == document_lengths(65536, **mods_bench.DOCS)
    assert lengths != document_lengths(65536, **{**mods_bench.DOCS, "seed": 1})
    assert sum(lengths) == 65536 and max(lengths) <= 8192
    assert min(lengths[:-1]) >= 16 and lengths[-1] >= 1
    assert 700 < 65536 / len(lengths) < 1300  # a mean of about 1K: the log-normal's mu is set from it
    clipped = document_lengths(200_000, mean=1024, max_len=1500, min_len=100, seed=3)
    assert sum(clipped) == 200_000 and max(clipped) == 1500 and min(clipped[:-1]) == 100  # both bounds bite
    assert document_lengths(5, mean=1024, max_len=8192) == [5]  # one document, cut to the total
    with pytest.raises(ValueError):
        document_lengths(100, min_len=10, max_len=5)


def test_cu_seqlens_are_the_cumulative_lengths():
    assert cu_seqlens([3, 1, 4]) == [0, 3, 4, 8]
    lengths = document_lengths(10_000, seed=2)
    cu = cu_seqlens(lengths)
    assert cu[-1] == 10_000 and np.diff(cu).tolist() == lengths


def test_padded_work_ratio():
    assert padded_work_ratio([64, 64, 64]) == 1.0
    assert padded_work_ratio([1, 3]) == pytest.approx(2 * 6 / (1 + 6))           # causal: n (n + 1) / 2 pairs
    assert padded_work_ratio([1, 3], causal=False) == pytest.approx(2 * 9 / (1 + 9))
    lengths = document_lengths(65536, **mods_bench.DOCS)
    N = max(lengths)
    assert padded_work_ratio(lengths) == pytest.approx(len(lengths) * N * (N + 1) / sum(n * (n + 1) for n in lengths))
    assert padded_work_ratio(lengths) > 2  # the long tail: padding to the longest document wastes most of the work


def test_the_padded_batch_holds_each_document_and_computes_the_packed_attention():
    lengths, H, d = [5, 11, 1, 8], 2, 4
    total, N = sum(lengths), max(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, H, d, generator=g, dtype=torch.float64) for _ in range(3))
    padded = [pad_documents(x, lengths, N) for x in (q, k, v)]
    assert padded[0].shape == (len(lengths), H, N, d) and padded[0].is_contiguous()
    cu = cu_seqlens(lengths)
    for b, n in enumerate(lengths):
        assert torch.equal(padded[0][b, :, :n], q[cu[b]:cu[b + 1]].transpose(0, 1))
        assert not padded[0][b, :, n:].any()
    # causal: the padding comes after every real query, so the real rows are the packed batch's attention
    o_padded = ref.attention(*(x.numpy() for x in padded), causal=True)
    o_packed = ref.attention_varlen(q.numpy(), k.numpy(), v.numpy(), np.array(cu), np.array(cu), causal=True)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(o_padded[b, :, :n], o_packed[cu[b]:cu[b + 1]].swapaxes(0, 1), atol=1e-12)


def _qkv(B=1, H=4, N=64, d=16):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, H, N, d, generator=g) for _ in range(3)]


def _reference(q, k, v, **kw):
    return torch.from_numpy(ref.attention(*(x.double().numpy() for x in (q, k, v)), **kw)).float()


def _flex(q, k, v, mask_mod, score_mod):
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = None if mask_mod is None else mods_bench.flex_block_mask(mask_mod, q.shape[2], "cpu", block_size=16)
    with warnings.catch_warnings():  # eager Flex on the CPU says it is unfused: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


@pytest.mark.parametrize("window_size, causal", [((7, 0), True), ((20, 0), True), ((5, 9), False), ((-1, 3), False),
                                                 ((-1, -1), True)])
def test_the_peers_windows_are_flashrefs(window_size, causal):
    q, k, v = _qkv()
    want = _reference(q, k, v, causal=causal, window_size=window_size)
    got_flex = _flex(q, k, v, mods_bench.flex_mask_mod(window_size, causal), None)
    mask = mods_bench.sdpa_window_mask(64, 64, window_size, causal)
    got_sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got_flex, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_sdpa, want, atol=1e-5, rtol=1e-5)
    assert int(mask.sum()) == visible_pairs(64, 64, window_size, causal)
    assert mods_bench.flex_mask_mod((-1, -1), causal=False) is None


def test_the_peers_softcaps_are_flashrefs():
    q, k, v = _qkv()
    q = q * 8  # large scores, so the cap bends them
    want = _reference(q, k, v, causal=True, softcap=2.0)
    assert not torch.allclose(want, _reference(q, k, v, causal=True), atol=1e-3)  # the cap changes the result
    got_flex = _flex(q, k, v, mods_bench.flex_mask_mod(causal=True), mods_bench.flex_score_mod(softcap=2.0))
    torch.testing.assert_close(got_flex, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mods_bench.softcap_attention(q, k, v, True, 2.0), want, atol=1e-5, rtol=1e-5)
    assert mods_bench.flex_score_mod() is None


def test_the_peers_alibi_biases_are_flashrefs():
    q, k, v = _qkv()
    slopes = torch.tensor(alibi_slopes(4), dtype=torch.float32)
    want = _reference(q, k, v, causal=True, alibi_slopes=slopes.numpy())
    got_flex = _flex(q, k, v, mods_bench.flex_mask_mod(causal=True), mods_bench.flex_score_mod(slopes=slopes))
    bias = mods_bench.alibi_bias(slopes, 64, 64, True, torch.float32)
    assert bias.shape == (1, 4, 64, 64) and bias[0, 1, 10, 3] == -slopes[1] * 7 and bias[0, 0, 3, 10] == -math.inf
    got_sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(got_flex, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_sdpa, want, atol=1e-5, rtol=1e-5)
    # without causality the keys after the query are penalized by their distance too: |i - j|
    want = _reference(q, k, v, alibi_slopes=slopes.numpy())
    got_flex = _flex(q, k, v, None, mods_bench.flex_score_mod(slopes=slopes))
    torch.testing.assert_close(got_flex, want, atol=1e-5, rtol=1e-5)
    bias = mods_bench.alibi_bias(slopes, 64, 64, False, torch.float32)
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias), want,
                               atol=1e-5, rtol=1e-5)
    # softcap and ALiBi together: capped first, then biased
    both = _reference(q * 8, k, v, causal=True, softcap=2.0, alibi_slopes=slopes.numpy())
    got = _flex(q * 8, k, v, mods_bench.flex_mask_mod(causal=True), mods_bench.flex_score_mod(2.0, slopes))
    torch.testing.assert_close(got, both, atol=1e-5, rtol=1e-5)


def test_a_row_counts_the_visible_pairs_of_its_whole_batch(monkeypatch):
    monkeypatch.setattr(mods_bench, "_time", lambda run, needs_grad, tensors: (2.0, 1234))
    fields = dict(part="window", B=4, H=16, N=8192, d=64, causal=True, window_size=[1023, 0])
    pairs = visible_pairs(8192, 8192, (1023, 0), causal=True)
    x = torch.zeros(1)
    rows = list(mods_bench._measure(fields, "flashref-triton", lambda: lambda q, k, v: q, (x, x, x), x, 4 * pairs))
    assert [(r["mode"], r["case"]) for r in rows] == [("fwd", "window fwd"), ("fwd+bwd", "window fwd+bwd")]
    for r, passes in zip(rows, (1.0, 3.5)):
        assert r["tflops"] == pytest.approx(passes * 4 * 64 * 4 * 16 * pairs / 2e-3 / 1e12)
        assert r["ms"] == 2.0 and r["peak_extra_bytes"] == 1234 and r["window_size"] == [1023, 0]
        assert (r["B"], r["H"], r["N"], r["d"], r["causal"]) == (4, 16, 8192, 64, True)
    varlen = dict(part="varlen", B=3, H=16, N=100, d=64, causal=True, tokens=150)
    rows = list(mods_bench._measure(varlen, "flashref-triton varlen", lambda: lambda q, k, v: q, (x, x, x), x, 999,
                                    tokens=150))
    assert rows[0]["tokens_per_s"] == pytest.approx(150 / 2e-3)
    assert rows[0]["tflops"] == pytest.approx(4 * 64 * 16 * 999 / 2e-3 / 1e12)


def test_a_peer_that_runs_out_of_memory_is_a_row():
    def make():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    fields = dict(part="softcap", B=2, H=16, N=16384, d=128, causal=True, softcap=30.0)
    rows = list(mods_bench._measure(fields, "plain", make, (None,) * 3, None, 1))
    assert [(r["case"], r["status"]) for r in rows] == [("softcap fwd", "OOM"), ("softcap fwd+bwd", "OOM")]
    assert all(r["N"] == 16384 and r["softcap"] == 30.0 and "ms" not in r for r in rows)
    rows = list(mods_bench._measure(fields, "flex", lambda: (_ for _ in ()).throw(ValueError("no\nmore")), (None,) * 3,
                                    None, 1))
    assert rows[0]["status"] == "ValueError: no"


def test_a_failed_mode_leaves_the_next_one_measured(monkeypatch, capsys):
    timings = iter([RuntimeError("CUDA out of memory."), (3.0, 10)])

    def fake_time(run, needs_grad, tensors):
        t = next(timings)
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(mods_bench, "_time", fake_time)
    fields = dict(part="alibi", B=1, H=16, N=4096, d=128, causal=True, alibi_slopes="2^(-8 h / H), h = 1..H")
    x = torch.zeros(1)
    rows = list(mods_bench._measure(fields, "sdpa attn_mask", lambda: lambda q, k, v: q, (x, x, x), x, 100))
    assert rows[0]["status"] == "OOM" and "ms" not in rows[0]
    assert rows[1]["ms"] == 3.0 and "status" not in rows[1]
    for r in rows:  # the table prints either
        mods_bench._print(r)
    out = capsys.readouterr().out.splitlines()
    assert "OOM" in out[0] and "3.000 ms" in out[1] and "N=4096" in out[1]


def test_parts_and_lengths_are_checked(capsys):
    args = mods_bench.parse_args([])
    assert args.parts == ["window", "window-kernels", "softcap", "alibi", "varlen"]
    assert args.n is None and not args.append
    assert mods_bench.parse_args(["--parts", "varlen", "alibi", "--n", "8192"]).parts == ["varlen", "alibi"]
    with pytest.raises(SystemExit) as e:
        mods_bench.parse_args(["--parts", "window", "gqa"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'gqa'" in err and "'window', 'window-kernels', 'softcap', 'alibi', 'varlen'" in err
    with pytest.raises(SystemExit):
        mods_bench.parse_args(["--n", "1000"])
    assert "--n [1000]: none of the lengths [4096, 8192, 16384]" in capsys.readouterr().err
    assert mods_bench.parse_args(["--parts", "varlen", "--n", "1000"]).n == [1000]  # varlen has no N grid


def test_the_suite_is_registered(monkeypatch):
    from flashref.bench import __main__ as bench_main

    seen = []
    monkeypatch.setattr(mods_bench, "main", lambda argv: seen.append(argv) or 0)
    assert bench_main.main(["mods", "--parts", "varlen"]) == 0 and seen == [["--parts", "varlen"]]


def test_the_bench_needs_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert mods_bench.main(["--out", str(tmp_path / "m.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err and not (tmp_path / "m.json").exists()


def test_load_results_reads_what_save_wrote(tmp_path):
    path = str(tmp_path / "mods_bench.json")
    data = {"device": "GPU A", "versions": {"torch": "1"}, "results": [{"case": "window fwd", "ms": 1.5}]}
    results.save(data, path)
    assert mods_bench.load_results(path) == data
    with pytest.raises(FileNotFoundError):
        mods_bench.load_results(str(tmp_path / "absent.json"))


def test_the_command_line_saves_and_appends(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU A")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(mods_bench, "window_cases",
                        lambda n: iter([{"part": "window", "case": "window fwd", "impl": "flex", "N": N} for N in n]))
    monkeypatch.setattr(mods_bench, "varlen_cases",
                        lambda: iter([{"part": "varlen", "case": "varlen fwd", "impl": "sdpa-flash padded"}]))
    out = str(tmp_path / "mods.json")
    assert mods_bench.main(["--out", out, "--parts", "window", "--n", "4096", "8192"]) == 0
    assert mods_bench.main(["--out", out, "--parts", "varlen", "--append"]) == 0
    saved = mods_bench.load_results(out)
    assert [(r["case"], r.get("N")) for r in saved["results"]] == [("window fwd", 4096), ("window fwd", 8192),
                                                                   ("varlen fwd", None)]
    assert saved["command"] == ("python -m flashref.bench mods --parts window --n 4096 8192; "
                                "python -m flashref.bench mods --parts varlen")
    # a part measured again at some lengths replaces those rows only
    assert mods_bench.main(["--out", out, "--parts", "window", "--n", "8192", "--append"]) == 0
    assert [(r["part"], r.get("N")) for r in mods_bench.load_results(out)["results"]] == [
        ("window", 4096), ("varlen", None), ("window", 8192)]
    assert saved["device"] == "GPU A" and saved["versions"] == results.versions() and saved["dtype"] == "float16"
    assert mods_bench.main(["--out", out, "--parts", "varlen"]) == 0  # no --append: a new file
    assert len(mods_bench.load_results(out)["results"]) == 1


def test_the_window_kernel_table_assembles_each_backward_from_its_kernels():
    rows = [{"part": "window-kernels", "N": 8192, "d": 128, "impl": impl, "ms": ms}
            for impl, ms in (("teaching dK/dV", 1.4), ("teaching dQ", 0.9), ("gluon dK/dV", 1.7), ("gluon dQ", 0.8),
                             ("D pre-pass", 0.1), ("flex backward", 2.2))]
    rows += [{"part": "window-kernels", "N": 8192, "d": 64, "impl": "teaching dQ", "status": "OOM"},
             {"part": "window", "N": 8192, "d": 128, "impl": "flex", "ms": 9.0}]
    lines = mods_bench.window_kernel_table(rows).splitlines()
    assert len(lines) == 2 and lines[1].split()[:2] == ["8192", "128"]
    numbers = [float(x) for x in lines[1].split()[2:]]
    assert numbers[:6] == [1.4, 0.9, 1.7, 0.8, 0.1, 2.2]
    assert numbers[6:] == [round(2.2 / 2.4, 2), round(2.2 / 2.3, 2), round(2.2 / 2.6, 2)]
    assert "Flex / ours" in lines[0] and "gluon dQ" in lines[0]
