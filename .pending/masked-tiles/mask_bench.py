"""Gluon backward kernels: mask on every tile (old) against the mask only where needed (runtime branch, 3 loops).
Times dK/dV and dQ alone (triton.testing.do_bench, median), checks the variants' gradients are bitwise equal."""
import importlib.util, sys, json, time
import torch, triton
from flashref.triton import flash_attention_forward, ops

def load(name):
    spec = importlib.util.spec_from_file_location(name, f".exp/{name}.py")
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m

mods = {n: load(n) for n in ("hb_old", "hb_if", "hb_3loop")}
SHAPES = [  # B, H, N, d, causal, window
    (8, 16, 4096, 64, True, None), (8, 16, 4096, 64, False, None),
    (8, 16, 4096, 128, True, None), (8, 16, 4096, 128, False, None),
    (4, 16, 8192, 128, True, None), (8, 16, 4000, 64, True, None),
    (4, 16, 8192, 128, True, (1023, 0)), (2, 16, 16384, 128, True, (1023, 0)),
    (4, 32, 8192, 64, True, (1023, 0)),
]
out = []
for B, H, N, d, causal, window in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    kw = dict(window_size=window) if window else {}
    o, lse = flash_attention_forward(q, k, v, causal, check_finite=False, kernel="triton", **kw)
    m2, l2 = ops._stats_from_lse(lse)
    delta = ops._delta(o, do)
    feat = ops.Features(q, k, causal=causal, scale=d ** -0.5, window_size=window or (-1, -1), check_finite=False)
    win = (feat.win_left, feat.win_right) if feat.window else None
    scale = d ** -0.5
    ref = None
    row = dict(B=B, H=H, N=N, d=d, causal=causal, window=window)
    for name, hb in mods.items():
      try:
        dk, dv = hb.hopper_dkdv(q, k, v, do, m2, l2, delta, feat.causal, scale, window=win)
        dq = hb.hopper_dq(q, k, v, do, m2, l2, delta, feat.causal, scale, window=win)
        got = (dq, dk, dv)
        if ref is None:
            ref = got
        row[name + " equal"] = all(torch.equal(a, b) for a, b in zip(got, ref))
        row[name + " dkdv"] = triton.testing.do_bench(lambda: hb.hopper_dkdv(q, k, v, do, m2, l2, delta, feat.causal, scale, window=win), warmup=50, rep=300)
        row[name + " dq"] = triton.testing.do_bench(lambda: hb.hopper_dq(q, k, v, do, m2, l2, delta, feat.causal, scale, window=win), warmup=50, rep=300)
      except Exception as e:
        row[name + " error"] = repr(e)[:300]
    if window:
        row["teaching dkdv"] = triton.testing.do_bench(lambda: ops._backward(q, k, v, o, (m2, l2), do, scale, True, feat, "triton", parts=("dkdv",), delta=delta), warmup=50, rep=300)
        row["teaching dq"] = triton.testing.do_bench(lambda: ops._backward(q, k, v, o, (m2, l2), do, scale, True, feat, "triton", parts=("dq",), delta=delta), warmup=50, rep=300)
    print(json.dumps(row), flush=True)
    out.append(row)

# Bitwise agreement with the old kernels on uneven shapes and every feature (the old ones are tested against the
# float64 reference); then a float64 check of the new ones on a few of them.
from flashref import reference
ODD = [  # B, H, N_q, N_k, d, causal, align, window, alibi, dropout_p
    (2, 3, 113, 203, 64, True, "top_left", (-1, -1), False, 0.0), (2, 3, 1, 239, 128, False, "top_left", (-1, -1), False, 0.0),
    (2, 3, 239, 1, 64, True, "top_left", (-1, -1), False, 0.0), (2, 3, 300, 97, 128, True, "bottom_right", (-1, -1), False, 0.0),
    (2, 3, 1023, 1024, 128, True, "top_left", (-1, -1), True, 0.0), (2, 3, 777, 777, 64, False, "top_left", (37, 90), True, 0.0),
    (2, 3, 700, 900, 128, False, "top_left", (-1, 20), False, 0.0), (2, 3, 900, 700, 64, True, "bottom_right", (100, 0), False, 0.0),
    (2, 3, 1000, 1000, 64, True, "top_left", (-1, -1), False, 0.1), (2, 3, 513, 1000, 128, False, "top_left", (-1, -1), False, 0.1),
    (1, 2, 2048, 2048, 128, True, "top_left", (255, 0), True, 0.0), (1, 2, 4096, 4096, 64, False, "top_left", (200, 300), False, 0.0),
]
bad = 0
for B, H, Nq, Nk, d, causal, align, window, alibi, p in ODD:
    g = torch.Generator(device="cuda").manual_seed(Nq + Nk)
    q = torch.randn(B, H, Nq, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(B, H, Nk, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    slopes = torch.rand(H, device="cuda") if alibi else None
    kw = dict(window_size=window, causal_align=align, alibi_slopes=slopes, dropout_p=p, seed=7 if p else None)
    o, lse = flash_attention_forward(q, k, v, causal, check_finite=False, kernel="triton", **kw)
    m2, l2 = ops._stats_from_lse(lse)
    delta = ops._delta(o, do)
    feat = ops.Features(q, k, p, 7 if p else None, causal=causal, scale=d ** -0.5, window_size=window,
                        alibi_slopes=slopes, check_finite=False, causal_align=align)
    win = (feat.win_left, feat.win_right) if feat.window else None
    drop = ops._dropout_scalars(feat)
    res = {}
    for name, hb in mods.items():
        try:
            res[name] = hb.hopper_backward(q, k, v, do, m2, l2, delta, feat.causal, d ** -0.5, window=win, slopes2=feat.slopes2, dropout=drop)
        except Exception as e:
            res[name] = repr(e)[:200]
    eq = {n: (r if isinstance(r, str) else all(torch.equal(a, b) for a, b in zip(r, res["hb_old"]))) for n, r in res.items()}
    finite = {n: (not isinstance(r, str)) and all(bool(torch.isfinite(a).all()) for a in r) for n, r in res.items()}
    bad += sum(1 for n in eq if eq[n] is not True)
    print(json.dumps(dict(shape=[B, H, Nq, Nk, d, causal, align, window, alibi, p], equal=eq, finite=finite)), flush=True)
print("ODD MISMATCHES", bad)
