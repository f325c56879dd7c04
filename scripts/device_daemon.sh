#!/usr/bin/env bash
# On the H200 device machine, from the repo root; needs only torch + Triton (nothing carried).
# Issue 5 in one call: with .device/pytest_site.tar.xz carried, the daemon's copy kernels' tests
# on CUDA first; then adopt_bench (what each of a page's three boundary operations costs the
# scheduler thread on CUDA: load, install, pump; --profile: the torch ops behind them), then
# daemon_bench at the Llama-8B shape (12 workers at nice 19, 32 slots,
# DAEMON_STEPS steps per phase), step time with the daemon idle vs saturated (p50/p99), pages/s,
# the boundary's operations, each run alone on the GPU and the host cores:
#   * 30 ms step, boundary after the step's device work (host-bound: the strict case), slots
#     filled on side streams (the pool's way) and on the current stream, side by side;
#   * 30 ms overlapped with the step's device work (SGLang's default overlap loop), the same two;
#   * 60 ms strict, side streams (the order of a MosaicKV step at 3 x 128K, measured 2026-11-30).
# COPIES: who moves a page's bytes (auto: the kernels on CUDA; torch).
# JSON per run, adopt_bench's JSON and log, and one daemon log under $OUT; prints each run's
# table last. Env: DAEMON_LIMIT_S (150), DAEMON_STEPS (400), SHARE (the config default), RUNS
# (the runs, see below), PROFILE_RUN (a run like those of RUNS, added last with its boundaries
# cProfiled into <name>_prof.txt; its ratios are not comparable).
set -uo pipefail
export PYTHONUNBUFFERED=1
source scripts/device_env.sh > "$OUT/env.log" 2>&1 || { tail -5 "$OUT/env.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cpu0 SMT siblings: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null); $(nproc) cpus; $(grep -m1 'model name' /proc/cpuinfo)"
if [ -f .device/pytest_site.tar.xz ]; then  # carried: pytest for the image that lacks it
  mkdir -p /tmp/pytest_site && tar -xJf .device/pytest_site.tar.xz -C /tmp/pytest_site
  export PYTHONPATH="/tmp/pytest_site:$PYTHONPATH"
fi
if python3 -c 'import pytest' 2> /dev/null; then  # the daemon's copy kernels' tests on CUDA
  timeout "${TESTS_LIMIT_S:-120}" python3 -m pytest -q -p no:cacheprovider -W ignore \
      tests/test_page_gather_kernel.py tests/test_row_copy_kernel.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc $? ($(tail -1 "$OUT/gpu_tests.log"))"
fi
timeout "${ADOPT_LIMIT_S:-90}" python3 benchmarks/adopt_bench.py --device cuda --reps 50 --profile \
    --json "$OUT/adopt_bench.json" > "$OUT/adopt_bench.log" 2>&1
echo "adopt bench rc $?"
share=${SHARE:-$(python3 -c 'from mosaickv_sglang.config import MosaicConfig as C; print(C.daemon_boundary_share)')}
copies=${COPIES:-auto}
# (step ms, mode, boundary share, slot-copy stream, workers, cores kept from the workers: the
# scheduler's core, or with "smt" its SMT siblings too); RUNS (";"-separated) replaces the list
IFS=';' read -r -a runs <<< "${RUNS:-30 strict $share side 12 core;30 strict $share current 12 core;30 overlap $share side 12 core;30 overlap $share current 12 core;60 strict $share side 12 core}"
[ -n "${PROFILE_RUN:-}" ] && runs+=("$PROFILE_RUN prof")
name_of() { echo "daemon_${2}_${1}ms_share${3}_${copies}_${4}_w${5}_${6}${7:+_$7}"; }
for run in "${runs[@]}"; do
  read -r ms mode sh stream workers spare prof <<< "$run"
  name=$(name_of $run)
  echo "===== $name" >> "$OUT/daemon.log"
  timeout "${DAEMON_LIMIT_S:-150}" python3 benchmarks/daemon_bench.py --shape llama8b --device cuda \
      --workers "$workers" --slots 32 --steps "${DAEMON_STEPS:-400}" --step-ms "$ms" --isolate \
      --share "$sh" --copies "$copies" --copy-stream "$stream" \
      $([ "$mode" = overlap ] && echo --overlap) $([ "$spare" = smt ] && echo --spare-smt) \
      $([ -n "$prof" ] && echo --profile-boundaries "$OUT/$name.txt") \
      --json "$OUT/$name.json" \
      > "$OUT/$name.log" 2>&1
  echo "daemon bench $name rc $?"
  cat "$OUT/$name.log" >> "$OUT/daemon.log" && rm "$OUT/$name.log"
done
grep -v -i warn "$OUT/adopt_bench.log" | tail -8
for run in "${runs[@]}"; do
  name=$(name_of $run)
  echo "== $name"
  sed -n "/^===== $name\$/,/^=====/p" "$OUT/daemon.log" \
    | grep -E "^(saturated/idle|daemon:|\| |adopting|saturated:|scheduler on)" | tail -"${TAIL_LINES:-12}"
done
