"""Send prompts to a live SGLang server: concurrent, greedy, retried, resumable.

Each prompt goes to ``/generate`` as text (it ends in RULER's answer prefix, so the model
continues the answer rather than restating the question) with temperature 0 and the task's
generation length. Every finished sample is appended at once to a JSONL results file keyed by
(system, task, length, index); a rerun skips what is there, so a killed run resumes. A record
also carries the system's server-argument fingerprint and the prompt's hash: results of a
changed system or prompt are not reused (they are reported and re-run).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..launch import request
from .ruler_gen import Prompt
from .scoring import score


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def prompt_hash(p: Prompt) -> str:
    return fingerprint([p.input, p.outputs, p.max_new_tokens])


class ResultStore:
    """Append-only JSONL of sample results and per-system records; thread-safe appends."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.samples: dict[tuple, dict] = {}  # (system, task, length, index) -> latest record
        self.system_records: dict[str, dict] = {}  # system -> latest "stats"/"unsupported" record
        self.stats_records: dict[str, list[dict]] = {}  # system -> every "stats" record, in order
        # system -> server id -> its latest "checkpoint" (stats taken while it ran: what is left
        # of a server stopped before its "stats" record, e.g. by a call's time limit)
        self.checkpoints: dict[str, dict[str, dict]] = {}
        self.dsl: dict[str, dict] = {}  # system -> latest "dsl" record (frontend DSL answers)
        if path.is_file():
            self._load(path)

    def _load(self, path: Path) -> None:
        """Index every record; a cut last line (a run killed mid-write) is cut off the file, so
        the next append starts on a line of its own; a bad line anywhere else is an error."""
        raw = path.read_bytes()
        good_end = 0
        for line in raw.splitlines(keepends=True):
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                if raw[good_end + len(line):].strip():
                    raise ValueError(f"{path}: a line at byte {good_end} is not JSON (only a killed "
                                     f"run's last line may be cut): {line[:120]!r}") from None
                print(f"[runner] {path}: cutting off a cut last line (a killed run's)", flush=True)
                with open(path, "r+b") as fh:
                    fh.truncate(good_end)
                return
            if rec is not None:
                self._index(rec)
            good_end += len(line)
        if raw and not raw.endswith(b"\n"):  # a whole last record whose newline was not written
            with open(path, "ab") as fh:
                fh.write(b"\n")

    def _index(self, rec: dict) -> None:
        if rec["kind"] == "sample":
            self.samples[(rec["system"], rec["task"], rec["length"], rec["index"])] = rec
            last = self.system_records.get(rec["system"])
            if last and last["kind"] == "unsupported" and last["system_fp"] == rec["system_fp"]:
                del self.system_records[rec["system"]]  # a later server of it did serve
        elif rec["kind"] == "dsl":
            self.dsl[rec["system"]] = rec
        elif rec["kind"] == "checkpoint":
            self.checkpoints.setdefault(rec["system"], {})[rec["server"]] = rec
        else:
            self.system_records[rec["system"]] = rec
            if rec["kind"] == "stats":
                self.stats_records.setdefault(rec["system"], []).append(rec)

    def add(self, rec: dict) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            self._index(rec)

    def done(self, system: str, p: Prompt, system_fp: str) -> dict | None:
        """The finished (scored, error-free) record of this sample under this exact system/prompt."""
        rec = self.samples.get((system, p.task, p.length, p.index))
        if rec and rec.get("error") is None and rec["system_fp"] == system_fp \
                and rec["prompt_hash"] == prompt_hash(p):
            return rec
        return None

    def dsl_answers(self, system: str, system_fp: str, question_keys: list[str]) -> dict | None:
        """The DSL answers of this system to exactly these questions, if recorded."""
        rec = self.dsl.get(system)
        if rec and rec["system_fp"] == system_fp and rec["questions"] == question_keys:
            return rec["answers"]
        return None

    def server_stats(self, system: str, system_fp: str) -> list[tuple[dict, bool]]:
        """(MosaicKV stats, from a checkpoint) of every server that ran prompts of this system (a
        resumed or split run has several; a server that ran none repeats an earlier one's and is
        left out): its final record, or the last checkpoint of one stopped before it."""
        final = [r for r in self.stats_records.get(system, [])
                 if r["system_fp"] == system_fp and r.get("mosaickv")
                 and (r.get("counts") or {}).get("run", 0) > 0]
        ended = {r.get("server") for r in self.stats_records.get(system, [])}
        cut = [r for sid, r in self.checkpoints.get(system, {}).items()
               if r["system_fp"] == system_fp and sid not in ended]
        return [(r["mosaickv"], False) for r in final] + [(r["mosaickv"], True) for r in cut]

    def system_record(self, system: str, system_fp: str) -> dict | None:
        """The latest per-system record ("stats" after a finished run, or "unsupported")."""
        rec = self.system_records.get(system)
        return rec if rec and rec["system_fp"] == system_fp else None


def generation_budget(p: Prompt, context_len: int | None) -> int:
    """The task's generation length, cut to what fits the context (SGLang refuses a request whose
    prompt + max_new_tokens exceeds it; RULER's fwe prompts can fill up to the nominal length)."""
    if context_len is None:
        return p.max_new_tokens
    return min(p.max_new_tokens, context_len - p.prompt_tokens)


def generate_once(url: str, p: Prompt, max_new_tokens: int, timeout: float) -> dict:
    status, body = request(f"{url}/generate", {
        "text": p.input,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}},
        timeout=timeout)
    if status != 200 or not isinstance(body, dict) or "text" not in body:
        raise RuntimeError(f"/generate answered {status}: {str(body)[:300]}")
    return body


def run_sample(url: str, system: str, system_fp: str, p: Prompt, retries: int,
               timeout: float, context_len: int | None = None) -> dict:
    """One sample, retried on transport errors and 5xx; the record says what happened."""
    budget = generation_budget(p, context_len)
    rec = {"kind": "sample", "system": system, "system_fp": system_fp, "task": p.task,
           "length": p.length, "index": p.index, "prompt_hash": prompt_hash(p), "error": None,
           "max_new_tokens": budget}
    if budget < 1:
        return {**rec, "error": f"prompt of {p.prompt_tokens} tokens leaves no room to generate "
                                f"in a {context_len}-token context", "attempts": 0}
    last = None
    for attempt in range(retries + 1):
        t0 = time.time()
        try:
            body = generate_once(url, p, budget, timeout)
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:300]!r}"
            if exc.code < 500:
                break  # a request the server refuses will be refused again
        except (urllib.error.URLError, ConnectionError, TimeoutError, RuntimeError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            meta = body.get("meta_info", {})
            rec.update(prediction=body["text"], score=score(p.metric, body["text"], p.outputs),
                       prompt_tokens=meta.get("prompt_tokens"),
                       expected_prompt_tokens=p.prompt_tokens,
                       completion_tokens=meta.get("completion_tokens"),
                       cached_tokens=meta.get("cached_tokens"),
                       latency_s=round(time.time() - t0, 3), attempts=attempt + 1)
            return rec
        time.sleep(min(30.0, 2.0 ** attempt))
    rec.update(error=last, attempts=attempt + 1)
    return rec


def run_prompts(url: str, system: str, system_fp: str, prompts: list[Prompt], store: ResultStore,
                concurrency: int = 4, retries: int = 3, timeout: float = 1800.0,
                progress: bool = True, context_len: int | None = None) -> dict:
    """Run every prompt not already done; return counts (done before, run now, errors)."""
    from tqdm import tqdm

    todo = [p for p in prompts if store.done(system, p, system_fp) is None]
    counts = {"resumed": len(prompts) - len(todo), "run": len(todo), "errors": 0}
    if not todo:
        return counts
    bar = tqdm(total=len(todo), desc=system, unit="prompt", disable=not progress, smoothing=0.1)
    pool = ThreadPoolExecutor(max(1, concurrency))
    try:
        futures = [pool.submit(run_sample, url, system, system_fp, p, retries, timeout,
                               context_len) for p in todo]
        for fut in as_completed(futures):
            rec = fut.result()
            store.add(rec)
            if rec["error"] is not None:
                counts["errors"] += 1
                bar.write(f"[{system}] {rec['task']}@{rec['length']}#{rec['index']} failed after "
                          f"{rec['attempts']} attempts: {rec['error']}")
            bar.update(1)
    finally:
        # on Ctrl-C, do not wait for requests in flight: the caller stops the server, which ends them
        pool.shutdown(wait=False, cancel_futures=True)
    bar.close()
    return counts
