"""The ring benchmark's pure-Python parts, on the CPU, from a synthetic result: its tables, the longest fit,
the trace's reduction, overlap and timeline plot, and its command line; then the whole run rehearsed on two CPU
ranks (python -m flashref.bench ring --device cpu). The measurements themselves need several GPUs."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from flashref.bench import ring_bench  # noqa: E402
from flashref.bench.ring_bench import (longest_fit, longest_table, overlap_fraction, plot_timeline,  # noqa: E402
                                       reduce_chrome_trace, scaling_table)


def _data():
    rows = []
    for causal in (False, True):
        for N in (32768, 65536):
            one = ring_bench._scaling_row("flashref-triton 1 GPU", 1, N, causal, 100.0 * N / 32768, 2**30)
            ring = ring_bench._scaling_row("ring 2 GPUs", 2, N, causal, 55.0 * N / 32768, 2**29)
            ring["speedup"] = one["ms"] / ring["ms"]
            rows += [one, ring]
    rows.append({"part": "scaling", "impl": "ring 2 GPUs", "gpus": 2, "N": 131072, "causal": True, "status": "OOM"})
    for gpus, fits in ((1, 3), (2, 4)):
        for i in range(fits + 1):
            N = 262144 << i
            peak = (i + 1) * 2**33 if i < fits else None
            rows.append(ring_bench._probe_row("x", gpus, N, "ok" if i < fits else "OOM", (peak // 2 if peak else None,
                                                                                       peak)))
    trace = {"N": 131072, "causal": True, "gpus": 2, "rank": 0, "span_us": 1000.0,
             "events": [[7, "flash_fwd_kernel", 0.0, 400.0], [7, "elementwise_kernel", 400.0, 10.0],
                        [7, "flash_bwd_dkdv_kernel", 410.0, 500.0],
                        [23, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 100.0, 200.0],
                        [23, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 900.0, 100.0]]}
    return {"device": "NVIDIA H200", "results": rows, "trace": trace}


def test_scaling_rows_count_tokens_and_the_whole_sequences_flops():
    row = ring_bench._scaling_row("ring 2 GPUs", 2, 65536, True, 250.0, 123)
    assert row["tokens_per_s"] == pytest.approx(65536 / 0.25)
    work = 3.5 * 4 * 16 * 65536 * 65536 * 128 / 2  # forward + backward, causal: half the pairs
    assert row["tflops"] == pytest.approx(work / 0.25 / 1e12, rel=1e-3)
    assert row["tflops_per_gpu"] == pytest.approx(row["tflops"] / 2)


def test_scaling_table():
    text = scaling_table(_data()["results"])
    lines = text.splitlines()
    assert "1 GPU ms" in lines[0] and "2 GPUs ms" in lines[0] and "speedup" in lines[0]
    assert len(lines) == 1 + 5  # (causal, N) points: 2 x 2, and the OOM one
    assert "1.82" in lines[1]  # 100 / 55
    assert "OOM" in lines[-1]


def test_longest_fit_and_table():
    rows = _data()["results"]
    assert longest_fit(rows) == {1: (262144 << 2, 3 * 2**33), 2: (262144 << 3, 4 * 2**33)}
    text = longest_table(rows)
    assert "longest on 1 GPU: N = 1048576 (1024K tokens), 24.0 GiB per GPU" in text
    assert "longest on 2 GPUs: N = 2097152" in text
    assert text.count("OOM") == 2


def test_overlap_fraction():
    trace = _data()["trace"]
    # NCCL runs 100-300 (all of it beside flash_fwd) and 900-1000 (beside flash_bwd_dkdv up to 910): 210 of 300
    assert overlap_fraction(trace) == pytest.approx(210 / 300)
    assert overlap_fraction(_data()) == overlap_fraction(trace)
    assert overlap_fraction({"events": [[7, "k", 0.0, 5.0]]}) == 0.0
    assert ring_bench.is_communication("ncclKernel_SendRecv_RING") and not ring_bench.is_communication("flash_fwd_kernel")


def test_plot_timeline_draws_one_row_per_stream():
    import matplotlib.pyplot as plt

    fig = plot_timeline(_data())
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["stream 7 (compute)", "stream 23 (NCCL)"]
    assert "70% of NCCL time overlaps compute" in ax.get_title()
    colors = {tuple(c.get_facecolor()[0][:3]) for c in ax.collections}
    assert len(colors) == 2, "compute and communication in two colours"
    plt.close(fig)


def test_plot_scaling_draws_both_sides_and_the_ideal():
    import matplotlib.pyplot as plt

    fig = ring_bench.plot_scaling(_data())
    assert [ax.get_title() for ax in fig.axes] == ["non-causal", "causal (zigzag layout)"]
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["1 GPU", "ring, 2 GPUs", "2 x one GPU"]
    speedups = [t.get_text() for t in fig.axes[1].texts]
    assert speedups == ["1.82x", "1.82x"]  # the OOM point draws nothing
    plt.close(fig)


def test_reduce_chrome_trace():
    raw = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 3},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 1010.5, "dur": 40, "args": {"stream": 7, "device": 0}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv" + "x" * 200, "ts": 1000, "dur": 90,
         "args": {"stream": 23, "device": 0}},
        {"ph": "X", "cat": "kernel", "name": "other_gpu", "ts": 900, "dur": 1, "args": {"stream": 7, "device": 1}},
    ]}
    events = reduce_chrome_trace(raw, device=0)
    assert events == [[23, "ncclDevKernel_SendRecv" + "x" * 58, 0.0, 90.0], [7, "flash_fwd_kernel", 10.5, 40.0]]
    assert len(reduce_chrome_trace(raw)) == 3
    assert reduce_chrome_trace({"traceEvents": []}) == []


def test_command_line():
    args = ring_bench.parse_args([])
    assert args.out == "book/data/ring_bench.json" and args.parts == list(ring_bench.PARTS)
    assert ring_bench.parse_args(["--n", "65536", "--parts", "trace"]).n == [65536]
    with pytest.raises(SystemExit):
        ring_bench.parse_args(["--n", "1000"])


def test_the_whole_run_rehearses_on_cpus(tmp_path):
    """Every step of the GPU run (the 1-GPU worker, autotuning and pinning, the ring's workers and their gloo
    agreement, the trace, the longest probes, the speedups, the file) on two CPU ranks, tiny shapes."""
    from flashref.triton import interpreter_problem

    problem = interpreter_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "ring.json"
    assert ring_bench.main(["--device", "cpu", "--out", str(out)]) == 0
    data = ring_bench.load_results(str(out))
    assert "rehearsal" in data["device"] and data["gpus"] == 2 and data["pinned_configs"] == {}
    assert data["nccl"] is None  # gloo
    rows = data["results"]
    assert all(r["status"] == "ok" for r in rows), rows
    N = ring_bench.REHEARSAL["lengths"][0]
    scaling = {(r["gpus"], r["causal"]): r for r in rows if r["part"] == "scaling"}
    assert sorted(scaling) == [(1, False), (1, True), (2, False), (2, True)]
    for causal in (False, True):
        one, ring = scaling[(1, causal)], scaling[(2, causal)]
        assert one["N"] == ring["N"] == N and one["H"] == ring_bench.REHEARSAL["H"]
        assert ring["speedup"] == pytest.approx(one["ms"] / ring["ms"])
        assert one["peak_bytes"] is None  # no allocator to ask on the CPU
    fits = ring_bench.longest_fit(rows)
    assert {g: n for g, (n, _) in fits.items()} == {1: 256, 2: 256}
    trace = data["trace"]
    assert (trace["N"], trace["gpus"], trace["causal"]) == (ring_bench.REHEARSAL["trace_n"], 2, True)
    assert trace["events"] == []  # the interpreter launches no GPU kernels
    assert "2 GPUs ms" in scaling_table(rows)


def _report_visible_gpus(out):
    """A worker for :func:`ring_bench._run`: the CUDA devices its environment lets it see."""
    out.put(("visible", os.environ.get("CUDA_VISIBLE_DEVICES")))
    out.put(("done", 0))


def test_a_rehearsal_hides_the_gpus_from_its_workers(monkeypatch):
    """On a machine with GPUs the rehearsal's workers must not see them: flashref.triton would compile its kernels
    for the GPU and refuse the rehearsal's CPU tensors (seen on an H200 before this). The parent's environment is
    left as it was, and a measuring run's workers see what the parent sees."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    seen = []
    assert ring_bench._run([(_report_visible_gpus, ())], seen.append, timeout=120, hide_gpus=True) == []
    assert seen == [("visible", "")] and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    seen.clear()
    assert ring_bench._run([(_report_visible_gpus, ())], seen.append, timeout=120) == []
    assert seen == [("visible", "0,1")]


def test_plan_of_the_command_line():
    plan = ring_bench.plan_of(ring_bench.parse_args([]))
    assert (plan.device, plan.H, plan.d, plan.lengths) == ("cuda", 16, 128, tuple(ring_bench.LENGTHS))
    cpu = ring_bench.parse_args(["--device", "cpu", "--n", "256", "--parts", "scaling"])
    assert cpu.out.endswith("flashref_ring_rehearsal.json")
    plan = ring_bench.plan_of(cpu)
    assert (plan.H, plan.d, plan.lengths, plan.parts) == (2, 16, (256,), ("scaling",))
    with pytest.raises(SystemExit):
        ring_bench.parse_args(["--gpus", "0"])


def test_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert ring_bench.main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_probe_lengths_grow_by_quarter_doublings():
    from flashref.bench.ring_bench import probe_lengths

    Ns = probe_lengths(262144, 1 << 21, 4)
    assert Ns[0] == 262144 and Ns[-1] == 1 << 21 and (1 << 19) in Ns and (1 << 20) in Ns
    assert len(Ns) == 13 and all(b > a for a, b in zip(Ns, Ns[1:]))
    assert all(N % 16384 == 0 for N in Ns)  # whole zigzag chunks for up to 8 ranks at every N
    assert all(b / a < 2 ** 0.3 for a, b in zip(Ns, Ns[1:]))  # a step is a quarter doubling, rounded
    assert probe_lengths(128, 256, 4) == [128, 192, 256]  # the rehearsal's: multiples of 64, no repeats
    assert probe_lengths(128, 256, 1) == [128, 256]


def test_next_probe_climbs_the_ladder_then_bisects_the_gap():
    from flashref.bench.ring_bench import next_probe, probe_lengths

    ladder = probe_lengths(262144, 1 << 23, 4)
    limit = 4_600_000  # what "fits"

    def run(refine):
        tried = {}
        while (N := next_probe(tried, 262144, 1 << 23, 4, refine)) is not None:
            assert N not in tried
            tried[N] = N <= limit
        return tried

    tried = run(3)
    climbed = [N for N in ladder if N <= 4980736]
    assert list(tried)[:len(climbed)] == climbed  # up the ladder to the first that does not fit ...
    bisected = list(tried)[len(climbed):]
    assert len(bisected) == 3 and all(N % 16384 == 0 for N in bisected)  # ... then three halvings of the gap
    best = max(N for N, ok in tried.items() if ok)
    worst = min(N for N, ok in tried.items() if not ok)
    assert best <= limit < worst and worst - best <= (4980736 - 4194304) / 8 + 16384
    assert list(run(0)) == climbed  # no refinement: the ladder alone
    assert next_probe({262144: False}, 262144, 1 << 23, 4, 3) is None  # nothing fits: nothing to bisect
    assert next_probe({N: True for N in ladder}, 262144, 1 << 23, 4, 3) is None  # everything fits
    assert next_probe({128: True, 192: False}, 128, 256, 4, 3) is None  # a gap of one quantum: done


def test_longest_table_counts_the_peaks_in_shard_tensors():
    from flashref.bench.ring_bench import _probe_row

    G = 2**30
    one = _probe_row("1 GPU", 1, 262144, "ok", (5 * G, 8 * G))  # shard = 16 heads x 256K x 128 x 2 bytes = 1 GiB
    ring = _probe_row("ring", 2, 262144, "ok", (int(5.5 * G), 12 * G // 2))
    oom = _probe_row("ring", 2, 524288, "OOM")
    assert one["shard_bytes"] == G and ring["shard_bytes"] == G // 2
    assert one["peak_bytes"] == 8 * G and oom["peak_bytes"] is None
    lines = longest_table([one, ring, oom]).splitlines()
    assert "shard tensors" in lines[0]
    assert lines[1].split()[-2:] == ["5.0,", "8.0"] and lines[2].split()[-2:] == ["11.0,", "12.0"]
    assert lines[3].split()[-1] == "-"


def test_a_ring_probe_that_never_answered_is_recorded():
    from flashref.bench.ring_bench import _probe_row, longest_fit, unanswered_probe_row

    fit = _probe_row("ring 2 GPUs", 2, 262144, "ok", (2**30, 2**31))
    probing = ("probing", "ring 2 GPUs", 2, 311296, 16, 128)
    failures = ["workers exited with [1]", "rank 0 failed:\nTraceback ..."]
    row = unanswered_probe_row(probing, [fit], failures)
    assert (row["part"], row["impl"], row["gpus"], row["N"], row["status"]) == \
        ("longest", "ring 2 GPUs", 2, 311296, "no answer")
    assert row["failure"] == "workers exited with [1]" and row["peak_bytes"] is None
    assert longest_fit([fit, row]) == {2: (262144, 2**31)}  # the unanswered probe is not a fit
    assert "no answer" in longest_table([fit, row]).splitlines()[2]
    # nothing to record: the run ended well, nothing was in flight, or the probe's row is already there
    assert unanswered_probe_row(probing, [fit], []) is None
    assert unanswered_probe_row(None, [fit], failures) is None
    assert unanswered_probe_row(("probing", "ring 2 GPUs", 2, 262144, 16, 128), [fit], failures) is None


def test_append_replaces_what_a_run_measures_again(tmp_path):
    """ring_bench.measures groups rows for --append: one implementation's series of longest probes is replaced
    whole by a run that probes again (a probe series cut shorter leaves no stale longer rows), a scaling point
    by its own (impl, N, causal), and what the run does not measure stays."""
    from flashref.bench import results

    def longest(impl, N):
        return {"part": "longest", "impl": impl, "N": N}

    def scaling(impl, N, causal):
        return {"part": "scaling", "impl": impl, "N": N, "causal": causal}

    old = [longest("ring 2 GPUs", n) for n in (1, 2, 3)] + [longest("flashref-triton 1 GPU", n) for n in (1, 2)]
    old += [scaling("ring 2 GPUs", 8, False), scaling("ring 2 GPUs", 16, False)]
    data = {"seconds": 1.0, "results": list(old)}
    add = results.recorder(data, str(tmp_path / "ring.json"), group=ring_bench.measures)
    for row in (longest("ring 2 GPUs", 1), longest("ring 2 GPUs", 2), scaling("ring 2 GPUs", 16, False)):
        add(row)
    kept = [(r["part"], r["impl"], r["N"]) for r in data["results"]]
    assert kept == [("longest", "flashref-triton 1 GPU", 1), ("longest", "flashref-triton 1 GPU", 2),
                    ("scaling", "ring 2 GPUs", 8), ("longest", "ring 2 GPUs", 1), ("longest", "ring 2 GPUs", 2),
                    ("scaling", "ring 2 GPUs", 16)]
    assert data["results"][-1] is not old[-1]  # the re-measured point is the new row, once


def test_nccl_groups_get_a_high_priority_stream(monkeypatch):
    """The bench's NCCL group takes ``nccl_group_options`` (a high-priority stream: notebook 13's timeline);
    gloo takes no options. ``ProcessGroupNCCL`` exists only in CUDA builds of torch, so a stand-in records what
    is set."""
    import torch.distributed as dist

    class Options:
        is_high_priority_stream = False

    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("ProcessGroupNCCL", (), {"Options": Options}), raising=False)
    gpu, cpu = (object.__new__(ring_bench._Device) for _ in range(2))  # no set_device, no thread count change
    gpu.kind, cpu.kind = "cuda", "cpu"
    options = ring_bench._group_options(gpu)
    assert isinstance(options, Options) and options.is_high_priority_stream is True
    assert ring_bench._group_options(cpu) is None
