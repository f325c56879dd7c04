"""How long does the band-decode kernel take to compile each (K, V) band-width class?

Every distinct (K b8/b4/b2, V b8/b4/b2) channel count of the registered layouts is a
compile-time variant of the stage-1 decode kernel (`band_width_classes`). A GPU server showed a
once-per-server decode stall of 7-11 s in both its inline and daemon systems (2026-12-01,
benchmarks/RESULTS_ARCHIVE.md); a layout pair first seen mid-run would cost one compile in the
next decode step.
This probe adds the default candidate set's (K, V) pairs to a synthetic arena one at a time
(each arena holds the pairs so far) and times the first decode after each addition (compiles
the new class) against a repeat of it (warm), synchronized, one request.

    python scripts/decode_compile_probe.py --json probe.json        # CUDA
    python scripts/decode_compile_probe.py --dry-run                # CPU, Triton interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch  # noqa: E402

from kernel_bench import SEGMENT, synth_arena  # noqa: E402
from mosaickv_kernels.band_decode import BandDecodeWrapper, band_width_classes  # noqa: E402
from mosaickv_sglang.config import MosaicConfig  # noqa: E402


def candidate_pairs(cfg: MosaicConfig) -> list[tuple[str, str]]:
    """Every (K, V) strategy pair the chooser can write as a band layout."""
    extra = list(dict.fromkeys(cfg.sink_candidates + cfg.rescue_candidates))
    ks = list(dict.fromkeys(cfg.k_candidates + extra))
    vs = list(dict.fromkeys(cfg.v_candidates + extra))
    return [(k, v) for k in ks for v in vs]


def decode_once(arena, q, hq: int, device) -> float:
    """One plan + run, synchronized: seconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    wrapper = BandDecodeWrapper()
    wrapper.plan(arena, hq)
    out = wrapper.run(q, arena)
    sync()
    if not torch.isfinite(out).all():
        raise SystemExit("decode produced a non-finite output")
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, 9q/3kv/d64, 3 pairs")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    hq, h, d = (9, 3, 64) if args.dry_run else args.heads
    pairs = candidate_pairs(MosaicConfig())[:3 if args.dry_run else None]
    ctx = (len(pairs) + 1) * SEGMENT + 64  # every pair owns at least one segment
    q = torch.randn(1, hq, d, device=device)
    rows, seen = [], set()
    print(f"{len(pairs)} (K, V) pairs, {hq}q/{h}kv/d{d}, {ctx} tokens, {device}", flush=True)
    for n in range(1, len(pairs) + 1):
        arena = synth_arena(1, ctx, h, d, pairs[:n], device)
        classes = band_width_classes(arena.plans)
        new = sorted(set(classes) - seen)
        seen.update(classes)
        first = decode_once(arena, q, hq, device)
        warm = decode_once(arena, q, hq, device)
        rows.append({"pair": pairs[n - 1], "classes": len(classes), "new_classes": new,
                     "first_ms": first * 1e3, "warm_ms": warm * 1e3})
        print(f"{n:>3} K {pairs[n - 1][0]:<34} V {pairs[n - 1][1]:<34} classes {len(classes):>2} "
              f"new {len(new)}  first {first * 1e3:9.1f} ms  warm {warm * 1e3:8.2f} ms", flush=True)
    compile_ms = [r["first_ms"] - r["warm_ms"] for r in rows if r["new_classes"]]
    print(f"classes {len(seen)}; first decode after a new class: +{min(compile_ms):.0f} .. "
          f"+{max(compile_ms):.0f} ms over warm (sum {sum(compile_ms) / 1e3:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "heads": [hq, h, d],
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
