"""What `make test` runs under which OpenBLAS kernels (tests/openblas_cores.py), with the CPU's answers faked."""

from __future__ import annotations

import os

import pytest

from tests import openblas_cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(monkeypatch, reports):
    """The plan on a CPU whose OpenBLAS reports ``reports[core]`` when forced to ``core`` (None: the probe crashed)."""
    monkeypatch.setattr(openblas_cores, "runnable", lambda core: reports[core])
    return {core: (kernels, scope) for core, kernels, scope in openblas_cores.plan()}


def test_on_amd_the_zen_run_is_not_repeated_and_skylakex_is_not_tested(monkeypatch):
    plan = _plan(monkeypatch, {"Haswell": "Haswell", "SkylakeX": None, "Zen": "Haswell",
                               "Sandybridge": "Sandybridge", "Prescott": "Katmai"})
    assert plan == {"Haswell": ("Haswell", "suite"), "SkylakeX": (None, ""), "Zen": ("Haswell", ""),
                    "Sandybridge": ("Sandybridge", "numpy"), "Prescott": ("Katmai", "numpy")}


def test_with_avx512_both_ci_families_run_the_whole_suite(monkeypatch):
    plan = _plan(monkeypatch, {"Haswell": "Haswell", "SkylakeX": "SkylakeX", "Zen": "Haswell",
                               "Sandybridge": "Sandybridge", "Prescott": "Katmai"})
    assert [core for core, (_, scope) in plan.items() if scope == "suite"] == ["Haswell", "SkylakeX"]


def test_an_old_family_mapped_onto_a_tested_one_is_not_run_again(monkeypatch):
    plan = _plan(monkeypatch, {"Haswell": "Haswell", "SkylakeX": None, "Zen": "Haswell",
                               "Sandybridge": "Haswell", "Prescott": "Katmai"})
    assert plan["Sandybridge"] == ("Haswell", "") and plan["Prescott"] == ("Katmai", "numpy")


def test_a_failure_under_any_family_fails_the_run(monkeypatch, capsys):
    monkeypatch.setattr(openblas_cores, "runnable", lambda core: {"Haswell": "Haswell", "Zen": "Haswell",
                                                                  "Prescott": "Katmai"}.get(core))
    ran = []

    def run(core, kernels, scope, args):
        ran.append((core, scope))
        return "the NumPy arithmetic FAILED (pytest exit code 1)" if core == "Prescott" else "passed"

    monkeypatch.setattr(openblas_cores, "run", run)
    assert openblas_cores.main([]) == 1
    assert ran == [("Haswell", "suite"), ("Prescott", "numpy")]
    table = capsys.readouterr().out
    assert "SkylakeX     NOT TESTED" in table and "Zen          runs the Haswell kernels, already tested" in table
    monkeypatch.setattr(openblas_cores, "run", lambda core, kernels, scope, args: "passed")
    assert openblas_cores.main([]) == 0


def test_where_no_ci_family_can_run_the_whole_suite_runs_under_the_cpus_own_kernels(monkeypatch, capsys):
    """A CPU without AVX2 (or probes that all crash) runs no CI family: the whole suite then runs once without
    OPENBLAS_CORETYPE, and its verdict is the run's, so nothing passes having run only the NumPy subset."""
    monkeypatch.setattr(openblas_cores, "runnable", lambda core: {"Sandybridge": "Sandybridge",
                                                                  "Prescott": "Katmai"}.get(core))
    ran = []

    def run(core, kernels, scope, args):
        ran.append((core, scope))
        return "the whole suite FAILED (pytest exit code 1)" if core is None else "passed"

    monkeypatch.setattr(openblas_cores, "run", run)
    assert openblas_cores.main([]) == 1
    assert ran == [("Sandybridge", "numpy"), ("Prescott", "numpy"), (None, "suite")]
    assert openblas_cores.OWN in capsys.readouterr().out
    monkeypatch.setattr(openblas_cores, "runnable", lambda core: None)
    ran.clear()
    assert openblas_cores.main([]) == 1 and ran == [(None, "suite")]


@pytest.mark.parametrize("path", openblas_cores.NUMPY_TESTS)
def test_the_numpy_arithmetic_files_exist(path):
    """A renamed file would make the old families' run fail with 'file not found': named here first."""
    assert os.path.exists(os.path.join(ROOT, path)), path
