#!/usr/bin/env bash
# Selection's second stage (`page_rescore`) on the GPU in one call, after BOTH server bundles are
# unpacked on this machine (scripts/device_env.sh server-base + server-flashinfer, this call or an
# earlier one while warm: on CUDA SGLang's fp8_utils imports flashinfer, so server-base alone
# cannot build the backend) and pytest at $PYTEST_SITE (default /tmp/pyt):
# 1. `tests/test_page_rescore_kernel.py` compiled for the GPU (every layout; ~2 minutes of JIT
#    compiles on a fresh machine) and the decode graph's replay with the second stage against the
#    eager step (`test_graph_decode.py -k rescore`);
# 2. `decode_step_bench.py --profile` at STEP_CONTEXTS x STEP_BATCHES (131072 x 1,8) under each
#    config of VARIANTS (name=JSON; default: the default, `rescore_layout: bands` and `columns`,
#    `rescore_factor: 2`, `rescore_channels: 16`), each beside FlashInfer's paged decode.
# Every output goes to $OUT as it comes (a call's time limit kills the pipeline: a `| tail` at the
# end of the command returns nothing then). Env: HBM_TBS (3.35: an H100; 4.8 on an H200),
# TEST_S / STEP_S (time limits), RESCORE_TESTS=0 (skip the kernel tests), GRAPH_K (the graph
# tests' -k, default "rescore"; e.g. "rescore or window"). Results: $OUT/rescore_tests.log, $OUT/graph_tests.log,
# $OUT/step_<name>.{json,log}.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
gpu_tests() {  # LOG, then pytest's arguments
  local log=$1; shift
  PYTHONPATH=${PYTEST_SITE:-/tmp/pyt}:${PYTHONPATH:-} timeout "${TEST_S:-200}" python3 -m pytest \
    -q -p no:cacheprovider -rf "$@" > "$OUT/$log" 2>&1
  tail -3 "$OUT/$log"; echo "$log done at $((SECONDS - t0)) s"
}
[ "${RESCORE_TESTS:-1}" = 1 ] && gpu_tests rescore_tests.log tests/test_page_rescore_kernel.py
gpu_tests graph_tests.log tests/test_graph_decode.py -k "${GRAPH_K:-rescore}"
VARIANTS=${VARIANTS:-'default={} bands={"select":{"rescore_layout":"bands"}} columns={"select":{"rescore_layout":"columns"}} factor2={"select":{"rescore_factor":2}} ch16={"select":{"rescore_channels":16}}'}
for v in $VARIANTS; do
  name=${v%%=*}; cfg=${v#*=}
  timeout "${STEP_S:-150}" python3 benchmarks/decode_step_bench.py \
    --contexts "${STEP_CONTEXTS:-131072}" --batches "${STEP_BATCHES:-1,8}" --profile \
    --hbm-tbs "${HBM_TBS:-3.35}" --config "$cfg" --json "$OUT/step_$name.json" \
    > "$OUT/step_$name.log" 2>&1
  grep -v "^W1207" "$OUT/step_$name.log" | tail -12
  echo "step $name done at $((SECONDS - t0)) s"
done
