"""Where a prompt ends in its page, and what its last query's attention error is: a capture's
last 32 queries taken one at a time as the last query of a prompt ending at that position (K/V
truncated after it), so the prompt end sweeps 32 offsets within a 128-token segment (one of them
just past a boundary where the capture allows), under the default (W = 0) and the read rule's
window anchored at the prompt's end (W = 128: `hot_tokens` at the codec level for this one
query). No page selection (a prefill query reads every page), every layer. Prints one JSON row
per (seed, prompt end, W); --plot draws error against the offset.

    python benchmarks/results/prompt_window_cpu_2026-12-07/prompt_end_sweep.py --seeds 2 \
        --every 2 --json prompt_end_sweep.json --plot prompt_end_sweep.png      # ~12 min
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
    ap.add_argument("--seeds", type=int, nargs="+", default=[2])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 8224],
                    help="capture lengths: 8192 gives prompt ends late in a page (and seed 2 "
                         "one just past a boundary), 8224 early in the next")
    ap.add_argument("--every", type=int, default=1, help="every Nth of the 32 query positions")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    rows = []
    for seed, tokens in ((s, t) for s in args.seeds for t in args.tokens):
        cap = capture(n_tokens=tokens, seed=seed)
        n_q = cap.q_positions.numel()
        for i in range(0, n_q, args.every):
            end = int(cap.q_positions[i]) + 1  # a prompt ending right after this query
            one = Capture([q[i:i + 1] for q in cap.q], [k[:, :end] for k in cap.k],
                          [v[:, :end] for v in cap.v], cap.q_positions[i:i + 1], end, cap.needle)
            for w in args.windows:
                # the server's W = 0 reads the query's own page dense: at the codec level
                # `hot_tokens` 1 (the same pages unless the prompt fills its last page)
                cfg = replace(MosaicConfig(hot_tokens=max(w, 1)),
                              select=SelectionConfig(enabled=False))
                r = evaluate(Method(f"window {w}", cfg, "mosaickv"), one, list(range(len(cap.k))))
                row = {"seed": seed, "prompt_tokens": end, "offset_in_page": end % 128,
                       "window": w, "attn_rel_err": round(r["attn_rel_err"], 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for w in args.windows:
            for seed in args.seeds:
                pts = sorted((r["offset_in_page"] or 128, r["attn_rel_err"]) for r in rows
                             if r["window"] == w and r["seed"] == seed)
                ax.plot(*zip(*pts), marker="o", ms=3,
                        label=f"W = {w}" + (f", seed {seed}" if len(args.seeds) > 1 else ""))
        ax.set_xlabel("tokens in the prompt's last page (prompt length mod 128; 128 = full)")
        ax.set_ylabel("last query's attention error")
        ax.set_title("The first answer token's error vs where the prompt ends (SmolLM2, 8K)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
