"""The benchmarks' one home for their plumbing (flashref.bench.results), on the CPU: every committed result
is read by one loader, written by one saver with the device, versions and command, and every benchmark counts
FLOPs with one formula, bit for bit the counts the committed runs were made with."""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

from flashref import reference
from flashref.bench import results

BENCHES = {"gpu_bench": "gpu_bench.json", "hbm_bench": "hbm_bench.json", "features_bench": "features_bench.json",
           "hopper_bench": "hopper_bench.json",
           "model_bench": "model_bench.json", "flush_bench": "flush_bench.json"}


@pytest.mark.parametrize("module, name", sorted(BENCHES.items()))
def test_each_bench_reads_its_committed_file_through_the_one_loader(monkeypatch, module, name):
    bench = importlib.import_module(f"flashref.bench.{module}")
    calls = []
    load = results.load
    monkeypatch.setattr(results, "load", lambda n, path=None: calls.append((n, path)) or load(n, path))
    data = bench.load_results()
    assert calls == [(name, None)]
    assert data["device"] and data["versions"]["torch"] and data["results"]


def test_the_numpy_and_cupy_benches_read_through_it_too(monkeypatch):
    from flashref.bench import cupy_bench, numpy_bench

    calls = []
    load = results.load
    monkeypatch.setattr(results, "load", lambda n, path=None: calls.append(n) or load(n, path))
    assert numpy_bench.load_results()["results"]
    device, rows = cupy_bench.load_results()
    assert device and rows
    device, rows = cupy_bench.load_results(cupy_bench.GPU_BENCH_PATH)
    assert device and {r["impl"] for r in rows} >= {"flashref-triton", "sdpa-flash"}
    assert calls == ["numpy_bench.json", "cupy_bench.json", "gpu_bench.json"]


def test_load_reads_a_path_or_fetches_the_repository_copy(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"a": 1}))
    assert results.load("x.json", str(path)) == {"a": 1}
    with pytest.raises(FileNotFoundError):
        results.load("x.json", str(tmp_path / "absent.json"))
    # not in this checkout: the course repository's copy (on Colab)
    import urllib.request

    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return b'{"fetched": true}'

    urls = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: urls.append(url) or Response())
    assert results.load("not_in_this_checkout.json") == {"fetched": True}
    assert urls == [results.RAW_URL + "book/data/not_in_this_checkout.json"]


def test_save_writes_what_load_reads(tmp_path):
    path = str(tmp_path / "deeper" / "run.json")
    data = {"device": "GPU A", "results": [{"ms": 1.5}]}
    results.save(data, path)
    assert results.load("run.json", path) == data
    results.save(data, path, indent=None)
    assert results.load("run.json", path) == data


def test_versions_name_python_torch_triton_cuda_and_cupy():
    v = results.versions()
    assert list(v) == ["python", "torch", "triton", "cuda", "cupy"]
    assert v["torch"] == torch.__version__


def test_hbm_adds_only_its_ncu_fields_to_the_versions(monkeypatch):
    import subprocess

    from flashref.bench import hbm_bench

    class Done:
        stdout = "NVIDIA (R) Nsight Compute\nVersion 2025.3\n"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done())
    v = hbm_bench.ncu_versions("ncu")
    assert {k: v[k] for k in results.versions()} == results.versions()
    assert set(v) - set(results.versions()) == {"ncu", "driver"}


def test_command_is_the_suite_and_its_arguments():
    assert results.command("gpu", ["--quick", "--d", "64"]) == "python -m flashref.bench gpu --quick --d 64"
    assert results.command("cupy", []) == "python -m flashref.bench cupy"


def test_append_adds_to_a_run_of_the_same_machine_and_refuses_another(tmp_path):
    fresh = results.start(None, "GPU A", {"torch": "1"}, "cmd --parts gqa", dtype="float16")
    assert fresh == {"device": "GPU A", "versions": {"torch": "1"}, "dtype": "float16", "command": "cmd --parts gqa",
                     "seconds": None, "results": []}
    path = tmp_path / "features.json"
    path.write_text(json.dumps({**fresh, "seconds": 12.0, "results": [{"case": "gqa fwd+bwd"}]}))
    more = results.start(str(path), "GPU A", {"torch": "1"}, "cmd --parts flex", dtype="float16")
    assert more["results"] == [{"case": "gqa fwd+bwd"}] and more["seconds"] == 12.0
    assert more["command"] == "cmd --parts gqa; cmd --parts flex"
    with pytest.raises(ValueError, match="GPU B"):
        results.start(str(path), "GPU B", {"torch": "1"}, "cmd --parts flex")
    with pytest.raises(ValueError, match="write a new file"):
        results.start(str(path), "GPU A", {"torch": "2"}, "cmd --parts flex")
    # a library the file does not name (CuPy, in a file written before it was recorded) is no difference
    assert results.start(str(path), "GPU A", {"torch": "1", "cupy": None}, "c")["results"] == [{"case": "gqa fwd+bwd"}]
    assert results.start(str(tmp_path / "absent.json"), "GPU A", {}, "c")["results"] == []


def test_the_model_bench_appends_to_its_committed_run():
    """The committed model run recorded no CuPy version: this machine's versions, CuPy included, append to it
    wherever torch, triton and CUDA agree."""
    path = os.path.join(results.REPO_ROOT, "book", "data", "model_bench.json")
    saved = results.load("model_bench.json", path)
    same = {**saved["versions"], "cupy": "14.2.0"}
    data = results.start(path, saved["device"], same, "more", dtype="bfloat16 autocast")
    assert data["results"] == saved["results"] and data["dtype"] == "bfloat16 autocast"


def test_the_recorder_saves_after_every_row(tmp_path):
    path = str(tmp_path / "run.json")
    data = results.start(None, "GPU A", {}, "c", dtype="float16")
    data["seconds"] = 10.0
    shown = []
    add = results.recorder(data, path, show=shown.append)
    add({"case": 1})
    assert results.load("run.json", path)["results"] == [{"case": 1}] and shown == [{"case": 1}]
    add({"case": 2})
    saved = results.load("run.json", path)
    assert saved["results"] == [{"case": 1}, {"case": 2}] and saved["seconds"] >= 10.0


def test_is_oom():
    assert results.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert results.is_oom(type("OutOfMemoryError", (Exception,), {})("x"))
    assert not results.is_oom(RuntimeError("illegal memory access"))


def _old_gpu_flops(B, H, N_q, N_k, d, causal, mode):
    """gpu_bench.flops as the committed runs computed it."""
    f = 4.0 * B * H * N_q * N_k * d * (0.5 if causal else 1.0)
    return {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode] * f


def test_one_flop_formula_gives_the_committed_runs_counts_bit_for_bit():
    from flashref.bench import cupy_bench, features_bench, gpu_bench, hbm_bench

    assert gpu_bench.flops is results.flops and cupy_bench.flops is results.flops
    assert features_bench.flops is results.flops and hbm_bench.flops is results.flops
    for d in (64, 128):
        for N in gpu_bench.FULL_N:
            B, H = gpu_bench.TOKENS // N, gpu_bench.WIDTH // d
            for causal in (False, True):
                for mode in gpu_bench.MODES:
                    assert results.flops(B, H, N, N, d, causal, mode) == _old_gpu_flops(B, H, N, N, d, causal, mode)
                assert results.flops(B, H, N, N, d, causal, "fwd") == reference.forward_flops(N, N, d, H, B, causal)
    # the features bench's GQA, dropout and FlexAttention points
    for B, H, N, d in [(2, 32, 4096, 128), (8, 16, 4096, 64), (4, 16, 4096, 64), (1, 8, 65536, 64)]:
        for causal in (False, True):
            old = 3.5 * 4.0 * B * H * N * N * d * (0.5 if causal else 1.0)
            assert results.flops(B, H, N, N, d, causal, "fwd+bwd") == old
        pairs = N * N // 3 + 7
        for mode in ("fwd", "fwd+bwd"):
            assert results.pair_flops(B, H, pairs, d, mode) == (1.0 if mode == "fwd" else 3.5) * 4.0 * B * H * pairs * d
    assert results.flops(1, 1, 1024, 512, 64, False, "bwd") == 2.5 * reference.forward_flops(1024, 512, 64)


def test_kernel_flops_are_the_counts_of_before():
    from flashref.bench import hbm_bench

    names = ["flash_fwd_kernel", "flash_tiled_forward", "flash_mma_forward", "flash_bwd_dkdv_kernel",
             "flash_bwd_dq_kernel", "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>",
             "nvjet_sm90_hsh_128x256", "ampere_fp16_s16816gemm_fp16"]
    counts = [2, 2, 2, 4, 3, 5, None, None]
    for N in hbm_bench.FULL_N:
        for d in (64, 128):
            for causal in (False, True):
                nn = float(hbm_bench.B * hbm_bench.H * N * N)
                for name, count in zip(names, counts):
                    old = 2 * nn * d if count is None else 2 * count * nn * d * (0.5 if causal else 1.0)
                    assert hbm_bench.kernel_flops({"name": name}, hbm_bench.B, hbm_bench.H, N, d, causal) == old


def test_the_plain_baseline_is_the_one_of_torch_attention():
    """gpu_bench's ``plain`` (the hbm bench counts its kernels) is flashref.torch_attention.plain_attention,
    the same operations as the copy it had before, bit for bit."""
    import math

    from flashref.bench import gpu_bench
    from flashref.torch_attention import plain_attention

    assert gpu_bench.implementation("plain") is plain_attention

    def old_plain(q, k, v, causal):
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v)

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 3, 37, 16, generator=g).to(dtype) for _ in range(3))
        for causal in (False, True):
            assert torch.equal(gpu_bench.implementation("plain")(q, k, v, causal), old_plain(q, k, v, causal))


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda as a command line sees it on a GPU machine: the benchmarks' main() runs up to the measurements
    (which each test replaces) and writes its file."""
    class Properties:
        L2_cache_size = 50 * 2**20

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU A")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Properties())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _committed_keys(name, *left_out):
    return set(results.load(name)) - set(left_out)


def test_each_command_line_saves_the_schema_of_its_committed_file(fake_gpu, monkeypatch, tmp_path):
    from flashref.bench import cupy_bench, features_bench, gpu_bench, hbm_bench, model_bench

    row = {"impl": "flashref-triton", "mode": "fwd", "B": 64, "H": 32, "N": 1024, "d": 64, "causal": False,
           "status": "ok", "ms": 1.0, "tflops": 1.0}
    monkeypatch.setattr(gpu_bench, "run_grid", lambda *a, checkpoint, **k: checkpoint([row]) or [row])
    monkeypatch.setattr(gpu_bench, "plot", lambda *a, **k: None)
    out = str(tmp_path / "gpu.json")
    assert gpu_bench.main(["--quick", "--no-progress", "--out", out]) == 0
    saved = results.load("gpu.json", out)
    assert set(saved) == _committed_keys("gpu_bench.json", "memory_target") | {"command"}
    assert saved["command"] == "python -m flashref.bench gpu --quick --no-progress --out " + out
    assert saved["results"] == [row] and saved["complete"] and saved["versions"] == results.versions()

    monkeypatch.setattr(features_bench, "gqa_cases", lambda: [{"case": "gqa fwd+bwd", "impl": "sdpa-flash"}])
    monkeypatch.setattr(features_bench, "dropout_cases", lambda: [{"case": "dropout fwd+bwd", "impl": "sdpa-flash"}])
    out = str(tmp_path / "features.json")
    assert features_bench.main(["--out", out, "--parts", "gqa"]) == 0
    assert features_bench.main(["--out", out, "--parts", "dropout", "--append"]) == 0
    saved = results.load("features.json", out)
    assert set(saved) == _committed_keys("features_bench.json", "note")
    assert [r["case"] for r in saved["results"]] == ["gqa fwd+bwd", "dropout fwd+bwd"]
    assert saved["command"] == (f"python -m flashref.bench features --parts gqa --out {out}; "
                                f"python -m flashref.bench features --parts dropout --out {out}")
    assert features_bench.main(["--out", out, "--parts", "gqa", "--append"]) == 0  # measured again: replaced
    assert [r["case"] for r in results.load("features.json", out)["results"]] == ["dropout fwd+bwd", "gqa fwd+bwd"]

    monkeypatch.setattr(model_bench, "compile_cases", lambda: iter([{"part": "compile", "attention": "sdpa"}]))
    out = str(tmp_path / "model.json")
    assert model_bench.main(["--out", out, "--parts", "compile"]) == 0
    saved = results.load("model.json", out)
    assert set(saved) == _committed_keys("model_bench.json")
    assert saved["dtype"] == "bfloat16 autocast" and saved["results"] == [{"part": "compile", "attention": "sdpa"}]
    monkeypatch.setattr(model_bench, "generate_cases", lambda *a: iter([{"part": "generate", "case": "speed"}]))
    assert model_bench.main(["--out", out, "--parts", "generate", "--append"]) == 0
    monkeypatch.setattr(model_bench, "compile_cases", lambda: iter([{"part": "compile", "attention": "flashref"}]))
    assert model_bench.main(["--out", out, "--parts", "compile", "--append"]) == 0  # measured again: replaced
    assert results.load("model.json", out)["results"] == [{"part": "generate", "case": "speed"},
                                                          {"part": "compile", "attention": "flashref"}]

    monkeypatch.setattr(cupy_bench, "run", lambda **k: [row])
    out = str(tmp_path / "cupy.json")
    assert cupy_bench.main(["--N", "1024", "--out", out]) == 0
    saved = results.load("cupy.json", out)
    assert set(saved) == _committed_keys("cupy_bench.json", "note")
    assert saved["command"] == "python -m flashref.bench cupy --N 1024 --out " + out

    monkeypatch.setattr(hbm_bench, "ncu_path", lambda: "ncu")
    monkeypatch.setattr(hbm_bench, "available_metrics", lambda ncu: hbm_bench.METRICS)
    monkeypatch.setattr(hbm_bench, "ncu_versions", lambda ncu: {**results.versions(), "ncu": "1", "driver": "2"})
    monkeypatch.setattr(hbm_bench, "measure", lambda todo, *a, checkpoint, **k: checkpoint(
        [{**c, "status": "ok", "kernels": [{"name": "k"}]} for c in todo]) or
        [{**c, "status": "ok", "kernels": [{"name": "k"}]} for c in todo])
    out = str(tmp_path / "hbm.json")
    assert hbm_bench.main(["--quick", "--no-progress", "--out", out]) == 0
    saved = results.load("hbm.json", out)
    assert set(saved) == _committed_keys("hbm_bench.json")
    assert saved["command"] == "python -m flashref.bench hbm --quick" and saved["complete"]


def test_a_group_measured_again_replaces_its_saved_rows_when_its_first_new_row_comes(tmp_path):
    """recorder(group=...): the saved rows of a group go when the run adds that group's first row (not before:
    a run cut short earlier keeps them), the run's own rows of the group stay, other groups are untouched."""
    data = {"device": "GPU A", "seconds": 1.0, "results": [{"g": 1, "v": "old"}, {"g": 2, "v": "old"}]}
    path = str(tmp_path / "run.json")
    add = results.recorder(data, path, group=lambda row: row["g"])
    assert data["results"] == [{"g": 1, "v": "old"}, {"g": 2, "v": "old"}]
    add({"g": 1, "v": "new"})
    add({"g": 1, "v": "new 2"})
    assert data["results"] == [{"g": 2, "v": "old"}, {"g": 1, "v": "new"}, {"g": 1, "v": "new 2"}]
    add({"g": 3, "v": "new"})
    assert results.load("run.json", path)["results"] == [{"g": 2, "v": "old"}, {"g": 1, "v": "new"},
                                                          {"g": 1, "v": "new 2"}, {"g": 3, "v": "new"}]


def test_the_hopper_bench_measures_some_parts_again_in_place(fake_gpu, monkeypatch, tmp_path):
    """``--parts training --append`` keeps the forward rows and replaces the forward + backward ones; the saved
    command names the parts, not --append, as the other suites' do."""
    from flashref.bench import hopper_bench

    runs = iter([1.0, 2.0])
    monkeypatch.setattr(hopper_bench, "cases", lambda: iter([{"case": "fwd", "impl": "a", "d": 64, "N": 1,
                                                               "causal": False, "ms": 1.0, "tflops": 1.0}]))
    monkeypatch.setattr(hopper_bench, "training_cases", lambda: iter([{"case": "fwd+bwd", "impl": "b", "d": 64, "N": 1,
                                                                       "causal": False, "ms": next(runs),
                                                                       "tflops": 1.0}]))
    out = str(tmp_path / "hopper.json")
    assert hopper_bench.main(["--out", out, "--parts", "steps", "training"]) == 0
    assert hopper_bench.main(["--out", out, "--parts", "training", "--append"]) == 0
    saved = results.load("hopper.json", out)
    assert [(r["case"], r["ms"]) for r in saved["results"]] == [("fwd", 1.0), ("fwd+bwd", 2.0)]
    assert saved["command"] == ("python -m flashref.bench hopper --out " + out + " --parts steps training; "
                                "python -m flashref.bench hopper --out " + out + " --parts training")


def test_the_hopper_bench_measures_some_head_dims_again_in_place(fake_gpu, monkeypatch, tmp_path):
    """``--head-dims 256 --append`` measures the training part at d = 256 only and replaces those rows, keeping
    d = 64's; ``--head-dims`` with a part off the grid is refused, naming the parts it applies to."""
    from flashref.bench import hopper_bench

    asked = []

    def training_cases(grid=hopper_bench.GRID, d256=True):
        asked.append((sorted({d for d, _, _ in grid}), d256))
        dims = sorted({d for d, _, _ in grid}) + ([256] if d256 else [])
        return iter([{"case": "fwd+bwd", "impl": "b", "d": d, "N": 1, "causal": False, "ms": float(len(asked)),
                      "tflops": 1.0} for d in dims])

    monkeypatch.setattr(hopper_bench, "training_cases", training_cases)
    out = str(tmp_path / "hopper.json")
    assert hopper_bench.main(["--out", out, "--parts", "training"]) == 0
    assert hopper_bench.main(["--out", out, "--parts", "training", "--head-dims", "256", "--append"]) == 0
    assert asked == [([64, 128], True), ([], True)]
    saved = results.load("hopper.json", out)
    assert [(r["d"], r["ms"]) for r in saved["results"]] == [(64, 1.0), (128, 1.0), (256, 2.0)]
    with pytest.raises(SystemExit):
        hopper_bench.main(["--out", out, "--parts", "dispatch", "--head-dims", "64"])


def test_the_backward_kernel_table_puts_the_other_dkdv_kernel_last_and_names_it():
    """hopper_bench.backward_kernel_table from synthetic rows: a column per kernel in the order measured, the other
    dK/dV kernel of each head dim (a different one at d = 64 and 128) in the last column, with its name."""
    from flashref.bench import hopper_bench

    rows = []
    for d in (64, 128):
        other = hopper_bench.OTHER_DKDV[d][0]
        for i, impl in enumerate(["gluon dK/dV", other, "gluon dQ", "teaching dK/dV", "teaching dQ"]):
            rows.append({"case": "bwd kernel", "impl": impl, "d": d, "N": 4096, "causal": False, "ms": 1.0,
                         "tflops": 100.0 * (i + 1) + d})
    rows.append({"case": "fwd", "impl": "sdpa-cudnn", "d": 64, "N": 4096, "causal": False, "tflops": 1.0})
    lines = hopper_bench.backward_kernel_table(rows).splitlines()
    assert lines[0].split()[3:8] == ["gluon", "dK/dV", "gluon", "dQ", "teaching"]
    assert lines[1].split()[:3] == ["64", "4096", "False"] and lines[1].split()[3:8] == ["164", "364", "464", "564",
                                                                                         "264"]
    assert lines[1].endswith("(warp-specialized)") and lines[2].endswith("(one warpgroup)")
    assert len(lines) == 3


def test_the_hopper_tables_and_plot_read_forward_rows_in_any_order():
    """``--append`` can leave the error rows (whose impl names FP8 too, but which have no step, d or causal) before
    the forward rows: the step table, the goals table and the plot must pick FP8's rows from the forward ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashref.bench import hopper_bench

    data = hopper_bench.load_results()
    errors = [r for r in data["results"] if r["case"] == "error"]
    rest = [r for r in data["results"] if r["case"] != "error"]
    assert errors and rest
    for rows in (errors + rest, rest + errors):
        table = hopper_bench.step_table(rows)
        assert all(label in table for _, label in hopper_bench.FP8_ROWS), table
        assert all(label in table for label, _ in hopper_bench.STEPS), table  # no label cut short
        assert len(hopper_bench.goals_table(rows).splitlines()) == 1 + len(hopper_bench._points(rows))
        hopper_bench.plot(dict(data, results=rows), point=(128, 16384, False))
        plt.close("all")
