#!/bin/bash
# One call on a lent H100 (Triton 3.6.0 in the image): fla 0.6.0 with TileLang carried beside it, so that
# fla's gated backward passes, which it refuses in Triton on Hopper before Triton 3.7.1 (#640), run in
# TileLang. .whl/site.tar.xz holds the unpacked wheels of tilelang 0.1.15, apache-tvm-ffi 0.1.12,
# torch-c-dlpack-ext 0.1.5, z3-solver 4.15.4.0 (without its binary), flash-linear-attention and fla-core
# 0.6.0 (xz, 38 MB: the wheels are 84 MB, over the call's 64 MiB). Usage: bash run.sh OUT_DIR
# Made here with: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#   --platform manylinux_2_28_x86_64 (and _2_27, _2_24, _2_17, manylinux2014) -d whl tilelang==0.1.15
#   "apache-tvm-ffi==0.1.12" torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 flash-linear-attention==0.6.0
#   fla-core==0.6.0; each wheel unzipped into site/ (z3_solver-*.data removed); tar -C site -cf - . | xz -9
set -o pipefail
out=${1:?out dir}; here=docs/results/gpu-tilelang
mkdir -p /tmp/site && { tar -xJf .whl/site.tar.xz -C /tmp/site 2>/dev/null \
  || python3 -c "import tarfile; tarfile.open('.whl/site.tar.xz').extractall('/tmp/site')"; } || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/docs/results/gpu-fla PYTHONUNBUFFERED=1
echo "[$SECONDS s] unpacked"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "nvcc: $(command -v nvcc) $(nvcc --version 2>&1 | tail -1)"
  python3 -c "
import torch, triton, fla, tilelang
from fla.backends import TileLangBackend
print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'tilelang', tilelang.__version__)
print('fla can use TileLang:', TileLangBackend.can_use())"
} 2>&1 | tee "$out/machine.txt"
py="python3 -m pytest -v -p no:cacheprovider -o addopts= -rfs --tb=short --durations=8"
timeout 280 $py -p one_config tests/ops/test_delta_cuda.py::test_fla_delta_rule_kernels_match_ours_on_cuda \
  tests/ops/test_fla_backend.py::test_fla_kernels_match_ours_on_cuda -k "not None" 2>&1 \
  | tee "$out/pytest-one-config.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|s call" | cut -c1-200
echo "[$SECONDS s] tests done"
left=$((420 - SECONDS)); [ $left -gt 30 ] && timeout $left python3 $here/fla_grad.py check 2>&1 | tee "$out/fla-grad-check.log"
echo "[$SECONDS s] check done"
left=$((440 - SECONDS)); [ $left -gt 40 ] && timeout $left python3 $here/fla_grad.py speed 2>&1 | tee "$out/fla-grad-speed.log"
echo "[$SECONDS s] all done"
