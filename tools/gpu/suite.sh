#!/usr/bin/env bash
# The GPU test suite on the H200 (device side), run from the repository root.
#
# FlashInfer and FlashAttention-4 come as wheel parts (../shared/gpu/pack-wheels.sh writes
# .gpu/p1 .. .gpu/p4): send runs 1-3 with `bash .gpu/pK/unpack.sh`, then run 4 carrying
# .gpu/p4 with `bash tools/gpu/suite.sh [pytest args]`. FlashInfer JIT-builds each prefill
# variant on first use (80-95 s each: the suite builds bf16 at head dims 64 and 128), so
# keep the machine warm for the benchmarks that follow (tools/gpu/bench.sh).
# Logs land in $OUT/gpu-examples.log (examples/, unfiltered) and $OUT/gpu-suite.log
# (the gpu-marked tests); record the run in docs/results/.
set -o pipefail
if [ -d .gpu/p4 ] && [ ! -f /tmp/site/env.sh ]; then bash .gpu/p4/unpack.sh || exit 1; fi
[ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
# examples/ are not marked gpu (CI runs them on CPU): run them whole, on the GPU here.
# graphcap is not installed here, so its pytest plugin (graphcap_device) is loaded by name.
timeout "${SUITE_TIMEOUT:-560}" python3 -m pytest -q -rA -p no:cacheprovider \
  -p graphcap.testing.pytest_plugin examples/ 2>&1 | tee "$OUT/gpu-examples.log" | grep -v "^PASSED" | tail -20
timeout "${SUITE_TIMEOUT:-560}" python3 -m pytest -m gpu -q -rA -p no:cacheprovider "$@" \
  tests/ 2>&1 | tee "$OUT/gpu-suite.log" | grep -v "^PASSED" | tail -80
echo "suite wall s: $(( $(date +%s) - start ))"
