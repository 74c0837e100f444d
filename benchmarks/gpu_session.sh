#!/usr/bin/env bash
# Everything that needs the H200, in one call (device time is scarce):
#   bash benchmarks/gpu_session.sh    (logs under $OUT, or ./gpu-logs)
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout "${TESTS_TIMEOUT:-300}" python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log" | tail -30
timeout "${KERNELS_TIMEOUT:-150}" python benchmarks/bench_kernels.py 2>&1 | tee "$out/bench_kernels.log" | tail -45
timeout "${STARTUP_TIMEOUT:-120}" python benchmarks/bench_startup.py 2>&1 | tee "$out/bench_startup.log" | tail -30
