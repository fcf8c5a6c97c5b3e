#!/bin/bash
# How the records in this folder were made, on a lent NVIDIA GPU (its image's torch with CUDA; fla 0.6.0
# carried as wheels in .whl/), in one call of about 9 minutes. Usage: bash docs/results/gpu-h200/run.sh OUT_DIR
set -o pipefail
out=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
here=docs/results/gpu-h200
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/machine.txt"
python3 -c "import torch, fla, triton, transformers as tf; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', tf.__version__)" | tee -a "$out/machine.txt"
# 1. the delta rule on CUDA against the CPU float64 reference; the delta GPTs on CUDA against the CPU
timeout 80 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfs --tb=short --durations=5 \
  tests/ops/test_delta_cuda.py tests/test_cuda.py -k "not fla and (delta or deltanet)" 2>&1 | tee "$out/pytest-delta.log" | tail -15
# 2. why backend="fla" did not return on the H100: timings of fla's first calls, stacks every 20 s
TRITON_PRINT_AUTOTUNING=1 timeout 120 python3 $here/fla_probe.py 20 > "$out/fla-probe.log" 2>&1; echo "fla probe rc $?" | tee -a "$out/fla-probe.log"
grep -E "^\[|rc " "$out/fla-probe.log" | tail -30
# 3. the real fla kernels against ours: Gated DeltaNet, then the backend="fla" dispatch
timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfs --tb=short -o faulthandler_timeout=40 \
  tests/ops/test_delta_cuda.py -k fla tests/ops/test_fla_backend.py 2>&1 | tee "$out/pytest-fla.log" | tail -15
# 4. ops in bf16 (SDPA takes its flash kernel) and the delta series in float32, fwd + bwd, B=1 H=8 D=64
timeout 100 python3 -m lintrans bench ops --device cuda --dtype bfloat16 --max-T 65536 --time-cap 2 \
  --out /tmp/bench/ops-bf16 --ops "softmax (SDPA)" "linear chunked" "linear chunked gated" delta gated-delta \
  "fla chunk_gated_delta_rule" transformers 2>&1 | grep -E "^(==|headline|warning)" ; tar -czf "$out/bench.tar.gz" -C /tmp bench
timeout 60 python3 -m lintrans bench ops --device cuda --max-T 65536 --time-cap 2 \
  --out /tmp/bench/ops-delta-fp32 --ops "softmax (SDPA)" "linear chunked gated" delta gated-delta \
  "fla chunk_gated_delta_rule" transformers 2>&1 | grep -E "^(==|headline|warning)" ; tar -czf "$out/bench.tar.gz" -C /tmp bench
# 5. GPT-2 124M-shaped training step in bf16 autocast: softmax (SDPA flash) against the linear layers
timeout 120 python3 -m lintrans bench train --device cuda --precision bf16 --sizes 12L-768 --forms chunked \
  --mechanisms gated-linear gated-deltanet --max-T 16384 --time-cap 3 --out /tmp/bench/train-bf16 \
  2>&1 | grep -E "^(==|headline|warning)"; tar -czf "$out/bench.tar.gz" -C /tmp bench
ls -la /tmp/bench/*
# Then, in three more calls on fresh / warm machines (the lease's remaining minutes):
#   python3 -m pytest -v -o addopts="" -o faulthandler_timeout=250 tests/ops/test_delta_cuda.py -k fla  # pytest-fla-delta.log
#   python3 docs/results/gpu-h200/fla_delta.py check    # fla-delta-forward.log
#   python3 docs/results/gpu-h200/fla_delta.py speed    # fla-delta-forward-speed.log
