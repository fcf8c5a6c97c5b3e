#!/usr/bin/env bash
# The delta-rule op against gated linear attention and transformers' pure-PyTorch Gated DeltaNet,
# forward + backward and forward only, in plain processes with default settings; then decoding.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/results/delta-rule-ops
OPS=(delta gated-delta "linear chunked gated" "transformers torch_chunk_gated_delta_rule")
.venv/bin/lintrans bench ops --T 1024 4096 16384 65536 --ops "${OPS[@]}" --repeats 3 --time-cap 30 --out $OUT/train
.venv/bin/lintrans bench ops --T 1024 4096 16384 65536 --ops "${OPS[@]}" --repeats 3 --time-cap 30 --forward-only --out $OUT/forward
.venv/bin/lintrans bench generate --T 256 1024 4096 16384 --decoders linear gated-deltanet softmax --repeats 10 --out $OUT/generate
