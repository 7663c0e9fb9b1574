# Device calls to land branch sparse-gluon-fwd (carry [".whl", ".exp"]). From the repository root:
#   git fetch .pending/sparse-gluon-fwd.bundle sparse-gluon-fwd:sparse-gluon-fwd && git checkout sparse-gluon-fwd
#   (merge main into it if main moved), cp .pending/sparse-gluon-fwd/* .exp/
# Already seen on the H100 (2026-11-26): test_hopper.py all passed (new test_the_gluon_forward_walks_a_block_mask,
# d 64/128/256, included), the backward block-mask test and test_triton_gpu's dispatch test passed. Not yet run: the
# rest of test_triton_gpu.py. Then decide the head dims (d = 128 causal measured slower than the teaching forward,
# 2.635 vs 2.491 ms; see features_bench_measured_on_branch.json), re-measure, execute notebooks 07-14.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 420 python3 -m pytest -q -o addopts= -p no:cacheprovider -n 14 -rs tests/test_triton_gpu.py 2>&1 | tail -8
timeout 100 python3 .exp/fwd_time.py 2>&1 | grep "=="
