"""Every exercise checker answers, never raises: None says "not answered", a wrong answer gets a falsy
Verdict with a message. (The right answers are checked where the notebooks' solution cells run them.)"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys

import pytest

import flashref.exercises as exercises
from flashref.exercises import NOT_ANSWERED, Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = [importlib.import_module(f"flashref.exercises.{m.name}") for m in pkgutil.iter_modules(exercises.__path__)]
CHECKERS = [(f"{mod.__name__.rsplit('.', 1)[1]}.{name}", fn) for mod in MODULES
            for name, fn in inspect.getmembers(mod, inspect.isfunction)
            if name.startswith("check_") and fn.__module__ == mod.__name__]


def test_every_notebook_topic_has_checkers():
    assert len(MODULES) >= 7 and len(CHECKERS) >= 14


@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_unanswered_is_not_correct(name, check):
    verdict = check(None)
    assert isinstance(verdict, Verdict) and not verdict
    assert repr(verdict) == NOT_ANSWERED


@pytest.mark.parametrize("wrong_answer", [-12345.678, "not a number"])
@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_wrong_answer_gets_a_message(name, check, wrong_answer):
    verdict = check(wrong_answer)
    assert isinstance(verdict, Verdict) and not verdict
    assert repr(verdict).startswith("Not quite")


def _run_without(modules, code):
    """Run ``code`` in a fresh interpreter in which importing any of ``modules`` fails, as on a machine
    without them."""
    blocker = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("missing", [("torch",), ("triton",)])
def test_flashref_triton_without_its_optional_parts_says_what_to_install(missing):
    code = "import flashref.triton\n"
    result = _run_without(missing, code)
    assert result.returncode != 0
    assert f"flashref.triton needs torch and triton, and {missing[0]} is not installed: pip install 'flashref[gpu]'" \
        in result.stderr


def test_checkers_need_neither_torch_nor_triton():
    result = _run_without(("torch", "triton"), (
        "from flashref.exercises import triton_kernels as ex\n"
        "from flashref.kernel_tiles import tile_counts\n"
        "c = tile_counts(4096, 4096, 128, 64, True)\n"
        "assert ex.check_causal_fraction_skipped(c['skipped'] / (c['full'] + c['masked'] + c['skipped']))\n"
        "assert not ex.check_causal_fraction_skipped(0.1)\n"
        "print('ok')\n"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_measured_io_checkers_accept_right_answers_and_explain_wrong_ones():
    from flashref.exercises import measured_io as ex

    B, H, N, d = ex.PREDICT["B"], ex.PREDICT["H"], ex.PREDICT["N"], ex.PREDICT["d"]
    right = B * H * 3 * N * d * 2
    assert ex.check_predicted_dram_read(right)
    assert "ncu measured" in repr(ex.check_predicted_dram_read(right))
    assert "factor of 2" in repr(ex.check_predicted_dram_read(right // 2))
    assert "one head" in repr(ex.check_predicted_dram_read(right // (B * H)))
    assert "O is written" in repr(ex.check_predicted_dram_read(right * 4 // 3))
    assert not ex.check_predicted_dram_read("lots") and not ex.check_predicted_dram_read(None)

    from flashref.bench import hbm_bench

    measured = hbm_bench.totals(hbm_bench.find(hbm_bench.load_results(), "plain", "fwd", ex.PASSES["N"], ex.PASSES["d"]))
    passes = ex.nn_passes(measured["dram"])
    assert 5.5 < passes < 6.5 and ex.check_nn_passes(passes)
    assert "twice" in repr(ex.check_nn_passes(passes / 2))
    assert not ex.check_nn_passes(1.0)

    assert ex.check_roofline_time(lambda f, b, p, w: max(f / p, b / w))
    assert "added" in repr(ex.check_roofline_time(lambda f, b, p, w: f / p + b / w))
    assert "shorter" in repr(ex.check_roofline_time(lambda f, b, p, w: min(f / p, b / w)))
    assert "units" in repr(ex.check_roofline_time(lambda f, b, p, w: max(f * p, b * w)))
    assert "raised" in repr(ex.check_roofline_time(lambda f, b, p, w: 1 / 0))
    assert not ex.check_roofline_time(None) and not ex.check_roofline_time(3)
