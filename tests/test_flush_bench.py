"""flashref.bench.flush_bench on the CPU: the line through the times, the tables, and ncu's log read into rows (the
measurement itself runs on a GPU: python -m flashref.bench flush)."""
import pytest

from flashref.bench import flush_bench
from flashref.bench.hbm_bench import MARKER, parse_ncu_csv, split_cases


def _time_row(impl, flush, B, N_k, us):
    nbytes = 2 * 2 * B * 8 * N_k * 128 + 2 * 2 * B * 32 * 128  # K and V, then Q and O
    return {"case": "time", "impl": impl, "flush": flush, "B": B, "H": 32, "H_kv": 8, "N_q": 1, "N_k": N_k, "d": 128,
            "bytes": nbytes, "status": "ok", "us": us, "us_rounds": [us]}


def _rows(fixed, tb_s, dirty_us, impl="flashref-decode"):
    """Times on an exact line (``fixed`` + bytes at ``tb_s``) after a read flush, ``dirty_us`` more after do_bench's."""
    rows = []
    for B, N_k in flush_bench.POINTS:
        read = fixed + _time_row(impl, "read", B, N_k, 0)["bytes"] / (tb_s * 1e6)
        rows += [_time_row(impl, "read", B, N_k, read), _time_row(impl, "zero", B, N_k, read + dirty_us)]
    return rows


def test_the_line_through_the_times_gives_the_fixed_cost_and_the_bandwidth():
    rows = _rows(10.0, 4.5, 6.0) + _rows(3.0, 2.0, 1.0, impl="sdpa-cudnn")
    read = flush_bench.fit(rows, "flashref-decode", "read")
    zero = flush_bench.fit(rows, "flashref-decode", "zero")
    assert read["fixed_us"] == pytest.approx(10.0) and read["tb_s"] == pytest.approx(4.5)
    assert zero["fixed_us"] == pytest.approx(16.0) and zero["tb_s"] == pytest.approx(4.5)
    assert read["points"] == len(flush_bench.POINTS)
    cudnn = flush_bench.fit(rows, "sdpa-cudnn", "read")  # the other implementation's rows are its own line
    assert cudnn["fixed_us"] == pytest.approx(3.0) and cudnn["tb_s"] == pytest.approx(2.0)


def test_no_line_without_two_cache_sizes_and_failed_rows_left_out():
    rows = [_time_row("flashref-decode", "read", 1, 4096, 12.0), _time_row("flashref-decode", "read", 1, 4096, 13.0),
            {**_time_row("flashref-decode", "read", 1, 65536, 0.0), "status": "OOM", "us": None}]
    assert flush_bench.fit(rows, "flashref-decode", "read") is None
    assert flush_bench.fit(rows, "flashref-decode", "zero") is None


def test_the_time_table_shows_what_the_dirty_lines_cost_each_call():
    rows = _rows(10.0, 4.5, 6.0) + _rows(9.0, 4.6, 5.0, impl="sdpa-cudnn")
    lines = flush_bench.time_table({"results": rows}).splitlines()
    assert lines[0].split()[:3] == ["B", "N_k", "MB"]
    body = lines[1:1 + len(flush_bench.POINTS)]
    sizes = [float(line.split()[2]) for line in body]
    assert sizes == sorted(sizes)  # by cache size
    for line in body:
        cols = [float(x) for x in line.split()]
        assert cols[5] == pytest.approx(cols[3] - cols[4]) and cols[5] == pytest.approx(6.0)  # flashref's dirty
        assert cols[8] == pytest.approx(5.0)  # cuDNN's
    fits = [line for line in lines if "flush:" in line]
    assert len(fits) == 4 and "16.0 us a call" in fits[0] and "4.50 TB/s" in fits[0] and "10.0 us" in fits[1]


def test_a_point_one_implementation_missed_shows_a_dash():
    rows = [_time_row("flashref-decode", "zero", 1, 4096, 13.0), _time_row("flashref-decode", "read", 1, 4096, 12.0)]
    line = flush_bench.time_table({"results": rows}).splitlines()[1]
    assert line.split()[3:6] == ["13.0", "12.0", "1.0"] and line.split()[6:] == ["-", "-", "-"]


HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
SPLIT, MERGE = "flash_decode_split_kernel", "flash_decode_merge_kernel"
#: (ID, kernel, metric, value) as ncu logged them after a zeroing flush (case 0) and a reading one (case 1): the
#: H200's run, the reading case's merge left out
LOGGED = [(0, MARKER, "dram__bytes_read.sum", "0"),
          (1, SPLIT, "dram__bytes_read.sum", "67,163,392"), (1, SPLIT, "dram__bytes_write.sum", "20,503,808"),
          (1, SPLIT, "gpu__time_duration.sum", "28,608"),
          (2, MERGE, "dram__bytes_read.sum", "8,960"), (2, MERGE, "dram__bytes_write.sum", "47,872"),
          (2, MERGE, "gpu__time_duration.sum", "4,288"),
          (3, MARKER, "dram__bytes_read.sum", "0"),
          (4, SPLIT, "dram__bytes_read.sum", "67,162,880"), (4, SPLIT, "dram__bytes_write.sum", "23,296"),
          (4, SPLIT, "gpu__time_duration.sum", "23,104")]


def _csv(fields):
    return ",".join(f'"{x}"' for x in fields)


NCU_LOG = "\n".join(["==PROF== Connected to process 1", _csv(HEADER)] + [
    _csv([i, 1, "python3", "h", name, 1, 7, "(128, 1, 1)", "(16, 8, 1)", 0, "9.0", "s", metric,
          "ns" if metric.startswith("gpu__") else "byte", value]) for i, name, metric, value in LOGGED])


def test_ncus_log_becomes_one_row_a_case_with_its_kernels_summed():
    cases = [{"B": 1, "N_k": 16384, "flush": "zero"}, {"B": 1, "N_k": 16384, "flush": "read"},
             {"B": 1, "N_k": 65536, "flush": "zero"}]  # the third case left no kernel: no row
    rows = flush_bench.writes_rows(split_cases(parse_ncu_csv(NCU_LOG)), cases)
    assert [r["flush"] for r in rows] == ["zero", "read"]
    zero, read = rows
    assert zero["kernels"] == ["flash_decode_split_kernel", "flash_decode_merge_kernel"]
    assert zero["dram_read"] == 67163392 + 8960 and zero["dram_write"] == 20503808 + 47872
    assert zero["ns"] == pytest.approx(28608 + 4288)
    assert read["kernels"] == ["flash_decode_split_kernel"] and read["dram_write"] == 23296
    lines = flush_bench.writes_table({"results": rows}).splitlines()
    assert lines[1].split() == ["1", "16384", "zero", "67.2", "20.55", "32.9"]
    assert lines[2].split() == ["1", "16384", "read", "67.2", "0.02", "23.1"]


def test_no_counts_no_writes_table():
    assert flush_bench.writes_table({"results": _rows(10.0, 4.5, 6.0)}) == ""


def test_a_flush_not_known_is_refused_by_name():
    from flashref.bench.features_bench import graph_time_us, l2_flush

    with pytest.raises(ValueError, match="flush must be one of"):
        graph_time_us(lambda: None, flush="clean")
    with pytest.raises(ValueError, match="flush must be one of"):
        l2_flush("clean")


def test_without_a_gpu_the_suite_says_what_it_needs(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flush_bench.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_command_line_saves_the_schema_of_the_committed_file(monkeypatch, capsys, tmp_path):
    """main() with the measurements replaced (as on a GPU machine): the file it writes has the committed file's
    keys, its rows in order, and the tables are printed from it."""
    import torch

    from flashref.bench import results

    timed, counted = _rows(10.0, 4.5, 6.0), [{"case": "writes", "B": 1, "N_k": 16384, "flush": "zero",
                                               "kernels": ["k"], "dram_read": 67e6, "dram_write": 2e7, "ns": 3e4}]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU A")
    monkeypatch.setattr(flush_bench, "times", lambda: iter(timed))
    monkeypatch.setattr(flush_bench, "writes", lambda: counted)
    out = str(tmp_path / "flush.json")
    assert flush_bench.main(["--out", out]) == 0
    saved = results.load("flush.json", out)
    assert set(saved) == set(results.load("flush_bench.json"))
    assert saved["results"] == timed + counted and saved["command"] == f"python -m flashref.bench flush --out {out}"
    printed = capsys.readouterr().out
    assert "after a read flush:  10.0 us a call" in printed and "20.00" in printed
    assert flush_bench.main(["--out", out, "--no-counts"]) == 0  # time only: no ncu rows
    assert results.load("flush.json", out)["results"] == timed


@pytest.mark.gpu
def test_both_flushes_time_a_decode_call():
    """On the GPU: one small point, each implementation timed after each flush (times, not asserted against
    each other: that is the benchmark's to measure)."""
    rows = list(flush_bench.times(points=[(1, 4096)], rounds=1))
    assert {(r["impl"], r["flush"]) for r in rows} == {(i, f) for i in flush_bench.IMPLS for f in flush_bench.FLUSHES}
    ours = [r for r in rows if r["impl"] == "flashref-decode"]
    assert all(r["status"] == "ok" and r["us"] > 0 for r in ours)
