#!/usr/bin/env bash
# The delta-rule op's speed targets on a 2-core AMD EPYC whose hypervisor exposes AVX2 but not AVX-512:
# the same series as the main record, side by side in one plain process each, default settings.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=docs/results/delta-rule-ops/epyc-avx2
OPS=(delta gated-delta "linear chunked gated" "transformers torch_chunk_gated_delta_rule")
.venv/bin/lintrans bench ops --T 4096 16384 --ops "${OPS[@]}" --repeats 3 --time-cap 30 --out $OUT/train
.venv/bin/lintrans bench ops --T 4096 --ops "${OPS[@]}" --repeats 3 --time-cap 30 --forward-only --out $OUT/forward
.venv/bin/lintrans bench ops --T 16384 65536 --ops gated-delta --repeats 3 --time-cap 60 --out $OUT/long
