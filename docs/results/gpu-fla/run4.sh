#!/bin/bash
# The fourth call (the lease's last ~400 s): run3.sh's 8 failures were identity features with the
# normaliser, whose random-sign denominators q . z come near zero (0.1% of elements off by up to
# 3.7x relative, with one configuration and, for the 3 rerun, with full autotuning); the test now takes
# |q|, |k| there as the CPU dispatch test does. This reruns the same selection with one configuration.
set -o pipefail
out=${1:?out dir}; here=docs/results/gpu-fla
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/$here || exit 1
export PYTHONUNBUFFERED=1
py="python3 -m pytest -v -p no:cacheprovider -o addopts= -rfs --tb=short --durations=5"
timeout 150 $py -p one_config tests/ops/test_delta_cuda.py tests/ops/test_fla_backend.py -k "test_fla_ and cuda" 2>&1 \
  | tee "$out/pytest-one-config-2.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | cut -c1-170
echo "[$SECONDS s] done"
