#!/usr/bin/env bash
# One device call of measurements (device time is scarce): pass section names.
#   bash benchmarks/gpu_measure.sh sweeps throughput ...   (logs under $OUT)
set -u
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # wheels carried to the device (see .library/device/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/.whl/slim:${PYTHONPATH:-}
fi
export TINYENGINE_CACHE=${TINYENGINE_CACHE:-/tmp/tecache}
run() { local name=$1 t=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$t" "$@" 2>&1 | tee "$out/$name.log" | tail -${TAIL:-40}; }
for section in "$@"; do
  case $section in
    info) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
          python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
          lscpu | grep -E "Model name|^CPU\(s\)" ;;
    mla_test) run mla_test 120 python -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_triton_mla.py ;;
    sweep_attn) run sweep_attn 100 python benchmarks/bench_kernels.py --sweep ;;
    sweep_mla) run sweep_mla 140 python benchmarks/sweep_mla.py --json "$out/sweep_mla.json" ;;
    sweep_moe) run sweep_moe 150 python benchmarks/sweep_moe.py --budget 120 ;;
    tp_profile) run tp_profile 150 python -m tinyengine.bench throughput --model qwen3-0.6b-shape \
          --profile-host --json "$out/tp_profile.json" ;;
    *) echo "unknown section $section" ;;
  esac
done
