"""Host time per call of flashref's autograd op, main's code against this branch's, on the GPU machine.

    git archive main flashref | tar -x -C gpu_todo/main_copy   (before the run, on the CPU machine)
    python3 gpu_todo/host_compare.py

Each version runs in its own process (PYTHONPATH); shapes are small (B 1, H 2, N 1K, d 64) so the GPU is never
the limit: 200 calls issued back to back, then one synchronize; per call = elapsed / 200, median of 7 rounds."""
import json, os, statistics, subprocess, sys, time

CHILD = r'''
import json, statistics, sys, time, torch
from flashref import block_masks
from flashref.triton import flash_attention
gpu = torch.cuda.is_available()  # (on a CPU only a rehearsal of this script: the interpreter, tiny and few)
dev, sync = ("cuda", torch.cuda.synchronize) if gpu else ("cpu", lambda: None)
B, H, N, d = 1, 2, 1024 if gpu else 64, 64
CALLS, ROUNDS = (200, 7) if gpu else (1, 1)
g = torch.Generator(device=dev).manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, d, device=dev, dtype=torch.float16 if gpu else torch.float32, generator=g) for _ in range(4))
q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
n = block_masks.n_blocks(N, 128)
sw = block_masks.sliding_window(n, window=2, causal=True, device=dev)
bb = block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device=dev)
cases = {"dense causal": dict(causal=True), "dense det=False": dict(causal=True, deterministic=False),
         "sliding window": dict(causal=True, block_mask=sw), "bigbird": dict(block_mask=bb),
         "dropout 0.1": dict(causal=True, dropout_p=0.1, seed=1)}
out = {}
for name, kw in cases.items():
    def fwd():
        with torch.no_grad():
            flash_attention(q, k, v, check_finite=False, **kw)
    def step():
        o = flash_attention(q, k, v, check_finite=False, **kw)
        o.backward(do)
        q.grad = k.grad = v.grad = None
    for label, f in (("fwd", fwd), ("fwd+bwd", step)):
        for _ in range(20 if gpu else 1): f()
        sync()
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for _ in range(CALLS): f()
            sync()
            rounds.append((time.perf_counter() - t0) / CALLS * 1e6)
        out[f"{name} {label}"] = statistics.median(rounds)
print("RESULT " + json.dumps(out))
'''

def run(path):
    env = dict(os.environ, PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if not line:
        print(r.stdout[-2000:], r.stderr[-4000:]); raise SystemExit(1)
    return json.loads(line[0][7:])

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
versions = {"main": os.path.join(root, "gpu_todo", "main_copy"), "branch": root}
res = {name: [] for name in versions}
for _ in range(2):  # alternate: A B A B
    for name, path in versions.items():
        res[name].append(run(path))
print(f"{'case':28s} {'main us':>9s} {'branch us':>10s} {'saved':>7s}")
for case in res["main"][0]:
    m = statistics.median(r[case] for r in res["main"])
    b = statistics.median(r[case] for r in res["branch"])
    print(f"{case:28s} {m:9.1f} {b:10.1f} {m - b:7.1f}")
