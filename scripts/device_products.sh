#!/usr/bin/env bash
# The decode graph's stage-1 products on the GPU in one call (`graph_products` exact vs bf16):
# the decode-graph kernel tests, stage 1 + 2 timed inside a CUDA graph
# (`request_decode_sweep.py --only-products`) and the decode step against FlashInfer's paged
# decode (`decode_step_bench.py --profile`) under each. Needs the server bundles unpacked by
# scripts/device_env.sh (in this call or an earlier one on the warm machine) and pytest at
# $PYTEST_SITE (default /tmp/pyt: `tar -xJf .device/pytest_site.tar.xz -C /tmp/pyt`).
# Env: SWEEP_CONTEXTS (32768), SWEEP_BATCHES (1,8,17), STEP_CONTEXTS (131072), STEP_BATCHES
# (1,8), HBM_TBS (3.35: an H100; 4.8 on an H200), TEST_S / SWEEP_S / STEP_S (time limits).
# Results: $OUT/sweep.json, $OUT/step_exact.json, $OUT/step_bf16.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
PYTHONPATH=${PYTEST_SITE:-/tmp/pyt}:${PYTHONPATH:-} timeout "${TEST_S:-150}" python3 -m pytest -q \
  -p no:cacheprovider tests/test_request_decode_kernel.py tests/test_row_merge_kernel.py 2>&1 | tail -4
echo "tests done at $((SECONDS - t0)) s"
timeout "${SWEEP_S:-200}" python3 benchmarks/request_decode_sweep.py --only-products \
  --contexts "${SWEEP_CONTEXTS:-32768}" --batches "${SWEEP_BATCHES:-1,8,17}" \
  --json "$OUT/sweep.json" 2>&1 | grep -v select_warps | cut -c1-400
echo "sweep done at $((SECONDS - t0)) s"
for p in exact bf16; do
  timeout "${STEP_S:-120}" python3 benchmarks/decode_step_bench.py \
    --contexts "${STEP_CONTEXTS:-131072}" --batches "${STEP_BATCHES:-1,8}" --profile \
    --hbm-tbs "${HBM_TBS:-3.35}" --config "{\"graph_products\": \"$p\"}" \
    --json "$OUT/step_$p.json" 2>&1 | tail -30
  echo "step $p done at $((SECONDS - t0)) s"
done
