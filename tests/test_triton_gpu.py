"""The FlashAttention test method on a GPU: flashref.triton in fp16/bf16 against an fp32 reference, within
2x (forward) and 3x (gradients) the error of plain PyTorch attention in the same precision; forward and
backward deterministic. Run on the GPU machine (marker ``gpu``), also with ``FLASHREF_T4_CONFIGS=1``.

Autotuning is off here (``FLASHREF_TRITON_AUTOTUNE=0``: the first config that fits the GPU) to keep
compile time short; ``test_every_config_is_correct`` pins each config the autotuner may choose in turn.
The method runs on both forwards ``flash_attention`` can take: ``kernel="triton"`` (the teaching kernel, which
the config and autotuning tests pin) and ``kernel="auto"`` (on an H100, the Hopper forward for what it supports).
"""

from __future__ import annotations

import functools

import pytest
import torch

from flashref.tolerance import assert_within_tolerance
from tests._triton_helpers import flash_forward_backward, make_qkv, plain_forward_backward

pytestmark = pytest.mark.gpu

LENGTHS = [(113, 203), (128, 217), (1, 239), (1023, 1024), (2048, 2048), (239, 1), (300, 97)]
CASES = ([(d, torch.float16) for d in (32, 64, 96, 128, 256)] + [(d, torch.bfloat16) for d in (64, 128)])


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("FLASHREF_TRITON_AUTOTUNE", "0")


def _batch(N_q, N_k):
    return (2, 3) if max(N_q, N_k) <= 1024 else (1, 2)


def _check(q, k, v, do, causal, deterministic=True, kernel="triton"):
    from flashref.triton import flash_attention

    fn = functools.partial(flash_attention, deterministic=deterministic, kernel=kernel)
    got = flash_forward_backward(fn, q, k, v, do, causal)
    ref = plain_forward_backward(*(x.float() for x in (q, k, v, do)), causal)
    base = plain_forward_backward(q, k, v, do, causal)
    for name, g, r, b, factor in zip(("o", "dq", "dk", "dv"), got, ref, base, (2.0, 3.0, 3.0, 3.0)):
        assert g.dtype == q.dtype
        assert_within_tolerance(g, r, b, factor=factor, name=f"{name} ({q.dtype}, causal={causal})")


@pytest.mark.parametrize("kernel", ["triton", "auto"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_method(d, dtype, causal, kernel):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs compute capability 8.0")
    for i, (N_q, N_k) in enumerate(LENGTHS):
        if d == 256 and max(N_q, N_k) > 1024:
            continue
        B, H = _batch(N_q, N_k)
        q, k, v, do = make_qkv(B, H, N_q, N_k, d, dtype, "cuda", seed=i + d)
        _check(q, k, v, do, causal, kernel=kernel)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.float16), (256, torch.float16),
                                     (128, torch.bfloat16)], ids=lambda x: str(x).replace("torch.", ""))
def test_method_on_the_hopper_forward(d, dtype, causal):
    """kernel="hopper" (an H100): the same rule on the uneven shapes, extreme logits too, with its o, lse and row
    statistics equal to what kernel="auto" computes, and the backward recomputing from them: the Gluon backward
    (at d = 256 its dK/dV kernel whose warpgroups split the head dim)."""
    from flashref.triton import backward_kernel, flash_attention_forward, forward_kernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward needs an sm_90 GPU")
    for i, (N_q, N_k) in enumerate(LENGTHS):
        B, H = _batch(N_q, N_k)
        q, k, v, do = make_qkv(B, H, N_q, N_k, d, dtype, "cuda", seed=300 + i + d)
        assert forward_kernel(q, k, v, causal) == "hopper"
        assert backward_kernel(q, k, v, causal, kernel="hopper") == "hopper"
        _check(q, k, v, do, causal, kernel="hopper")
        o_auto, lse_auto = flash_attention_forward(q, k, v, causal)
        o_hop, lse_hop = flash_attention_forward(q, k, v, causal, kernel="hopper")
        assert torch.equal(o_auto, o_hop) and torch.equal(lse_auto, lse_hop)
    q, k, v, do = make_qkv(1, 2, 300, 517, d, dtype, "cuda", seed=d)
    _check(q * 30, k, v, do, causal, kernel="hopper")  # extreme logits: scores in the hundreds


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_method_with_t4_configs(monkeypatch, dtype, causal):
    """Our Colab stand-in: the same checks with only the configs a T4 would use."""
    monkeypatch.setenv("FLASHREF_T4_CONFIGS", "1")
    for d in (64, 128):
        for i, (N_q, N_k) in enumerate([(113, 203), (1, 239), (1023, 1024)]):
            q, k, v, do = make_qkv(2, 3, N_q, N_k, d, dtype, "cuda", seed=100 + i)
            _check(q, k, v, do, causal)  # the teaching kernel: what a T4 runs


@pytest.mark.parametrize("kernel", ["triton", "auto"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.float16), (64, torch.bfloat16)],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_method_atomic_dq(d, dtype, causal, kernel):
    """deterministic=False meets the same tolerance rule: dQ added atomically by the teaching dK/dV kernel, or
    (kernel="auto" on an H100) by the one-kernel Gluon backward's TMA reduces."""
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs compute capability 8.0")
    for i, (N_q, N_k) in enumerate([(113, 203), (1, 239), (1023, 1024), (300, 97), (2048, 2048)]):
        B, H = _batch(N_q, N_k)
        q, k, v, do = make_qkv(B, H, N_q, N_k, d, dtype, "cuda", seed=200 + i + d)
        _check(q, k, v, do, causal, deterministic=False, kernel=kernel)


@pytest.mark.parametrize("kernel", ["triton", "auto"])
def test_deterministic(kernel):
    """Two runs agree bit for bit, on the teaching kernels and on what "auto" takes (on an H100: the Gluon forward
    and backward)."""
    from flashref.triton import flash_attention

    fn = functools.partial(flash_attention, kernel=kernel)
    q, k, v, do = make_qkv(2, 4, 1000, 1000, 64, torch.float16, "cuda", seed=1)
    for causal in (False, True):
        first = flash_forward_backward(fn, q, k, v, do, causal)
        second = flash_forward_backward(fn, q, k, v, do, causal)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


def test_every_config_is_correct():
    """Each config the autotuner may pick on this GPU (d = 64 and 128, fp16, causal), pinned in turn."""
    from flashref.triton import configs, flash_attention
    from flashref.triton.ops import fixed_configs

    for d in (64, 128):
        q, k, v, do = make_qkv(1, 2, 333, 517, d, torch.float16, "cuda", seed=d)
        lists = {name: configs.device_candidates(name, d, 2) for name in ("forward", "dkdv", "dq")}
        for i in range(max(len(c) for c in lists.values())):
            pinned = {name: c[min(i, len(c) - 1)] for name, c in lists.items()}
            with fixed_configs(**pinned):
                _check(q, k, v, do, True)


def test_autotuned_path(monkeypatch):
    """The default (autotuned) path on one shape."""
    from flashref.triton import flash_attention

    monkeypatch.setenv("FLASHREF_TRITON_AUTOTUNE", "1")
    q, k, v, do = make_qkv(2, 4, 1024, 1024, 64, torch.float16, "cuda", seed=3)
    _check(q, k, v, do, True)


def test_autotuned_path_with_t4_configs(monkeypatch):
    """FLASHREF_T4_CONFIGS=1 is read when tuning, not at import: the autotuner then picks from the T4 list,
    after it has tuned the same shape with the large list."""
    from flashref.triton import configs, flash_attention, ops

    monkeypatch.setenv("FLASHREF_TRITON_AUTOTUNE", "1")
    q, k, v, do = make_qkv(1, 2, 1024, 1024, 64, torch.float16, "cuda", seed=4)
    _check(q, k, v, do, False)
    monkeypatch.setenv("FLASHREF_T4_CONFIGS", "1")
    _check(q, k, v, do, False)
    # ops._tune_key: (name, HEAD_DIM, ..., T4 mode, dtypes); the T4 flag is second from the end
    chosen = {key[0]: cfg for key, cfg in ops._CHOSEN.items() if key[-2] and key[2] == 64}
    assert set(chosen) == {"forward", "dkdv", "dq"}
    for name, cfg in chosen.items():
        assert cfg in configs.KERNELS[name]["t4"], (name, cfg)


def test_memory_is_linear_in_n():
    """Forward+backward allocates O(N) beyond inputs, outputs and gradients (no N x N matrix)."""
    from flashref.triton import flash_attention

    q, k, v, do = make_qkv(1, 4, 16384, 16384, 64, torch.float16, "cuda", seed=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    flash_attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - start
    tensor_bytes = q.numel() * q.element_size()
    assert extra < 6 * tensor_bytes  # o, dq, dk, dv, small row statistics; an N x N matrix would be 256x


def test_block_sparse_backward_on_two_streams_matches_one_and_captures_in_a_cuda_graph(monkeypatch):
    """A block-sparse backward on the teaching kernels (on an H100 ``kernel="triton"``; ``"auto"`` takes the Gluon
    backward there, on one stream) launches dQ on a side stream beside dK/dV (ops._dq_stream). Its gradients
    equal, bit for bit, those of the same backward with both kernels on one stream, and the whole
    forward + backward replays from a CUDA graph with the same result (the side stream is forked from and
    joined to the capturing stream)."""
    from flashref import block_masks
    from flashref.triton import flash_attention, ops

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.float16) for _ in range(4))
    mask = block_masks.bigbird(block_masks.n_blocks(1000, 128), window=3, n_global=1, n_random=2, seed=0,
                               device="cuda")

    def grads():
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        flash_attention(qq, kk, vv, block_mask=mask, block_size=128, kernel="triton").backward(do)
        return [qq.grad, kk.grad, vv.grad]

    two = grads()
    torch.cuda.synchronize()
    with monkeypatch.context() as m:
        m.setattr(ops, "_dq_stream", lambda device: None)  # both kernels on the caller's stream
        one = grads()
    assert all(torch.equal(a, b) for a, b in zip(two, one))

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch.cuda.graph asks
        flash_attention(qq, kk, vv, block_mask=mask, block_size=128, kernel="triton").backward(do)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for x in (qq, kk, vv):
        x.grad = None
    with torch.cuda.graph(graph):
        flash_attention(qq, kk, vv, block_mask=mask, block_size=128, check_finite=False,
                        kernel="triton").backward(do)
    for x in (qq, kk, vv):
        x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip([qq.grad, kk.grad, vv.grad], one))


def test_auto_takes_the_teaching_kernel_where_the_hopper_forward_cannot_run():
    """On an H100, kernel="auto" falls back for each thing the Hopper forward does not take, and kernel="hopper"
    refuses it naming it; the backward falls back with it (except for ALiBi, which the Gluon backward
    takes). deterministic=False takes the one-kernel Gluon backward at d = 64 and 128 without a window, the
    teaching kernel's atomic dQ otherwise at those head dims, and the Gluon pair at d = 256; dropout takes the
    one-kernel backward with its dQ adds in order where it can order them. A window (or bottom-right causal) takes
    the Hopper forward and the Gluon backward, at d = 64 and 128; so does a block mask whose blocks hold their
    tiles whole. At d = 256 the Gluon backward runs with causal masking or none: a window, ALiBi or a block mask
    keeps the teaching one. Strided q, k, v take the Gluon kernels (through contiguous copies). On any other GPU
    both say there is no sm_90."""
    from flashref.triton import backward_kernel, flash_attention, forward_kernel

    q, k, v, _ = make_qkv(1, 2, 300, 300, 128, torch.float16, "cuda", seed=5)
    if torch.cuda.get_device_capability() != (9, 0):
        assert forward_kernel(q, k, v) == "triton" and backward_kernel(q, k, v) == "triton"
        with pytest.raises(ValueError, match="needs an sm_90"):
            flash_attention(q, k, v, kernel="hopper")
        return
    assert forward_kernel(q, k, v) == "hopper" and backward_kernel(q, k, v) == "hopper"
    assert backward_kernel(q, k, v, deterministic=False) == "hopper-fused"
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, d) seen as (B, H, N, d): copied, not refused
    assert forward_kernel(strided, k, v) == "hopper" and backward_kernel(strided, k, v) == "hopper"
    assert backward_kernel(q, k, v, kernel="triton") == backward_kernel(q, k, v, False, kernel="triton") == "triton"
    q256 = torch.cat([q, q], -1)
    assert forward_kernel(q256, q256, q256) == "hopper" and backward_kernel(q256, q256, q256, True) == "hopper"
    assert backward_kernel(q256, q256, q256, deterministic=False) == "hopper"  # (the faster pair there)
    for kw in (dict(window_size=(16, 0)), dict(alibi_slopes=torch.ones(2, device="cuda")),
               dict(block_mask=torch.ones(1, 2, 3, 3, dtype=torch.bool, device="cuda"))):
        assert backward_kernel(q256, q256, q256, **kw) == "triton", kw
    windows = {"window_size": ((q, k, v), dict(window_size=(16, 0))),
               "bottom_right": ((q, k[:, :, :200].contiguous(), v[:, :, :200].contiguous()),
                                dict(causal=True, causal_align="bottom_right"))}
    for why, (args, kw) in windows.items():
        assert forward_kernel(*args, **kw) == "hopper", why
        assert backward_kernel(*args, **kw) == "hopper", why
        assert backward_kernel(*args, **kw, kernel="triton") == "triton", why
        assert backward_kernel(*args, **kw, deterministic=False) == "triton", why
        assert backward_kernel(*(x[..., :64].contiguous() for x in args), **kw) == "hopper", why
    slopes = torch.ones(2, device="cuda")
    # Dropout: the Gluon kernels (the teaching kernel's mask), but not with a window, nor at d = 256. Deterministic,
    # the one-kernel backward with its dQ adds in order where its visits can be ordered (3 key blocks, 5 query
    # tiles), the pair where they cannot (3 key blocks, 1 query tile, no causal mask); else the one-kernel backward
    assert forward_kernel(q, k, v, dropout_p=0.1) == "hopper"
    assert backward_kernel(q, k, v, dropout_p=0.1) == "hopper-ordered"
    assert backward_kernel(q[:, :, :64].contiguous(), k, v, dropout_p=0.1) == "hopper"
    assert backward_kernel(q, k, v, dropout_p=0.1, deterministic=False) == "hopper-fused"
    for args, kw in (((q, k, v), dict(window_size=(16, 0))), ((q256, q256, q256), {})):
        assert forward_kernel(*args, dropout_p=0.1, **kw) == "triton"
        assert backward_kernel(*args, dropout_p=0.1, **kw) == "triton"
        with pytest.raises(ValueError, match="dropout_p only without a window"):
            flash_attention(*args, dropout_p=0.1, **kw, kernel="hopper")
    # A block mask: the Gluon forward and backward walk its lists where its blocks hold their tiles whole
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool, device="cuda")
    assert forward_kernel(q, k, v, block_mask=mask) == "hopper" and backward_kernel(q, k, v, block_mask=mask) == "hopper"
    small = torch.ones(1, 1, 5, 5, dtype=torch.bool, device="cuda")  # 64-token blocks split d = 64's 128-key tiles
    assert forward_kernel(q, k, v, block_mask=small, block_size=64) == "hopper"  # d = 128's 64 x 64 tiles fit
    q64, k64, v64 = (x[..., :64].contiguous() for x in (q, k, v))
    assert forward_kernel(q64, k64, v64, block_mask=small, block_size=64) == "triton"
    with pytest.raises(ValueError, match="block_mask"):
        flash_attention(q64, k64, v64, block_mask=small, block_size=64, kernel="hopper")
    assert forward_kernel(q, k, v, block_mask=mask, dropout_p=0.1) == "triton"
    calls = {"softcap": ((q, k, v), dict(softcap=30.0)),
             "alibi_slopes": ((q, k, v), dict(alibi_slopes=slopes)),
             "float16 or bfloat16": ((q.float(), k.float(), v.float()), {}),
             "head dim": (tuple(x[..., :96].contiguous() for x in (q, k, v)), {}),
             "grouped-query": ((q, k[:, :1], v[:, :1]), {})}
    gluon_backward_takes = ("alibi_slopes",)  # with the teaching forward's statistics
    for why, (args, kw) in calls.items():
        assert forward_kernel(*args, **kw) == "triton", why
        assert backward_kernel(*args, **kw) == ("hopper" if why in gluon_backward_takes else "triton"), why
        with pytest.raises(ValueError, match=why):
            flash_attention(*args, **kw, kernel="hopper")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_q_k_v_give_the_contiguous_inputs_results_bit_for_bit(d, causal):
    """q, k, v as a model's projection gives them ((B, N, 3, H, d) seen as three (B, H, N, d) views) are read in
    place by the Gluon kernels (tiles past a head's last row now read the next batch row's tokens instead of the
    next head's, masked alike), and o comes in their (B, N, H, d) layout: o and the gradients are those of
    contiguous inputs, bit for bit, on the full path and on the planned steps after it, with dO contiguous (copied
    into o's layout) or in o's layout already; and within the tolerance rule of the float32 reference."""
    from flashref.triton import flash_attention, forward_kernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on an sm_90 GPU")
    B, H, N = 2, 3, 333
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    buf = torch.randn(B, N, 3, H, d, device="cuda", dtype=torch.float16, generator=g)
    do = torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g)
    views = [buf[:, :, i].transpose(1, 2) for i in range(3)]
    assert forward_kernel(*views, causal=causal) == "hopper" and not views[0].is_contiguous()
    plain = [x.contiguous().requires_grad_() for x in views]
    o_ref = flash_attention(*plain, causal=causal, check_finite=False)
    o_ref.backward(do)
    token_do = do.transpose(1, 2).contiguous().transpose(1, 2)  # as the gradient of o.transpose(1, 2) comes
    for step in range(4):  # the first call takes the full path, the next ones its plan
        leaf = buf.clone().requires_grad_()
        qkv = [leaf[:, :, i].transpose(1, 2) for i in range(3)]
        o = flash_attention(*qkv, causal=causal, check_finite=False)
        assert o.transpose(1, 2).is_contiguous()  # o in the model's layout: its transpose-reshape is a view
        o.backward(do if step % 2 else token_do)
        assert torch.equal(o, o_ref)
        for i, x in enumerate(plain):
            assert torch.equal(leaf.grad[:, :, i].transpose(1, 2), x.grad)
    _check(*views, do, causal, kernel="auto")
