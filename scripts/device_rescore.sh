#!/usr/bin/env bash
# Selection's second stage (`page_rescore`) on the GPU in one call, after the server bundles are
# unpacked on this machine (scripts/device_env.sh, this call or an earlier one while warm) and
# pytest at $PYTEST_SITE (default /tmp/pyt):
# 1. `tests/test_page_rescore_kernel.py` compiled for the GPU (every layout) and the decode graph's
#    replay with the second stage against the eager step (`test_graph_decode.py -k rescore`);
# 2. `decode_step_bench.py --profile` at STEP_CONTEXTS x STEP_BATCHES (131072 x 1,8) under each
#    config of VARIANTS (name=JSON; default: the default, `rescore_layout: columns` and `bands`,
#    `rescore_factor: 2`, `rescore_channels: 16`), each beside FlashInfer's paged decode in the same process.
# Env: HBM_TBS (3.35: an H100; 4.8 on an H200), TEST_S / STEP_S (time limits). Results:
# $OUT/step_<name>.json, $OUT/rescore_tests.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
PYTHONPATH=${PYTEST_SITE:-/tmp/pyt}:${PYTHONPATH:-} timeout "${TEST_S:-120}" python3 -m pytest -q \
  -p no:cacheprovider tests/test_page_rescore_kernel.py 2>&1 | tail -4 | tee "$OUT/rescore_tests.log"
# the decode graph with the second stage (every layout that has a case) against the eager step
PYTHONPATH=${PYTEST_SITE:-/tmp/pyt}:${PYTHONPATH:-} timeout "${TEST_S:-120}" python3 -m pytest -q \
  -p no:cacheprovider tests/test_graph_decode.py -k rescore 2>&1 | tail -4 | tee -a "$OUT/rescore_tests.log"
echo "tests done at $((SECONDS - t0)) s"
VARIANTS=${VARIANTS:-'default={} columns={"select":{"rescore_layout":"columns"}} bands={"select":{"rescore_layout":"bands"}} factor2={"select":{"rescore_factor":2}} ch16={"select":{"rescore_channels":16}}'}
for v in $VARIANTS; do
  name=${v%%=*}; cfg=${v#*=}
  timeout "${STEP_S:-110}" python3 benchmarks/decode_step_bench.py \
    --contexts "${STEP_CONTEXTS:-131072}" --batches "${STEP_BATCHES:-1,8}" --profile \
    --hbm-tbs "${HBM_TBS:-3.35}" --config "$cfg" --json "$OUT/step_$name.json" 2>&1 | tail -24
  echo "step $name done at $((SECONDS - t0)) s"
done
