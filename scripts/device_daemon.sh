#!/usr/bin/env bash
# On the H200 device machine, from the repo root; needs only torch + Triton (nothing carried).
# Issue 5 in one call, each step alone on the GPU and the host cores:
#   1. adopt_bench on CUDA: one Llama-3.1-8B page adopted per tensor vs arena-ready (load + install
#      on the scheduler thread, both stores checked byte-equal);
#   2. daemon_bench at the Llama-8B shape, 12 workers, the session-5 call-4 command, workers at
#      the default nice 19: step time idle vs saturated (p50/p99), pages/s, per-page load/install,
#      side by side in one call: at a 30 ms step with the boundary after the step's device work
#      (strict) and overlapped with it (SGLang's default overlap loop), then strict at 60 ms.
# JSON and logs under $OUT; prints the tables last. Env: *_LIMIT_S, DAEMON_STEPS (300).
set -uo pipefail
export PYTHONUNBUFFERED=1
source scripts/device_env.sh > "$OUT/env.log" 2>&1 || { tail -5 "$OUT/env.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "${ADOPT_LIMIT_S:-90}" python3 benchmarks/adopt_bench.py --device cuda --reps 50 --json "$OUT/adopt_bench.json" \
    > "$OUT/adopt_bench.log" 2>&1
echo "adopt bench rc $?"
# (step ms, mode): a dense-like batch-128 step (30 ms) strict and overlapped, then strict at 60 ms
# (the order of a MosaicKV step at 3 x 128K, session 8)
runs=("30 strict" "30 overlap" "60 strict")
for run in "${runs[@]}"; do
  read -r ms mode <<< "$run"
  name=daemon_${mode}_${ms}ms
  timeout "${DAEMON_LIMIT_S:-150}" python3 benchmarks/daemon_bench.py --shape llama8b --device cuda \
      --workers 12 --slots 32 --steps "${DAEMON_STEPS:-300}" --step-ms "$ms" --isolate \
      $([ "$mode" = overlap ] && echo --overlap) --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "daemon bench step $ms ms $mode rc $?"
done
# the decode step's host plan on this host (pure host work; 3 x 128K, stand-in pool)
python3 benchmarks/plan_bench.py > "$OUT/plan_bench.log" 2>&1; echo "plan bench rc $?"
for f in plan_bench adopt_bench daemon_strict_30ms daemon_overlap_30ms daemon_strict_60ms; do
  echo "== $f"; tail -"${TAIL_LINES:-20}" "$OUT/$f.log"
done
