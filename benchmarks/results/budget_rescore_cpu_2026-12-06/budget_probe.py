"""Codec-level ratio and attention error (real SmolLM2 K/V, 8K, 3 haystacks) of looser chooser
error budgets with selection's second stage (rescore 4x on 32 channels): how much of the second
stage's accuracy can buy bytes. Group fit (default) and first-page fit (position rule)."""
import json, sys
from dataclasses import replace
sys.path.insert(0, "scripts")
import basis_rule_probe as P
from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.config import MosaicConfig, DEFAULT_K_CANDIDATES
K4 = [c for c in DEFAULT_K_CANDIDATES if ",b2=0," in c]
RUNS = [("b10_16", 0.10, 0.16, False), ("b12_20", 0.12, 0.20, False), ("b15_25", 0.15, 0.25, False)]
for seed in (0, 1, 2):
    cap = capture(8192, seed=seed)
    layers = list(range(len(cap.k)))
    for budget in (4096, 1024):
        for rule in ("group",):
            for name, kb, vb, k4 in RUNS:
                base = MosaicConfig()
                sel = replace(base.select, budget_tokens=budget, rescore_factor=4, rescore_channels=32)
                cfg = replace(base, select=sel, k_error_budget=kb, v_error_budget=vb,
                              **({"k_candidates": list(K4)} if k4 else {}))
                fidelity.compress_layer = P.compressor(rule, cap)
                r = fidelity.evaluate(fidelity.Method(name, cfg, "mosaickv"), cap, layers)
                print(json.dumps({"seed": seed, "budget": budget, "config": name, "rule": rule,
                                  "k_error_budget": kb, "v_error_budget": vb, "k4": k4,
                                  "physical_ratio": round(r["physical_ratio"], 3),
                                  "attn_rel_err": round(r["attn_rel_err"], 4)}), flush=True)
