# Device calls to try branch gluon-atomic-dq (carry [".whl", ".exp"]). From the repository root:
#   git fetch .pending/gluon-atomic-dq.bundle gluon-atomic-dq:gluon-atomic-dq && git checkout gluon-atomic-dq
#   (merge main into it if main moved), cp .pending/gluon-atomic-dq/* .exp/
# Not yet run on a GPU: the kernel only compiled for sm_90 on the CPU (spills 16-152 bytes a thread, mostly dQ's
# 64-bit atomic addresses). First the correctness test, then the backward's time against the split and cuDNN.
# Already wired into ops._backward (deterministic=False on an H100 at d = 64 takes it; test_triton_gpu's
# test_method_atomic_dq then runs it end to end, and the dispatch test expects it). If it is not faster than the
# teaching kernel's atomic dQ, take the dispatch back out (ops._backward_kernel). Then benches (hopper --parts
# training; the model bench if it runs deterministic=False), notebooks 07-14 (ops.py and hopper_backward.py
# changes stale them), nbval, and notebook 14's prose on the backward (seven products against five).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 420 python3 -m pytest -q -o addopts= -p no:cacheprovider -n 14 -rfs -x tests/test_hopper_backward.py tests/test_triton_gpu.py 2>&1 | tail -8
timeout 200 python3 .exp/time_atomic.py 2>&1 | grep "=="
