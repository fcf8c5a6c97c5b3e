#!/bin/bash
# Train a long study in pieces within one time-limited call (a lease of a GPU): one run per
# `lintrans experiment ... --max-runs 1`, starting another only while BUDGET seconds leave room for
# RESERVE more (the longest run, plus the record's n-gram baselines and plots in the last piece).
# BUDGET counts from this script's start: leave out what the call spent before it, and take the
# call's real limit (a device lease may grant less than asked). Run files new since the start are
# copied to COPY_TO/runs (e.g. the device tool's $OUT) every 15 s while a run trains and after it, so
# a call killed late still returns every finished run; the record and its PNGs too once the study
# completes. The record's runs/ folder must already hold the runs of earlier pieces (commit them):
# a run whose key is there is not trained again.
#
#   BUDGET=540 RESERVE=330 COPY_TO=$OUT bash tools/study_pieces.sh context --setting gpu --device cuda
#
# Usage: bash tools/study_pieces.sh STUDY [lintrans experiment options...]; PYTHON (default python3).
# Exit status: 0 the study is complete, 3 runs remain, 4 copying to COPY_TO failed, 2 bad usage, else
# that of the failed lintrans call.
if [ $# -lt 1 ]; then echo "usage: study_pieces.sh STUDY [lintrans experiment options...]" >&2; exit 2; fi
budget=${BUDGET:-540} reserve=${RESERVE:-330} py=${PYTHON:-python3}
for v in "$budget" "$reserve"; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "study_pieces: BUDGET and RESERVE must be whole seconds, got '$v'" >&2; exit 2; }
done
out=$("$py" -c "import sys; from lintrans.experiments.cli import record_folder; print(record_folder(sys.argv[1:]))" \
  "$@") || exit 2
marker=$(mktemp) || exit 2  # run files newer than this are this call's
trap 'rm -f "$marker"' EXIT
copy_failed=0

copy_new_runs() {
  [ -n "$COPY_TO" ] && [ -d "$out/runs" ] || return 0
  mkdir -p "$COPY_TO/runs" && find "$out/runs" -type f -newer "$marker" -exec cp {} "$COPY_TO/runs/" \; \
    || copy_failed=1
}

rc=3
while [ "$rc" -eq 3 ] && [ $((SECONDS + reserve)) -le "$budget" ]; do
  "$py" -m lintrans experiment "$@" --max-runs 1 --no-progress &
  pid=$!
  t=0
  while kill -0 "$pid" 2>/dev/null; do sleep 1; t=$((t + 1)); [ $((t % 15)) -eq 0 ] && copy_new_runs; done
  wait "$pid"
  rc=$?
  copy_new_runs
  if [ "$rc" -eq 0 ] && [ -n "$COPY_TO" ]; then
    shopt -s nullglob
    record=("$out"/*.json "$out"/*.png)
    shopt -u nullglob
    [ ${#record[@]} -gt 0 ] && cp "${record[@]}" "$COPY_TO/" || copy_failed=1
  fi
  echo "[study_pieces: ${SECONDS} s of ${budget}, exit ${rc}]"
done
if [ "$copy_failed" -ne 0 ]; then echo "study_pieces: copying to $COPY_TO failed" >&2; exit 4; fi
exit "$rc"
