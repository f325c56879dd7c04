# Source on the device machine, from the repo root, with the archives scripts/device_bundle.py
# built (carried in .device/):
#
#     source scripts/device_env.sh .device/kernel.tar.xz
#     source scripts/device_env.sh .device/server-base.tar.xz [.device/server-flashinfer.tar.xz]
#
# Unpacks each archive into $MOSAICKV_DEVICE_SITE (default /tmp/mosaickv_site; it stays while the
# machine is warm, so archives sent in back-to-back calls add up), puts its site/ first on
# PYTHONPATH with the repo (mosaickv_kernels = triton_kernels/, and a dist-info so SGLang finds
# the plugin's entry points), exports MOSAICKV_SGLANG_SRC when SGLang's decode kernel sources
# came along, and imports what every archive unpacked so far lists in its BUNDLE.json. Returns
# non-zero (and says which) on a missing archive or a failed import.

mosaickv_device_env() {
  local repo site a
  repo=$(pwd)
  site=${MOSAICKV_DEVICE_SITE:-/tmp/mosaickv_site}
  mkdir -p "$site/site" "$site/bundles" || return 1
  for a in "$@"; do
    if [ ! -f "$a" ]; then
      echo "device_env: archive '$a' not found (carry .device in the run call)" >&2
      return 1
    fi
    local t0=$SECONDS name
    name=$(basename "$a" .tar.xz)
    tar -xJf "$a" -C "$site" || { echo "device_env: could not unpack $a" >&2; return 1; }
    mv "$site/BUNDLE.json" "$site/bundles/$name.json"
    echo "device_env: unpacked $name in $((SECONDS - t0)) s"
  done
  ln -sfn "$repo/triton_kernels" "$site/site/mosaickv_kernels"
  export PYTHONPATH="$site/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
  [ -d "$site/sglang_src" ] && export MOSAICKV_SGLANG_SRC="$site/sglang_src"
  python3 - "$repo" "$site" <<'EOF'
import importlib, json, pathlib, sys, tomllib
repo, site = map(pathlib.Path, sys.argv[1:])
# Entry points for SGLang's plugin discovery (what `pip install -e .` would register).
proj = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
info = site / "site" / f"mosaickv_sglang-{proj['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mosaickv-sglang\n"
                               f"Version: {proj['version']}\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
    for group, eps in proj.get("entry-points", {}).items()))
failed = []
for bundle in sorted((site / "bundles").glob("*.json")):
    for mod in json.loads(bundle.read_text())["imports"]:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # report every failure, then fail
            failed.append(f"{bundle.stem}: import {mod}: {exc!r}"[:300])
for line in failed:
    print("device_env:", line, file=sys.stderr)
print("device_env: imports", "FAILED" if failed else "ok", flush=True)
sys.exit(1 if failed else 0)
EOF
}

mosaickv_device_env "$@"
