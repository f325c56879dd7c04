#!/usr/bin/env bash
# The prefill's GPU parts in one call with the kernel bundle only (no SGLang, no server):
#   run(carry=[".device/kernel", ".device/pytest_site.tar.xz"],
#       command="source scripts/device_env.sh .device/kernel/kernel.tar.xz && bash scripts/device_prefill.sh")
# 1. the chunk attention's GPU tests (FlashInfer batch prefill == each request alone, chunking
#    invariance), with pytest from .device/pytest_site.tar.xz;
# 2. `seal_bench.py --chunk-layers` at SEAL_TOKENS ("8192 32768"): the position rule's
#    layer-by-layer sealing of a chunk and its read-back each way (per segment / batched);
# 3. `prefill_attention_bench.py --position-rule` at PREFIXES (0,24576,122880): the chunk
#    attention per layer, batched vs one FlashInfer call per run.
# FlashInfer JIT-builds its prefill modules on a fresh machine (~1-2 minutes). Results: $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
if [ -f .device/pytest_site.tar.xz ]; then
  mkdir -p /tmp/pyt && tar -xJf .device/pytest_site.tar.xz -C /tmp/pyt
  PYTHONPATH=/tmp/pyt:${PYTHONPATH:-} timeout "${TEST_S:-200}" python3 -m pytest -q \
    -p no:cacheprovider tests/test_chunk_plan.py tests/test_batch_invariance.py -k chunk 2>&1 \
    | tail -4 | tee "$OUT/gpu_tests_prefill.log"
  echo "tests done at $((SECONDS - t0)) s"
fi
for t in ${SEAL_TOKENS:-8192 32768}; do
  timeout "${SEAL_S:-120}" python3 benchmarks/seal_bench.py --device cuda --tokens "$t" \
    --chunk-layers --json "$OUT/seal_chunk_layers_$t.json" 2>&1 | tail -2
done
echo "seal done at $((SECONDS - t0)) s"
timeout "${ATTN_S:-200}" python3 benchmarks/prefill_attention_bench.py \
  --prefixes "${PREFIXES:-0,24576,122880}" --chunk 8192 --page 128 --reps 3 \
  --kernels flashinfer,flashinfer_single --position-rule --out "$OUT/prefill_attention.json" \
  2>&1 | tail -5
echo "attention done at $((SECONDS - t0)) s"
