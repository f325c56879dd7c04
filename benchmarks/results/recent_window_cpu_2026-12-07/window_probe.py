"""Attention error of the default (CPU, codec level, real SmolLM2 K/V at ~8K) with and without
a dense window of the most recent tokens (`hot_tokens`), per haystack: where a prompt ends at a
segment boundary the position rule leaves its last tokens compressed.

    python benchmarks/results/recent_window_cpu_2026-12-07/window_probe.py --seeds 2 0 1 \
        --windows 0 128 --json window_probe.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.bench.fidelity import Method, evaluate
from mosaickv_sglang.config import MosaicConfig, SelectionConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 64, 128])
    ap.add_argument("--selection", action="store_true",
                    help="also with the default's page selection (slow on the CPU)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        cap = capture(n_tokens=args.tokens, seed=seed)
        layers = list(range(len(cap.k)))
        for w in args.windows:
            d = replace(MosaicConfig(), hot_tokens=w)
            pairs = [("no selection", replace(d, select=SelectionConfig(enabled=False)))]
            if args.selection:
                pairs.append(("default selection", d))
            for sel, cfg in pairs:
                t0 = time.time()
                r = evaluate(Method(f"hot_tokens={w} {sel}", cfg, "mosaickv"), cap, layers)
                row = {"seed": seed, "prompt_tokens": cap.prompt_tokens, "hot_tokens": w,
                       "selection": sel, **{k: r[k] for k in ("physical_ratio", "attn_rel_err",
                                                             "mass_recall", "pages_read")}}
                rows.append(row)
                print(json.dumps(row), f"({time.time() - t0:.0f}s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
