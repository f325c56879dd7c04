"""Codec-level attention error (real SmolLM2 K/V, 8K, 3 haystacks) of default-ratio candidates for
a new default: the default without its 2-bit K candidate (k4, 3.48-3.58x on RULER) with and without
selection's second stage, under the group fit and the first-page fit. Run from the repo root."""
import json, sys
from dataclasses import replace
sys.path.insert(0, "scripts")
import basis_rule_probe as P
from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.config import MosaicConfig, DEFAULT_K_CANDIDATES
K4 = [c for c in DEFAULT_K_CANDIDATES if ",b2=0," in c]
for seed in (0, 1, 2):
    cap = capture(8192, seed=seed)
    layers = list(range(len(cap.k)))
    for budget in (4096, 1024):
        for name, k4, rescore, rule in (("k4", True, False, "group"), ("k4_rescore", True, True, "group"),
                                        ("position_k4_rescore", True, True, "first_page"),
                                        ("default", False, False, "group")):
            base = MosaicConfig()
            sel = replace(base.select, budget_tokens=budget,
                          **({"rescore_factor": 4, "rescore_channels": 32} if rescore else {}))
            cfg = replace(base, select=sel, **({"k_candidates": list(K4)} if k4 else {}))
            fidelity.compress_layer = P.compressor(rule, cap)
            r = fidelity.evaluate(fidelity.Method(name, cfg, "mosaickv"), cap, layers)
            print(json.dumps({"seed": seed, "budget": budget, "config": name, "rule": rule,
                              "physical_ratio": round(r["physical_ratio"], 3),
                              "attn_rel_err": round(r["attn_rel_err"], 4)}), flush=True)
