"""flashref.triton against the float64 reference, forward and backward, on small uneven shapes.

Without a CUDA device (CI) the kernels run in Triton's CPU interpreter on CPU tensors; on the GPU machine
the same tests run compiled. fp32 is held to the tolerance rule against plain fp32 attention (the kernels
compute fp32 with input_precision="ieee"); fp16 and bf16 to the rule against plain attention in that
precision (factor 2 forward, 3 for gradients).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

from flashref import reference
from flashref.tolerance import assert_within_tolerance
from flashref.triton import flash_attention, flash_attention_backward, flash_attention_forward
from tests._triton_helpers import flash_forward_backward, make_qkv, plain_forward_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [(1, 1), (1, 17), (17, 1), (33, 47), (65, 64)]


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    """On a GPU, launch the first config that fits rather than autotuning every small shape (compile time)."""
    monkeypatch.setenv("FLASHREF_TRITON_AUTOTUNE", "0")


def _np64(x):
    return x.detach().cpu().double().numpy()


def _atol(q, ref):
    """fp32: 1e-5 of the reference's scale (plain fp32 attention can be exact on tiny shapes, where the
    rule's default slack of two ulps would demand bit-exactness from a different summation order);
    fp16/bf16: the rule's default."""
    return 1e-5 * max(1.0, float(np.abs(ref).max())) if q.dtype == torch.float32 else None


def _check_against_reference(q, k, v, do, causal, sm_scale=None, deterministic=True):
    """Forward, lse and the three gradients against float64, with plain attention in q's dtype as baseline."""
    fn = functools.partial(flash_attention, deterministic=deterministic)
    o, dq, dk, dv = flash_forward_backward(fn, q, k, v, do, causal, sm_scale)
    _, lse = flash_attention_forward(q, k, v, causal=causal, sm_scale=sm_scale)
    q64, k64, v64, do64 = (_np64(x) for x in (q, k, v, do))
    ref_o, ref_lse = reference.attention(q64, k64, v64, causal=causal, sm_scale=sm_scale, return_lse=True)
    ref_grads = reference.attention_backward(q64, k64, v64, do64, causal=causal, sm_scale=sm_scale)
    base = plain_forward_backward(q, k, v, do, causal, sm_scale)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert_within_tolerance(o, ref_o, base[0], factor=2.0, atol=_atol(q, ref_o), name="o")
    for name, got, ref, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, base[1:]):
        assert got.shape == b.shape
        assert_within_tolerance(got, ref, b, factor=3.0, atol=_atol(q, ref), name=name)
    # lse is fp32 whatever the inputs: its error is that of fp32 scores of fp16/bf16-rounded inputs
    np.testing.assert_allclose(_np64(lse), ref_lse, rtol=0, atol=1e-4 * max(1.0, np.abs(ref_lse).max()))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 40, 64])
@pytest.mark.parametrize("N_q,N_k", LENGTHS)
def test_fp32_matches_reference(N_q, N_k, d, causal):
    q, k, v, do = make_qkv(1, 2, N_q, N_k, d, torch.float32, DEVICE, seed=N_q * 1000 + N_k + d)
    _check_against_reference(q, k, v, do, causal)


def test_fp32_is_computed_in_fp32():
    """No TF32 and no fp16 rounding: fp32 results agree with float64 to a few fp32 ulps."""
    q, k, v, _ = make_qkv(1, 1, 40, 50, 64, torch.float32, DEVICE, seed=3)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    ref_o, ref_lse = reference.attention(_np64(q), _np64(k), _np64(v), causal=True, return_lse=True)
    assert np.abs(_np64(o) - ref_o).max() < 2e-6
    assert np.abs(_np64(lse) - ref_lse).max() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k,d", [(33, 47, 40), (65, 64, 64), (17, 1, 16)])
def test_low_precision_within_tolerance(N_q, N_k, d, causal, dtype):
    q, k, v, do = make_qkv(2, 2, N_q, N_k, d, dtype, DEVICE, seed=7 + d)
    _check_against_reference(q, k, v, do, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(causal, dtype):
    """Scores scaled by 1e3: the running max keeps exp from overflowing; every row stays finite."""
    q, k, v, do = make_qkv(1, 2, 33, 47, 32, dtype, DEVICE, seed=11)
    _check_against_reference(q, k, v, do, causal, sm_scale=1e3 / 32**0.5)


def test_sm_scale_is_used():
    q, k, v, do = make_qkv(1, 1, 20, 30, 16, torch.float32, DEVICE, seed=5)
    _check_against_reference(q, k, v, do, False, sm_scale=0.3)


@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs(causal):
    """Non-contiguous q, k, v (a (B, N, H, d) buffer seen as (B, H, N, d), and a slice of the head dim) are
    read through their strides, with no copy; the result matches the contiguous inputs' to fp32 rounding
    (on a GPU the two may compile with different load widths) and the float64 reference."""
    g = torch.Generator().manual_seed(13)
    base = torch.randn(2, 37, 3, 3, 48, generator=g).to(DEVICE)  # (B, N, 3 tensors, H, d + 8)
    q, k, v = (base[:, :, i].transpose(1, 2)[..., :40] for i in range(3))
    assert not q.is_contiguous()
    do = torch.randn(2, 37, 3, 40, generator=g).to(DEVICE).transpose(1, 2)
    o, dq, dk, dv = flash_forward_backward(flash_attention, q, k, v, do, causal)
    want = flash_forward_backward(flash_attention, *(x.contiguous() for x in (q, k, v, do)), causal)
    for got, ref in zip((o, dq, dk, dv), want):
        assert float((got - ref).abs().max()) <= 1e-6 * max(1.0, float(ref.abs().max()))
    _check_against_reference(q, k, v, do, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k,d", [(1, 17, 16), (33, 47, 40), (65, 64, 64), (70, 10, 16)])
def test_atomic_dq_matches_reference(N_q, N_k, d, causal, dtype):
    """deterministic=False: the dK/dV kernel adds dQ atomically (no dQ kernel); same tolerance rule."""
    q, k, v, do = make_qkv(1, 2, N_q, N_k, d, dtype, DEVICE, seed=29 + N_q + d)
    _check_against_reference(q, k, v, do, causal, deterministic=False)


def test_atomic_dq_agrees_with_the_deterministic_path():
    q, k, v, do = make_qkv(2, 2, 50, 70, 32, torch.float32, DEVICE, seed=31)
    det = flash_forward_backward(flash_attention, q, k, v, do, True)
    atomic = flash_forward_backward(functools.partial(flash_attention, deterministic=False), q, k, v, do, True)
    for a, b in zip(det, atomic):
        assert float((a - b).abs().max()) < 1e-5
    o, lse = flash_attention_forward(q, k, v, causal=True)
    explicit = flash_attention_backward(q, k, v, o, lse, do, causal=True, deterministic=False)
    for a, b in zip(explicit, det[1:]):
        assert float((a - b).abs().max()) < 1e-5


def test_backward_function_matches_autograd():
    q, k, v, do = make_qkv(1, 2, 19, 23, 16, torch.float32, DEVICE, seed=17)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True)
    want = flash_forward_backward(flash_attention, q, k, v, do, True)[1:]
    for got, ref in zip(grads, want):  # from lse alone P carries one more rounding: fp32-close, not bitwise
        assert float((got - ref).abs().max()) < 1e-5


def test_deterministic():
    q, k, v, do = make_qkv(1, 2, 45, 45, 16, torch.float16, DEVICE, seed=19)
    first = flash_forward_backward(flash_attention, q, k, v, do, True)
    second = flash_forward_backward(flash_attention, q, k, v, do, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_gradcheck_float64_is_refused_but_fp32_gradients_match_finite_differences():
    """float64 is not a kernel dtype (the error names it). In fp32, the directional derivative of
    sum(O * W) along a random direction E of q, k and v agrees with <grad, E> from the backward kernels."""
    q, k, v, _ = make_qkv(1, 1, 5, 7, 16, torch.float64, DEVICE, seed=23)
    with pytest.raises(TypeError, match="float16 or bfloat16 or float32"):
        flash_attention(q, k, v)
    q, k, v = (x.float() for x in (q, k, v))
    g = torch.Generator().manual_seed(29)
    w = torch.randn(q.shape, generator=g).to(DEVICE)
    e = [torch.randn(x.shape, generator=g).to(DEVICE) for x in (q, k, v)]
    loss = lambda a, b, c: float((flash_attention(a, b, c, causal=True).double() * w.double()).sum())  # noqa: E731
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    (flash_attention(qq, kk, vv, causal=True) * w).sum().backward()
    analytic = sum(float((x.grad.double() * d.double()).sum()) for x, d in zip((qq, kk, vv), e))
    eps = 1e-2
    plus = loss(*(x + eps * d for x, d in zip((q, k, v), e)))
    minus = loss(*(x - eps * d for x, d in zip((q, k, v), e)))
    numeric = (plus - minus) / (2 * eps)
    assert abs(numeric - analytic) <= 1e-3 * max(1.0, abs(analytic))


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors that name the argument
# ------------------------------------------------------------------------------------------------

def _ok(N=8, d=16, dtype=torch.float32):
    return make_qkv(1, 1, N, N, d, dtype, DEVICE)[:3]


def test_rejects_wrong_rank():
    q, k, v = _ok()
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, N, d\)"):
        flash_attention(q[0], k[0], v[0])


def test_rejects_mismatched_head_dims():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="k must have the head dimension"):
        flash_attention(q, k[..., :8], v)


def test_rejects_head_dim_over_256():
    q, k, v = _ok(N=2, d=264)
    with pytest.raises(ValueError, match="head dimension d = 264"):
        flash_attention(q, k, v)


def test_rejects_empty_sequence():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="empty sequence"):
        flash_attention(q[:, :, :0], k, v)


def test_rejects_mixed_dtypes_and_ints():
    q, k, v = _ok()
    with pytest.raises(TypeError, match="same dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="dtype float16 or bfloat16 or float32"):
        flash_attention(q.int(), k.int(), v.int())


def test_rejects_non_bool_deterministic():
    q, k, v, do = make_qkv(1, 1, 4, 4, 16, torch.float32, DEVICE)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention(q, k, v, deterministic=1)
    o, lse = flash_attention_forward(q, k, v)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention_backward(q, k, v, o, lse, do, deterministic="no")


def test_rejects_bad_causal_and_scale():
    q, k, v = _ok()
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="sm_scale must be a finite number"):
        flash_attention(q, k, v, sm_scale=float("nan"))
    with pytest.raises(TypeError, match="sm_scale must be a real number"):
        flash_attention(q, k, v, sm_scale="0.1")


def test_rejects_non_tensors():
    q, k, v = _ok()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attention(q.cpu().numpy(), k, v)


def test_rejects_sparse_tensors():
    q, k, v = _ok()
    with pytest.raises(TypeError, match="k must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        flash_attention(q, k.to_sparse(), v)
    rows = [q[0, 0], q[0, 0, :3]]  # two sequences of different lengths
    with warnings.catch_warnings():  # torch calls its strided nested layout a prototype; it is what a reader may have
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
        nested = torch.nested.nested_tensor(rows)
    with pytest.raises(TypeError, match="q must be a dense tensor, got a nested tensor"):
        flash_attention(nested, k, v)
    with pytest.raises(TypeError, match="q must be a dense \\(strided\\) tensor, got layout torch.jagged"):
        flash_attention(torch.nested.nested_tensor(rows, layout=torch.jagged), k, v)


def test_rejects_wrong_device():
    q, k, v = _ok()
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="must be CUDA tensors"):
            flash_attention(q.cpu(), k.cpu(), v.cpu())
    else:
        with pytest.raises(ValueError, match="must be CPU tensors"):
            flash_attention(q.to("meta"), k.to("meta"), v.to("meta"))


def test_kernel_picks_the_forward_and_refuses_what_it_cannot_run():
    """kernel="auto" runs the teaching kernels wherever the Hopper ones cannot (here: no sm_90 GPU, or fp32), with
    the same result as kernel="triton"; kernel="hopper" there is a ValueError saying why; a bad name is refused."""
    from flashref.triton import backward_kernel, forward_kernel

    q, k, v, do = make_qkv(1, 2, 33, 47, 64, torch.float32, DEVICE)
    assert forward_kernel(q, k, v, True) == "triton"
    assert forward_kernel(q, k, v, kernel="triton") == "triton"
    assert backward_kernel(q, k, v, True) == backward_kernel(q, k, v, True, kernel="hopper") == "triton"
    o, lse = flash_attention_forward(q, k, v, True)
    for a, b in zip(flash_attention_backward(q, k, v, o, lse, do, True),
                    flash_attention_backward(q, k, v, o, lse, do, True, kernel="triton")):
        assert torch.equal(a, b)
    for a, b in zip(flash_attention_forward(q, k, v, True), flash_attention_forward(q, k, v, True, kernel="triton")):
        assert torch.equal(a, b)
    auto = flash_forward_backward(flash_attention, q, k, v, do, True)
    teaching = flash_forward_backward(functools.partial(flash_attention, kernel="triton"), q, k, v, do, True)
    assert all(torch.equal(a, b) for a, b in zip(auto, teaching))
    with pytest.raises(ValueError, match="kernel='hopper': the Hopper forward"):
        flash_attention(q, k, v, kernel="hopper")
    with pytest.raises(ValueError, match="kernel='hopper'"):
        flash_attention_forward(q, k, v, kernel="hopper")
    with pytest.raises(ValueError, match="kernel must be one of 'auto', 'triton', 'hopper', got 'gluon'"):
        flash_attention(q, k, v, kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be one of"):
        forward_kernel(q, k, v, kernel=None)
    with pytest.raises(ValueError, match="kernel must be one of"):
        backward_kernel(q, k, v, kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be one of"):
        flash_attention_backward(q, k, v, o, lse, do, kernel=1)


def test_backward_rejects_bad_lse_and_do():
    q, k, v, do = make_qkv(1, 1, 8, 8, 16, torch.float32, DEVICE)
    o, lse = flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_attention_backward(q, k, v, o, lse[..., :4], do)
    with pytest.raises(ValueError, match="do must have the shape of o"):
        flash_attention_backward(q, k, v, o, lse, do[..., :4, :])


def test_every_listed_config_keeps_the_tile_rule():
    from flashref.triton import configs

    for kernel, pools in configs.KERNELS.items():
        for cfg in [*pools["large"], *pools["wide"], *pools["t4"], configs.INTERPRETER[kernel]]:
            configs.check_tile(kernel, cfg)


@pytest.mark.parametrize("kernel,cfg", [("forward", (16, 32, 4, 1)), ("dq", (16, 32, 4, 1)), ("dkdv", (32, 16, 4, 1))])
def test_pinned_config_breaking_the_tile_rule_is_refused(kernel, cfg):
    """A pinned config whose diagonal would not be whole tiles raises instead of computing garbage."""
    from flashref.triton import configs
    from flashref.triton.ops import fixed_configs

    q, k, v, do = make_qkv(1, 1, 40, 40, 16, torch.float32, DEVICE, seed=23)
    with fixed_configs(**{kernel: configs.TileConfig(*cfg)}), pytest.raises(ValueError, match="multiple of"):
        flash_forward_backward(flash_attention, q, k, v, do, True)
