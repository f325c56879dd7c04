"""Basis block size vs attention error and ratio on real SmolLM2 KV (CPU, codec)."""
import json, sys, time
from dataclasses import replace
from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.config import MosaicConfig

length = int(sys.argv[1]); seeds = [int(s) for s in sys.argv[2].split(",")]
for seed in seeds:
    cap = capture(length, seed=seed)
    layers = list(range(len(cap.k)))
    for block in (4096, 8192):
        for budget in (4096, length // 8):
            base = MosaicConfig()
            cfg = replace(base, basis_block_tokens=block, select=replace(base.select, budget_tokens=budget))
            t0 = time.time()
            r = fidelity.evaluate(fidelity.Method(f"block{block}", cfg, "mosaickv"), cap, layers)
            print(json.dumps({"length": length, "seed": seed, "block": block, "budget": budget,
                              "physical_ratio": round(r["physical_ratio"], 3),
                              "attn_rel_err": round(r["attn_rel_err"], 4),
                              "mass_recall": round(r["mass_recall"], 4),
                              "pages_read": round(r["pages_read"], 3),
                              "seconds": round(time.time() - t0, 1)}), flush=True)
