#!/usr/bin/env bash
# On the 2-GPU device machine (nvidia-h200-x2), from the repo root (carry
# .device/server/server-base.tar.xz, .device/server/server-flashinfer.tar.xz and .device/tok.tar.xz,
# as for scripts/device_serving.sh): unpack, then benchmarks/tp2_bench.py: TP=2 vs TP=1 greedy ids
# with the lossless config and the daemon on (+ a dense TP=2 control), the two ranks' swap logs
# compared, then the 128K decode point at TP=2, dense vs MosaicKV. Results: $OUT/tp2.json,
# server logs in $OUT/logs. DENSE_BATCHES / MOSAICKV_BATCHES / OUTPUT / DEADLINE_S override.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Five servers share the two GPUs on purpose (each capped by --max-total-tokens): SGLang's TP
# start-up check would otherwise refuse a rank that sees the other GPU less loaded at that
# instant ("memory capacity is unbalanced"); with 0 it only warns.
export SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0
source scripts/device_env.sh .device/server/server-base.tar.xz \
    .device/server/server-flashinfer.tar.xz > "$OUT/env.log" 2>&1 || { tail -20 "$OUT/env.log"; exit 1; }
tar -xJf .device/tok.tar.xz -C .device
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /dev/shm | tail -1
timeout -k 60 "${LIMIT_S:-490}" python3 benchmarks/tp2_bench.py --tokenizer .device/tok \
    --out "$OUT" --dense-batches "${DENSE_BATCHES:-1,4}" \
    --mosaickv-batches "${MOSAICKV_BATCHES:-1}" --output "${OUTPUT:-64}" \
    --deadline-s "${DEADLINE_S:-360}"
rc=$?
for f in "$OUT"/logs/*.log; do
    echo "== $f"; grep -E "Traceback|Error:|unbalanced|MosaicKV (pool|sizing|daemon)|max_total_num_tokens" "$f" | tail -6
done
exit $rc
