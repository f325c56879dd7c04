"""Which basis fit could a traffic-independent read rule use: the codec's attention error on real
SmolLM2 KV (`bench.fidelity`'s capture, evaluation and metrics) when each block's SVD bases are
fitted on another token range than the whole block (`basis_fit: group` when a chunk seals the
block at once) -- the block's first page (`first_page`, what `read_rule: position` needs
today), its first N tokens, the same after the sink segment, or the previous block. A page's
sealed bytes may depend only on tokens up to its own end for a cached prefix to hold exactly
what a request would seal itself (docs/determinism.md); the rules are here to measure what each
costs, the table there says which of them satisfy that.

    python scripts/basis_rule_probe.py --length 8192 --seeds 0 1 2 --budgets 4096 1024 \
        --rules group first_page first:1024 nosink:1024 prev:1024 prev:4096

Rules: `group` (the whole block), `first_page`, `first:N` (the block's first N tokens),
`nosink:N` (N tokens from the end of the sink segments, or the block's start), `prev:N` (block
b >= 1 on block b-1's tokens; block 0 as `nosink:N`), `prevdec:N` (as `prev:N`, on block b-1's
K/V as its sealed pages read back: what a pool that no longer holds them dense could fit on),
`inherit:N` (a block of fewer than N tokens -- the context's tail block -- takes block b-1's
bases, every other block its own: the pool's `basis_inherit_below_tokens`, where a small group
opening a block, e.g. a decode page, reuses the previous block's bases instead of fitting).
`calib:S` (every block b fitted on the same positions, block b, of another text: the capture of
seed S at the same length, per layer -- another span of the same essays; `calib:code`: this
repository's Python sources instead, a text unlike the haystack; `calib:random`: uniformly
random token ids (decoded and re-tokenized); bases that depend on positions
only, not on the request: prefix-closed for any prefix, what a start-up calibration pass on a
fixed text could give); `calib0:S` / `calib0:code`: every block on that text's block 0
(positions 0 .. block - 1 only: one calibration block for any context).
One JSON line per (seed, budget, rule).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from mosaickv_sglang.bench import fidelity
from mosaickv_sglang.bench.capture import capture
from mosaickv_sglang.codec import layer as codec_layer
from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.serving.pool import _decoded


def fit_range(rule: str, block_start: int, block_end: int, cfg: MosaicConfig) -> tuple[int, int]:
    """Token range [a, b) a block's bases are fitted on under `rule`."""
    seg = cfg.segment_tokens
    name, _, n = rule.partition(":")
    if name == "group":
        return block_start, block_end
    if name == "first_page":
        return block_start, block_start + seg
    n = int(n)
    if name == "first":
        return block_start, min(block_start + n, block_end)
    if name == "inherit":
        if block_end - block_start >= n or block_start == 0:
            return block_start, block_end
        return block_start - cfg.basis_block_tokens, block_start
    if name in ("prev", "prevdec") and block_start > 0:
        return block_start - cfg.basis_block_tokens, block_start
    if name in ("nosink", "prev", "prevdec"):
        a = max(block_start, cfg.sink_segments * seg)
        return a, min(a + n, block_end)
    raise ValueError(f"unknown rule {rule!r}")


CALIB: dict = {}  # seed or "code" -> capture (calib:S)
CODE_SEED = 990001  # the capture cache's key for calib:code


RANDOM_SEED = 990002  # the capture cache's key for calib:random


def code_capture(length: int, random_tokens: bool = False):
    """A capture of `length` tokens of this repository's Python sources (calib:code), or of
    uniformly random token ids (calib:random: text a server could make up at start-up)."""
    import random  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    from mosaickv_sglang.bench import capture as capture_mod  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1] / "mosaickv_sglang"
    text = "\n\n".join(p.read_text() for p in sorted(root.rglob("*.py")))

    def code_prompt(tokenizer, n_tokens, depth, seed):
        if random_tokens:
            rng = random.Random(seed)
            ids = [rng.randrange(100, tokenizer.vocab_size) for _ in range(n_tokens)]
        else:
            ids = tokenizer(text)["input_ids"][:n_tokens]
        return tokenizer.decode(ids), ""
    saved = capture_mod.needle_prompt
    capture_mod.needle_prompt = code_prompt
    try:
        return capture(length, seed=RANDOM_SEED if random_tokens else CODE_SEED)
    finally:
        capture_mod.needle_prompt = saved


def compressor(rule: str, cap=None):
    """`codec.layer.compress_layer` with the bases fitted as `rule` says (`cap`: the capture
    being evaluated, to find a layer's index for calib:S)."""
    def compress_layer(k, v, cfg, select_meta=None):
        def fit_on(block_start, block_end, kf, vf, layer):
            if rule.startswith(("calib:", "calib0:")):
                other = CALIB[rule.partition(":")[2]]
                li = next(i for i, x in enumerate(cap.k) if x is k)
                a, b = (block_start, block_end) if rule.startswith("calib:") else \
                    (0, cfg.basis_block_tokens)
                return other.k[li][:, a:b].float(), other.v[li][:, a:b].float()
            a, b = fit_range(rule, block_start, block_end, cfg)
            if rule.startswith("prevdec:") and block_start > 0:  # block b-1 as it reads back
                back = [_decoded(s, layer.k_bases[s.basis], layer.v_bases[s.basis])
                        for s in layer.segments if a <= s.start < b]
                return tuple(torch.cat([x[i] for x in back], 1) for i in (0, 1))
            return kf[:, a:b], vf[:, a:b]
        return codec_layer.compress_layer(k, v, cfg, select_meta, fit_on=fit_on)
    return compress_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budgets", type=int, nargs="+", default=[4096])
    ap.add_argument("--rules", nargs="+", default=["group", "first_page", "prev:4096"])
    args = ap.parse_args()
    for seed in args.seeds:
        cap = capture(args.length, seed=seed)
        layers = list(range(len(cap.k)))
        for budget in args.budgets:
            base = MosaicConfig()
            cfg = replace(base, select=replace(base.select, budget_tokens=budget))
            for rule in args.rules:
                name = rule.partition(":")[2]
                if rule.startswith(("calib:", "calib0:")) and name not in CALIB:
                    CALIB[name] = code_capture(args.length) if name == "code" else \
                        code_capture(args.length, True) if name == "random" else \
                        capture(args.length, seed=int(name))
                fidelity.compress_layer = compressor(rule, cap)
                t0 = time.time()
                r = fidelity.evaluate(fidelity.Method(rule, cfg, "mosaickv"), cap, layers)
                print(json.dumps({"length": args.length, "seed": seed, "budget": budget,
                                  "rule": rule, "physical_ratio": round(r["physical_ratio"], 3),
                                  "attn_rel_err": round(r["attn_rel_err"], 4),
                                  "mass_recall": round(r["mass_recall"], 4),
                                  "pages_read": round(r["pages_read"], 3),
                                  "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
