"""Small launches of the three flashref.cupy kernels, for compute-sanitizer (memcheck, racecheck); run by
tests/test_cupy_gpu.py's sanitizer test on the GPU machine.

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/cupy_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/cupy_sanitize.py

Shapes cover edge tiles (N not a multiple of the block), N_q != N_k, N = 1 and causal; each result is
also checked against the float64 reference, so the script fails on a wrong answer as well.
"""

import sys

import numpy as np

from flashref import reference
from flashref.cupy import flash_attention_forward
from flashref.tolerance import check_tolerance


def main() -> int:
    import cupy as cp
    rng = np.random.default_rng(0)
    failures = 0
    for kernel, dtype in (("tiled", "float32"), ("tiled", "float16"), ("wmma", "float16"), ("mma", "float16")):
        for (N_q, N_k, d) in ((1, 1, 64), (70, 130, 64), (129, 65, 128), (33, 47, 24)):
            for causal in (False, True):
                q, k, v = (rng.standard_normal((1, 2, n, d)).astype(dtype) for n in (N_q, N_k, N_k))
                o = flash_attention_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal, kernel=kernel)
                ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
                result = check_tolerance(o, ref, reference.attention(q, k, v, causal=causal))
                failures += not result.ok
                print(f"{kernel:5s} {dtype:7s} N_q={N_q:3d} N_k={N_k:3d} d={d:3d} causal={causal!s:5s} {result}")
    cp.cuda.Device().synchronize()
    print("FAILURES:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
