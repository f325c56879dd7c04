"""Codec-level ratio and attention error (real SmolLM2 K/V, 8K, 3 haystacks) of compact candidate
sets: bands that drop the rotated tail channels and use more 2-bit channels, with selection's
second stage (rescore 4x on 32 channels), at the default selection budget (4096) and 1/8 (1024).
Towards a compact preset at >= 4.5x. From the repo root: python <this file> [names...]"""
import json, sys
from dataclasses import replace
from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.config import MosaicConfig

DEF_K = ["band:b8=4,b4=44,b2=16,group=128", "band:b8=4,b4=60,b2=0,group=128",
         "band:b8=16,b4=48,b2=0,group=64"]
DEF_V = ["band:b8=0,b4=48,b2=16,group=128", "band:b8=4,b4=60,b2=0,group=128",
         "band:b8=16,b4=48,b2=0,group=64"]
RUNS = {  # name -> (k candidates, v candidates, k budget, v budget)
    "b12": (DEF_K, DEF_V, 0.12, 0.20),
    "c1": (["band:b8=4,b4=28,b2=24,group=128"] + DEF_K, ["band:b8=0,b4=32,b2=24,group=128"] + DEF_V,
           0.12, 0.20),
    "c2": (["band:b8=4,b4=20,b2=32,group=128", "band:b8=4,b4=28,b2=24,group=128"] + DEF_K[:2],
           ["band:b8=0,b4=16,b2=40,group=128", "band:b8=0,b4=32,b2=24,group=128"] + DEF_V[:2],
           0.15, 0.25),
    "c3": (["band:b8=4,b4=20,b2=32,group=128", "band:b8=4,b4=28,b2=24,group=128"] + DEF_K[:2],
           ["band:b8=0,b4=16,b2=40,group=128", "band:b8=0,b4=32,b2=24,group=128"] + DEF_V[:2],
           0.20, 0.30),
}
C5_K = ["band:b8=4,b4=12,b2=40,group=128", "band:b8=4,b4=20,b2=32,group=128",
        "band:b8=4,b4=28,b2=24,group=128", "band:b8=4,b4=44,b2=16,group=128"]
C5_V = ["band:b8=0,b4=8,b2=48,group=128", "band:b8=0,b4=16,b2=40,group=128",
        "band:b8=0,b4=32,b2=24,group=128", "band:b8=0,b4=48,b2=16,group=128"]
RUNS.update({
    "c4": (RUNS["c3"][0], RUNS["c3"][1], 0.25, 0.35),
    "c5": (C5_K, C5_V, 0.20, 0.30),
    "c6": (C5_K, C5_V, 0.25, 0.35),
})
# second pass (`python compact_probe.py --budgets 4096 c4 c5 c6`): the default budget only
argv = sys.argv[1:]
budgets = (4096, 1024)
if argv[:1] == ["--budgets"]:
    budgets, argv = tuple(int(b) for b in argv[1].split(",")), argv[2:]
names = argv or ["b12", "c1", "c2", "c3"]
for seed in (0, 1, 2):
    cap = capture(8192, seed=seed)
    layers = list(range(len(cap.k)))
    for budget in budgets:
        for name in names:
            ks, vs, kb, vb = RUNS[name]
            base = MosaicConfig()
            sel = replace(base.select, budget_tokens=budget, rescore_factor=4, rescore_channels=32)
            cfg = replace(base, select=sel, k_error_budget=kb, v_error_budget=vb,
                          k_candidates=list(ks), v_candidates=list(vs))
            r = fidelity.evaluate(fidelity.Method(name, cfg, "mosaickv"), cap, layers)
            print(json.dumps({"seed": seed, "budget": budget, "config": name,
                              "k_error_budget": kb, "v_error_budget": vb,
                              "physical_ratio": round(r["physical_ratio"], 3),
                              "attn_rel_err": round(r["attn_rel_err"], 4)}), flush=True)
