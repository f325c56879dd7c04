"""Where page selection loses accuracy: attention error of the default at one context length
while only the selection changes (metadata channels, budget), on real SmolLM2 K/V (codec level,
no server; see mosaickv_sglang/bench/fidelity.py for the metrics).

    python benchmarks/selection_sweep.py --tokens 8192 --json OUT.json

Prints one row per variant: physical ratio, attention error vs exact dense attention, attention
mass recall of the top-64 tokens, and the share of pages a decode step reads.

Every variant is the default config with selection's first stage alone (the page bound: the
default's second stage, rescore_factor 4 on 32 channels since 2026-12-07, off), but for those
naming a second stage: `rescore_factor=f` (every channel of K), `meta_only`, `channels=r`
(`--rescore 4 --rescore-channels 32`: the default's selection).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.bench.fidelity import Method, evaluate, quest_config
from mosaickv_sglang.config import MosaicConfig, SelectionConfig

METRICS = ("physical_ratio", "attn_rel_err", "mass_recall", "pages_read", "pages_rescored")


def variants(meta_channels: list[int], budgets: list[int], rescore: list[int] = (),
             rescore_channels: list[int] = ()) -> list[tuple[str, MosaicConfig]]:
    d = MosaicConfig()
    # the first stage alone; the second stage's variants below set their keys
    d = replace(d, select=replace(d.select, rescore_factor=0, rescore_channels=0,
                                  rescore_meta_only=False))
    out = [("no selection", replace(d, select=SelectionConfig(enabled=False)))]
    out += [(f"meta_channels={m}" + (" (default)" if m == d.select.meta_channels else ""),
             replace(d, select=replace(d.select, meta_channels=m))) for m in meta_channels]
    for b in budgets:
        out.append((f"budget_tokens={b}", replace(d, select=replace(d.select, budget_tokens=b))))
        # every channel's min/max (Quest's bound, on the rotated K): the metadata upper end
        out.append((f"budget_tokens={b} meta_channels=all", replace(d, select=replace(
            d.select, budget_tokens=b, meta_channels=4096))))
        # Quest itself: dense values, every channel's min/max on the raw K, 16-token pages
        out.append((f"budget_tokens={b} quest (dense values)",
                    quest_config(replace(d.select, budget_tokens=b), 4096)))
        for f in rescore:
            out.append((f"budget_tokens={b} rescore_factor={f}", replace(d, select=replace(
                d.select, budget_tokens=b, rescore_factor=f))))
            out.append((f"budget_tokens={b} rescore_factor={f} meta_only", replace(
                d, select=replace(d.select, budget_tokens=b, rescore_factor=f,
                                  rescore_meta_only=True))))
            for r in rescore_channels:
                out.append((f"budget_tokens={b} rescore_factor={f} channels={r}", replace(
                    d, select=replace(d.select, budget_tokens=b, rescore_factor=f,
                                      rescore_channels=r))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--meta-channels", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--rescore", type=int, nargs="*", default=[],
                    help="rescore factors to try at each budget (select.rescore_factor)")
    ap.add_argument("--rescore-channels", type=int, nargs="*", default=[],
                    help="with each rescore factor, also score on only the leading r channels "
                         "of K (select.rescore_channels)")
    ap.add_argument("--seed", type=int, default=0, help="the haystack (capture seed)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cap = capture(n_tokens=args.tokens, seed=args.seed)
    layers = list(range(len(cap.k)))
    print(f"{cap.prompt_tokens}-token context, {len(layers)} layers, {cap.q[0].shape[0]} decode "
          f"queries", flush=True)
    rows = []
    for name, cfg in variants(args.meta_channels, args.budgets, args.rescore, args.rescore_channels):
        t0 = time.time()
        r = evaluate(Method(name, cfg, "mosaickv"), cap, layers)
        rows.append({"variant": name, **{k: r[k] for k in METRICS}})
        print(f"  {name:30s} " + "  ".join(f"{k} {r[k]:.4f}" for k in METRICS)
              + f"  ({time.time() - t0:.0f}s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"context_tokens": cap.prompt_tokens, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
