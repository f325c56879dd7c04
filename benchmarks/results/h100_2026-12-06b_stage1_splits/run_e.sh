#!/usr/bin/env bash
# One short device call: the decode seal probe with jacobi vs jacobi_tf32 (the block-opening
# step fits 16 blocks x 512 matrices on 128 tokens each), then stage 1's split counts at
# 8 x 128K (the model was fitted at 32K).
cat /tmp/stash/base.part.00 .device/server/base.part.01 > /tmp/server-base.tar.xz || exit 1
source scripts/device_env.sh /tmp/server-base.tar.xz .device/server/server-flashinfer.tar.xz > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
echo "env in $SECONDS s"; nvidia-smi --query-gpu=name --format=csv,noheader; date -u
for fs in jacobi jacobi_tf32; do
  timeout 70 python3 scripts/decode_seal_probe.py --device cuda --requests 16 --layers-per-step 0,0 --phases --config "{\"fit_solver\": \"$fs\"}" > $OUT/probe_$fs.log 2>&1
  echo "== $fs rc $? ($SECONDS s)"; grep -E "^decode_seal|phases" $OUT/probe_$fs.log | tail -4 | cut -c1-260
done
left=$((230 - SECONDS)); [ $left -gt 40 ] && { timeout $left python3 benchmarks/request_decode_sweep.py --contexts 131072 --batches 8 --splits 2,3,4,6,8,12,16 --reps 30 > $OUT/sweep_128k.log 2>&1; echo "== sweep rc $? ($SECONDS s)"; grep run_us $OUT/sweep_128k.log | python3 -c "
import sys, ast
for line in sys.stdin:
    r = ast.literal_eval(line.strip()); print(r['context'], r['batch'], 'splits', r['splits'], 'run_us', round(r['run_us'], 1))"; }
