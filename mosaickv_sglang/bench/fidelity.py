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
        Method("quest (selection only, 1/4 budget)", MosaicConfig(
            k_candidates=["dense"], v_candidates=["dense"], hot_tokens=BASELINE_HOT,
            sink_segments=0, page_tokens=16,
            select=replace(quarter, meta_channels=d)),
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


def plot(records: list[dict], path: Path) -> None:
    """Attention error vs physical ratio, one panel per context length (log error axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["context_tokens"] for r in records})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.5), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for r in (r for r in records if r["context_tokens"] == n and r["method"] != "dense"):
            style = {"mosaickv": "r*", "ablation": "ms", "baseline": "bo"}[r["family"]]
            ax.plot(r["physical_ratio"], max(r["attn_rel_err"], 1e-4), style,
                    markersize=12 if r["default"] else 7)
            ax.annotate(r["method"], (r["physical_ratio"], max(r["attn_rel_err"], 1e-4)),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("physical compression ratio vs bf16 (all metadata counted)")
        ax.set_ylabel("attention-output relative error")
        ax.set_title(f"SmolLM2-135M, {n}-token context, 30 layers")
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
    args = ap.parse_args(argv)
    lengths = [4096] if args.quick else args.lengths
    default_cfg = MosaicConfig.parse(args.config)
    all_records = []
    for n in lengths:
        t0 = time.time()
        print(f"[fidelity] capturing SmolLM2 Q/K/V on a {n}-token essay haystack ...", flush=True)
        cap = capture(n_tokens=n)
        layers = list(range(len(cap.k)))
        print(f"[fidelity] {cap.prompt_tokens} tokens, {len(layers)} layers, "
              f"{cap.q[0].shape[0]} decode queries ({time.time() - t0:.0f}s)", flush=True)
        default = evaluate(Method("mosaickv (default)", default_cfg, "mosaickv", default=True),
                           cap, layers)
        records = [default]
        for m in methods_for(cap, default["physical_ratio"], default_cfg):
            print(f"[fidelity] {n}: {m.name} ...", flush=True)
            records.append(evaluate(m, cap, layers))
        for r in records:
            r["context_tokens"] = cap.prompt_tokens
        print(f"\n== {cap.prompt_tokens}-token context ({time.time() - t0:.0f}s) ==")
        print_table(records)
        for ok, claim in check_claims(records):
            print(f"  [{'PASS' if ok else 'FAIL'}] {claim}")
        all_records += records
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
