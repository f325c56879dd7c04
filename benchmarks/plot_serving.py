"""Plots of the serving results: throughput vs context, latency percentiles, memory per system.

Reads the JSON rows that `serving_bench.py` (rows with `context`/`batch`) and `agent_bench.py`
(rows with `workload`) write — files, or folders of `*.json` — and saves PNGs into `--out`:

* `throughput_vs_context.png`: decode tokens/s against context, one line per (system, batch)
  and one through each system's largest batches; beside it, largest-batch throughput as a
  multiple of dense_flashinfer's in the same call;
* `throughput_vs_batch.png` (when some system has several batches at one context): per
  context, decode tokens/s and ITL p50 against batch, one line per system up to its largest;
* `latency.png`: ITL p50 and p99 per streamed run (log scale);
* `memory.png`: token capacity per (system, input), and KV bytes per token: kept (SGLang's rows;
  MosaicKV's sealed pages, all metadata counted) and reserved per token slot (MosaicKV: hot
  buffer + packed store);
* `agent_turns.png` (agent rows only): output tokens/s and cached-token ratio per turn.

Rows with an `error` are listed on stdout and left out; a plot without any row is not written.

    python benchmarks/plot_serving.py benchmarks/results/serving_h200_2026-11-29 \\
        benchmarks/results/agent_h200 --out benchmarks/results/plots
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_rows(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """(serving rows, agent rows) from JSON files or folders of them; error rows reported. Each
    row gets `source` (the folder's or file's name; folder/file when a folder holds several;
    prefixed by the parent folder when two inputs share a name) so runs of different machines or
    calls stay apart."""
    files = []
    for p in paths:
        found = sorted(p.glob("*.json")) if p.is_dir() else [p]
        # a folder of several runs: each file is its own source
        files += [(f, f"{p.stem}/{f.stem}" if len(found) > 1 else p.stem) for f in found]
    # files of the same name from different folders (call1/serving.json, call2/serving.json)
    stems = [source for _, source in files]
    files = [(f, f"{f.parent.name}/{source}" if stems.count(source) > 1 else source)
             for f, source in files]
    if not files:
        raise SystemExit(f"no JSON files under {', '.join(map(str, paths))}")
    serving, agent = [], []
    for f, source in files:
        rows = json.loads(f.read_text())
        for r in rows if isinstance(rows, list) else [rows]:
            r["source"] = source
            if "error" in r:
                print(f"{f}: {r.get('system')} failed, left out: {r['error'][:120]}")
            elif "workload" in r:
                agent.append(r)
            elif "context" in r:
                serving.append(r)
            else:
                raise SystemExit(f"{f}: a row that is neither serving_bench's nor agent_bench's: "
                                 f"{sorted(r)[:8]}")
    return serving, agent


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def largest_batch_ratios(serving: list[dict], reference: str) -> dict[str, list]:
    """{system: [(context, its largest-batch tokens/s / the reference's in the same call)]}."""
    refs = {(r["source"], r["context"]): r["decode_tok_s"] for r in serving
            if r["system"] == reference and r.get("is_largest_batch") and r["decode_tok_s"]}
    out = {}
    for r in sorted(serving, key=lambda r: r["context"]):
        if (r["system"] != reference and r.get("is_largest_batch") and r["decode_tok_s"]
                and (r["source"], r["context"]) in refs):
            out.setdefault(r["system"], []).append(
                (r["context"], r["decode_tok_s"] / refs[(r["source"], r["context"])]))
    return out


def plot_throughput(serving: list[dict], out: Path, plt, reference: str = "dense_flashinfer"
                    ) -> None:
    """Decode tokens/s against context: one line per (system, batch), and one per system through
    its largest-batch rows (each point labelled with its batch). When `reference` rows exist, a
    second panel gives each system's largest-batch throughput as a multiple of the reference's
    measured in the same call (same `source`, same context): ratios, never across calls."""
    def key(r):
        return (r["system"], "largest" if r.get("is_largest_batch") else r["batch"])

    ratios = largest_batch_ratios(serving, reference)
    fig, axes = plt.subplots(1, 2 if ratios else 1, figsize=(12 if ratios else 7, 4.5))
    ax = axes[0] if ratios else axes
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {k: palette[i % len(palette)]
             for i, k in enumerate(sorted({key(r) for r in serving}, key=str))}
    for system, batch in sorted({key(r) for r in serving}, key=str):
        rs = sorted((r for r in serving if key(r) == (system, batch)
                     and r["decode_tok_s"] is not None), key=lambda r: r["context"])
        label = f"{system}, {'largest batch' if batch == 'largest' else f'batch {batch}'}"
        ax.plot([r["context"] for r in rs], [r["decode_tok_s"] for r in rs], marker="o",
                label=label, color=color[(system, batch)])
        if batch == "largest":
            for r in rs:
                ax.annotate(f"b{r['batch']}", (r["context"], r["decode_tok_s"]), fontsize=7,
                            xytext=(4, 4), textcoords="offset points",
                            color=color[(system, batch)])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per request)")
    ax.set_ylabel("decode tokens/s (all requests)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if ratios:
        ax = axes[1]
        for system, points in sorted(ratios.items()):
            ax.plot(*zip(*points), marker="o", label=system, color=color[(system, "largest")])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens per request)")
        ax.set_ylabel(f"x {reference}, largest batches, same call")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    _save(fig, out / "throughput_vs_context.png")
    plt.close(fig)


def plot_batch_sweep(serving: list[dict], out: Path, plt) -> bool:
    """Per context (a column), decode tokens/s (top) and ITL p50 (bottom) against batch, one
    line per system. Written only when some system has two or more batches at one context;
    returns whether it was."""
    lines: dict[int, dict[str, list]] = {}
    for r in serving:
        if r["decode_tok_s"] is not None:
            lines.setdefault(r["context"], {}).setdefault(r["system"], []).append(r)
    contexts = sorted(c for c, systems in lines.items()
                      if any(len({r["batch"] for r in rs}) > 1 for rs in systems.values()))
    if not contexts:
        return False
    fig, axes = plt.subplots(2, len(contexts), figsize=(5.5 * len(contexts), 7), squeeze=False)
    for col, ctx in enumerate(contexts):
        for system, rs in sorted(lines[ctx].items()):
            rs = sorted(rs, key=lambda r: r["batch"])
            batches = [r["batch"] for r in rs]
            axes[0][col].plot(batches, [r["decode_tok_s"] for r in rs], marker="o", label=system)
            axes[1][col].plot(batches, [r["itl_ms_p50"] for r in rs], marker="o", label=system)
        axes[0][col].set_title(f"context {ctx // 1024}K")
        for row, ylabel in enumerate(("decode tokens/s (all requests)", "ITL p50 (ms)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch (concurrent requests)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    _save(fig, out / "throughput_vs_batch.png")
    plt.close(fig)
    return True


def _runs(serving: list[dict], agent: list[dict]) -> list[tuple[str, dict]]:
    """(label, row) per run that measured inter-token latency."""
    many = len({r["source"] for r in serving}) > 1  # then say which run a bar is from
    runs = [(f"{r['system']}\n{r['context'] // 1024}K x{r['batch']}"
             + (f"\n{r['source']}" if many else ""), r) for r in serving]
    runs += [(f"{r['system']}\n{r['workload']} {r['sessions']}x{r['turns']}", r) for r in agent
             if "itl_ms_p50" in r]
    return runs


def plot_latency(runs: list[tuple[str, dict]], out: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(runs)), 4.5))
    x = range(len(runs))
    for offset, key in ((-0.2, "itl_ms_p50"), (0.2, "itl_ms_p99")):
        ax.bar([i + offset for i in x], [r[key] for _, r in runs], width=0.4,
               label=key.replace("itl_ms_", "ITL "))
    ax.set_xticks(list(x), [label for label, _ in runs], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("inter-token latency (ms)")
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=8)
    _save(fig, out / "latency.png")
    plt.close(fig)


def _memory(serving: list[dict], agent: list[dict]) -> dict[str, dict]:
    """Per (system, source): token capacity, the KV bytes kept per token (MosaicKV: its sealed
    pages, every byte counted; SGLang's caches: their rows) and, for serving rows, the bytes the
    cache reserved per token slot (SGLang's `kvcache` GiB; MosaicKV: hot buffer + the packed
    store it reserved, both measured from the allocated tensors)."""
    mem: dict[str, dict] = {}
    for r in serving + agent:
        m = mem.setdefault(f"{r['system']}\n{r['source']}", {})
        memory = r.get("memory") or {}
        m["capacity"] = (r.get("token_capacity") or r.get("max_total_num_tokens")
                         or memory.get("token_capacity"))
        mk = r.get("mosaickv") or {}
        m["dense_bytes_per_token"] = mk.get("dense_bytes_per_token") \
            or memory.get("dense_bytes_per_token") or m.get("dense_bytes_per_token")
        if mk.get("bytes") and m["capacity"]:
            store = (mk.get("segment_store") or {}).get("reserved_bytes") \
                or mk.get("arena_budget_bytes") or 0
            m["reserved_bytes_per_slot"] = (mk["bytes"]["hot_buffer_capacity"] + store) \
                / m["capacity"]
        elif r.get("kv_cache_gb") and m["capacity"]:  # serving_bench's SGLang-cache rows
            m["reserved_bytes_per_slot"] = r["kv_cache_gb"] * 2**30 / m["capacity"]
            m["bytes_per_token"] = m["reserved_bytes_per_slot"]
            if r["system"] == "dense" and not m["dense_bytes_per_token"]:
                m["dense_bytes_per_token"] = m["reserved_bytes_per_slot"]
        sealed = mk.get("sealed_bytes_per_token") or memory.get("sealed_bytes_per_token")
        if sealed:
            m["bytes_per_token"] = sealed
    for m in mem.values():  # a dense cache keeps bf16 rows
        m.setdefault("bytes_per_token", m["dense_bytes_per_token"])
    return mem


def plot_memory(mem: dict[str, dict], out: Path, plt) -> None:
    systems = sorted(mem)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(systems)), 4))
    caps = [mem[s].get("capacity") or 0 for s in systems]
    a1.bar(systems, caps)
    a1.tick_params(axis="x", labelsize=7)
    a2.tick_params(axis="x", labelsize=7)
    for i, c in enumerate(caps):
        a1.annotate(f"{c:,}", (i, c), ha="center", va="bottom", fontsize=8)
    a1.set_ylabel("tokens that fit (MosaicKV: at its sealed layout mix)")
    x = range(len(systems))
    for offset, key, label in ((-0.2, "bytes_per_token", "kept per token (MosaicKV: sealed)"),
                               (0.2, "reserved_bytes_per_slot", "reserved per token slot")):
        kib = [(mem[s].get(key) or 0) / 1024 for s in systems]
        a2.bar([i + offset for i in x], kib, width=0.4, label=label)
        for i, b in enumerate(kib):
            if b:
                a2.annotate(f"{b:.1f}", (i + offset, b), ha="center", va="bottom", fontsize=7)
    a2.set_xticks(list(x), systems)
    a2.set_ylabel("KV KiB per token, all layers")
    a2.legend(fontsize=7)
    _save(fig, out / "memory.png")
    plt.close(fig)


def plot_agent_turns(agent: list[dict], out: Path, plt) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in agent:
        label = f"{r['system']} {r['workload']}"
        turns = [t["turn"] + 1 for t in r["per_turn"]]
        if all("output_tok_s" in t for t in r["per_turn"]):
            a1.plot(turns, [t["output_tok_s"] for t in r["per_turn"]], marker="o", label=label)
        a2.plot(turns, [t["cached_ratio"] for t in r["per_turn"]], marker="o", label=label)
    a1.set_xlabel("turn")
    a1.set_ylabel("output tokens/s (streamed runs)")
    a2.set_xlabel("turn")
    a2.set_ylabel("cached prompt tokens / prompt tokens")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    _save(fig, out / "agent_turns.png")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", type=Path, nargs="+", help="JSON files or folders of them")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    serving, agent = load_rows(args.inputs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if serving:
        plot_throughput(serving, args.out, plt)
        plot_batch_sweep(serving, args.out, plt)
    runs = _runs(serving, agent)
    if runs:
        plot_latency(runs, args.out, plt)
    mem = _memory(serving, agent)
    if mem:
        plot_memory(mem, args.out, plt)
    if agent:
        plot_agent_turns(agent, args.out, plt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
