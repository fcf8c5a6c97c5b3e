#!/usr/bin/env bash
# MQAR with the answers hidden (Zoology's task: a filler token follows each query), the main record's
# setting (T = 64, 16 pairs, 1000 steps) at width 64 / 4 heads, six mechanisms: does the main record's
# ranking hold once a model cannot rule out the values already asked for? Resumable: run it again.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
.venv/bin/lintrans experiment recall --answers hidden --shapes '[[64,4]]' \
  --mechanisms softmax linear:elu linear:based gated-linear deltanet:conv_init=identity gated-deltanet:conv_init=identity \
  --jobs 2 --out docs/results/experiments/recall-hidden "$@"
