"""The HBM benchmark's bookkeeping, on the CPU: ncu's CSV log is parsed and split into cases exactly.
(The measurement itself needs a GPU and ncu: ``python -m flashref.bench hbm``.)"""

from __future__ import annotations

from flashref.bench import hbm_bench

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _rows(kernel_id, name, values):
    return [f'"{kernel_id}","1","python3","host","{name}","1","7","(128, 1, 1)","(32, 16, 1)","0","9.0","Command line '
            f'profiler metrics","{metric}","{unit}","{value}"' for metric, unit, value in values]


def _log():
    lines = ["==PROF== Connected to process 1 (/usr/bin/python3)", "some output of the program", HEADER]
    metrics = lambda r, w, ns: [("dram__bytes_read.sum", "byte", f"{r:,}"), ("dram__bytes_write.sum", "byte", w),  # noqa: E731
                                ("lts__t_sectors_srcunit_tex_op_read.sum", "sector", r // 16),
                                ("gpu__time_duration.sum", "ns", ns)]
    lines += _rows(0, "hbm_case_marker", metrics(0, 0, 1000))
    lines += _rows(1, "flash_fwd_kernel", metrics(1048576, 262144, 51000))
    lines += _rows(2, "hbm_case_marker", metrics(32, 0, 900))
    lines += _rows(3, "ampere_fp16_s16816gemm", metrics(4096, 2048, 7000))
    lines += _rows(4, "softmax_warp_forward", [("dram__bytes_read.sum", "byte", "n/a")])
    return "\n".join(lines) + "\n==PROF== Disconnected from process 1\n"


def test_parse_and_split():
    kernels = hbm_bench.parse_ncu_csv(_log())
    assert [k["name"] for k in kernels] == ["hbm_case_marker", "flash_fwd_kernel", "hbm_case_marker",
                                            "ampere_fp16_s16816gemm", "softmax_warp_forward"]
    assert kernels[1]["dram__bytes_read.sum"] == 1048576.0  # thousands separators are read
    assert kernels[4]["dram__bytes_read.sum"] is None  # "n/a" is no number
    cases = hbm_bench.split_cases(kernels)
    assert sorted(cases) == [0, 1]
    assert [k["name"] for k in cases[0]] == ["flash_fwd_kernel"]
    assert [k["name"] for k in cases[1]] == ["ampere_fp16_s16816gemm", "softmax_warp_forward"]
    row = hbm_bench.summarize(cases[0][0])
    assert row == {"name": "flash_fwd_kernel", "dram_read": 1048576, "dram_write": 262144,
                   "l2_read_bytes": 1048576 // 16 * 32, "ns": 51000.0}


def test_no_csv_means_no_kernels():
    assert hbm_bench.parse_ncu_csv("==ERROR== the application returned an error\n") == []
    assert hbm_bench.split_cases([]) == {}


def test_cases_cover_the_grid_and_the_sweep():
    cases = hbm_bench.cases()
    grid = [c for c in cases if c["kind"] == "grid"]
    assert {c["N"] for c in grid} == set(hbm_bench.FULL_N) and {c["d"] for c in grid} == {64, 128}
    assert {(c["impl"], c["mode"]) for c in grid} == {(i, m) for i, ms in hbm_bench.IMPLS.items() for m in ms}
    sweep = [c for c in cases if c["kind"] == "sweep"]
    assert all(c["block_m"] % c["block_n"] == 0 for c in sweep)  # the forward kernel's tile rule
    assert len(hbm_bench.cases(quick=True)) < len(cases)


def test_kernel_flops_counts_the_work_of_each_kind_of_kernel():
    B, H, N, d = 1, 2, 64, 16
    nn = B * H * N * N
    flops = lambda name, causal=False, **k: hbm_bench.kernel_flops({"name": name, **k}, B, H, N, d, causal)  # noqa: E731
    assert flops("flash_fwd_kernel") == 4 * nn * d and flops("flash_fwd_kernel", causal=True) == 2 * nn * d
    assert flops("flash_bwd_dkdv_kernel") == 8 * nn * d and flops("flash_bwd_dq_kernel") == 6 * nn * d
    assert flops("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>") == 10 * nn * d
    assert flops("nvjet_sm90_hsh_128x256_64x4_2x1_v_bz_coopA_TNN", causal=True) == 2 * nn * d  # cuBLAS: whole product
    # element-wise: one FLOP per fp16 element written, however many launches PyTorch splits it into
    assert flops("void at::vectorized_elementwise_kernel<8, at::AUnaryFunctor<c10::Half>>", l2_write_bytes=2 * nn) == nn
    assert flops("flash_bwd_preprocess_kernel") == 0 and flops("void at::elementwise_kernel<direct_copy_kernel>") == 0


def test_committed_run_is_complete_and_consistent():
    """book/data/hbm_bench.json holds every case of the full grid, each profiled and timed, with provenance."""
    data = hbm_bench.load_results()
    assert data["complete"] and "H100" in data["device"]
    for key in ("torch", "triton", "cupy", "ncu", "driver"):
        assert data["versions"][key]
    keys = {hbm_bench._key(r) for r in data["results"] if r["status"] == "ok" and r["kernels"]}
    assert keys == {hbm_bench._key(c) for c in hbm_bench.cases()}
    # the Triton forward launches exactly one kernel, and its DRAM reads are the compulsory bytes (+-2%)
    from flashref import hbm

    for N in hbm_bench.FULL_N:
        row = hbm_bench.find(data, "flashref-triton", "fwd", N, 64)
        assert [k["name"] for k in row["kernels"]] == ["flash_fwd_kernel"]
        compulsory = hbm.flash_forward(hbm_bench.B, hbm_bench.H, N, N, 64, 128, 64).compulsory_read
        assert abs(row["kernels"][0]["dram_read"] / compulsory - 1) < 0.02


def test_a_metric_is_known_by_its_base_name_whatever_its_roll_up(monkeypatch):
    """``ncu --query-metrics`` lists base names; a metric asked for adds a roll-up of one part (``.sum``) or more
    (``.avg.pct_of_peak_sustained_active``): both are found, and a base name ncu lacks is left out."""
    import subprocess

    class Done:
        stdout = ("Device GH100 (HopperX)\n----\nMetric Name  Metric Description\n"
                  "dram__bytes_read  # of bytes read from DRAM\nsmsp__issue_active  # of cycles with an issue\n")

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done())
    names = hbm_bench.metric_names("ncu")
    assert {"dram__bytes_read", "smsp__issue_active"} <= names
    assert hbm_bench.knows(names, "dram__bytes_read.sum")
    assert hbm_bench.knows(names, "smsp__issue_active.avg.pct_of_peak_sustained_active")
    assert not hbm_bench.knows(names, "dram__bytes_write.sum")
    assert hbm_bench.available_metrics("ncu") == ["dram__bytes_read.sum"]
