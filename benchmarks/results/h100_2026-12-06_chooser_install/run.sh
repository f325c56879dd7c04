#!/usr/bin/env bash
# scratch: this session's A/B call (deleted after); old = d413c87's packages from ab_old.tar.gz
cat /tmp/stash/base.part.00 .device/server/base.part.01 > /tmp/server-base.tar.xz || exit 1
source scripts/device_env.sh /tmp/server-base.tar.xz .device/server/server-flashinfer.tar.xz > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
echo "env in $SECONDS s"; nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf ab_old.tar.gz -C /tmp/old && mv /tmp/old/triton_kernels /tmp/old/mosaickv_kernels
P="python3 scripts/decode_seal_probe.py --device cuda --requests 16"
OLD="env PYTHONPATH=/tmp/old:$PYTHONPATH"
run() { local name=$1; shift; timeout 120 "$@" > $OUT/$name.log 2>&1; echo "== $name ($SECONDS s)"; grep -E "^decode_seal|phases" $OUT/$name.log | cut -c1-400; }
run old1 $OLD $P --layers-per-step 0,0
run new1 $P --layers-per-step 0,0
run old2 $OLD $P --layers-per-step 0,0
run new2 $P --layers-per-step 0,0
run new_cascade $P --layers-per-step 0,0 --config '{"chooser": "cascade"}'
run old_phases $OLD $P --layers-per-step 0,0 --phases
run new_phases $P --layers-per-step 0,0 --phases


for t in new old; do
  pre=""; [ $t = old ] && pre="$OLD"
  timeout 150 $pre python3 benchmarks/seal_bench.py --device cuda --tokens 8192 --pack-kernel triton --json $OUT/sb_$t.json > $OUT/sb_$t.log 2>&1
  echo "== seal_bench $t ($SECONDS s)"; tail -12 $OUT/sb_$t.log
done
left=$((440 - SECONDS)); echo "gate gets $left s"
if [ $left -gt 120 ]; then
  GPU_TEST_FILES="tests/test_band_errors_kernel.py tests/test_pack_install.py tests/test_band_pack_kernel.py" TESTS_LIMIT_S=$((left - 40)) timeout $((left - 10)) bash scripts/device_gpu_tests.sh > $OUT/gate.log 2>&1
  tail -25 $OUT/gate.log
fi
