"""The Hopper kernels' hardware profile (flashref.bench.hopper_profile): ncu's log read into rows, the tables the
notebook prints (forward, backward), --append, and the committed run (book/data/hopper_profile.json) complete for
every case it lists."""

from __future__ import annotations

import os

import pytest

from flashref.bench import hopper_profile as hp
from flashref.bench.hbm_bench import MARKER, parse_ncu_csv, split_cases

STALL = hp.STALL_PREFIX + "{}" + hp.STALL_SUFFIX + ".pct"


def _log(kernels):
    """An ncu --csv log of these kernels: (name, {metric: value})."""
    lines = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    for i, (name, metrics) in enumerate(kernels):
        lines += [f'"{i}","{name}","{m}","","{v}"' for m, v in metrics.items()]
    return "ncu: profiling\n" + "\n".join(lines)


def test_summarize_takes_the_longest_kernel_of_a_call_and_names_its_stalls():
    known = {"ns": hp.METRICS["ns"], "tensor": hp.METRICS["tensor"]}
    stalls = [STALL.format("barrier"), STALL.format("wait")]
    log = _log([(MARKER, {hp.METRICS["ns"]: 1000}),
                ("fill_kernel", {hp.METRICS["ns"]: 2000, hp.METRICS["tensor"]: 0}),
                ("hopper_ws_fwd_kernel", {hp.METRICS["ns"]: "3,500,000", hp.METRICS["tensor"]: 70.5,
                                          stalls[0]: 41.5, stalls[1]: "n/a"})])
    cases = split_cases(parse_ncu_csv(log))
    row = hp.summarize(cases[0], known, stalls)
    assert row["kernel"] == "hopper_ws_fwd_kernel" and row["ns"] == 3.5e6 and row["tensor"] == 70.5
    assert row["stalls"] == {"barrier": 41.5}  # "n/a": not read, left out
    assert [name for name, _ in row["launches"]] == ["fill_kernel", "hopper_ws_fwd_kernel"]
    assert hp.top_stalls({"stalls": {"a": 1.0, "b": 3.0, "c": 2.0}}, 2) == [("b", 3.0), ("c", 2.0)]


def test_the_table_has_a_line_for_each_profiled_case():
    rows = [dict(impl="flashref-hopper", B=16, H=16, N=4096, d=128, causal=False, ns=3.5e6, tensor=70.6, xu=36.4,
                 fma=14.3, alu=16.0, issue_active=33.5, stalls={"barrier": 41.5, "wait": 20.0, "selected": 11.2,
                                                                "gmma": 0.8}),
            dict(impl="sdpa-cudnn", B=16, H=16, N=4096, d=128, causal=True, status="not profiled")]
    text = hp.table({"results": rows})
    lines = text.splitlines()
    assert len(lines) == 3  # header, rule, the one profiled case
    assert "| 128 | 4K | no | flashref-hopper | 3500 | 71% | 36% | 14% | 16% | 34% | barrier 42%, wait 20%, " \
           "selected 11% |" == lines[2]


def test_cases_cover_the_goals_shapes_for_each_kernel():
    cases = hp.cases()
    assert len(cases) == sum(len(hp.SHAPES_OF[part]) * 2 * len(impls) for part, impls in hp.IMPLS.items())
    assert {c["part"] for c in cases} == {"fwd", "bwd", "fp8", "dropout"}
    assert {c["part"] for c in hp.cases(["bwd"])} == {"bwd"}
    for B, H, N, d in hp.SHAPES:
        assert B * N == 65536 and H * d == 2048
    # FP8 beside fp16 at each of those shapes, and at hopper_bench's d = 256 point (B 8, H 8, N 4K)
    fp8 = {(c["B"], c["H"], c["N"], c["d"], c["impl"]) for c in hp.cases(["fp8"])}
    assert fp8 == {(*shape, impl) for shape in [*hp.SHAPES, (8, 8, 4096, 256)] for impl in hp.IMPLS["fp8"]}
    # dropout at the features bench's dropout shape and rate, each kernel with and without the mask
    import inspect

    from flashref.bench import features_bench

    bench = {k: v.default for k, v in inspect.signature(features_bench.dropout_cases).parameters.items()}
    drop = hp.cases(["dropout"])
    assert {(c["B"], c["H"], c["N"], c["d"]) for c in drop} == {(bench["B"], bench["H"], bench["N"], 64)}
    assert len(drop) == 8 and hp.DROPOUT_P == bench["p"] and bench["head_dims"] == (64,)
    assert hp.part_of({"impl": "sdpa-cudnn"}) == "fwd"  # the first runs' rows (forward only) name no part


def test_the_table_shows_one_part(monkeypatch):
    row = dict(impl="sdpa-cudnn", B=16, H=16, N=4096, d=128, causal=False, ns=9.4e6, tensor=66, xu=13, fma=17,
               alu=23, issue_active=37, stalls={"long_scoreboard": 24})
    data = {"results": [row, dict(row, part="bwd", impl="flashref-hopper dQ", ns=4.9e6)]}
    assert hp.table(data).count("sdpa-cudnn") == 1 and "flashref-hopper dQ" not in hp.table(data)
    bwd = hp.table(data, "bwd")
    assert "| 128 | 4K | no | flashref-hopper dQ | 4900 |" in bwd and "sdpa-cudnn" not in bwd


def test_append_replaces_only_the_parts_profiled_again(monkeypatch, tmp_path):
    """``--parts bwd --append`` keeps the file's forward rows, replaces its backward rows, and adds its command."""
    import json

    import torch

    from flashref.bench import results

    out = str(tmp_path / "hopper_profile.json")
    versions = {**results.versions(), "ncu": "1", "driver": "2"}
    old = {"device": "NVIDIA H100 80GB HBM3", "versions": versions, "command": "python -m flashref.bench hopper-profile",
           "seconds": 60.0, "results": [{"impl": "sdpa-cudnn", "d": 64, "ns": 1.0},
                                        {"impl": "sdpa-flash", "part": "bwd", "d": 64, "ns": 2.0}]}
    with open(out, "w") as f:
        json.dump(old, f)
    monkeypatch.setattr(hp, "ncu_path", lambda: "ncu")
    monkeypatch.setattr(hp, "available", lambda ncu: ({"ns": hp.METRICS["ns"]}, []))
    monkeypatch.setattr(hp, "ncu_versions", lambda ncu: versions)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(hp, "measure", lambda todo, ncu, log=None: [dict(c, ns=3.0) for c in todo])
    assert hp.main(["--parts", "bwd", "--append", "--out", out]) == 0
    with open(out) as f:
        saved = json.load(f)
    assert saved["results"][0] == old["results"][0]  # the forward row kept
    assert all(r["part"] == "bwd" and r["ns"] == 3.0 for r in saved["results"][1:])
    assert len(saved["results"]) == 1 + len(hp.cases(["bwd"]))
    assert saved["command"] == old["command"] + "; python -m flashref.bench hopper-profile --parts bwd --out " + out


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), hp.DEFAULT_OUT)),
                    reason="no committed profile")
def test_the_committed_profile_read_every_case():
    data = hp.load_results()
    assert "H100" in data["device"] and data["versions"]["ncu"]
    keys = {(c["part"], c["impl"], c["N"], c["d"], c["causal"]) for c in hp.cases()}
    assert {(hp.part_of(r), r["impl"], r["N"], r["d"], r["causal"]) for r in data["results"]} == keys
    for r in data["results"]:
        assert r["ns"] > 0 and 0 < r["tensor"] <= 100 and 0 < r["issue_active"] <= 100, r
        # Shares of one whole, but ncu reads them over several replays of the kernel (one group of counters each),
        # so they come from different runs: seen up to 101.6% (the dK/dV kernel loading its statistics, d 64, 16K).
        assert r["stalls"] and sum(r["stalls"].values()) <= 103, r
        if r["impl"] == "flashref-hopper":
            assert r["kernel"].startswith(("hopper_fwd_kernel", "hopper_ws_fwd_kernel")), r["kernel"]
        elif r["impl"].startswith("flashref-hopper dK/dV"):
            assert r["kernel"].startswith(("hopper_bwd_dkdv_kernel", "hopper_ws_bwd_dkdv_kernel")), r["kernel"]
        elif r["impl"] == "flashref-hopper fp8":
            assert r["kernel"].startswith("hopper_ws_fwd_kernel"), r["kernel"]
        elif r["impl"] == "flashref-hopper dropout":
            assert r["kernel"].startswith("hopper_fwd_kernel"), r["kernel"]
        elif r["impl"].startswith("flashref-hopper fused"):
            assert r["kernel"].startswith("hopper_fused_bwd_kernel"), r["kernel"]
        elif r["impl"] == "flashref-hopper dQ":
            assert r["kernel"].startswith("hopper_bwd_dq_kernel"), r["kernel"]
