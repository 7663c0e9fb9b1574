# Device call for branch bwd-kernel-bench (carry [".whl"]; about 200 s on an H100):
#   git fetch .pending/bwd-kernel-bench.bundle bwd-kernel-bench:bwd-kernel-bench && git checkout bwd-kernel-bench
#   bash .exp/land_gpu.sh   (copied from .pending/bwd-kernel-bench/ first)
# Then: unpack data.tgz over book/data; in notebook 14, after the paragraph that quotes "520-552 TFLOP/s for dK/dV
# against 466-509 for one warpgroup", add a code cell `print(hopper_bench.backward_kernel_table(data["results"]))`
# and quote the measured figures instead (that sentence and hopper_backward.default_config's docstring); execute
# notebook 14 on the GPU (it reads hopper_bench.py, which the branch changes).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 500 python3 -m flashref.bench hopper --parts backward-kernels --append 2>&1 | grep -v Warn | tail -45
tar czf $OUT/data.tgz book/data/hopper_bench.json
