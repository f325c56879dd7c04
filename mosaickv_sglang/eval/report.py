"""Scores per system and task-length, losses against dense where dense is competent, tables, plot.

A 135M model is at the floor on several RULER tasks at long lengths, where compressed and dense
both score ~0 and a "no loss" says nothing. Every accuracy claim is therefore made over the
task-lengths where dense scores >= COMPETENT points, and those are named in the output.
"""
from __future__ import annotations

import random
from pathlib import Path

from .ruler_gen import Prompt

COMPETENT = 50.0
BOOTSTRAP_REPS, BOOTSTRAP_SEED = 2000, 0


def cell(p: Prompt) -> str:
    return f"{p.task}@{p.length}"


def summarize(prompts: list[Prompt], systems: list, store, fingerprints: dict[str, str]) -> dict:
    """The JSON summary of a run (see module docstring); `store` is a runner.ResultStore."""
    cells = list(dict.fromkeys(cell(p) for p in prompts))
    out = {"competent_threshold": COMPETENT, "cells": cells, "systems": {}}
    for s in systems:
        fp = fingerprints[s.name]
        entry = {"description": s.description, "family": s.family, "server_args": s.server_args()}
        record = store.system_record(s.name, fp)
        if record and record["kind"] == "unsupported":
            entry.update(status="unsupported", reason=record["reason"])
            out["systems"][s.name] = entry
            continue
        scores, missing, mismatched, clamped = {}, 0, 0, 0
        for c in cells:
            pairs = [(p, store.done(s.name, p, fp)) for p in prompts if cell(p) == c]
            got = [(p, r) for p, r in pairs if r is not None]
            missing += len(pairs) - len(got)
            mismatched += sum(r["prompt_tokens"] != r["expected_prompt_tokens"] for _, r in got)
            clamped += sum(r.get("max_new_tokens", p.max_new_tokens) < p.max_new_tokens
                           for p, r in got)
            scores[c] = {"score": _mean([r["score"] for _, r in got]), "n": len(got),
                         "missing": len(pairs) - len(got)}
        stats = (record or {}).get("mosaickv")
        ratio, source = s.nominal_ratio, "nominal (bf16 bytes / bytes per element)"
        servers = [(st, cut) for st, cut in store.server_stats(s.name, fp) if st.get("sealed_tokens")]
        per_server = [st for st, _ in servers]
        n_cut = sum(cut for _, cut in servers)
        cut_note = f"; {n_cut} stopped early: their last stats checkpoint" if n_cut else ""
        if len(per_server) > 1 or n_cut:
            ratio, source = combined_ratio(per_server), \
                f"measured (sealed bytes summed over the {len(per_server)} servers that ran it" \
                f"{cut_note})"
        elif stats and stats.get("sealed_ratio"):
            ratio, source = stats["sealed_ratio"], "measured (server sealed_ratio)"
        entry.update(status="ok" if missing == 0 else "incomplete", missing_samples=missing,
                     prompt_token_mismatches=mismatched, generation_cut_to_context=clamped,
                     scores=scores,
                     ratio=ratio, ratio_source=source,
                     stats=stats, wall_s=(record or {}).get("wall_s"),
                     ratio_per_server=[{"sealed_tokens": st["sealed_tokens"],
                                        "sealed_ratio": st["sealed_ratio"]} for st in per_server],
                     average=_mean([v["score"] for v in scores.values()]))
        out["systems"][s.name] = entry
    dense = out["systems"].get("dense")
    if dense and dense["status"] != "unsupported":
        competent = [c for c in cells if (dense["scores"][c]["score"] or 0) >= COMPETENT]
        out["competent_cells"] = competent
        out["floor_cells"] = [c for c in cells if c not in competent]
        for name, entry in out["systems"].items():
            if entry["status"] == "unsupported":
                continue
            # paired: over the samples both finished (all of a cell's, for a complete system)
            pairs = list(_paired(prompts, store, name, fingerprints))
            diffs = _cell_diffs(pairs, competent)
            losses = {c: _mean(v) for c, v in diffs.items()}
            worst = max(losses, key=losses.get) if losses else None
            entry["competent_average"] = _mean([entry["scores"][c]["score"] for c in competent])
            entry["identical_to_dense"] = _identical_share(pairs)
            entry["loss"] = {"average": _mean(list(losses.values())),
                             "average_ci95": None if name == "dense" else _loss_ci(diffs),
                             "worst": losses[worst] if worst else None, "worst_at": worst,
                             "per_cell": losses,
                             "paired_samples": sum(len(v) for v in diffs.values())}
    return out


def combined_ratio(per_server: list[dict]) -> float:
    """bf16 bytes of every token the servers sealed / every byte their sealed pages keep."""
    tokens = sum(st["sealed_tokens"] for st in per_server)
    kept = sum(st["sealed_tokens"] * st["sealed_bytes_per_token"] for st in per_server)
    return per_server[0]["dense_bytes_per_token"] * tokens / kept


def _paired(prompts: list[Prompt], store, name: str, fingerprints: dict):
    """(prompt, dense record, `name`'s record) for every prompt both have finished."""
    for p in prompts:
        d, s = store.done("dense", p, fingerprints["dense"]), store.done(name, p, fingerprints[name])
        if d and s:
            yield p, d, s


def _cell_diffs(pairs: list, cells: list[str]) -> dict[str, list[float]]:
    """Per cell of `cells`, dense's score minus the system's for every pair (`_paired`)."""
    diffs: dict[str, list[float]] = {}
    for p, d, s in pairs:
        if cell(p) in cells:
            diffs.setdefault(cell(p), []).append(d["score"] - s["score"])
    return diffs


def _loss_ci(diffs: dict[str, list[float]]) -> list[float] | None:
    """95% paired-bootstrap interval of the average loss over the cells of `diffs`
    (`_cell_diffs`): samples are resampled within each cell, keeping each sample's dense and
    system scores together (what the sampling of prompts alone makes uncertain; seeded, so the
    same file gives the same interval)."""
    if not diffs:
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    means = sorted(
        sum(sum(rng.choices(v, k=len(v))) / len(v) for v in diffs.values()) / len(diffs)
        for _ in range(BOOTSTRAP_REPS))
    return [means[int(0.025 * BOOTSTRAP_REPS)], means[int(0.975 * BOOTSTRAP_REPS) - 1]]


def _identical_share(pairs: list) -> float | None:
    """% of the pairs (`_paired`, all cells) whose greedy prediction is the same text as dense's."""
    return 100.0 * sum(d["prediction"] == s["prediction"] for _, d, s in pairs) / len(pairs) \
        if pairs else None


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(summary: dict) -> str:
    """Scores per task-length (rows) and system (columns), then averages, losses and ratios."""
    names = list(summary["systems"])
    sysd = summary["systems"]
    lines = ["| task@length | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    competent = set(summary.get("competent_cells", []))
    for c in summary["cells"]:
        mark = "" if c in competent else " (dense < 50)"
        row = [_fmt(sysd[n]["scores"][c]["score"]) if sysd[n]["status"] != "unsupported" else "n/a"
               for n in names]
        lines.append(f"| {c}{mark} | " + " | ".join(row) + " |")

    def summary_row(label, fn):
        vals = [fn(sysd[n]) if sysd[n]["status"] != "unsupported" else "n/a" for n in names]
        lines.append(f"| **{label}** | " + " | ".join(vals) + " |")

    summary_row("average, all", lambda e: _fmt(e["average"]))
    if "competent_cells" in summary:
        summary_row(f"average, dense >= {COMPETENT:.0f}", lambda e: _fmt(e["competent_average"]))
        summary_row("avg loss vs dense", lambda e: _fmt(e["loss"]["average"], 2))
        summary_row("avg loss, 95% paired bootstrap", lambda e: "-" if not e["loss"].get(
            "average_ci95") else f"[{e['loss']['average_ci95'][0]:.2f}, "
                                 f"{e['loss']['average_ci95'][1]:.2f}]")
        summary_row("worst loss vs dense", lambda e: f"{_fmt(e['loss']['worst'], 1)} "
                    f"({e['loss']['worst_at'] or '-'})")
        summary_row("% predictions identical to dense", lambda e: _fmt(e["identical_to_dense"], 0))
    summary_row("physical ratio vs bf16", lambda e: f"{_fmt(e['ratio'], 2)}"
                + ("" if e["ratio_source"].startswith("measured") else " (nominal)"))
    summary_row("status", lambda e: e["status"])
    unsupported = [f"* `{n}`: unsupported: {e['reason']}" for n, e in sysd.items()
                   if e["status"] == "unsupported"]
    notes = []
    if "competent_cells" in summary:
        notes.append(f"Task-lengths where dense >= {COMPETENT:.0f} (the claims): "
                     f"{', '.join(summary['competent_cells']) or 'none'}.")
        notes.append(f"Dense below {COMPETENT:.0f} (floor, not used for claims): "
                     f"{', '.join(summary['floor_cells']) or 'none'}.")
    return "\n".join(lines + [""] + notes + unsupported) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Accuracy over the competent task-lengths vs physical compression ratio, one point per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = "competent_average" if "competent_cells" in summary else "average"
    for name, e in summary["systems"].items():
        if e["status"] == "unsupported" or e.get(key) is None or e.get("ratio") is None:
            continue
        marker = "s" if e["ratio_source"].startswith("nominal") else "o"
        ci = (e.get("loss") or {}).get("average_ci95") if key == "competent_average" else None
        # the loss interval drawn around the score: score = dense's - loss
        yerr = [[ci[1] - e["loss"]["average"]], [e["loss"]["average"] - ci[0]]] if ci else None
        ax.errorbar(e["ratio"], e[key], yerr=yerr, fmt=marker, capsize=3)
        ax.annotate(name, (e["ratio"], e[key]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    label = f"RULER score over task-lengths with dense >= {COMPETENT:.0f}" \
        if key == "competent_average" else "RULER score (all task-lengths)"
    ax.set_xlabel("physical compression ratio vs bf16\n(squares: nominal; bars: 95% paired "
                  "bootstrap of the loss vs dense)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
