#!/usr/bin/env bash
# On the H200 device machine, from the repo root. Carry .device/server/server-base.tar.xz,
# .device/server/server-flashinfer.tar.xz (the server imports flashinfer even with the triton
# backend), .device/tok.tar.xz (the SmolLM2 tokenizer files, xz) and, for GPU_TESTS=1,
# .device/pytest (pytest wheels). Unpacks, optionally runs the kernel/decode tests on the GPU,
# then the serving benchmark (dense SGLang, triton backend vs MosaicKV) on a Llama-3.1-8B-shaped
# dummy-weight model. Results under $OUT (serving.json, server logs, gpu_tests.log).
# Env: SYSTEMS, CONTEXTS, BATCHES, OUTPUT, LIMIT_S, MOSAICKV_CONFIG (JSON), GPU_TESTS=1,
# EXTRA_ARGS (more server arguments, space separated).
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
source scripts/device_env.sh .device/server/server-base.tar.xz \
    .device/server/server-flashinfer.tar.xz > "$OUT/env.log" 2>&1 || { tail -20 "$OUT/env.log"; exit 1; }
tar -xJf .device/tok.tar.xz -C .device
echo "bundle ready in $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${GPU_TESTS:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pytest_site \
      .device/pytest/*.whl && export PYTHONPATH="/tmp/pytest_site:$PYTHONPATH"
  t1=$SECONDS
  timeout "${TESTS_LIMIT_S:-240}" python3 -m pytest -q -p no:cacheprovider -W ignore \
      tests/test_band_pack_kernel.py tests/test_band_unpack_kernel.py \
      tests/test_page_select_kernel.py tests/test_band_decode_kernel.py \
      tests/test_packed_decode.py > "$OUT/gpu_tests.log" 2>&1
  echo "GPU tests (rc $?) in $((SECONDS - t1)) s: $(tail -1 "$OUT/gpu_tests.log")"
fi
args=(--make-llama8b /tmp/llama8b --tokenizer .device/tok --load-format dummy
      --contexts "${CONTEXTS:-32768}" --systems "${SYSTEMS:-dense,mosaickv}"
      --batches "${BATCHES:-1,8}" --output "${OUTPUT:-64}"
      --server-arg=--mem-fraction-static --server-arg=0.85
      --server-arg=--cuda-graph-max-bs --server-arg=8
      --server-arg=--sampling-backend --server-arg=pytorch
      --logs "$OUT/logs" --json "$OUT/serving.json")
[ -n "${MOSAICKV_CONFIG:-}" ] && args+=(--mosaickv-config "$MOSAICKV_CONFIG")
for a in ${EXTRA_ARGS:-}; do args+=("--server-arg=$a"); done
timeout "${LIMIT_S:-540}" python3 benchmarks/serving_bench.py "${args[@]}"
rc=$?
for f in "$OUT"/logs/*.log; do
  echo "== $f"; grep -E "Error|error|Traceback|MosaicKV|max_total_num_tokens|Capture cuda graph end" "$f" | tail -6
done
exit $rc
