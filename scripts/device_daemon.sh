#!/usr/bin/env bash
# On the H200 device machine, from the repo root; needs only torch + Triton (nothing carried).
# Issue 5 in one call, each step alone on the GPU and the host cores:
#   1. adopt_bench on CUDA: one Llama-3.1-8B page adopted per tensor vs arena-ready (load + install
#      on the scheduler thread, both stores checked byte-equal);
#   2. daemon_bench at the Llama-8B shape, 12 workers, the session-5 call-4 command, with the
#      workers at nice 0 and then at nice 19 (the default): step time idle vs saturated (p50/p99),
#      pages/s, per-page load/install, side by side in one call; then nice 19 at a 60 ms step.
# JSON and logs under $OUT; prints the tables last. Env: *_LIMIT_S, DAEMON_STEPS (300).
set -uo pipefail
export PYTHONUNBUFFERED=1
source scripts/device_env.sh > "$OUT/env.log" 2>&1 || { tail -5 "$OUT/env.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "${ADOPT_LIMIT_S:-90}" python3 benchmarks/adopt_bench.py --device cuda --reps 50 --json "$OUT/adopt_bench.json" \
    > "$OUT/adopt_bench.log" 2>&1
echo "adopt bench rc $?"
# (nice, step ms): the session-5/8 runs at a 30 ms step (a dense-like batch-128 step: the strict
# case), then the default nice at 60 ms (the order of a MosaicKV step at 3 x 128K, session 8)
runs=("0 30" "19 30" "19 60")
for run in "${runs[@]}"; do
  read -r nice ms <<< "$run"
  name=daemon_nice${nice}_${ms}ms
  timeout "${DAEMON_LIMIT_S:-150}" python3 benchmarks/daemon_bench.py --shape llama8b --device cuda \
      --workers 12 --slots 32 --steps "${DAEMON_STEPS:-300}" --step-ms "$ms" --isolate --nice "$nice" \
      --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "daemon bench nice $nice step $ms ms rc $?"
done
# the decode step's host plan on this host (pure host work; 3 x 128K, stand-in pool)
python3 benchmarks/plan_bench.py > "$OUT/plan_bench.log" 2>&1; echo "plan bench rc $?"
for f in plan_bench adopt_bench daemon_nice0_30ms daemon_nice19_30ms daemon_nice19_60ms; do
  echo "== $f"; tail -"${TAIL_LINES:-20}" "$OUT/$f.log"
done
