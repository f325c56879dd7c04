#!/usr/bin/env bash
# On the H200 device machine, from the repo root (carry .device/server/server-base.tar.xz,
# .device/server/server-flashinfer.tar.xz (the server imports flashinfer even with the triton
# backend) and .device/tok.tar.xz = the SmolLM2 tokenizer files, xz): unpack, then run the serving
# benchmark (dense SGLang, triton backend vs MosaicKV) on a Llama-3.1-8B-shaped dummy-weight
# model. Results under $OUT (serving.json, server logs). CONTEXTS/BATCHES/OUTPUT override.
set -uo pipefail
source scripts/device_env.sh .device/server/server-base.tar.xz \
    .device/server/server-flashinfer.tar.xz > "$OUT/env.log" 2>&1 || { tail -20 "$OUT/env.log"; exit 1; }
tar -xJf .device/tok.tar.xz -C .device
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "${LIMIT_S:-540}" python3 benchmarks/serving_bench.py --make-llama8b /tmp/llama8b \
    --tokenizer .device/tok --load-format dummy --contexts "${CONTEXTS:-32768}" \
    --systems "${SYSTEMS:-dense,mosaickv}" \
    --batches "${BATCHES:-1,8}" --output "${OUTPUT:-64}" \
    --server-arg=--mem-fraction-static --server-arg=0.85 \
    --server-arg=--cuda-graph-max-bs --server-arg=8 \
    --logs "$OUT/logs" --json "$OUT/serving.json"
rc=$?
for f in "$OUT"/logs/*.log; do echo "== $f"; grep -E "Error|error|Traceback|MosaicKV|max_total_num_tokens" "$f" | tail -8; done
exit $rc
