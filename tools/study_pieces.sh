#!/bin/bash
# Train a long study in pieces within one time-limited call (a lease of a GPU): one run per
# `lintrans experiment ... --max-runs 1`, starting another only while BUDGET seconds leave room for
# RESERVE more (the longest run's time), so the call's limit never kills a run in flight. New run files
# are copied to COPY_TO (e.g. the device tool's $OUT) after each run; when the study completes, its
# record and PNGs too. The runs' folder must already hold every run of earlier pieces (commit them
# with `git add -f`); a run whose key is in it is not trained again.
#
#   BUDGET=540 RESERVE=330 COPY_TO=$OUT bash tools/study_pieces.sh context --setting gpu --device cuda
#
# Usage: bash tools/study_pieces.sh STUDY [lintrans experiment options...]; PYTHON (default python3).
# Exit status: 0 when the study is complete, 3 when runs remain, else that of the failed call.
set -o pipefail
study=${1:?usage: study_pieces.sh STUDY [options]}; shift
budget=${BUDGET:-540} reserve=${RESERVE:-330} py=${PYTHON:-python3}
out=$("$py" -c "
import sys
from lintrans.experiments.cli import default_out
study, args = sys.argv[1], sys.argv[2:]
get = lambda flag: args[args.index(flag) + 1] if flag in args else None
print(get('--out') or default_out(study, '--quick' in args, get('--setting')))" "$study" "$@") || exit 2
marker=$(mktemp) || exit 2  # runs newer than this are this call's
rc=3
while [ "$rc" -eq 3 ] && [ $((SECONDS + reserve)) -le "$budget" ]; do
  "$py" -m lintrans experiment "$study" "$@" --max-runs 1 --no-progress
  rc=$?
  if [ -n "$COPY_TO" ] && [ -d "$out/runs" ]; then
    mkdir -p "$COPY_TO/runs" && find "$out/runs" -type f -newer "$marker" -exec cp {} "$COPY_TO/runs/" \;
    [ "$rc" -eq 0 ] && cp "$out"/*.json "$out"/*.png "$COPY_TO/" 2>/dev/null
  fi
  echo "[study_pieces: ${SECONDS} s of ${budget}, exit ${rc}]"
done
exit "$rc"
