# Device call 1 of 3 for landing masked-tiles (carry [".whl"]; about 250 s on an H100). From the repository root:
#   bash .pending/masked-tiles/land_gpu_1_tests.sh
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 500 python3 -m pytest -q -o addopts= -p no:cacheprovider -n 14 -rs --durations=10 \
    tests/test_hopper_backward.py tests/test_triton_gpu.py tests/test_hopper.py 2>&1 | tee $OUT/gpu_tests.log | tail -25
