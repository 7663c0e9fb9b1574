"""flashref.bench.host_bench on the CPU: the switch that turns step plans off (and, in tests/test_host_path.py, on
the recorded Gluon path), the cases' keywords, the table from synthetic rows (the measurement itself runs on an
H100: python -m flashref.bench host)."""

from __future__ import annotations

import pytest

from flashref.bench import host_bench


def test_plans_off_gives_no_signature_a_key_and_the_switch_is_restored():
    from flashref.triton import ops

    key = ops._plan_key
    ops._PLANS["left over"] = (None, False)
    with pytest.raises(RuntimeError, match="inside"):
        with host_bench.plans(False):
            assert ops._PLANS == {}
            assert ops._plan_key is not key and ops._plan_key("anything", causal=True) is None
            raise RuntimeError("inside")
    assert ops._plan_key is key and ops._PLANS == {}
    with host_bench.plans(True):
        assert ops._plan_key is key


@pytest.mark.parametrize("pattern", sorted({case[0] for case in host_bench.CASES}))
def test_each_pattern_has_its_keywords(pattern):
    kw = host_bench.call_kwargs(pattern, 1000, device="cpu")
    assert kw["check_finite"] is False
    if pattern in ("sliding window", "bigbird"):
        assert tuple(kw["block_mask"].shape[-2:]) == (8, 8)  # ceil(1000 / 128) blocks a side
    assert ("dropout_p" in kw) == (pattern == "dropout")
    assert kw.get("causal", False) == (pattern in ("sliding window", "causal"))


def test_an_unknown_pattern_is_refused_by_name():
    with pytest.raises(ValueError, match="pattern: 'diagonal'"):
        host_bench.call_kwargs("diagonal", 1024, device="cpu")


def _row(plans, rnd, host, ms, graph=0.5, mode="fwd+bwd"):
    return {"case": "host", "pattern": "bigbird", "mode": mode, "plans": plans, "round": rnd, "B": 4, "H": 16,
            "N": 4096, "d": 64, "host_ms": host, "host_min_ms": host * 0.9, "ms": ms, "graph_ms": graph}


def test_the_table_compares_medians_with_plans_off_and_on():
    rows = [_row(False, 0, 1.0, 1.1), _row(False, 1, 1.2, 1.3), _row(False, 2, 5.0, 1.2),  # an outlier round
            _row(True, 0, 0.5, 0.6), _row(True, 1, 0.6, 0.7), _row(True, 2, 0.55, 0.65, graph=None),
            _row(True, 0, 0.3, 0.3, mode="fwd")]  # a mode with only one side has no line
    lines = host_bench.table({"results": rows}).splitlines()
    assert len(lines) == 2 and lines[0].split()[:6] == ["pattern", "B", "H", "N", "d", "mode"]
    cells = lines[1].replace("|", " ").split()
    assert cells[:6] == ["bigbird", "4", "16", "4096", "64", "fwd+bwd"]
    assert float(cells[6]) == 1.2 and cells[7] == "(1.00-5.00)"
    assert float(cells[8]) == 0.55 and cells[9] == "(0.50-0.60)"
    assert float(cells[10]) == pytest.approx(1.2 / 0.55, abs=0.01)
    assert float(cells[11]) == 1.2 and float(cells[12]) == 0.65 and float(cells[13]) == 0.5


def test_the_command_refuses_a_machine_without_a_hopper_gpu(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("this machine has an sm_90 GPU: the command would measure")
    assert host_bench.main([]) == 2
    assert "needs an sm_90" in capsys.readouterr().err


def test_the_committed_run_holds_every_case_with_plans_off_and_on():
    """book/data/host_bench.json: each case and mode measured with plans off and on in every round, on the GPU the
    file names, with its versions and command; and the table has a line for each."""
    data = host_bench.load_results()
    assert "H100" in data["device"] and data["versions"]["triton"] and data["command"].startswith(
        "python -m flashref.bench host")
    got = {(r["pattern"], r["B"], r["H"], r["N"], r["d"], r["mode"], r["plans"], r["round"])
           for r in data["results"] if r["case"] == "host"}
    want = {(*case, mode, on, rnd) for case in host_bench.CASES for mode in host_bench.MODES
            for on in (False, True) for rnd in range(host_bench.ROUNDS)}
    assert got == want
    assert all(r["host_min_ms"] <= r["host_ms"] and r["ms"] > 0 for r in data["results"])
    assert len(host_bench.table(data).splitlines()) == 1 + len(host_bench.CASES) * len(host_bench.MODES)
