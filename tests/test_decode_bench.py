"""The decode benchmark's pure-Python parts, on the CPU: the bytes a call moves, the grid, the peak bandwidth
by device name, and the table and figure drawn from a saved run (a synthetic one here). (The timings
themselves run on the GPU: python -m flashref.bench decode.)"""

from __future__ import annotations

import matplotlib
import pytest

from flashref.bench import decode_bench
from flashref.bench.decode_bench import (IMPLS, bytes_moved, graph_table, host_table, parse_args, peak_bandwidth, plot,
                                         points, speedup_table)

matplotlib.use("Agg")


def _synthetic():
    """A run's dict: every implementation at two batch sizes and two lengths, flashref-decode at full speed,
    the others slower by a known factor; one backend refused, one out of memory."""
    rows = []
    slower = {impl: 1.0 + i for i, impl in enumerate(IMPLS)}
    for B in (1, 16):
        for N_k in (4096, 65536):
            nbytes = bytes_moved(B, 32, 8, 1, N_k, 128)
            for impl in IMPLS[:-1]:
                row = dict(case="decode", impl=impl, B=B, H=32, H_kv=8, N_q=1, N_k=N_k, d=128, causal=False,
                           bytes=nbytes)
                if impl == "sdpa-efficient":
                    row["status"] = "refused: RuntimeError: No available kernel. Aborting execution."
                elif impl == "sdpa-math" and B == 16:
                    row["status"] = "OOM"
                else:
                    ms = 0.01 * N_k / 4096 * B * slower[impl]
                    row.update(status="ok", ms=ms, gb_per_s=nbytes / ms / 1e6, bw_fraction=nbytes / ms * 1e3 / 3.35e12,
                               peak_extra_bytes=1024, host_us=50.0 * slower[impl],
                               graph_us=ms * 1e3 * 0.9)
                rows.append(row)
    return {"device": "NVIDIA H100 80GB HBM3", "versions": {}, "command": "python -m flashref.bench decode",
            "peak_bytes_per_s": 3.35e12, "results": rows}


def test_bytes_moved_counts_kv_once_per_group():
    # K and V: 2 B H_kv N_k d fp16 numbers; q and o: 2 B H N_q d
    assert bytes_moved(1, 32, 8, 1, 4096, 128) == 2 * (2 * 8 * 4096 * 128 + 2 * 32 * 128)
    assert bytes_moved(4, 32, 32, 16, 1024, 64, elem_bytes=4) == 4 * 4 * (2 * 32 * 1024 * 64 + 2 * 32 * 16 * 64)
    # grouped-query attention reads a quarter of the K/V bytes of multi-head attention at H = 32, H_kv = 8
    mha, gqa = bytes_moved(1, 32, 32, 1, 65536, 128), bytes_moved(1, 32, 8, 1, 65536, 128)
    assert 3.99 < mha / gqa <= 4


def test_the_grid():
    full, quick = points(), points(quick=True)
    assert len(full) == 2 * 3 * 4 + 1 and len(quick) == 2 * 2 * 2 + 1
    assert {p[1] for p in full} == {1, 16} and {p[2] for p in full} == {4096, 16384, 65536, 131072}
    assert full[-1] == decode_bench.MHA_POINT and all(p[0] == 8 for p in full[:-1])
    assert points(n_ks=[1024], batches=[2])[:2] == [(8, 1, 1024, 2), (8, 16, 1024, 2)]
    args = parse_args(["--quick", "--impls", "sdpa-math", "flashref-triton"])
    assert args.quick and args.out == "book/data/decode_bench.json"
    assert args.impls == ["flashref-decode", "flashref-triton", "sdpa-math"]  # ours first, in IMPLS order
    with pytest.raises(SystemExit):
        parse_args(["--impls", "xformers"])


def test_peak_bandwidth_by_name():
    assert peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert peak_bandwidth("NVIDIA H200") == 4.8e12
    assert peak_bandwidth("NVIDIA GH200 480GB") == 4.0e12  # contains "H200": the longer key must win
    assert peak_bandwidth("Tesla T4") == 0.32e12
    assert peak_bandwidth("some future GPU") == decode_bench.DEFAULT_PEAK


def test_speedup_table_from_a_saved_run():
    data = _synthetic()
    table = speedup_table(data["results"])
    lines = table.splitlines()
    assert "unsplit" in lines[0] and "triton" in lines[0] and "efficient" in lines[0] and "decode" not in lines[0]
    assert len(lines) == 1 + 4
    first = lines[1].split()
    # flashref-decode at slowdown 1, num_splits=1 at 2, flashref-triton at 3, sdpa-flash 4, cudnn 5: speedups
    assert first[:4] == ["1", "8", "1", "4096"] and first[7:10] == ["2.00", "3.00", "4.00"]
    assert "refused" in lines[1] and "OOM" in lines[-1] and "OOM" not in lines[1]


def test_plot_from_a_saved_run(tmp_path):
    data = _synthetic()
    fig = plot(data, path=tmp_path / "decode.png")
    assert len(fig.axes) == 2 and (tmp_path / "decode.png").exists()
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[0] == "flashref-decode" and "sdpa-efficient" not in labels  # refused: no line
    assert "sdpa-math" in labels and "sdpa-math" not in [line.get_label() for line in fig.axes[1].get_lines()]
    x, y = fig.axes[0].get_lines()[0].get_data()
    assert list(x) == [4096, 65536] and all(0 < f <= 1 for f in y)
    matplotlib.pyplot.close(fig)


def test_host_table_from_a_saved_run():
    lines = host_table(_synthetic()["results"]).splitlines()
    assert len(lines) == 1 + 4 and "decode us, host" in lines[0] and "flash us, host" in lines[0]
    # B = 1, N_k = 4096: decode 10 us on the GPU and 50 us of host time; sdpa-flash (4x slower) 40 and 200
    assert lines[1].split() == ["1", "4096", "10,", "50", "40,", "200", "50,", "250"]


def test_graph_table_from_a_saved_run():
    lines = graph_table(_synthetic()["results"]).splitlines()
    assert len(lines) == 1 + 4 and "decode graph us" in lines[0] and "cudnn / decode" in lines[0]
    # B = 1, N_k = 4096: graph times 9 us (decode), 36 (flash: 4x), 45 (cudnn: 5x); the ratios follow
    assert lines[1].split() == ["1", "4096", "9.0", "36.0", "45.0", "4.00", "5.00"]
    rows = [dict(r, graph_us=None) if r["impl"] == "sdpa-cudnn" else r for r in _synthetic()["results"]]
    assert graph_table(rows).splitlines()[1].split() == ["1", "4096", "9.0", "36.0", "-", "4.00", "-"]


def test_the_split_sweep_times_flash_decode_at_each_fixed_number_of_splits():
    """``--num-splits`` adds one flash_decode per number of splits, named by :func:`split_impl`; each computes
    what the chosen split does (in the interpreter on CPU tensors here, compiled on a GPU machine)."""
    import torch

    from flashref.triton.decode import flash_decode
    from tests._triton_helpers import DEVICE

    args = parse_args(["--num-splits", "8", "32", "--impls", "sdpa-cudnn"])
    assert args.num_splits == [8, 32] and args.impls == ["flashref-decode", "sdpa-cudnn"]
    with pytest.raises(SystemExit):
        parse_args(["--num-splits", "0"])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 2, 150, 32, generator=g).to(DEVICE) for _ in range(2))
    seqlens = torch.tensor([150, 77], dtype=torch.int32, device=DEVICE)
    fns = decode_bench.implementations(1, 150, False, seqlens, impls=["flashref-decode"], splits=(1, 3))
    assert list(fns) == ["flashref-decode", decode_bench.split_impl(1), decode_bench.split_impl(3)]
    want = flash_decode(q, k, v, seqlens)
    for name, fn in fns.items():
        torch.testing.assert_close(fn(q, k, v), want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_graph_time_is_the_kernels_time_without_the_host():
    """On the GPU: a decode call's time from CUDA-graph replay is positive and at most do_bench's (which adds the
    host's time where the host is the slower), and a backend that cannot be captured gives None, not an error."""
    import torch

    from flashref.bench.features_bench import _time
    from flashref.triton import flash_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    call = lambda: flash_decode(q, k, v, check_finite=False)  # noqa: E731
    call()
    graph_us = decode_bench.graph_time_us(call)
    ms, _ = _time(call, False, None)
    assert graph_us is not None and 0 < graph_us <= ms * 1e3 * 1.1

    def not_capturable():
        torch.cuda.synchronize()  # synchronizing is not allowed while a stream is captured
        return q * 2

    assert decode_bench.graph_time_us(not_capturable) is None


def test_windows_are_taken_in_turn():
    """Every implementation's later windows come in turn (A B C, A B C), after each has its first; one that
    raises keeps what it has while the others go on."""
    order, errors = [], []

    def timer(name, fail_at=None):
        def take():
            order.append(name)
            if fail_at is not None and order.count(name) == fail_at:
                raise RuntimeError("out of memory")
            return float(len(order))
        return take

    windows = {"a": [0.5], "b": [0.5], "c": [0.5]}
    decode_bench.in_turn({"a": timer("a"), "b": timer("b", fail_at=1), "c": timer("c")}, windows, 3,
                         on_error=lambda impl, exc: errors.append((impl, str(exc))))
    assert order == ["a", "b", "c", "a", "b", "c"]
    assert windows == {"a": [0.5, 1.0, 4.0], "b": [0.5, 5.0], "c": [0.5, 3.0, 6.0]}
    assert errors == [("b", "out of memory")]
    assert decode_bench.in_turn({"a": timer("a")}, {"a": [1.0]}, 1) == {"a": [1.0]}  # one round: the first only


def test_a_pinned_backend_can_be_entered_for_every_window():
    """Each timing window enters the SDPA backend's context anew: one ``sdpa_kernel`` context can be entered only
    once, so ``fn.backend`` makes a fresh one each time (a GPU run once found every later window of the
    pinned backends lost to a spent context)."""
    torch = pytest.importorskip("torch")
    fns = decode_bench.implementations(1, 64, False, None, ["sdpa-math", "flashref-decode"])
    q = torch.randn(1, 2, 1, 16)
    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    for _ in range(3):
        with decode_bench._backend(fns["sdpa-math"]):
            fns["sdpa-math"](q, k, v)
    with decode_bench._backend(fns["flashref-decode"]), decode_bench._backend(fns["flashref-decode"]):
        pass  # no backend: nothing to pin


@pytest.mark.gpu
def test_a_point_times_each_implementation_in_rounds():
    """On the GPU: each row of a point that ran holds ROUNDS windows and their median as ``ms``; flash_decode gets
    the dense cache, as the peers do, and agrees with them."""
    import statistics

    rows = list(decode_bench.measure_point(8, 1, 4096, 2, impls=["flashref-decode", "sdpa-cudnn", "sdpa-flash"]))
    ran = [r for r in rows if r.get("status") == "ok"]
    assert any(r["impl"] == "flashref-decode" for r in ran) and len(ran) >= 2
    for r in ran:
        assert "rounds_status" not in r, r["rounds_status"]
        assert len(r["ms_rounds"]) == decode_bench.ROUNDS and r["ms"] == statistics.median(r["ms_rounds"])
        if r["impl"] != "flashref-decode":  # each peer's output is compared with flash_decode's
            assert r["max_abs_diff_vs_decode"] < 1e-3, r


def test_append_replaces_a_point_measured_again(monkeypatch, tmp_path):
    import torch

    from flashref.bench import results

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    calls, stamps = [], iter(range(1, 1000))

    def fake_point(H_kv, N_q, N_k, B, impls, peak_bw=None, splits=()):
        calls.append((H_kv, N_q, N_k, B))
        for impl in impls:
            yield dict(case="decode", impl=impl, B=B, H=32, H_kv=H_kv, N_q=N_q, N_k=N_k, d=128, causal=False,
                       bytes=1, status="ok", ms=float(next(stamps)), gb_per_s=1.0, bw_fraction=0.5,
                       peak_extra_bytes=0)

    monkeypatch.setattr(decode_bench, "measure_point", fake_point)
    out = str(tmp_path / "decode.json")
    assert decode_bench.main(["--out", out, "--n-k", "4096", "16384", "--b", "1", "--impls", "sdpa-cudnn"]) == 0
    first = results.load("decode.json", out)["results"]
    calls.clear()
    assert decode_bench.main(["--out", out, "--n-k", "4096", "--b", "1", "4", "--impls", "sdpa-cudnn", "--append"]) == 0
    saved = results.load("decode.json", out)["results"]
    keys = [decode_bench.point_key(r) for r in saved]
    assert len(keys) == len(set(keys))  # no point twice
    again = {decode_bench.point_key(r): r["ms"] for r in saved}
    kept = {decode_bench.point_key(r): r["ms"] for r in first}
    measured_again = {(H_kv, N_q, N_k, B) for H_kv, N_q, N_k, B in calls}
    assert measured_again and set(kept) - {k for k in kept if k[:4] in measured_again}  # some of each
    for key, ms in kept.items():
        if key[:4] in measured_again:
            assert again[key] != ms  # measured again: the new row
        else:
            assert again[key] == ms  # not measured again: kept as it was
    assert set(again) > set(kept)  # new points (B 4): added
