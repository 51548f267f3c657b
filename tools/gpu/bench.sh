#!/usr/bin/env bash
# graphcap bench on the H200 (device side, machine warm after tools/gpu/suite.sh):
#   GRAPHCAP_COMMIT=<hash> bash tools/gpu/bench.sh prefill --models qwen3-0.6b
# JSON, log and plot land in $OUT (copy them to docs/results/ under a dated name).
[ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
suite=$1
shift
python3 -m graphcap bench "$suite" --out "$OUT/bench-$suite.json" "$@" 2>&1 \
  | tee "$OUT/bench-$suite.log" | grep -v "Warning\|warn(" | tail -70
