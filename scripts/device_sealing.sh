#!/usr/bin/env bash
# On the H200 device machine, from the repo root; needs only torch + Triton (nothing carried).
# Sealing and the recompression daemon, without a server, one after the other (each alone on the
# GPU and the host cores):
#   1. seal_bench at the Llama-3.1-8B shape (8 KV heads, D=128, 32 layers): fit solvers
#      $SEAL_SOLVERS (default host,jacobi) side by side, both pack paths, --check;
#   2. seal_bench at the SmolLM2-135M shape (3 KV heads, D=64, 30 layers), same solvers;
#   3. daemon_bench at the Llama-8B shape, 12 workers (idle vs saturated step time);
#   4. basis_fit speed table on CUDA.
# JSON and logs under $OUT; prints the tables last. Env: SEAL_TOKENS (8192), *_LIMIT_S.
set -uo pipefail
export PYTHONUNBUFFERED=1
source scripts/device_env.sh > "$OUT/env.log" 2>&1 || { tail -5 "$OUT/env.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
solvers=${SEAL_SOLVERS:-host,jacobi}
timeout "${SEAL_LIMIT_S:-200}" python3 benchmarks/seal_bench.py --device cuda --check \
    --tokens "${SEAL_TOKENS:-8192}" --fit-solvers "$solvers" \
    --json "$OUT/seal_llama8b.json" > "$OUT/seal_llama8b.log" 2>&1
echo "seal bench llama8b rc $?"
timeout "${SEAL_SMOL_LIMIT_S:-120}" python3 benchmarks/seal_bench.py --device cuda \
    --tokens "${SEAL_TOKENS:-8192}" --layers 30 --heads 3 --head-dim 64 --fit-solvers "$solvers" \
    --pack-kernel triton --json "$OUT/seal_smollm2.json" > "$OUT/seal_smollm2.log" 2>&1
echo "seal bench smollm2 rc $?"
timeout "${DAEMON_LIMIT_S:-150}" python3 benchmarks/daemon_bench.py --shape llama8b --device cuda \
    --workers 12 --slots 32 --steps "${DAEMON_STEPS:-400}" --step-ms 30 --isolate \
    --json "$OUT/daemon_bench.json" > "$OUT/daemon_bench.log" 2>&1
echo "daemon bench rc $?"
timeout "${FIT_LIMIT_S:-90}" python3 -m mosaickv_sglang.bench.basis_fit --parts speed \
    --device cuda --threads 16 --json "$OUT/basis_fit_cuda.json" > "$OUT/basis_fit.log" 2>&1
echo "basis fit rc $?"
for f in seal_llama8b seal_smollm2 daemon_bench basis_fit; do
  echo "== $f"; tail -"${TAIL_LINES:-22}" "$OUT/$f.log"
done
