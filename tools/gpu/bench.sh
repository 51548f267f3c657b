#!/usr/bin/env bash
# graphcap bench on the H200 (device side, machine warm after tools/gpu/suite.sh):
#   GRAPHCAP_COMMIT=<hash> [BENCH_NAME=name] bash tools/gpu/bench.sh prefill --models qwen3-0.6b
# The JSON (and prefill's plot) land in $OUT as <name>.json, name defaulting to
# bench-<suite>; the table goes to stdout and /tmp/<name>.log. Several suites may run in
# one command (each a file or two: $OUT returns at most 8). Copy the JSON to docs/results/
# under a dated name.
[ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
suite=$1
shift
name=${BENCH_NAME:-bench-$suite}
python3 -m graphcap bench "$suite" --out "$OUT/$name.json" "$@" 2>&1 \
  | tee "/tmp/$name.log" | grep -v "Warning\|warn(" | tail -45
