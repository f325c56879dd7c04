"""One table of daemon_bench JSON results (saturated vs idle in each run), in the order given:
the device A/B scripts print it last. "worker busy" is the workers' busy fraction while
saturated: near 1 the workers bound the throughput, well under 1 the step boundary's budget does
(pages wait there to be loaded, installed or copied); "per busy core" is what one worker core
seals per second of work.

    python scripts/summarize_daemon_runs.py out/daemon_*.json [--plot throughput.png]

--plot (matplotlib) draws each run's daemon pages/s against its saturated/idle p99 step
ratio, beside the 5% step target and batch-128 decode's production at 30 ms: where a setting
sits between "keeps the step" and "keeps up" ("batch N": `daemon_install_batch`; crosses,
"1 job": runs of code from before batched installs, one job a boundary).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(path: Path) -> str:
    r = json.loads(path.read_text())
    sat, idle = r["saturated"], r["idle"]
    install = sat["adopt_page_ms"]["install"]
    load = sat["adopt_page_ms"]["load"]
    busy = sat["worker_busy_fraction"]
    cells = [path.stem, f"{r['step_p50_ratio']:.3f}", f"{r['step_p99_ratio']:.3f}",
             f"{idle['step_ms']['p50']:.2f}",
             "/".join(f"{x['boundary_ms'][q]:.2f}" for x in (idle, sat) for q in ("p50", "p99")),
             f"{install['p50']:.2f}" if install else "-", f"{load['p50']:.2f}" if load else "-",
             f"{r['daemon_pages_per_s']:.1f}", f"{busy:.2f}",
             f"{per_busy_core(r):.2f}" if busy else "-"]
    return "| " + " | ".join(cells) + " |"


def per_busy_core(r: dict) -> float:
    """Pages per busy worker core-second, as daemon_bench computes it (older JSON lacks it)."""
    cores = r["args"]["workers"] * r["args"]["threads"]
    return r["daemon_pages_per_s"] / (r["saturated"]["worker_busy_fraction"] * cores)


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    production = None  # batch-128 decode's pages/s at a 30 ms step, as the bench states it
    for p in paths:
        r = json.loads(p.read_text())
        production = r["production_pages_per_s_batch128"].get("30.0", production)
        mode = f"{'overlap' if r['args']['overlap'] else 'strict'} {r['args']['step_ms']:g} ms"
        x, y = r["daemon_pages_per_s"], r["step_p99_ratio"]
        batch = r["args"].get("install_batch")  # absent: code from before batched installs
        ax.scatter(x, y, color="tab:orange" if r["args"]["overlap"] else "tab:blue",
                   marker="o" if batch else "x")
        ax.annotate(f"{mode}, share {r['args']['share']:g}, "
                    + (f"batch {batch}" if batch else "1 job"), (x, y), fontsize=6,
                    xytext=(4, 2), textcoords="offset points")
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi + 0.35 * (hi - lo))  # room for the labels of the rightmost runs
    ax.axhline(1.05, color="gray", ls="--", lw=1)
    if production is not None:
        ax.axvline(production, color="gray", ls=":", lw=1)
        ax.text(production, ax.get_ylim()[0], " batch-128 @ 30 ms", fontsize=7, rotation=90,
                va="bottom")
    ax.text(ax.get_xlim()[0], 1.05, " 5% step target", fontsize=7, va="bottom")
    ax.set_xlabel("daemon throughput, pages/s (Llama-8B shape)")
    ax.set_ylabel("step p99, daemon saturated / idle")
    ax.set_title("Daemon throughput against the decode step's tail")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="daemon_bench JSON files")
    ap.add_argument("--plot", type=Path, help="also draw pages/s against the p99 ratio here")
    args = ap.parse_args()
    paths = args.results
    print("| run | p50 ratio | p99 ratio | idle step p50 ms | boundary p50/p99 idle, saturated ms "
          "| install p50 ms | load p50 ms | pages/s | worker busy | pages/s per busy core |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        print(row(p))
    if args.plot:
        plot(paths, args.plot)


if __name__ == "__main__":
    main()
