"""flashref.reference against independent formulas, torch and finite differences (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashref import reference
from flashref.tolerance import check_tolerance

NS = [1, 7, 64, 100, 257]
DS = [1, 16, 64, 80]


def other_n(n: int) -> int:
    """A key length different from n (shorter for long sequences, longer for short ones)."""
    return n + 5 if n < 64 else n // 2 + 3


def make_qkv(shape_q, shape_k, seed=0, dtype=np.float64, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal(shape_q) * scale).astype(dtype)
    k = (rng.standard_normal(shape_k) * scale).astype(dtype)
    v = rng.standard_normal(shape_k).astype(dtype)
    return q, k, v


def naive_attention(q, k, v, causal, sm_scale):
    """Row by row with Python's math module: an implementation that shares no code with the package."""
    N_q, d = q.shape
    N_k = k.shape[0]
    o = np.zeros_like(q)
    lse = np.zeros(N_q)
    for i in range(N_q):
        keys = [j for j in range(N_k) if not causal or j <= i]
        s = [sm_scale * math.fsum(q[i, t] * k[j, t] for t in range(d)) for j in keys]
        mx = max(s)
        w = [math.exp(x - mx) for x in s]
        total = math.fsum(w)
        lse[i] = mx + math.log(total)
        for idx, j in enumerate(keys):
            o[i] += (w[idx] / total) * v[j]
    return o, lse


def torch_attention(q, k, v, causal, sm_scale, do=None):
    tq, tk, tv = (torch.tensor(x, requires_grad=do is not None) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=sm_scale)
    if do is None:
        return o.detach().numpy()
    o.backward(torch.tensor(do))
    return o.detach().numpy(), tuple(t.grad.numpy() for t in (tq, tk, tv))


def torch_lse(q, k, causal, sm_scale):
    s = sm_scale * torch.tensor(q) @ torch.tensor(k).transpose(-1, -2)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(s, dim=-1).numpy()


# ------------------------------------------------------------------ forward

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k", [(1, 1), (3, 5), (6, 4), (7, 7)])
def test_matches_naive_formula(N_q, N_k, causal):
    q, k, v = make_qkv((N_q, 3), (N_k, 3), seed=N_q * 10 + N_k)
    o, lse = reference.attention(q, k, v, causal=causal, sm_scale=0.7, return_lse=True)
    o_ref, lse_ref = naive_attention(q, k, v, causal, 0.7)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("same_n", [True, False], ids=["Nq=Nk", "Nq!=Nk"])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("N", NS)
def test_forward_matches_torch(N, d, same_n, causal):
    N_k = N if same_n else other_n(N)
    q, k, v = make_qkv((2, 3, N, d), (2, 3, N_k, d), seed=N + d)
    o, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    scale = 1 / math.sqrt(d)
    assert o.shape == q.shape and o.dtype == np.float64
    assert lse.shape == (2, 3, N)
    np.testing.assert_allclose(o, torch_attention(q, k, v, causal, scale), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, torch_lse(q, k, causal, scale), rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_sm_scale_and_default(causal):
    q, k, v = make_qkv((9, 16), (11, 16), seed=3)
    np.testing.assert_array_equal(reference.attention(q, k, v, causal=causal),
                                  reference.attention(q, k, v, causal=causal, sm_scale=0.25))
    np.testing.assert_allclose(reference.attention(q, k, v, causal=causal, sm_scale=2.0),
                               torch_attention(q, k, v, causal, 2.0), rtol=0, atol=1e-12)


def test_causal_rows_past_the_keys_see_every_key():
    """Top-left causal with N_q > N_k: rows i >= N_k attend every key, exactly like non-causal rows."""
    q, k, v = make_qkv((6, 4), (3, 4), seed=4)
    o_c = reference.attention(q, k, v, causal=True)
    o_f = reference.attention(q, k, v, causal=False)
    np.testing.assert_array_equal(o_c[3:], o_f[3:])
    assert not np.allclose(o_c[:2], o_f[:2])
    np.testing.assert_allclose(o_c[0], v[0], rtol=0, atol=1e-15)  # row 0 sees key 0 only


def test_causal_mask_is_top_left():
    mask = reference.causal_mask(3, 5)
    assert mask.tolist() == [[True, False, False, False, False],
                             [True, True, False, False, False],
                             [True, True, True, False, False]]
    assert reference.causal_mask(4, 2)[2:].all()


def test_single_token():
    q, k, v = make_qkv((1, 8), (1, 8), seed=5)
    o, lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(o, v)  # one key: all the weight on it
    np.testing.assert_allclose(lse, [q[0] @ k[0] / math.sqrt(8)], rtol=1e-15)


def test_batch_dims_equal_per_head_2d():
    q, k, v = make_qkv((2, 3, 10, 8), (2, 3, 13, 8), seed=6)
    o, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    for b in range(2):
        for h in range(3):
            o2, lse2 = reference.attention(q[b, h], k[b, h], v[b, h], causal=True, return_lse=True)
            np.testing.assert_allclose(o[b, h], o2, rtol=0, atol=1e-15)
            np.testing.assert_allclose(lse[b, h], lse2, rtol=0, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits_are_finite_and_right(causal):
    """Scores of size ~1e3 would overflow a naive exp (exp(710) = inf in float64); the max shift saves it."""
    q, k, v = make_qkv((2, 2, 33, 16), (2, 2, 47, 16), seed=7, scale=1e3 ** 0.5)
    s = np.abs(np.matmul(q, np.swapaxes(k, -1, -2)) / 4)
    assert s.max() > 800  # so np.exp(s) alone would overflow
    o, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(o, torch_attention(q, k, v, causal, 0.25), rtol=0, atol=1e-11)
    np.testing.assert_allclose(lse, torch_lse(q, k, causal, 0.25), rtol=1e-13)
    o_ref, lse_ref = naive_attention(q[0, 0], k[0, 0], v[0, 0], causal, 0.25)
    np.testing.assert_allclose(o[0, 0], o_ref, rtol=0, atol=1e-11)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_keeps_dtype_and_is_close(dtype):
    """In float32/float16 the reference runs in that precision (the tolerance rule's baseline): it keeps
    the dtype, stays finite with large logits, and its error is a few rounding steps."""
    q, k, v = make_qkv((2, 2, 40, 16), (2, 2, 30, 16), seed=8, scale=4.0)
    o, lse = reference.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=True, return_lse=True)
    assert o.dtype == dtype and lse.dtype == dtype
    o64 = reference.attention(q.astype(dtype).astype(np.float64), k.astype(dtype).astype(np.float64),
                              v.astype(dtype).astype(np.float64), causal=True)
    eps = np.finfo(dtype).eps
    assert np.isfinite(o).all()
    assert np.abs(o.astype(np.float64) - o64).max() < 64 * eps * np.abs(o64).max()
    # As the tolerance rule's baseline it rejects a visibly wrong answer.
    assert not check_tolerance(o + dtype(0.1), o64, o).ok


def test_torch_tensors_are_refused_with_the_conversion():
    """validation's rule: NumPy implementations take NumPy arrays, and say how to convert a tensor."""
    q, k, v = make_qkv((5, 4), (6, 4), seed=9)
    with pytest.raises(TypeError, match=r"k must be a NumPy array, got a torch.Tensor: pass k.detach\(\).cpu\(\).numpy\(\)"):
        reference.attention(q, torch.tensor(k), v)


# ------------------------------------------------------------------ backward

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("same_n", [True, False], ids=["Nq=Nk", "Nq!=Nk"])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("N", NS)
def test_backward_matches_torch_autograd(N, d, same_n, causal):
    N_k = N if same_n else other_n(N)
    q, k, v = make_qkv((1, 2, N, d), (1, 2, N_k, d), seed=N * d + 1)
    do = np.random.default_rng(N).standard_normal(q.shape)
    grads = reference.attention_backward(q, k, v, do, causal=causal)
    _, grads_torch = torch_attention(q, k, v, causal, 1 / math.sqrt(d), do=do)
    for name, g, gt in zip(("dq", "dk", "dv"), grads, grads_torch):
        assert g.shape == gt.shape and g.dtype == np.float64, name
        np.testing.assert_allclose(g, gt, rtol=0, atol=1e-11, err_msg=name)


def finite_difference_grads(q, k, v, do, causal, sm_scale, h=1e-6):
    """Central differences of the scalar loss sum(O * dO) with respect to each entry of q, k, v."""
    def loss(q_, k_, v_):
        return float(np.sum(reference.attention(q_, k_, v_, causal=causal, sm_scale=sm_scale) * do))

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        g = np.zeros_like(args[which])
        for idx in np.ndindex(g.shape):
            orig = args[which][idx]
            args[which][idx] = orig + h
            up = loss(*args)
            args[which][idx] = orig - h
            down = loss(*args)
            args[which][idx] = orig
            g[idx] = (up - down) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,shape_k", [((4, 3), (5, 3)), ((5, 2), (3, 2)), ((1, 4), (1, 4)),
                                             ((1, 2, 3, 2), (1, 2, 4, 2))])
def test_backward_matches_finite_differences(shape_q, shape_k, causal):
    q, k, v = make_qkv(shape_q, shape_k, seed=11)
    do = np.random.default_rng(12).standard_normal(q.shape)
    grads = reference.attention_backward(q, k, v, do, causal=causal, sm_scale=0.9)
    fd = finite_difference_grads(q, k, v, do, causal, 0.9)
    for name, g, g_fd in zip(("dq", "dk", "dv"), grads, fd):
        np.testing.assert_allclose(g, g_fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_backward_extreme_logits_finite_and_right():
    q, k, v = make_qkv((1, 1, 20, 8), (1, 1, 25, 8), seed=13, scale=30.0)
    do = np.random.default_rng(14).standard_normal(q.shape)
    grads = reference.attention_backward(q, k, v, do, causal=True, sm_scale=1.0)
    assert all(np.isfinite(g).all() for g in grads)
    _, grads_torch = torch_attention(q, k, v, True, 1.0, do=do)
    for g, gt in zip(grads, grads_torch):
        np.testing.assert_allclose(g, gt, rtol=1e-12, atol=1e-9)


def test_masked_keys_get_no_gradient():
    """With causal and N_k > N_q, keys j >= N_q are seen by no query: dk and dv are exactly 0 there."""
    q, k, v = make_qkv((3, 4), (6, 4), seed=15)
    _, dk, dv = reference.attention_backward(q, k, v, np.ones((3, 4)), causal=True)
    assert not dk[3:].any() and not dv[3:].any()
    assert dv[:3].any()


# ------------------------------------------------------------------ bytes and FLOPs

def test_worked_example_bytes():
    MiB = 2 ** 20
    assert reference.score_matrix_bytes(8192) == 256 * MiB
    assert reference.materialized_bytes(8192) == 512 * MiB
    assert reference.score_matrix_bytes(8192, dtype="float16") == 128 * MiB
    assert reference.score_matrix_bytes(4096, dtype=np.float32) == 64 * MiB
    assert reference.score_matrix_bytes(32, 128, dtype="float16") == 8 * 1024
    assert reference.score_matrix_bytes(1024, 2048, heads=16, batch=8, dtype=np.dtype("float64")) == \
        1024 * 2048 * 16 * 8 * 8
    assert reference.materialized_bytes(100, 30, heads=3, dtype="bfloat16") == 2 * 100 * 30 * 3 * 2
    assert reference.score_matrix_bytes(10, dtype=torch.float16) == 200


@pytest.mark.parametrize("dtype,size", [("float16", 2), ("bfloat16", 2), ("float32", 4), ("float64", 8),
                                        (np.float32, 4), (np.dtype("float16"), 2), (torch.bfloat16, 2)])
def test_itemsize(dtype, size):
    assert reference.itemsize(dtype) == size


def test_byte_count_matches_the_arrays_the_reference_builds():
    q, k, _ = make_qkv((2, 3, 17, 4), (2, 3, 29, 4), seed=16, dtype=np.float32)
    s = reference.scores(q, k, False, 0.5)
    assert s.nbytes == reference.score_matrix_bytes(17, 29, heads=3, batch=2, dtype=s.dtype)


def test_forward_flops():
    assert reference.forward_flops(1024, d=64) == 4 * 1024 * 1024 * 64
    assert reference.forward_flops(1024, 512, d=64, heads=2, batch=3, causal=True) == 2 * 1024 * 512 * 64 * 6
