#!/usr/bin/env bash
# On the H200 device machine, from the repo root. Carry (in one call, or base + tok with
# PREPARE_ONLY=1 and then the rest in the next call while the machine is warm) .device/server/server-base.tar.xz,
# .device/server/server-flashinfer.tar.xz (the server imports flashinfer even with the triton
# backend), .device/tok.tar.xz (the SmolLM2 tokenizer files, xz) and, for GPU_TESTS=1,
# .device/pytest_site.tar.xz (pytest, trimmed to fit the 64 MiB carry) or .device/pytest (wheels).
# GPU_TEST_FILES overrides the test files; GPU_TESTS=gate runs every GPU test file through
# scripts/gpu_tests.py instead, $OUT/gpu-tests.json being the gate's evidence (`record` it here). Unpacks; starts in the background the GPU work that must end
# before any measurement (GPU_TESTS=1: the kernel/decode tests; SEAL_BENCH=1: the sealing
# benchmark, both at once) while the servers start; then the serving benchmark (dense SGLang, triton backend,
# vs MosaicKV) on a Llama-3.1-8B-shaped dummy-weight model; then, with DAEMON_BENCH=1, the
# recompression daemon benchmark. Results under $OUT (JSON, logs): keep it to a few files, the
# device returns only so many (a run lost serving.json that way); agent logs stay in /tmp.
# Env: SYSTEMS, CONTEXTS, BATCHES, OUTPUT, LIMIT_S (seconds from this script's start to the
# benchmark's stop), MOSAICKV_CONFIG (JSON), PARALLEL=1 (start the
# servers at once, each with MEM_FRACTION of the GPU), MEM_FRACTION (default 0.85), CUDA_GRAPH_ARGS
# (default --cuda-graph-max-bs 8), EXTRA_ARGS (more server arguments), SYSTEM_ARGS (one system's
# server arguments, items SYSTEM:ARG, e.g. "mosaickv:--max-total-tokens mosaickv:270000"),
# WARMUP (tokens of one uncounted request per server, default 16384: two 8192-token chunks, so
# the chunked prefill over a compressed prefix is compiled before TTFT is timed), AGENT=1, DAEMON_BENCH=1,
# SOAK=1 (the soak and flood after each server's rows, below), SAVE_CACHES=1 (return Triton's
# and FlashInfer's compile caches as $OUT/compile_caches.tar.xz; carried back as
# .device/compile_caches.tar.xz they spare the next call the compiles),
# LOGPROBS=1, SEAL_SOLVERS (fit solvers the seal benchmark compares, e.g.
# host,device,jacobi: give it SEAL_LIMIT_S=300; default the config's), SEAL_TOKENS, SEAL_LIMIT_S.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
# AGENT=1 runs on the servers serving_bench started, whose context length comes from CONTEXTS:
# refuse before the (minutes of) start-up one that cannot hold the agent's 16K system prompt +
# turns (a call was lost to that); its sessions run at once (--max-running-requests below).
agent_args=()
if [ "${AGENT:-0}" = 1 ]; then
  ctx_max=$(tr ',' '\n' <<< "${CONTEXTS:-32768}" | sort -n | tail -1)
  need=$((16384 + ${AGENT_TURNS:-4} * (64 + 16) + 64))
  if [ "$ctx_max" -lt "$need" ]; then
    echo "AGENT=1 needs CONTEXTS up to >= $need tokens (has $ctx_max)"; exit 1
  fi
  batch_max=$(tr ',' '\n' <<< "${BATCHES:-1,8}" | sed 's/^max$/256/' | sort -n | tail -1)
  agent_args=(--server-arg=--max-running-requests
              --server-arg=$((batch_max > ${AGENT_SESSIONS:-16} ? batch_max : ${AGENT_SESSIONS:-16})))
fi
# An archive absent from this call's carry is fine when an earlier call on this (still warm)
# machine unpacked it: the tree, two bundles and the tokenizer exceed one 64 MiB carry, so they
# can come as `PREPARE_ONLY=1` (base + tok) and then this call (FlashInfer), back to back.
site=${MOSAICKV_DEVICE_SITE:-/tmp/mosaickv_site}
archives=()
for a in .device/server/server-base.tar.xz .device/server/server-flashinfer.tar.xz; do
  if [ -f "$a" ]; then archives+=("$a")
  elif [ "${PREPARE_ONLY:-0}" != 1 ] && [ ! -f "$site/bundles/$(basename "$a" .tar.xz).json" ]; then
    echo "$a neither carried nor unpacked by an earlier call on this machine"; exit 1
  fi
done
source scripts/device_env.sh "${archives[@]}" > "$OUT/env.log" 2>&1 || { tail -20 "$OUT/env.log"; exit 1; }
if [ -f .device/tok.tar.xz ]; then tar -xJf .device/tok.tar.xz -C "$site"
elif [ ! -d "$site/tok" ]; then echo "no tokenizer: carry .device/tok.tar.xz"; exit 1; fi
if [ "${PREPARE_ONLY:-0}" = 1 ]; then echo "unpacked in $((SECONDS - t0)) s: ${archives[*]}"; exit 0; fi
echo "bundle ready in $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Servers an earlier call left running (the device's own call limit kills the command, not the
# servers' own sessions) would hold the GPU: a call then ran out of memory at start-up.
leftover=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' ')
if [ -n "${leftover// }" ]; then
  echo "killing GPU processes left by an earlier call: $leftover"
  kill -9 $leftover 2>/dev/null; sleep 5
fi
# Compile caches carried from an earlier call (SAVE_CACHES=1 returns them as
# $OUT/compile_caches.tar.xz; carry it as .device/compile_caches.tar.xz): Triton's kernels
# (MosaicKV's decode graph capture spent 72 s compiling on a fresh H100) and FlashInfer's JIT.
# Entries whose sources changed simply miss and compile again.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/compile_caches/triton}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/compile_caches}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .device/compile_caches.tar.xz ]; then
  tar -xJf .device/compile_caches.tar.xz -C /tmp && echo "compile caches: $(du -sh /tmp/compile_caches | cut -f1) carried in"
fi
rm -f /tmp/bg_done
(
  if [ "${GPU_TESTS:-0}" != 0 ]; then
    # pytest from .device/pytest_site.tar.xz (trimmed to fit the carry: recipe in docs/device.md),
    # else from the wheels in .device/pytest
    mkdir -p /tmp/pytest_site
    if [ -f .device/pytest_site.tar.xz ]; then tar -xJf .device/pytest_site.tar.xz -C /tmp/pytest_site
    else python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pytest_site \
        .device/pytest/*.whl; fi
    t1=$SECONDS
    if [ "$GPU_TESTS" = gate ]; then  # every GPU test file, the gate's JSON (scripts/gpu_tests.py)
      PYTHONPATH="/tmp/pytest_site:$PYTHONPATH" python3 scripts/gpu_tests.py run \
          --out "$OUT/gpu-tests.json" --jobs "${JOBS:-4}" --limit-s "${TESTS_LIMIT_S:-300}" \
          > "$OUT/gpu_tests.log" 2>&1
      echo "GPU test gate (rc $?) in $((SECONDS - t1)) s: $(grep -E 'passed|failed' "$OUT/gpu_tests.log" | tail -1)" > "$OUT/gpu_tests.summary"
    else
    PYTHONPATH="/tmp/pytest_site:$PYTHONPATH" timeout "${TESTS_LIMIT_S:-200}" python3 -m pytest \
        -q -p no:cacheprovider -W ignore ${GPU_TEST_FILES:-tests/test_band_pack_kernel.py \
        tests/test_band_unpack_kernel.py tests/test_page_select_kernel.py \
        tests/test_band_decode_kernel.py tests/test_row_merge_kernel.py \
        tests/test_packed_decode.py tests/test_pack_install.py tests/test_extend_attention.py} \
        > "$OUT/gpu_tests.log" 2>&1
    echo "GPU tests (rc $?) in $((SECONDS - t1)) s: $(tail -1 "$OUT/gpu_tests.log")" > "$OUT/gpu_tests.summary"
    fi
  fi &
  # SEAL_BENCH=1: at the same time as the tests (and the servers' start-up): its times share the
  # GPU with them; the runs inside it are still side by side. SEAL_ARGS: more seal_bench flags.
  if [ "${SEAL_BENCH:-0}" = 1 ]; then
    timeout "${SEAL_LIMIT_S:-240}" python3 benchmarks/seal_bench.py --device cuda --check \
        --tokens "${SEAL_TOKENS:-8192}" ${SEAL_SOLVERS:+--fit-solvers "$SEAL_SOLVERS"} \
        ${SEAL_ARGS:-} --json "$OUT/seal_bench.json" > "$OUT/seal_bench.log" 2>&1
    echo "seal bench rc $?" >> "$OUT/seal_bench.log"
  fi
  wait
  touch /tmp/bg_done
) &
args=(--make-llama8b /tmp/llama8b --tokenizer $site/tok --load-format dummy
      --contexts "${CONTEXTS:-32768}" --systems "${SYSTEMS:-dense,mosaickv}"
      --batches "${BATCHES:-1,8}" --output "${OUTPUT:-64}"
      --server-arg=--mem-fraction-static --server-arg="${MEM_FRACTION:-0.85}"
      --server-arg=--sampling-backend --server-arg=pytorch
      --wait-for /tmp/bg_done --logs "$OUT/logs" --json "$OUT/serving.json")
[ "${PARALLEL:-0}" = 1 ] && args+=(--parallel-start)
[ "${LOGPROBS:-0}" = 1 ] && args+=(--logprobs)  # per-token log-probs compared across systems
args+=(--warmup "${WARMUP:-16384}")  # tokens of one uncounted request per server (0: none)
args+=("${agent_args[@]}")  # after serving_bench's own --max-running-requests: the last one wins
# AGENT=1: the multi-turn agent workload (benchmarks/agent_bench.py) on each server after its rows
[ "${AGENT:-0}" = 1 ] && args+=(--after-bench "timeout ${AGENT_LIMIT_S:-80} python3 \
benchmarks/agent_bench.py --url {url} --systems {system} --model /tmp/llama8b --tokenizer $site/tok \
--workloads ${AGENT_WORKLOADS:-native,dsl} --sessions ${AGENT_SESSIONS:-16} --turns ${AGENT_TURNS:-4} \
--system-tokens 16384 --user-tokens 64 --output 16 --logs /tmp/agent_logs --json $OUT/agent_{system}.json")
# SOAK=1: the soak and flood (benchmarks/soak_bench.py) on each server after its rows: SOAK_REQUESTS
# concurrent mixed requests offering SOAK_OFFER x the tokens it holds, aborts, a daemon worker
# killed once (with daemon: process), then every finished one alone; SOAK_ARGS adds flags.
[ "${SOAK:-0}" = 1 ] && args+=(--after-bench "timeout ${SOAK_LIMIT_S:-300} python3 \
benchmarks/soak_bench.py --url {url} --system {system} --requests ${SOAK_REQUESTS:-500} \
--offer ${SOAK_OFFER:-2} --model /tmp/llama8b --limit-s $(( ${SOAK_LIMIT_S:-300} - 20 )) ${SOAK_ARGS:-} \
--json $OUT/soak_{system}.json")
[ -n "${MOSAICKV_CONFIG:-}" ] && args+=(--mosaickv-config "$MOSAICKV_CONFIG")
for a in ${CUDA_GRAPH_ARGS:---cuda-graph-max-bs 8} ${EXTRA_ARGS:-}; do args+=("--server-arg=$a"); done
for a in ${SYSTEM_ARGS:-}; do args+=("--system-arg=$a"); done
# LIMIT_S counts from this script's start (unpacking included), so the benchmark's SIGTERM
# (its servers stopped, results so far in serving.json) comes before a device call limit of
# LIMIT_S + a margin cuts everything off; at least 1 s (`timeout 0` would mean no limit)
left=$(( ${LIMIT_S:-540} - (SECONDS - t0) ))
timeout "$(( left > 0 ? left : 1 ))" python3 benchmarks/serving_bench.py "${args[@]}"
rc=$?
wait
if [ "${DAEMON_BENCH:-0}" = 1 ]; then
  timeout "${DAEMON_LIMIT_S:-120}" python3 benchmarks/daemon_bench.py --shape llama8b --device cuda \
      --workers 12 --slots 32 --steps "${DAEMON_STEPS:-400}" --step-ms 30 --isolate \
      --json "$OUT/daemon_bench.json" > "$OUT/daemon_bench.log" 2>&1
  echo "daemon bench rc $?"; tail -15 "$OUT/daemon_bench.log"
fi
cat "$OUT/gpu_tests.summary" 2>/dev/null; tail -24 "$OUT/seal_bench.log" 2>/dev/null
for f in "$OUT"/agent_*.json; do [ -f "$f" ] && python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    mk = {k: v for k, v in (r.get("mosaickv") or {}).items() if "by_prefix" not in k}
    print({k: r.get(k) for k in ("system", "workload", "error", "wall_s", "output_tok_s",
                                 "cached_ratio") if k in r}, mk)
PY
done
[ -f "$OUT/serving.json" ] && python3 - "$OUT/serving.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):  # the daemon's counters where it ran (mosaickv_daemon)
    mk = r.get("mosaickv") or {}
    d = mk.get("daemon")
    if d:
        c = mk.get("counters", {})
        keys = ("submitted_pages", "adopted_pages", "discarded_pages", "sync_seals_backpressure",
                "sync_seals_fallback", "out_of_order_seals", "worker_errors", "restarts",
                "arena_ready_pages", "per_tensor_pages", "page_seconds_p50", "boundary")
        print(f"daemon {r['system']} ctx {r['context']} batch {r['batch']}:",
              {k: d.get(k) for k in keys},
              {k: c.get(k) for k in ("prefix_repairs", "prefix_repair_pages")},
              "sealed_ratio", mk.get("sealed_ratio"))
PY
for f in "$OUT"/logs/*.log; do
  echo "== $f"; grep -E "Error|error|Traceback|MosaicKV|max_total_num_tokens|Capture cuda graph end" "$f" | tail -5 | cut -c1-300
  # what compiled after start-up (a decode stall of seconds on a cold Triton cache): the lines
  # that name a compile, with their times, kept even when the logs are not brought back
  grep -nE "compil|width class" "$f" | tail -8 | cut -c1-240
done
if [ "${SAVE_CACHES:-0}" = 1 ]; then  # small enough to come back (and to carry next time)?
  tar -cJf /tmp/compile_caches.tar.xz -C /tmp compile_caches 2>/dev/null
  size=$(stat -c %s /tmp/compile_caches.tar.xz 2>/dev/null || echo 0)
  if [ "$size" -gt 0 ] && [ "$size" -lt $((40 * 1024 * 1024)) ]; then
    cp /tmp/compile_caches.tar.xz "$OUT/" && echo "compile caches saved: $size bytes"
  else echo "compile caches not saved ($size bytes)"; fi
fi
exit $rc
