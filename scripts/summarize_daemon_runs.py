"""One table of daemon_bench JSON results (saturated vs idle in each run), in the order given:
the device A/B scripts print it last. "worker busy" is the workers' busy fraction while
saturated: near 1 the workers bound the throughput, well under 1 the step boundary's budget does
(pages wait there to be loaded, installed or copied); "per busy core" is what one worker core
seals per second of work.

    python scripts/summarize_daemon_runs.py out/daemon_*.json
"""
from __future__ import annotations

import json
import sys
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
             f"{r['daemon_pages_per_s'] / (busy * r['args']['workers']):.2f}" if busy else "-"]
    return "| " + " | ".join(cells) + " |"


def main(paths: list[str]) -> None:
    print("| run | p50 ratio | p99 ratio | idle step p50 ms | boundary p50/p99 idle, saturated ms "
          "| install p50 ms | load p50 ms | pages/s | worker busy | pages/s per busy core |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in map(Path, paths):
        print(row(p))


if __name__ == "__main__":
    main(sys.argv[1:])
