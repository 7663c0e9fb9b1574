"""The one-kernel Hopper backward (flashref.triton.hopper_backward_fused): compiled for the H100 on any machine
(the TMA reduce and the warpgroups' own barriers in its PTX, within the H100's shared memory); its inputs checked;
and on an H100 dQ, dK and dV within the course's tolerance rule against float32 on uneven shapes, causal and not,
fp16 and bf16, with logits large and small (marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (before triton: the interpreter switch)
from tests._triton_helpers import compile_in_child, make_qkv, plain_forward_backward

_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from flashref.triton import hopper, hopper_backward_fused as hf
from flashref.triton.compile_check import ptxas_usage

for d in hf.HEAD_DIMS:
    cfg = hf.default_config(d)
    bm, rows = cfg["block_m"], cfg["block_n"] // 2
    cols = d // 2 if cfg["split_cols"] else d
    ql, kl = hopper.shared_layout((bm, d), gl.float16), hopper.shared_layout((rows, d), gl.float16)
    dl = gl.NVMMASharedLayout.get_default_for([bm, cols], gl.float32)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32)
    sig = {"q_desc": f"tensordesc<fp16[{bm}, {d}],{ql!r}>", "k_desc": f"tensordesc<fp16[{rows}, {d}],{kl!r}>",
           "v_desc": f"tensordesc<fp16[{rows}, {d}],{kl!r}>", "do_desc": f"tensordesc<fp16[{bm}, {d}],{ql!r}>",
           "lse_desc": f"tensordesc<fp32[1, {bm}],{sl!r}>", "delta_desc": f"tensordesc<fp32[1, {bm}],{sl!r}>",
           "dq_desc": f"tensordesc<fp32[{bm}, {cols}],{dl!r}>", "DK": "*fp16", "DV": "*fp16", "N_q": "i32",
           "N_k": "i32", "sm_scale": "fp32", "qk_scale": "fp32", "seed": "i64", "drop_below": "i32",
           "SEMS": "*i32"}
    for causal in (False, True):
        for dropout in (False, True) if d in hf.DROPOUT_HEAD_DIMS else (False,):
            for ordered in (False, True):
                cx = dict(HEAD_D=d, BLOCK_M=bm, BLOCK_N=cfg["block_n"], STAGES=cfg["stages"], CAUSAL=causal,
                          SPLIT_COLS=cfg["split_cols"], DROPOUT=dropout,
                          KEEP_LAYOUT=hopper.keep_t_layout(rows, bm, 4) if dropout else None, ORDERED=ordered,
                          num_warps=4)
                sig.update({k: "constexpr" for k in cx})
                k = triton.compile(GluonASTSource(hf.hopper_fused_bwd_kernel, sig, cx, {}),
                                   target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=4, maxnreg=hopper.WS_MAXNREG))
                ptx = k.asm["ptx"]
                print(d, causal, dropout, ordered, k.metadata.shared, ptxas_usage(k)["spill_stores"],
                      ptx.count("cp.reduce.async.bulk.tensor"), ptx.count("wgmma.mma_async"),
                      len(re.findall(r"bar\.sync\s+\d+,\s*128;", ptx)), ptx.count("ld.acquire.gpu"),
                      ptx.count("st.release.gpu"), ptx.count("cp.async.bulk.wait_group 0;"),
                      ptx.count("atom.global.gpu.relaxed.add"))
"""


def test_compiles_for_the_h100():
    """At d = 64 and 128, with dropout and without, causal and not, ordered and not: within the H100's 227 KB of
    shared memory (129 KB and 225 KB), wgmma products, and barriers of one warpgroup's 128 threads (a barrier of the
    whole block inside a warp-specialized kernel would hang); no register spills at d = 64, few at d = 128 (40-76
    bytes a thread with Triton 3.7; with dropout 44-88, the mask drawn late, 132-204 when a Philox call served eight
    entries, not sixteen; ordered 56-148). Unordered: one TMA reduce in each consumer's code and no semaphores.
    Ordered: the reduces in the writer warp, which acquires each tile's semaphore, waits for a reduce to land (all of
    it, not only its reads) and releases; and one ticket drawn a program. In a child process:
    compiling needs the interpreter off."""
    pytest.importorskip("triton.experimental.gluon")
    lines = compile_in_child(_COMPILE)
    assert [line[:4] for line in lines] == [[d, c, p, o] for d in ("64", "128") for c in ("False", "True")
                                            for p in ("False", "True") for o in ("False", "True")]
    for d, causal, dropout, ordered, shared, spills, reduces, wgmma, group_bars, *order in lines:
        acquires, releases, in_flight, tickets = (int(x) for x in order)
        assert int(shared) <= 227 * 1024, (d, causal, shared)
        assert int(wgmma) > 0 and int(group_bars) > 0, (d, causal, wgmma, group_bars)
        if ordered == "True":
            assert int(reduces) >= 1 and acquires >= 1 and releases >= 1 and in_flight >= 1 and tickets == 1, order
        else:
            assert int(reduces) == 2 and acquires == releases == in_flight == tickets == 0, (reduces, order)
        limit = {"64": 0, "128": 256 if dropout == "True" else 128}[d]
        assert int(spills) <= limit, (d, causal, dropout, ordered, spills)


def test_default_config_and_supported_say_why_not():
    """Head dims 64 and 128 only (a ValueError naming the head dim); :func:`supported` gives the Gluon backward's
    reasons first (here: no sm_90 GPU)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashref.triton import hopper_backward_fused as hf

    assert hf.default_config(64)["split_cols"] is False and hf.default_config(128)["split_cols"] is True
    with pytest.raises(ValueError, match="head dim in \\(64, 128\\), got 256"):
        hf.default_config(256)
    q = torch.zeros(1, 2, 8, 64)
    assert "needs an sm_90" in hf.supported(q, q, q)
    q256 = torch.zeros(1, 2, 8, 256)
    with pytest.raises(ValueError, match="takes dropout at head dims \\(64, 128\\), got 256"):
        hf.hopper_fused_backward(q256, q256, q256, q256, None, None, None, False, 0.1, dropout=(1, 100, 1.1))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        q256 = torch.zeros(1, 2, 8, 256, device="cuda", dtype=torch.float16)
        assert "head dim in (64, 128)" in hf.supported(q256, q256, q256)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.float16), (64, torch.bfloat16),
                                     (128, torch.bfloat16)], ids=lambda x: str(x).replace("torch.", ""))
def test_gradients_within_the_rule_on_uneven_shapes(d, dtype, causal):
    """dQ, dK and dV from the forward's statistics, within 3x the error of plain attention's in the same precision
    (the rule the two kernels meet), on lengths no tile divides, one query, one key, N_q != N_k, and logits 8x the
    usual size (sharp softmax rows: dS is large where P is near 1)."""
    from flashref.tolerance import assert_within_tolerance
    from flashref.triton import flash_attention_forward, ops

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs an sm_90 GPU")
    from flashref.triton import hopper_backward_fused as hf

    shapes = [(113, 203, 1), (1, 239, 1), (239, 1, 1), (300, 97, 1), (1023, 1024, 1), (2048, 2048, 1), (517, 300, 8)]
    for i, (N_q, N_k, scale) in enumerate(shapes):
        q, k, v, do = make_qkv(2, 3, N_q, N_k, d, dtype, "cuda", seed=i + d)
        q = (q.float() * scale).to(dtype)
        assert hf.supported(q, k, v) is None
        o, lse = flash_attention_forward(q, k, v, causal, kernel="triton")
        m2, l2 = ops._stats_from_lse(lse)
        got = hf.hopper_fused_backward(q, k, v, do, m2, l2, ops._delta(o, do), causal, d ** -0.5)
        ref = plain_forward_backward(*(x.float() for x in (q, k, v, do)), causal)[1:]
        base = plain_forward_backward(q, k, v, do, causal)[1:]
        for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
            assert g.dtype == dtype and g.shape == b.shape
            assert torch.isfinite(g).all(), (name, N_q, N_k)
            assert_within_tolerance(g, r, b, factor=3.0, name=f"{name} ({N_q}, {N_k}, x{scale}, causal={causal})")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_through_flash_attention_within_the_rule(causal, d):
    """deterministic=False with dropout at d = 64 and 128 runs the one-kernel backward (the forward's mask drawn once a
    tile for dQ, dK and dV): gradients within the rule against the float64 reference with the kernels' own mask
    (flashref.triton.dropout_mask), on uneven shapes and two batch rows."""
    import numpy as np

    from flashref import reference
    from flashref.tolerance import assert_within_tolerance
    from flashref.triton import backward_kernel, dropout_mask, flash_attention
    from tests._triton_helpers import np64, plain_with_features

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs an sm_90 GPU")
    for N_q, N_k in [(600, 700), (1, 239), (239, 3), (1000, 1000)]:
        B, H, p, seed = 2, 4, 0.2, 11 + N_q
        q, k, v, do = make_qkv(B, H, N_q, N_k, d, torch.float16, "cuda", seed=N_k)
        assert backward_kernel(q, k, v, causal, deterministic=False, dropout_p=p) == "hopper-fused"
        keep = dropout_mask(seed, B, H, N_q, N_k, p, "cuda")
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        flash_attention(qq, kk, vv, causal, deterministic=False, dropout_p=p, seed=seed).backward(do)
        ref_kw = dict(causal=causal, dropout_mask=keep.cpu().numpy(), dropout_p=p)
        refs = reference.attention_backward(*(np64(x) for x in (q, k, v, do)), **ref_kw)
        base = plain_with_features(q, k, v, do, causal, None, keep, p)[1:]
        for name, x, r, b in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), refs, base):
            assert torch.isfinite(x).all() and not np.isnan(r).any(), name
            assert_within_tolerance(x, r, b, factor=3.0, name=f"{name}, {N_q}x{N_k}, causal={causal}")


def test_ordered_supported_says_where_the_order_cannot_deadlock():
    """Causal, any length (a program waits only for key blocks that drew their tickets before it). Without causal
    masking the visits wrap around, so a head's key blocks must all be resident (no more than the GPU's
    multiprocessors) and start on tiles of their own (no more key blocks than 64-row query tiles)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashref.triton import hopper_backward_fused as hf

    assert hf.ordered_supported(1, 10**6, True, 132) is None
    assert hf.ordered_supported(4096, 4096, False, 132) is None
    assert hf.ordered_supported(132 * 128, 132 * 128, False, 132) is None
    assert "132 SMs" in hf.ordered_supported(132 * 128 + 1, 132 * 128 + 1, False, 132)
    assert "no more key blocks than query tiles (3 > 2)" in hf.ordered_supported(100, 300, False, 132)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_ordered_is_bitwise_reproducible_and_within_the_rule(causal, d):
    """ordered=True: dQ, dK and dV the same bits run after run (four runs), within the rule against float32 on
    uneven shapes (N_q != N_k, one query, one key, 8x logits, several heads of 4K, and as many 64-row query tiles
    as 128-row key blocks, 113 x 203 and 2048 x 4096, where a writer that released a tile late would deadlock),
    and with dropout the same gradients as the deterministic pair to fp16 rounding (both take the forward's mask)."""
    from flashref.tolerance import assert_within_tolerance
    from flashref.triton import flash_attention_forward, ops

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs an sm_90 GPU")
    from flashref.triton import hopper_backward_fused as hf

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(2, 3, 113, 203, 1), (2, 3, 239, 1, 1), (2, 3, 1023, 1024, 8), (1, 4, 517, 300, 1),
              (1, 4, 4096, 4096, 1), (1, 2, 2048, 4096, 1), (1, 2, 1, 239, 1) if causal else (1, 2, 70, 120, 1)]
    for B, H, N_q, N_k, scale in shapes:
        assert hf.ordered_supported(N_q, N_k, causal, sms) is None
        q, k, v, do = make_qkv(B, H, N_q, N_k, d, torch.float16, "cuda", seed=d + N_q)
        q = (q.float() * scale).half()
        o, lse = flash_attention_forward(q, k, v, causal, kernel="triton")
        m2, l2 = ops._stats_from_lse(lse)
        delta = ops._delta(o, do)
        got = hf.hopper_fused_backward(q, k, v, do, m2, l2, delta, causal, d ** -0.5, ordered=True)
        for _ in range(3):
            again = hf.hopper_fused_backward(q, k, v, do, m2, l2, delta, causal, d ** -0.5, ordered=True)
            for name, x, y in zip(("dq", "dk", "dv"), got, again):
                assert torch.equal(x, y), (name, B, H, N_q, N_k)
        ref = plain_forward_backward(*(x.float() for x in (q, k, v, do)), causal)[1:]
        base = plain_forward_backward(q, k, v, do, causal)[1:]
        for name, x, r, b in zip(("dq", "dk", "dv"), got, ref, base):
            assert_within_tolerance(x, r, b, factor=3.0, name=f"{name} ({B}, {H}, {N_q}, {N_k}, x{scale})")
    q, k, v, do = make_qkv(2, 3, 700, 600, d, torch.float16, "cuda", seed=7)
    feat = ops.Features(q, k, dropout_p=0.1, seed=1234, causal=causal, scale=d ** -0.5, check_finite=False)
    o, lse = flash_attention_forward(q, k, v, causal, dropout_p=0.1, seed=1234)
    m2, l2 = ops._stats_from_lse(lse)
    delta = ops._delta(o, do)
    pair = ops._backward(q, k, v, o, (m2, l2), do, d ** -0.5, True, feat, "hopper", delta=delta, parts=("dq",))[:1]
    pair += ops._backward(q, k, v, o, (m2, l2), do, d ** -0.5, True, feat, "hopper", delta=delta,
                          parts=("dkdv",))[1:]
    drop = ops._dropout_scalars(feat)
    got = hf.hopper_fused_backward(q, k, v, do, m2, l2, delta, causal, d ** -0.5, dropout=drop, ordered=True)
    again = hf.hopper_fused_backward(q, k, v, do, m2, l2, delta, causal, d ** -0.5, dropout=drop, ordered=True)
    for name, x, y, p in zip(("dq", "dk", "dv"), got, again, pair):
        assert torch.equal(x, y), name
        assert (x.float() - p.float()).abs().max() <= 5e-3 * p.float().abs().max(), name


@pytest.mark.gpu
def test_deterministic_dropout_through_flash_attention_runs_the_ordered_kernel_bit_for_bit():
    """flash_attention with dropout and deterministic=True (the default) at d = 64 and 128 runs the ordered
    one-kernel backward; two calls with one seed give the same gradients bit for bit."""
    from flashref.triton import backward_kernel, flash_attention

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs an sm_90 GPU")
    for d in (64, 128):
        for causal in (False, True):
            q, k, v, do = make_qkv(2, 4, 1000, 900, d, torch.float16, "cuda", seed=d)
            assert backward_kernel(q, k, v, causal, dropout_p=0.1) == "hopper-ordered"
            grads = []
            for _ in range(2):
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                flash_attention(qq, kk, vv, causal, dropout_p=0.1, seed=5).backward(do)
                grads.append((qq.grad, kk.grad, vv.grad))
            for a, b in zip(*grads):
                assert torch.equal(a, b), (d, causal)
