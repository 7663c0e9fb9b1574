"""flashref.bench.step_profile on the CPU: the kernels' groups, the row it makes of a profile, and its command line
up to the measurement (which needs a GPU, and which these tests replace)."""

from __future__ import annotations

import pytest
import torch

from flashref.bench import results, step_profile

#: Kernel names as the torch profiler gave them for the model's step on an H200 (trimmed), with their group.
NAMES = [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0",
     "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*)", "attention"),
    ("hopper_bwd_dkdv_kernel", "attention"),
    ("hopper_fwd_kernel", "attention"),
    ("flash_bwd_preprocess_kernel", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4> >(Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)", "copies"),
    ("triton_poi_fused__unsafe_view_cat_clone_transpose_7", "copies"),
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", "matrix products"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "matrix products"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::TensorIterator",
     "other"),
    ("triton_poi_fused__to_copy_view_2", "other"),
    ("void at::native::vectorized_layer_norm_kernel<float, float, false>(int, float, float const*)", "other"),
]


@pytest.mark.parametrize("name, group", NAMES)
def test_each_kernel_counts_in_its_group(name, group):
    assert step_profile.kernel_group(name) == group
    assert step_profile.kernel_group(name.upper()) == group


def test_a_profile_becomes_a_row_whose_groups_add_up():
    kernels = {name: float(i + 1) for i, (name, _) in enumerate(NAMES)}
    row = step_profile.summarize(kernels)
    assert row["kernels_us"] == sum(kernels.values())
    assert sum(row["groups"].values()) == pytest.approx(row["kernels_us"])
    assert set(row["groups"]) == set(step_profile.GROUPS)
    assert row["groups"]["copies"] == kernels[NAMES[7][0]] + kernels[NAMES[8][0]]
    assert [us for _, us, _ in row["top"]] == sorted(kernels.values(), reverse=True)[:step_profile.TOP]
    assert all(group == step_profile.kernel_group(name) for name, _, group in row["top"])
    many = {f"k{i}": float(i) for i in range(3 * step_profile.TOP)}
    assert len(step_profile.summarize(many)["top"]) == step_profile.TOP


def _fake_row(attention, mode, T, B, us=1.0):
    return {"attention": attention, "mode": mode, "T": T, "batch": B, "step_ms": 2.0,
            **step_profile.summarize({"hopper_fwd_kernel": us, "nvjet_x": 2 * us})}


def test_the_command_line_needs_a_gpu_and_saves_each_attention_and_mode(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step_profile.main(["--out", str(tmp_path / "none.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_profile.main(["--T", "0"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU A")
    seen = []
    monkeypatch.setattr(step_profile, "profile_step", lambda a, m, T, B: seen.append((a, m, T, B)) or
                        _fake_row(a, m, T, B))
    out = str(tmp_path / "profile.json")
    assert step_profile.main(["--out", out, "--T", "1024"]) == 0
    assert seen == [(a, m, 1024, 16) for a in step_profile.ATTENTIONS for m in step_profile.MODES]
    saved = results.load("profile.json", out)
    assert saved["device"] == "GPU A" and saved["dtype"] == "bfloat16 autocast"
    assert saved["command"] == f"python -m flashref.bench step-profile --out {out} --T 1024"
    assert [(r["attention"], r["mode"]) for r in saved["results"]] == [(a, m) for a, m, _, _ in seen]
    assert "kernels ms" in capsys.readouterr().out

    monkeypatch.setattr(step_profile, "profile_step", lambda a, m, T, B: _fake_row(a, m, T, B, us=5.0))
    assert step_profile.main(["--out", out, "--T", "1024", "--batch", "2", "--append"]) == 0  # measured again
    saved = results.load("profile.json", out)
    assert len(saved["results"]) == len(seen) and all(r["kernels_us"] == 15.0 and r["batch"] == 2
                                                       for r in saved["results"])


def test_the_bench_command_line_knows_the_suite(monkeypatch):
    from flashref.bench import __main__ as bench_main

    monkeypatch.setattr(step_profile, "main", lambda argv: 7 if argv == ["--T", "8"] else 0)
    assert bench_main.main(["step-profile", "--T", "8"]) == 7
