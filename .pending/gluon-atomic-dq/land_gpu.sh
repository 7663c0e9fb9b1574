# Device calls to try branch gluon-atomic-dq (carry [".whl", ".exp"]). From the repository root:
#   git fetch .pending/gluon-atomic-dq.bundle gluon-atomic-dq:gluon-atomic-dq && git checkout gluon-atomic-dq
#   (merge main into it if main moved), cp .pending/gluon-atomic-dq/* .exp/
# Not yet run on a GPU: the kernel only compiled for sm_90 on the CPU (spills 16-152 bytes a thread, mostly dQ's
# 64-bit atomic addresses). First the correctness test, then the backward's time against the split and cuDNN.
# If faster: wire it into ops._backward (deterministic=False on an H100 at d = 64, instead of the teaching
# kernel's atomic dQ), then benches (hopper --parts training), notebooks 07-14 (hopper_backward.py changes stale
# them), nbval.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 300 python3 -m pytest -q -o addopts= -p no:cacheprovider -n 8 -rfs -x tests/test_hopper_backward.py 2>&1 | tail -8
timeout 200 python3 .exp/time_atomic.py 2>&1 | grep "=="
