#!/usr/bin/env bash
# On the H200 device machine, from the repo root: every GPU-capable test in one call
# (scripts/gpu_tests.py's GPU_TEST_FILES: the `gpu`-marked tests and the kernel/decode tests
# that run on CUDA when it is there), real Triton compiles (TRITON_INTERPRET unset), and the
# evidence in $OUT/gpu-tests.json (tree fingerprints, GPU, versions, UTC date, per test
# nodeid/outcome/duration) plus $OUT/gpu-tests.log; prints a table. Back here:
# `python3 scripts/gpu_tests.py record <files_at>/gpu-tests.json` names the commit and writes
# benchmarks/results/gpu-tests.json.
#
# Carry .device/server/server-base.tar.xz (SGLang: 4 of the files import it; without it they
# are reported as not run, the rest still runs) -- or unpack it in an earlier call on this warm
# machine -- and, if the image has no pytest, .device/pytest_site.tar.xz
# (bash scripts/pytest_site.sh) or the wheels in .device/pytest.
# Env: TESTS_LIMIT_S (pytest's limit, default 420), JOBS (pytest processes at once, default 4),
# GPU_TEST_FILES (instead of the list), PYTEST_ARGS (e.g. "-x -k decode").
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$SECONDS
: "${OUT:?OUT must name the folder whose files come back}"
unset TRITON_INTERPRET  # the kernels compile for the GPU
site=${MOSAICKV_DEVICE_SITE:-/tmp/mosaickv_site}
archives=()
a=.device/server/server-base.tar.xz
if [ -f "$a" ]; then archives+=("$a")
elif [ ! -f "$site/bundles/server-base.json" ]; then
  echo "no SGLang bundle ($a not carried, not unpacked earlier): SGLang's tests will not run"
fi
# SGLang's attention modules import flashinfer even for the torch/triton paths the tests use
a=.device/server/server-flashinfer.tar.xz
if [ -f "$a" ]; then archives+=("$a")
elif [ ! -f "$site/bundles/server-flashinfer.json" ]; then
  echo "no FlashInfer bundle ($a not carried, not unpacked earlier): 3 SGLang test files fail to import"
fi
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh ${archives[@]+"${archives[@]}"} > "$OUT/env.log" 2>&1 || {
  tail -20 "$OUT/env.log"; exit 1; }
if ! python3 -c 'import pytest' 2> /dev/null; then
  mkdir -p /tmp/pytest_site
  if [ -f .device/pytest_site.tar.xz ]; then tar -xJf .device/pytest_site.tar.xz -C /tmp/pytest_site
  elif ls .device/pytest/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pytest_site \
      .device/pytest/*.whl
  fi
  export PYTHONPATH="/tmp/pytest_site:$PYTHONPATH"
  python3 -c 'import pytest' || { echo "no pytest: carry .device/pytest_site.tar.xz"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "environment ready in $((SECONDS - t0)) s"
files=()
[ -n "${GPU_TEST_FILES:-}" ] && read -r -a files <<< "$GPU_TEST_FILES"
read -r -a extra <<< "${PYTEST_ARGS:-}"
python3 scripts/gpu_tests.py run --out "$OUT/gpu-tests.json" --jobs "${JOBS:-4}" \
  --limit-s "${TESTS_LIMIT_S:-420}" ${files[@]+--files "${files[@]}"} -- ${extra[@]+"${extra[@]}"}
rc=$?
echo "gpu tests rc $rc in $((SECONDS - t0)) s"
exit $rc
