"""The fill of capacity_bench.py with this folder's config, then layers 0, 15, 29 of the arena at the
refusal (free bytes, whole largest-layout blocks, extents, live bytes). From the repo root:
`python benchmarks/results/capacity_cpu_2026-12-07_cold_compact/allocators_probe.py` (~20 min)."""
import sys, json
sys.path.insert(0, "benchmarks")
import torch
import capacity_bench as cb
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.bench.capture import capture
cfg = MosaicConfig.parse(open("benchmarks/results/capacity_cpu_2026-12-07_cold_compact/config.json").read())
caps = [capture(n_tokens=8192, seed=s) for s in (0, 1, 2)]
layers, (heads, _, hd) = len(caps[0].k), caps[0].k[0].shape
pool = cb.build_pool(cfg, 213504, layers, heads, hd, 8192, 8192)
got = cb.fill(pool, caps, 10000, log_every=16)
st = pool.store
for l in (0, layers // 2, layers - 1):
    a = st.allocators[l]
    print(json.dumps({"layer": l, "capacity": a.capacity, "top": a.top, "unit": a.unit,
                      "free_bytes": a.free_bytes(), "fits": a.fits(), "fits_bytes": a.fits() * a.unit,
                      "extents": len(a._start), "largest_extent": max(a._start.values(), default=0),
                      "layer_live": int(st.layer_live[l])}), flush=True)
print("requests", got["requests"], "tokens", got["tokens"])
