"""The prompt's last query alone (position T-1: its output is the first answer token, and it
reads the prompt's pages as the server's position rule does), no page selection, every layer:
the default against the former default, per haystack seed.

    python benchmarks/results/recent_window_cpu_2026-12-07/last_query_probe.py 2 0
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from mosaickv_sglang.bench.capture import Capture, capture
from mosaickv_sglang.bench.fidelity import Method, evaluate
from mosaickv_sglang.config import MosaicConfig, SelectionConfig

NO_SELECTION = SelectionConfig(enabled=False)
CONFIGS = {"default": MosaicConfig(), "former": MosaicConfig.from_dict({"preset": "former_default"})}

for seed in map(int, sys.argv[1:]):
    cap = capture(n_tokens=8192, seed=seed)
    last = Capture([q[-1:] for q in cap.q], cap.k, cap.v, cap.q_positions[-1:],
                   cap.prompt_tokens, cap.needle)
    for name, cfg in CONFIGS.items():
        r = evaluate(Method(name, replace(cfg, select=NO_SELECTION), "mosaickv"), last,
                     list(range(len(cap.k))))
        print(json.dumps({"seed": seed, "prompt_tokens": cap.prompt_tokens, "config": name,
                          "queries": "last (position T-1)", "no selection": True,
                          "attn_rel_err": round(r["attn_rel_err"], 4),
                          "mass_recall": round(r["mass_recall"], 4)}), flush=True)
