"""``python -m flashref.bench``: the suites it names, its help, and the default suite."""

import importlib

import pytest

from flashref.bench import __main__ as bench_main


@pytest.mark.parametrize("name", sorted(bench_main.SUITES))
def test_every_suite_names_a_module_with_a_main(name):
    module = importlib.import_module(bench_main.SUITES[name][0])
    assert callable(module.main)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_suite_and_succeeds(flag, capsys):
    assert bench_main.main([flag]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in bench_main.SUITES)


@pytest.mark.parametrize("argv, passed", [([], []), (["--quick"], ["--quick"]), (["gpu", "--quick"], ["--quick"])])
def test_no_suite_runs_the_gpu_benchmark(argv, passed, monkeypatch, capsys):
    gpu_bench = importlib.import_module("flashref.bench.gpu_bench")
    seen = []
    monkeypatch.setattr(gpu_bench, "main", lambda args: seen.append(args) or 0)
    assert bench_main.main(argv) == 0 and seen == [passed]
    assert ("running 'gpu'" in capsys.readouterr().err) == (argv[:1] != ["gpu"])


def test_an_unknown_suite_is_named_with_the_list(capsys):
    assert bench_main.main(["gpus"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite 'gpus'" in err and "sparse-tiles" in err
