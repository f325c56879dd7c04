#!/usr/bin/env bash
# A server-base bundle that fits ONE device call beside the working tree and the pytest site, for
# benchmarks that import SGLang but start no server and need no FlashInfer (decode_step_bench,
# the GPU tests of the decode graph): `.device/server/server-base.tar.xz` (scripts/device_bundle.py
# --profile server) without the `nvtx` package (SGLang imports it only when an
# SGLANG_ENABLE_NVTX_* flag is set; ~11 MB unpacked), recompressed with xz -9e:
# 57.6 MB -> 53.3 MB, so tree (~12.4 MiB on disk) + bundle + pytest site < 64 MiB.
#     bash scripts/device_bench_bundle.sh   # -> .device/server_bench/server-base.tar.xz (~5 min)
#     run(carry=[".device/server_bench/server-base.tar.xz", ".device/pytest_site.tar.xz"],
#         command="source scripts/device_env.sh .device/server_bench/server-base.tar.xz && ...")
set -euo pipefail
src=.device/server/server-base.tar.xz
[ -f "$src" ] || { echo "$src missing: python3 scripts/device_bundle.py --profile server"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
xz -dc "$src" | tar -x -C "$tmp"
rm -rf "$tmp"/site/nvtx "$tmp"/site/nvtx-*.dist-info
mkdir -p .device/server_bench
tar -cf - -C "$tmp" . | xz -9e -T2 > .device/server_bench/server-base.tar.xz
ls -la .device/server_bench/server-base.tar.xz
