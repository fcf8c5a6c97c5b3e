#!/bin/bash
# How the records in this folder were made, on a lent NVIDIA H100 (its image's torch with CUDA; fla
# carried as wheels in .whl/). Usage: bash docs/results/gpu-h100/run.sh OUT_DIR [all|tests|bench|fla|train|generate]...
set -o pipefail
out=${1:?out dir}; shift; parts=" ${*:-all} "
want() { [[ $parts == *" $1 "* || $parts == *" all "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/machine.txt"
python3 -c "import torch, fla; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'fla', fla.__version__)" | tee -a "$out/machine.txt"
if want tests; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rf --tb=short --durations=8 \
    tests/test_cuda.py tests/bench/test_peers.py 2>&1 | tee "$out/pytest.log" | tail -60
fi
if want fla-tests; then  # fla's Triton kernels compile (and autotune) per shape: minutes for the whole set
  timeout 220 python3 -m pytest -v -p no:cacheprovider -o addopts="" -rf --tb=short \
    tests/ops/test_fla_backend.py -k "${FLA_TESTS:-match_ours_on_cuda}" 2>&1 | tee "$out/pytest-fla.log" | tail -30
fi
if want bench; then
  timeout 170 python3 -m lintrans bench ops --device cuda --max-T 65536 --time-cap 5 --out /tmp/bench/ops \
    --ops softmax state_parallel "linear chunked" aft sliding cosformer bigbird reformer
  tar -czf "$out/bench.tar.gz" -C /tmp bench
fi
if want fla; then
  timeout 150 python3 -m lintrans bench ops --device cuda --max-T 65536 --time-cap 60 --out /tmp/bench/ops-fla \
    --ops "linear chunked" fla
  tar -czf "$out/bench.tar.gz" -C /tmp bench
fi
if want train; then
  timeout 170 python3 -m lintrans bench train --device cuda --sizes 12L-768 --forms chunked --mechanisms gated-linear \
    --max-T 16384 --time-cap 5 --out /tmp/bench/train
  tar -czf "$out/bench.tar.gz" -C /tmp bench
fi
if want generate; then
  timeout 120 python3 -m lintrans bench generate --device cuda --sizes 12L-768 --max-T 32768 --time-cap 5 \
    --out /tmp/bench/generate
  tar -czf "$out/bench.tar.gz" -C /tmp bench
fi
