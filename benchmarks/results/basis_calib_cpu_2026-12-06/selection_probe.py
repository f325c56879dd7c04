import json, sys
from dataclasses import replace
sys.path.insert(0, "scripts")
import basis_rule_probe as P
from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.config import MosaicConfig
for seed in (0, 1, 2):
    cap = capture(8192, seed=seed)
    layers = list(range(len(cap.k)))
    for budget in (4096, 1024):
        base = MosaicConfig()
        for meta in (8,):  # (8, 64) with rescore_factor=0, rescore_channels=0 for the meta rows
            cfg = replace(base, select=replace(base.select, budget_tokens=budget, meta_channels=meta, rescore_factor=4, rescore_channels=32))
            for rule in ("group", "first_page"):
                fidelity.compress_layer = P.compressor(rule, cap)
                r = fidelity.evaluate(fidelity.Method(rule, cfg, "mosaickv"), cap, layers)
                print(json.dumps({"seed": seed, "budget": budget, "meta_channels": meta, "rule": rule,
                                  "physical_ratio": round(r["physical_ratio"], 3),
                                  "attn_rel_err": round(r["attn_rel_err"], 4)}), flush=True)
