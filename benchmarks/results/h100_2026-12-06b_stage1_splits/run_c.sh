#!/usr/bin/env bash
# One device call: stage 1's split counts at 1, 8 and 17 x 32K (the default plan otherwise),
# the basis-fit GPU tests after the tf32 fix, seal_bench jacobi vs jacobi_tf32, and the decode
# seal probe with the start-up compiles done first.
if [ ! -f /tmp/mosaickv_site/bundles/server-base.json ]; then
  cat /tmp/stash/base.part.00 .device/server/base.part.01 > /tmp/server-base.tar.xz || exit 1
  source scripts/device_env.sh /tmp/server-base.tar.xz .device/server/server-flashinfer.tar.xz > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
else
  source scripts/device_env.sh > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
fi
echo "env in $SECONDS s"; nvidia-smi --query-gpu=name --format=csv,noheader; date -u
summ() { grep -E "run_us" "$1" | python3 -c "
import sys, ast
for line in sys.stdin:
    r = ast.literal_eval(line.strip())
    print(r['context'], r['batch'], 'splits', r['splits'], 'run_us', round(r['run_us'], 1), 'empty_us', round(r['empty_us'], 1), 'diff', r['max_abs_diff_vs_first'])
"; }
for pt in "1 16,24,33,40" "8 3,4,6,8,12,16,20,24,32" "17 1,2,3,4,5,6,8,10,12,16"; do
  set -- $pt
  timeout 150 python3 benchmarks/request_decode_sweep.py --contexts 32768 --batches $1 --splits $2 --reps 50 > $OUT/sweep_b$1.log 2>&1
  echo "== sweep batch $1 rc $? ($SECONDS s)"; summ $OUT/sweep_b$1.log
done
[ -d /tmp/pytest_site ] || { mkdir -p /tmp/pytest_site && tar -xJf .device/pytest_site.tar.xz -C /tmp/pytest_site; }
PYTHONPATH=/tmp/pytest_site:$PYTHONPATH timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_basis_fit.py > $OUT/basis_fit.log 2>&1
echo "== basis_fit rc $? ($SECONDS s)"; tail -3 $OUT/basis_fit.log
timeout 150 python3 benchmarks/seal_bench.py --device cuda --tokens 8192 --pack-kernel triton --fit-solvers jacobi,jacobi_tf32 --json $OUT/seal_bench.json > $OUT/seal_bench.log 2>&1
echo "== seal_bench rc $? ($SECONDS s)"; tail -14 $OUT/seal_bench.log
left=$((585 - SECONDS)); [ $left -gt 60 ] && { timeout $left python3 scripts/decode_seal_probe.py --device cuda --requests 16 --layers-per-step 0,0 --phases > $OUT/probe.log 2>&1; echo "== probe rc $? ($SECONDS s)"; grep -E "^decode_seal|phases" $OUT/probe.log | cut -c1-330; }
