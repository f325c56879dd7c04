import json, time
from dataclasses import replace
from mosaickv_sglang.bench.capture import capture, Capture
from mosaickv_sglang.bench.fidelity import Method, evaluate
from mosaickv_sglang.config import MosaicConfig, SelectionConfig
import sys
for seed in map(int, sys.argv[1:]):
    cap = capture(n_tokens=8192, seed=seed)
    last = Capture([q[-1:] for q in cap.q], cap.k, cap.v, cap.q_positions[-1:], cap.prompt_tokens, cap.needle)
    layers = list(range(len(cap.k)))
    for name, cfg in (("default", replace(MosaicConfig(), select=SelectionConfig(enabled=False))),
                      ("former", replace(MosaicConfig.from_dict({"preset": "former_default"}), select=SelectionConfig(enabled=False)))):
        r = evaluate(Method(name, cfg, "mosaickv"), last, layers)
        print(json.dumps({"seed": seed, "prompt_tokens": cap.prompt_tokens, "config": name, "queries": "last (position T-1)", "no selection": True, "attn_rel_err": round(r["attn_rel_err"], 4), "mass_recall": round(r["mass_recall"], 4)}), flush=True)
