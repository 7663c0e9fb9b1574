"""flashref.bench.clocks_bench on the CPU: nvidia-smi's samples parsed, and the table from synthetic rows (the
measurement itself runs on an H100: python -m flashref.bench clocks)."""
import pytest

from flashref.bench import clocks_bench


def test_samples_are_parsed_and_unreadable_lines_left_out():
    text = "1980, 120.5\n1755, 690.12\n[N/A], 500\n1530 , 699.9\n\nnot a sample\n"
    assert clocks_bench.parse_samples(text) == [(1980.0, 120.5), (1755.0, 690.12), (1530.0, 699.9)]
    assert clocks_bench.parse_samples(text, skip=1) == [(1755.0, 690.12), (1530.0, 699.9)]
    assert clocks_bench.parse_samples("") == []


def _row(impl, rnd, ms, mhz, d=64, causal=False):
    return {"case": "clocks", "impl": impl, "round": rnd, "B": 16, "H": 32, "N": 4096, "d": d, "causal": causal,
            "ms": ms, "sm_mhz": mhz, "watts": 690.0, "mcycles": ms * mhz / 1e3, "tflops": 1.0, "samples": 150}


def test_the_table_takes_medians_over_rounds_and_compares_time_and_cycles():
    """A kernel as fast as cuDNN at a lower clock needs fewer cycles: time x 1.00, cycles x above 1."""
    rows = [_row("flashref-hopper", 0, 4.0, 1500), _row("flashref-hopper", 1, 4.0, 1500),
            _row("flashref-hopper", 2, 9.0, 1000),  # an outlier round: the median ignores it
            _row("sdpa-cudnn", 0, 4.0, 1650), _row("sdpa-cudnn", 1, 4.0, 1650), _row("sdpa-cudnn", 2, 4.0, 1650),
            _row("sdpa-flash", 0, 6.0, 1700)]
    lines = clocks_bench.table({"results": rows}).splitlines()
    assert lines[0].split()[:4] == ["d", "N", "causal", "impl"]
    ours, cudnn, flash = lines[1].split(), lines[2].split(), lines[3].split()
    assert ours[3] == "flashref-hopper" and cudnn[3] == "sdpa-cudnn" and flash[3] == "sdpa-flash"
    assert float(ours[4]) == 4.0 and float(ours[5]) == 1500 and float(ours[7]) == 6.0
    assert float(ours[8]) == pytest.approx(1.0) and float(ours[9]) == pytest.approx(1.1)
    assert float(cudnn[8]) == 1.0 and float(cudnn[9]) == 1.0
    assert float(flash[8]) == pytest.approx(0.67, abs=0.01)


def test_a_point_without_the_baseline_has_no_ratio():
    lines = clocks_bench.table({"results": [_row("flashref-hopper", 0, 2.0, 1500, d=128)]}).splitlines()
    assert len(lines) == 2 and len(lines[1].split()) == 8


def test_the_command_refuses_a_machine_without_a_hopper_gpu(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("this machine has an sm_90 GPU: the command would measure")
    assert clocks_bench.main([]) == 2
    assert "needs an sm_90" in capsys.readouterr().err
