#!/usr/bin/env bash
# The GPU test suite on the H200 (device side), run from the repository root.
#
# FlashInfer and FlashAttention-4 come as wheel parts (../shared/gpu/pack-wheels.sh writes
# .gpu/p1 .. .gpu/p4): send runs 1-3 with `bash .gpu/pK/unpack.sh`, then run 4 carrying
# .gpu/p4 with `bash tools/gpu/suite.sh [pytest args]`. FlashInfer JIT-builds each prefill
# variant on first use (80-95 s each: the suite builds bf16 at head dims 64 and 128), so
# keep the machine warm for the benchmarks that follow (tools/gpu/bench.sh).
#
# The gpu-marked tests run as nine pytest processes side by side, with examples/ (not
# marked gpu: CI runs them on CPU) as a tenth (the tests are bound by the host's Python,
# the machine has 16 cores and one GPU with room for all of them): replay equivalence and
# the capture core; the kernels' property tests, in two halves; attention backends and
# transformers models; the kinds of input, the engine and the attention variants; the
# strategies' trust tests; stock models' generation; the stock variant families and every
# op's kernels against their references; examples/, all in the background; the rest in
# front. (On a slow host, groups of seven ran out of 430 s:
# 2026-12-06-gpu-suite-4dd7a48-h100.json.)
# Each process has SUITE_TIMEOUT seconds, then an interrupt (pytest still prints what
# failed so far, by name); the script exits non-zero if any failed or ran out of time.
# Logs land in $OUT/gpu-examples.log and $OUT/gpu-suite-{1,...,9}.log, then go into
# $OUT/gpu-suite-logs.tgz (a run brings back at most eight files; with the caller's stdout
# the logs are nine); record the run in
# docs/results/.
set -o pipefail
# Where the wheel parts arrive, where unpack.sh installs them, FlashInfer's JIT cache.
parts=${GRAPHCAP_GPU_PARTS:-.gpu}
site=${GRAPHCAP_GPU_SITE:-/tmp/site}
last=$(ls -d "$parts"/p* 2>/dev/null | sort -V | tail -n 1)
if [ -n "$last" ] && [ ! -f "$site/env.sh" ]; then bash "$last/unpack.sh" || exit 1; fi
[ -f "$site/env.sh" ] && source "$site/env.sh"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
limit=${SUITE_TIMEOUT:-560}
pytest_gpu() {  # log name, then pytest arguments
  local log=$1
  shift
  timeout -s INT -k 30 "$limit" python3 -m pytest -m gpu -q -rA -p no:cacheprovider "$@" \
    > "$OUT/$log" 2>&1
}
g1=(tests/strategies/test_replay_equivalence.py tests/core)
g9=(tests/kernels/test_triton_attention.py tests/kernels/test_moe_mxfp4.py tests/kernels/test_triton_moe.py)
g2=(tests/kernels)
g7=(tests/opsdb/test_attention_backends.py tests/hf/test_hf.py tests/hf/test_hf_kernels.py)
g3=(tests/inputs tests/engine tests/opsdb/test_attention_variants.py)
g5=(tests/strategies)
g8=(tests/hf)
g6=(tests/hf/test_hf_variants.py tests/opsdb/test_opsdb.py)
ignore=()
for path in "${g9[@]}"; do ignore+=(--ignore="$path"); done
pytest_gpu gpu-suite-2.log "${g2[@]}" "${ignore[@]}" "$@" &
p2=$!
pytest_gpu gpu-suite-9.log "${g9[@]}" "$@" &
p9=$!
for path in "${g1[@]}" "${g2[@]}" "${g6[@]}" "${g7[@]}"; do ignore+=(--ignore="$path"); done
pytest_gpu gpu-suite-1.log "${g1[@]}" "$@" &
p1=$!
pytest_gpu gpu-suite-3.log "${g3[@]}" "${ignore[@]}" "$@" &
p3=$!
pytest_gpu gpu-suite-5.log "${g5[@]}" "${ignore[@]}" "$@" &
p5=$!
pytest_gpu gpu-suite-8.log "${g8[@]}" "${ignore[@]}" "$@" &
p8=$!
pytest_gpu gpu-suite-6.log "${g6[@]}" "$@" &
p6=$!
pytest_gpu gpu-suite-7.log "${g7[@]}" "$@" &
p7=$!
for path in "${g3[@]}" "${g5[@]}" "${g8[@]}"; do ignore+=(--ignore="$path"); done
# graphcap is not installed here, so its pytest plugin (graphcap_device) is loaded by name.
timeout -s INT -k 30 "$limit" python3 -m pytest -q -rA -p no:cacheprovider \
  -p graphcap.testing.pytest_plugin examples/ > "$OUT/gpu-examples.log" 2>&1 &
pe=$!
pytest_gpu gpu-suite-4.log tests/ "${ignore[@]}" "$@"
rc4=$?
wait "$pe"
rc_examples=$?
wait "$p1"
rc1=$?
wait "$p2"
rc2=$?
wait "$p9"
rc9=$?
wait "$p3"
rc3=$?
wait "$p5"
rc5=$?
wait "$p6"
rc6=$?
wait "$p8"
rc8=$?
wait "$p7"
rc7=$?
for log in gpu-examples.log gpu-suite-{1,2,9,7,3,5,8,6,4}.log; do
  echo "== $log"
  grep -E "^(FAILED|ERROR|SKIPPED) |(passed|failed|error|skipped)[ ,].* in [0-9.]+s|Interrupt" \
    "$OUT/$log" | tail -40
done
echo "suite wall s: $(( $(date +%s) - start ))"
echo "exit codes: examples $rc_examples, groups $rc1 $rc2 $rc9 $rc7 $rc3 $rc5 $rc8 $rc6 $rc4 (124: out of time)"
(cd "$OUT" && tar czf gpu-suite-logs.tgz gpu-examples.log gpu-suite-*.log; \
  rm -f gpu-examples.log gpu-suite-*.log)
[ "$rc_examples" -eq 0 ] && [ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ] && [ "$rc9" -eq 0 ] && [ "$rc7" -eq 0 ] \
  && [ "$rc3" -eq 0 ] && [ "$rc5" -eq 0 ] && [ "$rc8" -eq 0 ] && [ "$rc6" -eq 0 ] && [ "$rc4" -eq 0 ]
