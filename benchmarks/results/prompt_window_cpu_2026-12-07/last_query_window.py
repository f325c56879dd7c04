"""The prompt's last query alone (position T-1: its output is the first answer token) read as the
server's position rule reads it, with the window W anchored at the prompt's end (`hot_tokens`):
pages ending at least W before the prompt's end compressed, the rest dense. At the codec level
that is `compress_layer` with `hot_tokens` W (its last W tokens stay dense) for this one query.
No page selection (a prefill query reads every page), every layer, per haystack seed.

    python benchmarks/results/prompt_window_cpu_2026-12-07/last_query_window.py \
        --seeds 2 0 1 --windows 0 64 128 --json last_query_window.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from mosaickv_sglang.bench.capture import Capture, capture
from mosaickv_sglang.bench.fidelity import Method, evaluate
from mosaickv_sglang.config import MosaicConfig, SelectionConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 0, 1])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 64, 128])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        cap = capture(n_tokens=args.tokens, seed=seed)
        last = Capture([q[-1:] for q in cap.q], cap.k, cap.v, cap.q_positions[-1:],
                       cap.prompt_tokens, cap.needle)
        for w in args.windows:
            cfg = replace(MosaicConfig(hot_tokens=w), select=SelectionConfig(enabled=False))
            r = evaluate(Method(f"window {w}", cfg, "mosaickv"), last, list(range(len(cap.k))))
            row = {"seed": seed, "prompt_tokens": cap.prompt_tokens, "window": w,
                   "dense_recent_tokens": cap.prompt_tokens
                   - max(cap.prompt_tokens - w, 0) // 128 * 128,
                   "attn_rel_err": round(r["attn_rel_err"], 4),
                   "mass_recall": round(r["mass_recall"], 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
