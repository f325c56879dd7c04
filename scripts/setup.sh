#!/usr/bin/env bash
# One-time, idempotent set-up of a CPU development checkout:
#   .venv with SGLang 0.5.17's lite CPU dependency set (no GPU-only kernels), torch 2.11.0,
#   this package in editable mode, and the offline assets (SmolLM2-135M-Instruct, RULER essays).
# Re-running it only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.mosaickv-deps-$(sha256sum scripts/requirements-cpu.txt | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "[setup] installing the pinned CPU dependency set (a few minutes the first time)"
  .venv/bin/pip install -q --disable-pip-version-check -r scripts/requirements-cpu.txt 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/pip install -q --disable-pip-version-check --no-deps sglang==0.5.17 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import torch, sglang, transformers; assert torch.__version__.startswith('2.11.0'), torch.__version__"
  touch "$stamp"
fi
echo "[setup] installing mosaickv-sglang (editable)"
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored: it is neither" || true
echo "[setup] offline assets"
.venv/bin/python -m mosaickv_sglang.assets.smollm2
.venv/bin/python -c "from mosaickv_sglang.assets.ruler_data import essay_text; print(f'[setup] essays: {len(essay_text())} characters')"
echo "[setup] done"
