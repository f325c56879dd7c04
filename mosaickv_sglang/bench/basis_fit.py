"""Basis fit solvers compared: exact eigh (fit_solver host/device) vs `jacobi_axes` (jacobi).

Three tables, one JSON:

* quality: per data set, the energy the top-r axes capture as a ratio to the exact top-r
  subspace's (sum of the r largest eigenvalues), min and mean over heads, for r in the ranks the
  default bands and page metadata use; the bf16 R's orthonormality error |R R^T - I|_max;
  data: the captured SmolLM2 K/V (if `.assets/captures` holds them) and synthetic K/V-like
  blocks (decaying spectrum, outlier channels, RoPE pairs) at D=64 and 128, plus edge cases;
* speed: seconds per basis block at the Llama-8B shape (256 matrices D x D per kind: 32
  layers x 8 KV heads) for the solver alone and for fit_basis (covariance included);
* codec: the default config's attention-output error and ratio on the SmolLM2 capture
  (fidelity.evaluate) with each solver.

    python -m mosaickv_sglang.bench.basis_fit --json OUT.json [--threads 2]
    python -m mosaickv_sglang.bench.basis_fit --parts speed --device cuda --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import replace

import torch

from ..codec.basis import fit_basis, jacobi_axes
from ..config import MosaicConfig


def kv_like(n: int, tokens: int, d: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[n, tokens, d] float K- or V-like blocks: a decaying spectrum (300x from first to last
    axis) in random axes; K adds four outlier channels (large offsets, like real keys) and
    RoPE (rotate-half pairs (i, i + d/2), base 10000) after them."""
    spec = torch.logspace(0, -2.5, d).sqrt()
    axes = torch.linalg.qr(torch.randn(n, d, d, generator=gen))[0]
    x = (torch.randn(n, tokens, d, generator=gen) * spec) @ axes.transpose(-1, -2)
    if kind == "v":
        return x
    offset = torch.zeros(d)
    offset[torch.randperm(d // 2, generator=gen)[:4]] = 3.0
    x = x + offset
    freq = 10000 ** (-torch.arange(d // 2) * 2 / d)
    angle = torch.arange(tokens)[:, None] * freq
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


def edge_cases(d: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Blocks [4, T, d] that break naive solvers."""
    k = kv_like(4, 512, d, "k", gen)
    zero_half = k.clone()
    zero_half[..., d // 2:] = 0
    const = k.clone()
    const[..., 0] = 5.0
    return {
        "near-degenerate": torch.randn(4, 4096, d, generator=gen) * (1 + 1e-3 * torch.arange(d)),
        "half the channels zero": zero_half,
        "a constant channel": const,
        "rank one": torch.randn(4, 512, 1, generator=gen) * torch.randn(4, 1, d, generator=gen),
        "all zero": torch.zeros(4, 128, d),
        "64 tokens": kv_like(4, 64, d, "k", gen),
        "fp16 range": (k / k.abs().amax() * 60000).half().float(),
    }


def energy_ratios(cov: torch.Tensor, axes: torch.Tensor, ranks) -> dict[int, torch.Tensor]:
    """Energy on the top-r columns of `axes` [N, D, D] (sorted by their Rayleigh quotients) of
    the covariance `cov` [N, D, D] / the exact top-r energy, per matrix, on the CPU in fp64:
    1.0 is optimal. NaN where the covariance is zero."""
    c, a = cov.detach().cpu().double(), axes.detach().cpu().double()
    energy = ((c @ a) * a).sum(-2).sort(-1, descending=True).values.cumsum(-1)
    best = torch.linalg.eigvalsh(c).flip(-1).cumsum(-1)
    return {r: (energy[:, r - 1] / best[:, r - 1]).float() for r in ranks}


def orth_error(basis: torch.Tensor) -> float:
    """max |R R^T - I| of a bf16 read transform R [N, D, D]."""
    r = basis.double()
    return float((r @ r.transpose(-1, -2) - torch.eye(r.shape[-1], dtype=r.dtype)).abs().max())


def ranks_for(d: int) -> list[int]:
    """The ranks the default config cuts at (band widths are per 64 channels and scale with D:
    the 8-bit bands end at D/16 or D/4, the 4-bit ones at 3D/4 or D; page metadata keeps 8
    channels), plus 16, 32 and D/2."""
    return sorted({d // 16, 8, 16, 32, d // 2, 3 * d // 4})


def quality_rows(blocks: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for name, x in blocks.items():
        d = x.shape[-1]
        ranks = ranks_for(d)
        row = {"data": name, "heads": x.shape[0], "tokens": x.shape[1], "head_dim": d}
        cov = x.double().transpose(-1, -2) @ x.double()
        for solver, jacobi in (("eigh", False), ("jacobi", True)):
            basis = fit_basis(x, jacobi=jacobi)
            axes = basis.float().transpose(-1, -2)
            if jacobi:  # the fp32 axes: the solver's quality apart from the bf16 cast
                axes = jacobi_axes(x.float().transpose(-1, -2) @ x.float())
            ratios = energy_ratios(cov, axes, ranks)
            row[solver] = {
                "finite": bool(torch.isfinite(basis.float()).all()),
                "orth_err_bf16": orth_error(basis),
                "ratio_min": {r: float(v.nan_to_num(1.0).min()) for r, v in ratios.items()},
                "ratio_mean": {r: float(v.nan_to_num(1.0).mean()) for r, v in ratios.items()},
            }
        rows.append(row)
    return rows


def timed(fn, repeats: int, device: str) -> float:
    """Best of `repeats` wall-clock seconds (the box is shared: the minimum is the cost)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def speed(device: str, tokens: int, repeats: int) -> dict:
    """One kind of one Llama-8B basis block: 256 matrices 128 x 128 ([256, tokens, 128] for
    fit_basis). Seconds; a block has two kinds."""
    gen = torch.Generator().manual_seed(0)
    x = kv_like(256, tokens, 128, "k", gen).to(device=device, dtype=torch.bfloat16)
    xf = x.float()
    cov = xf.transpose(-1, -2) @ xf
    out = {
        "eigh_qr_s": timed(lambda: (torch.linalg.qr(torch.linalg.eigh(cov)[1])), repeats, device),
        "jacobi_axes_s": timed(lambda: jacobi_axes(cov), repeats, device),
        "covariance_s": timed(lambda: xf.transpose(-1, -2) @ xf, repeats, device),
        "fit_basis_eigh_s": timed(lambda: fit_basis(x), repeats, device),
        "fit_basis_jacobi_s": timed(lambda: fit_basis(x, jacobi=True), repeats, device),
    }
    return out


def codec_rows(layers: int | None) -> list[dict]:
    """The default config on the SmolLM2 capture with each solver (fidelity.evaluate)."""
    from .capture import capture
    from .fidelity import Method, evaluate

    cap = capture(n_tokens=4096)
    chosen = list(range(len(cap.k)))[:layers] if layers else list(range(len(cap.k)))
    rows = []
    for solver in ("host", "jacobi"):
        cfg = replace(MosaicConfig(), fit_solver=solver)
        t0 = time.perf_counter()
        r = evaluate(Method(f"default, fit_solver={solver}", cfg, "mosaickv"), cap, chosen)
        rows.append({"fit_solver": solver, "attn_rel_err": r["attn_rel_err"],
                     "physical_ratio": r["physical_ratio"], "mass_recall": r["mass_recall"],
                     "layers": len(chosen), "seconds": time.perf_counter() - t0})
    return rows


def real_blocks() -> dict[str, torch.Tensor]:
    """SmolLM2 K/V captures on disk (30 layers x 3 KV heads, D=64), if any: whole 4K blocks and
    64-token blocks."""
    from .capture import CACHE_DIR
    paths = sorted(CACHE_DIR.glob("smollm2_4096_*.pt")) if CACHE_DIR.exists() else []
    if not paths:
        return {}
    cap = torch.load(paths[0])
    out = {}
    for kind in ("k", "v"):
        x = torch.stack(cap[kind]).flatten(0, 1).float()  # [L*H, T, D]
        out[f"SmolLM2 {kind.upper()} 4K"] = x
        out[f"SmolLM2 {kind.upper()} 64 tokens"] = x[:, 1000:1064]
    return out


def quality_table() -> list[dict]:
    """Quality rows of the captures, synthetic blocks and edge cases, printed."""
    gen = torch.Generator().manual_seed(0)
    blocks = real_blocks()
    for d in (64, 128):
        for kind in ("k", "v"):
            blocks[f"synthetic {kind.upper()} D={d}"] = kv_like(32, 4096, d, kind, gen)
            blocks[f"synthetic {kind.upper()} D={d}, 64 tokens"] = kv_like(32, 64, d, kind, gen)
    for name, x in edge_cases(128, gen).items():
        blocks[f"edge: {name}"] = x
    rows = quality_rows(blocks)
    print("\nenergy of the top-r axes / exact top-r energy (min over heads; jacobi's fp32 axes) "
          "and max |R R^T - I| of the bf16 R")
    print(f"{'data':38s} {'ranks':>18s} {'jacobi min ratio':>38s} {'orth eigh/jacobi':>18s}")
    for row in rows:
        j = row["jacobi"]
        ranks = ",".join(str(r) for r in j["ratio_min"])
        ratios = " ".join(f"{v:.4f}" for v in j["ratio_min"].values())
        print(f"{row['data']:38s} {ranks:>18s} {ratios:>38s} "
              f"{row['eigh']['orth_err_bf16']:8.1e}/{j['orth_err_bf16']:.1e}"
              + ("" if j["finite"] else "  NON-FINITE"))
    return rows


def speed_table(args) -> dict:
    """The speed rows, printed."""
    out = speed(args.device, args.tokens, args.repeats)
    out.update(device=args.device, tokens=args.tokens, matrices=256, head_dim=128)
    print(f"\none kind of a Llama-8B basis block (256 matrices 128x128, {args.tokens} tokens) on "
          f"{args.device}, {args.threads} threads, best of {args.repeats}:")
    for key in ("eigh_qr_s", "jacobi_axes_s", "covariance_s", "fit_basis_eigh_s",
                "fit_basis_jacobi_s"):
        print(f"  {key:22s} {out[key] * 1e3:9.1f} ms")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="for the speed table")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per block (speed table)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codec-layers", type=int, default=None,
                    help="codec table on the first N capture layers (default all)")
    ap.add_argument("--parts", default="quality,speed,codec",
                    help="comma list of tables to run: quality, speed, codec")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or set(parts) - {"quality", "speed", "codec"}:
        ap.error(f"--parts={args.parts!r}: a comma list from quality, speed, codec")
    torch.set_num_threads(args.threads)
    result = {"host": platform.processor() or "cpu", "torch": torch.__version__,
              "threads": args.threads}
    if "quality" in parts:
        result["quality"] = quality_table()
    if "speed" in parts:
        result["speed"] = speed_table(args)
    if "codec" in parts:
        result["codec"] = codec_rows(args.codec_layers)
        print("\ndefault config on the SmolLM2 4K capture:")
        for r in result["codec"]:
            print(f"  fit_solver={r['fit_solver']:7s} attn_rel_err {r['attn_rel_err']:.5f} "
                  f"ratio {r['physical_ratio']:.3f} mass_recall {r['mass_recall']:.4f} "
                  f"({r['layers']} layers, {r['seconds']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
