#!/usr/bin/env bash
# One device call: the GPU gate (every GPU-capable test) on this tree, then stage 1's sweep
# (early_v on/off, gathers, splits, register caps) at 1 x 32K and 8 x 32K.
cat /tmp/stash/base.part.00 .device/server/base.part.01 > /tmp/server-base.tar.xz || exit 1
source scripts/device_env.sh /tmp/server-base.tar.xz .device/server/server-flashinfer.tar.xz > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
echo "env in $SECONDS s"; nvidia-smi --query-gpu=name --format=csv,noheader; date -u
TESTS_LIMIT_S=270 timeout 320 bash scripts/device_gpu_tests.sh > $OUT/gate.log 2>&1
echo "== gate rc $? ($SECONDS s)"; tail -8 $OUT/gate.log
left=$((575 - SECONDS)); echo "sweep gets $left s"
timeout $left python3 benchmarks/request_decode_sweep.py --contexts 32768 --batches 1,8 --json $OUT/sweep.json > $OUT/sweep.log 2>&1
echo "== sweep rc $? ($SECONDS s)"
grep -E "run_us|unpack_us" $OUT/sweep.log | python3 -c "
import sys, ast
for line in sys.stdin:
    r = ast.literal_eval(line.strip())
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k not in ('hot_tokens',)})
"
