# Device call 1 for branch sparse-gluon-bwd (carry [".whl", ".exp"]; ~550 s on an H100). First:
#   cp .pending/sparse-gluon-bwd/* .exp/ && git fetch .pending/sparse-gluon-bwd.bundle sparse-gluon-bwd:sparse-gluon-bwd
#   git checkout sparse-gluon-bwd      (rebase on main if main moved)
# The branch changes every Gluon backward kernel's loads (_load_pair takes the tile's own index), so the whole
# Gluon backward suite runs again; then the block-sparse timing: Gluon backward (auto) vs teaching vs Flex.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 420 python3 -m pytest -q -o addopts= -p no:cacheprovider -n 14 -rs tests/test_hopper_backward.py \
    tests/test_triton_gpu.py tests/test_hopper.py 2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 150 python3 .exp/sparse_time.py 2>&1 | grep -v "Warn\|warn" | tee $OUT/sparse_time.log | grep "=="
