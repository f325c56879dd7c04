"""Fidelity benchmark on real SmolLM2 KV: compression ratio vs attention error, method by method.

For each method (MosaicKV default, its ablations, and the baselines at the same byte budget) the
captured K/V of every layer is compressed with the codec, decode attention is computed with the
reference packed attention for the captured decode queries, and compared with exact attention on
the dense bf16 cache. Reported per method, overall and per layer:

* physical_ratio: bf16 bytes of the same tokens / every byte the method keeps (values, indices,
  scales, headers, bases, page metadata, hot buffer), measured from the tensors;
* attn_rel_err: ||O - O_dense|| / ||O_dense|| over all layers, heads and decode queries;
* mass_recall: dense attention mass of the method's top-64 tokens / mass of the true top-64;
* pages_read: fraction of compressed pages a decode step reads (1.0 without selection).

    python -m mosaickv_sglang.bench.fidelity --quick --json OUT.json
    python -m mosaickv_sglang.bench.fidelity --lengths 8192 --seeds 0 1 2 --json OUT.json

With several `--seeds` (each a different haystack and needle placement) every method is also
reported as its mean over the seeds with a 95% t-interval, and each claim against a baseline as
the paired margin (baseline error - default error, seed by seed) with its interval: a claim
holds when the margin's interval lies above 0, not only when the means are ordered.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..codec.attention import decode_attention
from ..codec.layer import compress_layer
from ..codec.strategies import parse_strategy
from ..config import MosaicConfig, SelectionConfig
from .capture import Capture, capture

TOPK = 64
BASELINE_HOT = MosaicConfig().hot_tokens  # same dense recent window for every method


@dataclass
class Method:
    name: str
    cfg: MosaicConfig
    family: str  # mosaickv | ablation | baseline
    default: bool = False
    note: str = ""


@dataclass
class Totals:
    err_sq: float = 0.0
    ref_sq: float = 0.0
    kept_bytes: int = 0
    dense_bytes: int = 0
    mass_recall: list = field(default_factory=list)
    pages_read: int = 0
    pages_total: int = 0
    pages_rescored: int = 0
    breakdown: dict = field(default_factory=dict)
    strategies: dict = field(default_factory=dict)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
    """Exact causal attention probabilities and outputs for decode queries on the bf16 cache."""
    nq, hq, d = q.shape
    g = hq // k.shape[0]
    kk, vv = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    scores = torch.einsum("nhd,htd->nht", q.float(), kk) * d ** -0.5
    causal = torch.arange(k.shape[1])[None, :] <= pos[:, None]  # [Nq, T]
    probs = scores.masked_fill(~causal[:, None], float("-inf")).softmax(-1)
    return probs, torch.einsum("nht,htd->nhd", probs, vv)


def mass_recall(true_probs: torch.Tensor, approx_probs: torch.Tensor, k: int = TOPK) -> float:
    top_true = true_probs.topk(k, dim=-1).values.sum(-1)
    top_approx = torch.gather(true_probs, -1, approx_probs.topk(k, dim=-1).indices).sum(-1)
    return float((top_approx / top_true).mean())


def evaluate(method: Method, cap: Capture, layers: list[int]) -> dict:
    tot = Totals()
    per_layer = []
    for li in layers:
        q, k, v = cap.q[li], cap.k[li], cap.v[li]
        true_probs, ref = dense_attention(q, k, v, cap.q_positions)
        layer = compress_layer(k, v, method.cfg)
        out, info, approx_probs = decode_attention(q, layer, cap.q_positions, method.cfg.select,
                                                   method.cfg.page_tokens, return_probs=True)
        err_sq, ref_sq = float((out - ref).pow(2).sum()), float(ref.pow(2).sum())
        kept = sum(layer.byte_breakdown().values())
        dense = 2 * k.numel() * 2
        rec = mass_recall(true_probs, approx_probs)
        tot.err_sq += err_sq
        tot.ref_sq += ref_sq
        tot.kept_bytes += kept
        tot.dense_bytes += dense
        tot.mass_recall.append(rec)
        tot.pages_read += info.pages_read
        tot.pages_total += info.pages_total
        tot.pages_rescored += info.pages_rescored
        for key, val in layer.byte_breakdown().items():
            tot.breakdown[key] = tot.breakdown.get(key, 0) + val
        for seg in layer.segments:
            for kind, choice in (("k", seg.k), ("v", seg.v)):
                name = f"{kind}:{choice.strategy.spec}" + ("" if choice.reason == "within-budget"
                                                            else f" ({choice.reason})")
                tot.strategies[name] = tot.strategies.get(name, 0) + 1
        per_layer.append({"layer": li, "physical_ratio": dense / kept,
                          "attn_rel_err": math.sqrt(err_sq / ref_sq), "mass_recall": rec})
    return {
        "method": method.name, "family": method.family, "default": method.default,
        "note": method.note,
        "physical_ratio": tot.dense_bytes / tot.kept_bytes,
        "bits_per_scalar": 16 * tot.kept_bytes / tot.dense_bytes,
        "attn_rel_err": math.sqrt(tot.err_sq / tot.ref_sq),
        "mass_recall": sum(tot.mass_recall) / len(tot.mass_recall),
        "pages_read": tot.pages_read / tot.pages_total if tot.pages_total else 1.0,
        # pages whose compressed K a second selection stage scored (select.rescore_factor)
        "pages_rescored": tot.pages_rescored / tot.pages_total if tot.pages_total else 0.0,
        "bytes": tot.breakdown, "strategies": tot.strategies,
        "config": method.cfg.to_dict(), "per_layer": per_layer,
    }


def _no_select(cfg: MosaicConfig) -> MosaicConfig:
    return replace(cfg, select=replace(cfg.select, enabled=False))


def _unrotated(spec: str) -> str:
    strat = parse_strategy(spec)
    strat.rot = False
    return strat.spec


def _uniform(spec: str) -> MosaicConfig:
    """A baseline: one strategy for every segment, no selection, same hot window."""
    return MosaicConfig(k_candidates=[spec], v_candidates=[spec], k_error_budget=math.inf,
                        v_error_budget=math.inf, hot_tokens=BASELINE_HOT,
                        sink_segments=0,
                        select=SelectionConfig(enabled=False))


def matched(family_spec: str, target_ratio: float, cap: Capture, probe_layer: int,
            head_dim: int) -> tuple[str, float]:
    """The r (channels kept) whose physical ratio is nearest the target, probed on one layer."""
    best = None
    for r in range(1, head_dim + 1):
        spec = family_spec.format(r=r)
        layer = compress_layer(cap.k[probe_layer], cap.v[probe_layer], _uniform(spec))
        ratio = 2 * cap.k[probe_layer].numel() * 2 / sum(layer.byte_breakdown().values())
        if best is None or abs(ratio - target_ratio) < abs(best[1] - target_ratio):
            best = (spec, ratio)
    return best


def quest_config(select: SelectionConfig, head_dim: int) -> MosaicConfig:
    """Quest as a config: dense values, every channel's min/max per 16-token page (raw K),
    `select`'s budget, the same dense recent window as every baseline. Quest's bound alone:
    no second stage, whatever `select` has (the default rescores since 2026-12-07)."""
    return MosaicConfig(k_candidates=["dense"], v_candidates=["dense"], hot_tokens=BASELINE_HOT,
                        sink_segments=0, page_tokens=16,
                        select=replace(select, enabled=True, meta_channels=head_dim,
                                       rescore_factor=0, rescore_channels=0,
                                       rescore_meta_only=False))


def methods_for(cap: Capture, default_ratio: float, default_cfg: MosaicConfig) -> list[Method]:
    d = cap.k[0].shape[-1]
    probe = len(cap.k) // 2
    quarter = replace(default_cfg.select, enabled=True, budget_tokens=cap.prompt_tokens // 4)
    out = [
        Method("mosaickv + selection (1/4 budget)", replace(default_cfg, select=quarter),
               "ablation", note=f"reads {quarter.budget_tokens} compressed tokens per step"),
        Method("mosaickv (no selection)", _no_select(default_cfg), "ablation",
               note="channel/value compression only"),
        Method("mosaickv (no rotation)", _no_select(replace(
            default_cfg, k_candidates=[_unrotated(s) for s in default_cfg.k_candidates],
            v_candidates=[_unrotated(s) for s in default_cfg.v_candidates])),
            "ablation", note="same strategies and budgets in the raw basis"),
        Method("dense", _uniform("dense"), "baseline"),
        Method("quest (selection only, 1/4 budget)", quest_config(quarter, d),
               "baseline", note="dense values, per-page per-channel min/max, same token budget"),
    ]
    for bits in (8, 4, 2):
        out.append(Method(f"kivi-int{bits}", _uniform(f"lowbit:bits={bits},group=32"), "baseline",
                          note="K per channel over 32-token groups, V per token, asymmetric"))
    for label, fam in (("global channel mask (ThinK-like)", "mask:r={r}"),
                       ("per-vector top-r, no rotation", "topr:r={r},rot=0"),
                       ("per-vector top-r, rotated", "topr:r={r}"),
                       ("per-vector top-r fp8, no rotation", "topr:r={r},val=fp8,rot=0"),
                       ("per-vector top-r fp8, rotated", "topr:r={r},val=fp8")):
        spec, _ = matched(fam, default_ratio, cap, probe, d)
        out.append(Method(label, _uniform(spec), "baseline", note=f"{spec} (bytes matched)"))
    return out


def print_table(records: list[dict]) -> None:
    print(f"\n{'method':44s} {'ratio':>6s} {'bits':>5s} {'attn_err':>9s} {'recall':>7s} {'read':>6s}")
    for r in records:
        mark = " *" if r["default"] else ""
        print(f"{(r['method'] + mark):44s} {r['physical_ratio']:6.2f} {r['bits_per_scalar']:5.2f} "
              f"{r['attn_rel_err']:9.4f} {r['mass_recall']:7.4f} {r['pages_read']:6.2f}")
    print("(* = default config; ratio = bf16 bytes / all bytes kept incl. metadata and hot buffer)")


def check_claims(records: list[dict]) -> list[tuple[bool, str]]:
    """The codec's acceptance claims, evaluated on one context length's records."""
    default = next(r for r in records if r["default"])
    ratio, err = default["physical_ratio"], default["attn_rel_err"]
    out = [(ratio >= 3.0, f"default physical_ratio {ratio:.2f} >= 3.0")]
    for label in ("global channel mask", "per-vector top-r, no rotation",
                  "per-vector top-r fp8, no rotation"):
        base = next(r for r in records if r["method"].startswith(label))
        same = abs(base["physical_ratio"] / ratio - 1) <= 0.10
        out.append((same and err < base["attn_rel_err"],
                    f"beats '{base['method']}' at equal bytes: {err:.4f} < {base['attn_rel_err']:.4f} "
                    f"(ratio {base['physical_ratio']:.2f} vs {ratio:.2f}, within 10%: {same})"))
    for base in records:
        if base["method"].startswith("kivi") and base["physical_ratio"] >= 0.9 * ratio:
            out.append((err < base["attn_rel_err"],
                        f"not dominated by {base['method']} ({base['physical_ratio']:.2f}x): "
                        f"{err:.4f} < {base['attn_rel_err']:.4f}"))
    return out


# two-sided 95% Student t quantiles by degrees of freedom (n - 1), for intervals over seeds
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}


def mean_interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of xs and its 95% t-interval (low == high == mean for one)."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def over_seeds(records: list[dict]) -> list[dict]:
    """Per (context length, method): physical ratio and attention error as mean and 95%
    interval over the seeds, in the records' order."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["context_tokens"], r["method"]), []).append(r)
    out = []
    for (n, method), rs in groups.items():
        row = {"context_tokens": n, "method": method, "default": rs[0]["default"],
               "seeds": [r["seed"] for r in rs]}
        for key in ("physical_ratio", "attn_rel_err", "mass_recall", "pages_read"):
            row[key], row[f"{key}_low"], row[f"{key}_high"] = mean_interval([r[key] for r in rs])
        out.append(row)
    return out


def paired_claims(records: list[dict]) -> list[tuple[bool, str]]:
    """The claims against baselines at one context length, over seeds: per baseline the margin
    (its attention error - the default's, paired by seed) with a 95% interval; a claim holds
    when the interval's low end is above 0. Equal bytes as in `check_claims` (ratio within 10%
    of the default's, or a KIVI at >= 0.9x its ratio), judged on the means."""
    seeds = sorted({r["seed"] for r in records})
    by = {(r["method"], r["seed"]): r for r in records}
    default = next(r["method"] for r in records if r["default"])
    ratio = mean_interval([by[(default, s)]["physical_ratio"] for s in seeds])[0]
    out = [(ratio >= 3.0, f"default physical_ratio {ratio:.2f} >= 3.0 (mean of {len(seeds)} seeds)")]
    for method in dict.fromkeys(r["method"] for r in records):
        eq = method.startswith(("global channel mask", "per-vector top-r, no rotation",
                                "per-vector top-r fp8, no rotation"))
        base_ratio = mean_interval([by[(method, s)]["physical_ratio"] for s in seeds])[0]
        if not (eq or (method.startswith("kivi") and base_ratio >= 0.9 * ratio)):
            continue
        same = abs(base_ratio / ratio - 1) <= 0.10 if eq else True
        margin = [by[(method, s)]["attn_rel_err"] - by[(default, s)]["attn_rel_err"]
                  for s in seeds]
        m, lo, hi = mean_interval(margin)
        out.append((same and lo > 0,
                    f"beats '{method}' ({base_ratio:.2f}x vs {ratio:.2f}x): margin {m:+.4f} "
                    f"[{lo:+.4f}, {hi:+.4f}] over {len(seeds)} seeds, every seed "
                    f"{all(x > 0 for x in margin)}"))
    return out


def print_over_seeds(rows: list[dict]) -> None:
    print(f"\n{'method':44s} {'ratio':>6s} {'attn_err [95% over seeds]':>28s} {'recall':>7s}")
    for r in rows:
        mark = " *" if r["default"] else ""
        print(f"{(r['method'] + mark):44s} {r['physical_ratio']:6.2f} {r['attn_rel_err']:9.4f} "
              f"[{r['attn_rel_err_low']:.4f}, {r['attn_rel_err_high']:.4f}] "
              f"{r['mass_recall']:7.4f}")


def plot(records: list[dict], path: Path) -> None:
    """Attention error vs physical ratio, one panel per context length (log error axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["context_tokens"] for r in records})
    family = {r["method"]: r["family"] for r in records}
    seeds = sorted({r.get("seed", 0) for r in records})
    points = over_seeds([{"seed": 0, **r} for r in records])  # means (and intervals) per method
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.5), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for r in (r for r in points if r["context_tokens"] == n and r["method"] != "dense"):
            style = {"mosaickv": "r*", "ablation": "ms", "baseline": "bo"}[family[r["method"]]]
            err = max(r["attn_rel_err"], 1e-4)
            bar = [[err - max(r["attn_rel_err_low"], 1e-4)],
                   [max(r["attn_rel_err_high"], 1e-4) - err]]
            ax.errorbar(r["physical_ratio"], err, yerr=bar, fmt=style,
                        markersize=12 if r["default"] else 7, elinewidth=1, capsize=2)
            ax.annotate(r["method"], (r["physical_ratio"], max(r["attn_rel_err"], 1e-4)),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("physical compression ratio vs bf16 (all metadata counted)")
        ax.set_ylabel("attention-output relative error")
        ax.set_title(f"SmolLM2-135M, {n}-token context, 30 layers"
                     + (f"\nmean of {len(seeds)} seeds, 95% intervals" if len(seeds) > 1
                        else ""), fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one 4K prompt (CPU, a few minutes)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--config", default=None, help="MosaicKV config (JSON or @file) for the default")
    ap.add_argument("--json", type=Path, default=None, help="write all records here")
    ap.add_argument("--plot", type=Path, default=None, help="write an error-vs-ratio PNG here")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="haystacks (needle text and placement) per length: with several, means "
                         "and 95%% intervals over them, claims as paired margins")
    args = ap.parse_args(argv)
    lengths = [4096] if args.quick else args.lengths
    default_cfg = MosaicConfig.parse(args.config)
    all_records = []
    for n in lengths:
        per_length = []
        for seed in args.seeds:
            t0 = time.time()
            print(f"[fidelity] capturing SmolLM2 Q/K/V on a {n}-token essay haystack (seed "
                  f"{seed}) ...", flush=True)
            cap = capture(n_tokens=n, seed=seed)
            layers = list(range(len(cap.k)))
            print(f"[fidelity] {cap.prompt_tokens} tokens, {len(layers)} layers, "
                  f"{cap.q[0].shape[0]} decode queries ({time.time() - t0:.0f}s)", flush=True)
            default = evaluate(Method("mosaickv (default)", default_cfg, "mosaickv",
                                      default=True), cap, layers)
            records = [default]
            for m in methods_for(cap, default["physical_ratio"], default_cfg):
                print(f"[fidelity] {n} seed {seed}: {m.name} ...", flush=True)
                records.append(evaluate(m, cap, layers))
            for r in records:
                r["context_tokens"], r["seed"] = n, seed
                r["prompt_tokens"] = cap.prompt_tokens
            print(f"\n== {cap.prompt_tokens}-token context, seed {seed} "
                  f"({time.time() - t0:.0f}s) ==")
            print_table(records)
            for ok, claim in check_claims(records):
                print(f"  [{'PASS' if ok else 'FAIL'}] {claim}")
            per_length += records
        if len(args.seeds) > 1:
            print(f"\n== {n}-token context over seeds {args.seeds} ==")
            print_over_seeds(over_seeds(per_length))
            for ok, claim in paired_claims(per_length):
                print(f"  [{'PASS' if ok else 'FAIL'}] {claim}")
        all_records += per_length
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(all_records, indent=1))
        print(f"[fidelity] wrote {len(all_records)} records to {args.json}")
    if args.plot:
        plot(all_records, args.plot)
        print(f"[fidelity] wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
