"""The codec-level attention error (same haystacks, seed 0, 8K, default budget, no second stage:
as RULER's servers ran them) of the fixed-layout systems RULER measured on the H200 (2026-11-30):
mosaickv_lo (4.32x, loss 4.10) and mosaickv_xlo (loss 70.9), and the default (3.46x, loss 2.10),
to read the compact probe's errors against. From the repo root: python <this file>"""
import json
from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.eval.systems import SYSTEMS
from mosaickv_sglang.config import MosaicConfig

cap = capture(8192, seed=0)
layers = list(range(len(cap.k)))
for name in ("mosaickv", "mosaickv_lo", "mosaickv_xlo", "mosaickv_rescore_b12"):
    cfg = SYSTEMS[name].mosaic_config() or MosaicConfig()
    r = fidelity.evaluate(fidelity.Method(name, cfg, "mosaickv"), cap, layers)
    print(json.dumps({"seed": 0, "budget": cfg.select.budget_tokens, "config": name,
                      "physical_ratio": round(r["physical_ratio"], 3),
                      "attn_rel_err": round(r["attn_rel_err"], 4)}), flush=True)
