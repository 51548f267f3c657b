#!/usr/bin/env bash
# graphcap bench on the H200 (device side, machine warm after tools/gpu/suite.sh):
#   GRAPHCAP_COMMIT=<hash> [BENCH_NAME=name] bash tools/gpu/bench.sh prefill --models qwen3-0.6b
# The JSON (and prefill's plot) land in $OUT as <name>.json, name defaulting to
# bench-<suite>; the table goes to stdout and /tmp/<name>.log. Several suites may run in
# one command (each a file or two: $OUT returns at most 8). Copy the JSON to docs/results/
# under a dated name. Exits with graphcap bench's status (1: a target missed, 2: refused).
set -o pipefail
site=${GRAPHCAP_GPU_SITE:-/tmp/site}  # where ../shared/gpu/unpack.sh installed the wheels
[ -f "$site/env.sh" ] && source "$site/env.sh"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
[ -n "${GRAPHCAP_COMMIT:-}" ] || echo "bench.sh: GRAPHCAP_COMMIT is unset; a copy of the tree has no commit of its own to record" >&2
suite=$1
shift
name=${BENCH_NAME:-bench-$suite}
python3 -m graphcap bench "$suite" --out "$OUT/$name.json" "$@" 2>&1 \
  | tee "/tmp/$name.log" | { grep -v "Warning\|warn(" || true; } | tail -45
