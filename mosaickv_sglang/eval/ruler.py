"""RULER accuracy of named KV-cache systems, each served by a real SGLang server this command starts.

For each system (``--systems``, see eval/systems.py) a server is started on the model, the same
RULER prompts are run through ``/generate`` (greedy, concurrent, retried), the server's physical
MosaicKV stats are recorded, and the server is stopped; then per-task scores, the average and
worst loss against dense over the task-lengths where dense >= 50 (named), and the physical
compression ratios are printed as a table and written as JSON. Results are appended to a JSONL
file as they come, so a rerun of the same command resumes.

CPU (generates the prompts with the pinned RULER package, runs fp32 servers):

    python -m mosaickv_sglang.eval.ruler --tasks niah_single_1 --length 4096 --samples 4 \\
        --json OUT.json

GPU (no PyPI there: prompts from a file exported by ``python -m mosaickv_sglang.eval.ruler_gen``):

    python -m mosaickv_sglang.eval.ruler --prompts ruler_prompts.jsonl.xz --systems all \\
        --concurrency 32 --json OUT.json --report OUTDIR
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from ..assets.smollm2 import CHECKSUMS
from ..assets.smollm2 import DEFAULT_OUT as SMOLLM2
from ..launch import mosaickv_stats, running_server, stop_servers_on_signals
from . import dsl_fidelity, report, ruler_gen, systems
from .runner import ResultStore, fingerprint, run_prompts

# SGLang sizes its KV pool from the GPU memory free while it starts: servers starting together
# saw each other's allocations come and go (pools of 1792 to 281600 tokens, one refused, on the
# H200), so --parallel lets one server at a time size its pool (launch.running_server's
# sizing_lock), overlapping their warm-ups, and runs them at once.
_ONE_POOL_SIZING_AT_A_TIME = threading.Lock()
_ERROR_LINE = re.compile(r"(Error|error:|Exception|not supported|unsupported|refuse)", re.I)


def platform_args(concurrency: int, platform: str = "auto") -> list[str]:
    """bf16 on a GPU; fp32 on a CPU (SGLang's bf16 CPU matmuls are several times slower; ratios
    are reported against bf16 either way) with a pool for `concurrency` 8K requests."""
    import torch

    if platform == "gpu" or (platform == "auto" and torch.cuda.is_available()):
        return ["--dtype", "bfloat16"]
    return ["--dtype", "float32", "--max-total-tokens", str(max(32768, 8192 * concurrency))]


def context_length(model: Path, server_args: list[str]) -> int:
    """The context the server enforces (prompt + generation must fit): --context-length if
    given, else the model's."""
    if "--context-length" in server_args:
        return int(server_args[server_args.index("--context-length") + 1])
    return json.loads((model / "config.json").read_text())["max_position_embeddings"]


def model_identity(model: Path) -> str:
    """What results are keyed by: the model folder's checksums (the same weights at another path,
    e.g. on another machine, resume), else its path."""
    sums = model / CHECKSUMS
    return fingerprint(sums.read_text()) if sums.is_file() else str(model)


def failure_reason(log: Path) -> str:
    """The last error-looking line of a server log (else its last line): why a system cannot run."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] \
        if log.is_file() else []
    errors = [ln for ln in lines if _ERROR_LINE.search(ln)]
    return (errors or lines or ["server exited without output"])[-1][:500]


_STOPPING = threading.Event()  # set by a signal: servers dying now are not "unsupported"
CHECKPOINT_EVERY_S = 60.0  # a MosaicKV server's stats are recorded this often while it runs


def _checkpoints(url: str, store: ResultStore, system: str, fp: str, server: str,
                 done: threading.Event) -> None:
    """Record the server's MosaicKV stats every CHECKPOINT_EVERY_S until `done`: a server stopped
    before its final "stats" record (a call's time limit) still has a measured ratio."""
    while not done.wait(CHECKPOINT_EVERY_S):
        try:
            stats = mosaickv_stats(url)
        except Exception as e:  # the server is going away: its last checkpoint stands
            print(f"[ruler] {system}: stats checkpoint failed ({e!r}); keeping the last one",
                  flush=True)
            return
        store.add({"kind": "checkpoint", "system": system, "system_fp": fp, "server": server,
                   "mosaickv": stats})


def run_system(system, prompts, questions, store: ResultStore, fp: str, args,
               server_args: list[str], log_dir: Path) -> None:
    """Start the system's server, run what is not done yet (RULER prompts, then the DSL
    questions), record its stats, or record why it cannot run."""
    pending = [p for p in prompts if store.done(system.name, p, fp) is None]
    record = store.system_record(system.name, fp)
    qkeys = [q.key for q in questions]
    dsl_pending = bool(questions) and store.dsl_answers(system.name, fp, qkeys) is None
    if not pending and not dsl_pending and record and record["kind"] == "stats":
        print(f"[ruler] {system.name}: all {len(prompts)} samples already in {store.path}", flush=True)
        return
    log = log_dir / f"{system.name}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[ruler] {system.name}: starting server ({' '.join(server_args)}); log {log}", flush=True)
    t0 = time.time()
    try:
        server = running_server(args.model, log, *server_args, startup_s=args.startup_s,
                                sizing_lock=_ONE_POOL_SIZING_AT_A_TIME)
        srv = server.__enter__()
    except RuntimeError:
        if _STOPPING.is_set():
            return
        reason = failure_reason(log)
        store.add({"kind": "unsupported", "system": system.name, "system_fp": fp, "reason": reason})
        print(f"[ruler] {system.name}: unsupported: {reason}", flush=True)
        return
    server_id, done = uuid.uuid4().hex[:12], threading.Event()
    if system.kv_backend == "mosaickv":
        threading.Thread(target=_checkpoints, daemon=True,
                         args=(srv.url, store, system.name, fp, server_id, done)).start()
    try:
        print(f"[ruler] {system.name}: up in {time.time() - t0:.0f}s, {len(pending)} prompts to run",
              flush=True)
        counts = run_prompts(srv.url, system.name, fp, prompts, store, args.concurrency,
                             args.retries, args.timeout, progress=not args.no_progress,
                             context_len=context_length(args.model, server_args))
        stats = mosaickv_stats(srv.url) if system.kv_backend == "mosaickv" else None
        if not counts["run"] and record and record["kind"] == "stats":
            stats = record["mosaickv"]  # this server ran no prompt: keep the run's own stats
        if dsl_pending:
            print(f"[ruler] {system.name}: {len(questions)} DSL questions", flush=True)
            answers = dsl_fidelity.answer_all(srv.url, questions, args.concurrency)
            store.add({"kind": "dsl", "system": system.name, "system_fp": fp,
                       "questions": qkeys, "answers": answers})
        store.add({"kind": "stats", "system": system.name, "system_fp": fp, "mosaickv": stats,
                   "counts": counts, "wall_s": round(time.time() - t0, 1), "server": server_id})
    finally:
        done.set()
        server.__exit__(None, None, None)


def load_prompts(args) -> tuple[list, list, dict]:
    """(RULER prompts, DSL questions, where they came from)."""
    if args.prompts:
        meta, everything = ruler_gen.load(args.prompts)
        if meta.get("excluded"):
            print(f"[ruler] {args.prompts} excludes {meta['excluded']} (not generated)", flush=True)
        prompts = ruler_gen.select(everything, args.tasks, args.length, args.samples,
                                   meta.get("excluded", ()), args.cells)
        dsl_source = ruler_gen.select(everything, [dsl_fidelity.TASK], [args.dsl_length]) \
            if args.dsl else []
        return prompts, dsl_fidelity.questions_from(dsl_source, args.dsl), \
            {**meta, "file": str(args.prompts)}
    prompts = ruler_gen.generate_all(args.tasks or ruler_gen.TASKS, args.length or [4096],
                                     args.samples or 4, args.seed, args.model, args.gen_jobs)
    if args.cells:
        prompts = ruler_gen.select(prompts, cells=args.cells)
    dsl_source = ruler_gen.generate(dsl_fidelity.TASK, args.dsl_length, args.dsl, args.seed,
                                    args.model) if args.dsl else []
    return prompts, dsl_fidelity.questions_from(dsl_source, args.dsl), \
        ruler_gen.header(args.model, args.seed)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", help=f"RULER tasks (default: all 13: {', '.join(ruler_gen.TASKS)})")
    ap.add_argument("--length", nargs="+", type=int, action="extend",
                    help="RULER lengths, repeatable (default: 4096, or every length in --prompts)")
    ap.add_argument("--cells", nargs="+", metavar="TASK@LENGTH",
                    help="exactly these task-lengths instead of --tasks x --length, e.g. the ones "
                         "where dense scored >= 50 in an earlier run")
    ap.add_argument("--samples", type=int, help="samples per task-length (default: 4, or all in --prompts)")
    ap.add_argument("--systems", nargs="+", default=list(systems.DEFAULT_SYSTEMS),
                    help=f"'all' or names from {list(systems.SYSTEMS)} (default: dense mosaickv)")
    ap.add_argument("--json", type=Path, required=True, help="summary JSON to write")
    ap.add_argument("--results", type=Path, help="per-sample JSONL, resumable (default: next to --json)")
    ap.add_argument("--report", type=Path, help="also write ruler.md and ruler.png into this folder")
    ap.add_argument("--prompts", type=Path, help="an exported prompts file instead of generating")
    ap.add_argument("--model", type=Path, default=SMOLLM2)
    ap.add_argument("--seed", type=int, default=ruler_gen.SEED)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    ap.add_argument("--startup-s", type=float, default=600.0, help="seconds for a server to get healthy")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for every server, repeatable; quote flags with values: "
                         "--server-arg=--attention-backend --server-arg=triton")
    ap.add_argument("--dense-server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the systems on SGLang's own KV cache only (dense, fp8), "
                         "repeatable: e.g. their attention backend, which --kv-backend mosaickv "
                         "refuses (it sets its own): --dense-server-arg=--attention-backend "
                         "--dense-server-arg=triton")
    ap.add_argument("--dsl", type=int, default=0, metavar="N",
                    help="also answer N multiple-choice questions with sgl.select and a fork "
                         "program on every system (eval/dsl_fidelity.py)")
    ap.add_argument("--dsl-length", type=int, default=2048, help="RULER length of the DSL contexts")
    ap.add_argument("--gen-jobs", type=int, default=2, help="RULER generators run at a time")
    ap.add_argument("--parallel", type=int, default=1, metavar="N",
                    help="systems served at once, each by its own server, started one after "
                         "another (give each a share of the GPU: --server-arg=--mem-fraction-static "
                         "--server-arg=F with N*F < 0.9)")
    ap.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                    help="whose server arguments (and so results) to use: this machine's (auto), or "
                         "another's, e.g. to report a GPU run's samples file on a CPU")
    ap.add_argument("--report-only", action="store_true",
                    help="start no server: summarize what the samples file holds (missing samples "
                         "are counted, not run)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.systems == ["all"]:
        args.systems = list(systems.FULL_SYSTEMS)
    if "dense" not in args.systems:
        ap.error("--systems must include 'dense': every loss is measured against it")
    args.systems = [s.name for s in systems.get(args.systems)]
    if args.cells:
        if args.tasks or args.length:
            ap.error("--cells replaces --tasks and --length: give one or the other")
        try:
            cells = [ruler_gen.parse_cell(c) for c in args.cells]
        except ValueError as e:
            ap.error(f"--cells: {e}")
        args.tasks = sorted({t for t, _ in cells})
        args.length = sorted({n for _, n in cells})
    if args.samples is not None and args.samples < 1:
        ap.error(f"--samples {args.samples}: must be >= 1")
    if args.parallel < 1:
        ap.error(f"--parallel {args.parallel}: must be >= 1")
    if not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json (build SmolLM2 with bash scripts/setup.sh)")
    return args


def system_fingerprint(system, extra: list[str], baseline_args: list[str], model_id: str) -> str:
    """What a sample of `system` was computed by: its server arguments, the shared ones, the
    model, its baseline arguments when given, and a MosaicKV system's resolved config."""
    return fingerprint([system.server_args(), extra, model_id] +
                       ([baseline_args] if baseline_args else []) +
                       ([asdict(system.mosaic_config())] if system.kv_backend == "mosaickv"
                        else []))


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts, questions, source = load_prompts(args)
    results = args.results or args.json.with_suffix(".samples.jsonl")
    store = ResultStore(results)
    extra = platform_args(args.concurrency, args.platform) + args.server_arg
    chosen = systems.get(args.systems)
    baseline_args = {s.name: args.dense_server_arg if s.kv_backend == "default" else []
                     for s in chosen}
    own_args = {s.name: s.server_args() + extra + baseline_args[s.name] for s in chosen}
    # (the baseline arguments join the fingerprint only when given: older results still resume;
    # a MosaicKV system's resolved config always joins it, so a changed default never resumes
    # samples of the config before it)
    model_id = model_identity(args.model)
    fps = {s.name: system_fingerprint(s, extra, baseline_args[s.name], model_id) for s in chosen}
    print(f"[ruler] {len(prompts)} prompts ({len({(p.task, p.length) for p in prompts})} "
          f"task-lengths) x {len(chosen)} systems; samples -> {results}", flush=True)
    for system in chosen:
        systems.validate(system)
    if not args.report_only:
        # every finished sample is already in the results file (a line cut by the exit is
        # dropped on the next load), so a rerun resumes
        stop_servers_on_signals("ruler", "; rerun the same command to resume",
                                before=_STOPPING.set)
        with ThreadPoolExecutor(args.parallel) as pool:
            for done in [pool.submit(run_system, s, prompts, questions, store, fps[s.name], args,
                                     own_args[s.name], results.with_suffix(".logs"))
                         for s in chosen]:
                done.result()
    summary = report.summarize(prompts, chosen, store, fps)
    summary.update(command=sys.argv, prompts=source, server_args_common=extra,
                   results_file=str(results))
    dense = summary["systems"]["dense"]
    if dense["status"] == "unsupported":
        raise SystemExit(f"the dense reference could not run: {dense['reason']}")
    table = report.markdown(summary)
    if questions:
        answers = {s.name: a for s in chosen
                   if (a := store.dsl_answers(s.name, fps[s.name], [q.key for q in questions]))}
        summary["dsl"] = dsl_fidelity.summarize(questions, answers)
        table += "\n" + dsl_fidelity.markdown(summary["dsl"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "ruler.md").write_text(table)
        report.plot(summary, args.report / "ruler.png")
    print("\n" + table)
    print(f"[ruler] wrote {args.json}")
    incomplete = [n for n, e in summary["systems"].items() if e["status"] == "incomplete"]
    if incomplete:
        print(f"[ruler] incomplete (failed samples, rerun the same command to retry): {incomplete}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
