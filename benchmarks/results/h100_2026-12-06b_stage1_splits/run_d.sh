#!/usr/bin/env bash
# One device call: decode_step_bench (MosaicKV's graph attention per layer vs FlashInfer's paged
# decode and SDPA, both captured) for the tree before this change (71592ab: splits "fill once,
# rounded up", V loaded after the scores) and this tree, alternating, same machine.
if [ ! -f /tmp/mosaickv_site/bundles/server-base.json ]; then
  cat /tmp/stash/base.part.00 .device/server/base.part.01 > /tmp/server-base.tar.xz || exit 1
  source scripts/device_env.sh /tmp/server-base.tar.xz .device/server/server-flashinfer.tar.xz > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
else
  source scripts/device_env.sh > $OUT/env.log 2>&1 || { tail -20 $OUT/env.log; exit 1; }
fi
echo "env in $SECONDS s"; nvidia-smi --query-gpu=name --format=csv,noheader; date -u
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf ab_old.tar.gz -C /tmp/old && mv /tmp/old/triton_kernels /tmp/old/mosaickv_kernels
OLD="env PYTHONPATH=/tmp/old:$PYTHONPATH"
summ() { python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get('rows', d if isinstance(d, list) else []):
    s1 = [round(x['ms_per_layer'], 4) for x in (r.get('kernels') or []) if 'stage1' in x['kernel']]
    print(sys.argv[2], r.get('context'), r.get('batch'), 'mosaickv', round(r.get('mosaickv_ms_per_layer', -1), 4), 'flashinfer', r.get('flashinfer_ms_per_layer'), 'sdpa', r.get('dense_ms_per_layer'), 'stage1', s1[:1])
" "$1" "$2"; }
for ctx_b in "32768 1,8,17" "131072 1,8"; do
  set -- $ctx_b
  for t in new old; do
    pre=""; [ $t = old ] && pre="$OLD"
    timeout 200 $pre python3 benchmarks/decode_step_bench.py --contexts $1 --batches $2 --profile --hbm-tbs 3.35 --json $OUT/step_${t}_$1.json > $OUT/step_${t}_$1.log 2>&1
    echo "== $t $1 rc $? ($SECONDS s)"; summ $OUT/step_${t}_$1.json $t || tail -5 $OUT/step_${t}_$1.log
    [ $SECONDS -gt 540 ] && exit 0
  done
done
