#!/usr/bin/env bash
# On the H200 device machine, from the repo root: a same-call A/B of what the daemon costs the
# scheduler thread, this tree against an older commit's (hosts differ between calls by up to 2x,
# so only one call's runs compare). Carry BASE_ARCHIVE (default .device/base.tar: `git archive
# <commit> mosaickv_sglang triton_kernels benchmarks`). Runs adopt_bench (old, new), then
# daemon_bench at the Llama-8B shape, 12 workers, 30 ms strict (old, new, old, new: the spread
# between equal runs shows), then the new tree at 30 ms overlapped and 60 ms strict. Prints a
# table last (summarize_daemon_runs.py); under $OUT a JSON per daemon run and two logs (the
# device returns at most 8 files).
# With .device/pytest_site.tar.xz carried, GPU_TESTS (the daemon's copy kernels' and in-place
# adoption's tests by default) run on CUDA first, in this tree, into $OUT/gpu_tests.log.
# Env: DAEMON_STEPS (400), DAEMON_LIMIT_S (150), EXTRA (more daemon_bench args, both trees),
# RUNS (";"-separated "tree mode step-ms [daemon_bench args...]" runs, at most 6 (5 with the GPU tests' log): the files
# that come back; the args of one run, e.g. "--share 0.03", name its JSON too), ADOPT=0 (no
# adopt_bench).
set -uo pipefail
export PYTHONUNBUFFERED=1
source scripts/device_env.sh > /tmp/env.log 2>&1 || { tail -5 /tmp/env.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
base=/tmp/base_tree
rm -rf "$base" && mkdir -p "$base" && tar -xf "${BASE_ARCHIVE:-.device/base.tar}" -C "$base" \
  || { echo "no base archive"; exit 1; }
ln -sfn "$base/triton_kernels" "$base/mosaickv_kernels"
if [ -f .device/pytest_site.tar.xz ]; then  # carried: pytest for the image that lacks it
  mkdir -p /tmp/pytest_site && tar -xJf .device/pytest_site.tar.xz -C /tmp/pytest_site
  PYTHONPATH="/tmp/pytest_site:$PYTHONPATH" timeout "${TESTS_LIMIT_S:-150}" python3 -m pytest -q \
    -p no:cacheprovider -W ignore ${GPU_TESTS:-tests/test_adopt_in_place.py \
    tests/test_page_gather_kernel.py tests/test_row_copy_kernel.py} > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc $? ($(tail -1 "$OUT/gpu_tests.log"))"
fi
in_tree() {  # in_tree old|new CMD...: the old tree's package first on the path, from its root
  if [ "$1" = old ]; then shift; (cd "$base" && PYTHONPATH="$base:$PYTHONPATH" "$@")
  else shift; "$@"; fi
}
for tree in $([ "${ADOPT:-1}" = 1 ] && echo old new); do
  echo "===== $tree" >> "$OUT/adopt.log"
  in_tree $tree timeout 120 python3 benchmarks/adopt_bench.py --device cuda --reps 50 \
    > /tmp/adopt_$tree.log 2>&1
  echo "adopt bench $tree rc $?"
  cat /tmp/adopt_$tree.log >> "$OUT/adopt.log"
done
i=0
IFS=';' read -r -a runs <<< "${RUNS:-old strict 30;new strict 30;old strict 30;new strict 30;new overlap 30;new strict 60}"
for run in "${runs[@]}"; do
  read -r tree mode ms args <<< "$run"
  i=$((i + 1))
  tag=$(tr -cd 'A-Za-z0-9.' <<< "${args:-}")  # the device returns plain file names only
  name="daemon_${i}_${tree}_${mode}_${ms}ms${tag:+_$tag}"
  in_tree $tree timeout "${DAEMON_LIMIT_S:-150}" python3 benchmarks/daemon_bench.py \
    --shape llama8b --device cuda --workers 12 --slots 32 --steps "${DAEMON_STEPS:-400}" \
    --step-ms "$ms" --isolate $([ "$mode" = overlap ] && echo --overlap) ${EXTRA:-} \
    ${args:-} --json "$OUT/$name.json" > /tmp/run.log 2>&1
  echo "daemon bench $name rc $?"
  { echo "===== $name"; cat /tmp/run.log; } >> "$OUT/daemon.log"
done
for tree in $([ "${ADOPT:-1}" = 1 ] && echo old new); do echo "adopt_bench $tree: $(grep -E \
  '^arena_ready_kernels|^in_place_kernels|^pump by kernel' /tmp/adopt_$tree.log \
  | sed 's/: .*median of 50 ms:/:/; s/ (row table.*//; s/.*pinned): /pump: /' | tr '\n' ' ')"; done
python3 scripts/summarize_daemon_runs.py "$OUT"/daemon_*.json
