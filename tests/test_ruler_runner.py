"""Runner and report against a fake /generate server on loopback: retries, resumability (keyed by
system/task/length/sample, invalidated by a changed system or prompt), losses over the cells
where dense >= 50."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mosaickv_sglang.eval import report
from mosaickv_sglang.eval.ruler_gen import Prompt
from mosaickv_sglang.eval.runner import ResultStore, fingerprint, run_prompts
from mosaickv_sglang.eval.systems import SYSTEMS


class FakeServer:
    """Answers the reference when the prompt contains 'good', else 'no idea'; the first
    `fail_first` requests get a 503; records every request."""

    def __init__(self, fail_first=0):
        self.requests, self.fail_left = [], fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if outer.fail_left > 0:
                    outer.fail_left -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                text = body["text"]
                answer = " " + text.split("ref=")[1].split()[0] if "good" in text else " no idea"
                out = json.dumps({"text": answer, "meta_info": {
                    "prompt_tokens": len(text.split()), "completion_tokens": 3}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def server():
    srv = FakeServer(fail_first=2)
    yield srv
    srv.close()


def _prompts(quality):
    return [Prompt(task, 2048, i, f"{quality[task]} ref=V{i} is", [f"V{i}"], 8, 3, "string_match_all")
            for task in quality for i in range(3)]


def test_retries_resume_and_invalidation(server, tmp_path, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)  # no backoff waits in the test
    prompts = _prompts({"niah_single_1": "good", "vt": "bad"})
    store = ResultStore(tmp_path / "r.jsonl")
    counts = run_prompts(server.url, "dense", "fp1", prompts, store, concurrency=3, retries=3,
                         progress=False)
    assert counts == {"resumed": 0, "run": 6, "errors": 0}
    assert len(server.requests) == 8  # two 503s retried
    assert all(r["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 8}
               for r in server.requests)
    # a new store on the same file resumes: nothing is sent again
    store = ResultStore(tmp_path / "r.jsonl")
    assert run_prompts(server.url, "dense", "fp1", prompts, store, progress=False)["run"] == 0
    assert len(server.requests) == 8
    # a changed system fingerprint or prompt text is not reused
    assert run_prompts(server.url, "dense", "fp2", prompts[:1], store, progress=False)["run"] == 1
    changed = [Prompt(**{**prompts[1].__dict__, "input": prompts[1].input + " "})]
    assert run_prompts(server.url, "dense", "fp2", changed, store, progress=False)["run"] == 1


def test_failures_are_recorded_then_retried(tmp_path, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    srv = FakeServer(fail_first=100)
    try:
        prompts = _prompts({"vt": "good"})[:1]
        store = ResultStore(tmp_path / "r.jsonl")
        counts = run_prompts(srv.url, "dense", "fp", prompts, store, retries=1, progress=False)
        assert counts["errors"] == 1 and "HTTP 503" in store.samples[("dense", "vt", 2048, 0)]["error"]
        srv.fail_left = 0
        assert run_prompts(srv.url, "dense", "fp", prompts, ResultStore(tmp_path / "r.jsonl"),
                           progress=False) == {"resumed": 0, "run": 1, "errors": 0}
    finally:
        srv.close()


def test_summary_losses_over_competent_cells(server, tmp_path, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    store = ResultStore(tmp_path / "r.jsonl")
    dense_p = _prompts({"niah_single_1": "good", "vt": "bad", "qa_1": "good"})
    run_prompts(server.url, "dense", "fd", dense_p, store, progress=False)
    # mosaickv: dense's records, except that it misses qa_1 samples 1 and 2
    for p in dense_p:
        rec = dict(store.done("dense", p, "fd"))
        if p.task == "qa_1":
            rec.update(score=0.0 if p.index else 100.0)
        store.add({**rec, "system": "mosaickv", "system_fp": "fm"})
    store.add({"kind": "stats", "system": "mosaickv", "system_fp": "fm",
               "mosaickv": {"sealed_ratio": 3.2}})
    store.add({"kind": "unsupported", "system": "fp8", "system_fp": "f8", "reason": "boom: no fp8"})
    chosen = [SYSTEMS["dense"], SYSTEMS["mosaickv"], SYSTEMS["fp8"]]
    s = report.summarize(dense_p, chosen, store, {"dense": "fd", "mosaickv": "fm", "fp8": "f8"})
    assert s["competent_cells"] == ["niah_single_1@2048", "qa_1@2048"]
    assert s["floor_cells"] == ["vt@2048"]
    loss = s["systems"]["mosaickv"]["loss"]
    assert loss["worst_at"] == "qa_1@2048" and loss["worst"] == pytest.approx(200 / 3)
    assert loss["average"] == pytest.approx(100 / 3)
    lo, hi = loss["average_ci95"]  # qa_1's paired differences are 0, 100, 100: resampled
    assert 0 <= lo < 100 / 3 < hi <= 50
    assert s["systems"]["mosaickv"]["ratio"] == 3.2
    assert s["systems"]["mosaickv"]["identical_to_dense"] == 100.0  # same records copied
    assert s["systems"]["fp8"] == {**s["systems"]["fp8"], "status": "unsupported",
                                   "reason": "boom: no fp8"}
    md = report.markdown(s)
    assert "vt@2048 (dense < 50)" in md and "`fp8`: unsupported: boom: no fp8" in md
    report.plot(s, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_losses_of_an_incomplete_system_are_paired(server, tmp_path, monkeypatch):
    """A system that finished only some samples is compared with dense on those samples: a cell
    where dense fails the samples the system skipped shows no loss, not an unpaired one."""
    monkeypatch.setattr("time.sleep", lambda s: None)
    store = ResultStore(tmp_path / "r.jsonl")
    prompts = _prompts({"niah_single_1": "good", "qa_1": "good"})
    run_prompts(server.url, "dense", "fd", prompts, store, progress=False)
    for p in prompts:
        rec = dict(store.done("dense", p, "fd"))
        if p.task == "qa_1" and p.index == 2:
            store.add({**rec, "score": 0.0})  # dense misses it; the system never ran it
            continue
        store.add({**rec, "system": "mosaickv", "system_fp": "fm"})
    s = report.summarize(prompts, [SYSTEMS["dense"], SYSTEMS["mosaickv"]], store,
                         {"dense": "fd", "mosaickv": "fm"})
    entry = s["systems"]["mosaickv"]
    assert entry["status"] == "incomplete" and entry["scores"]["qa_1@2048"]["score"] == 100.0
    assert s["systems"]["dense"]["scores"]["qa_1@2048"]["score"] == pytest.approx(200 / 3)
    assert entry["loss"]["per_cell"] == {"niah_single_1@2048": 0.0, "qa_1@2048": 0.0}
    assert entry["loss"]["paired_samples"] == 5 and entry["loss"]["average_ci95"] == [0.0, 0.0]


def test_generation_is_cut_to_the_context(server, tmp_path, monkeypatch):
    """SGLang refuses prompt + max_new_tokens > context: the budget is cut (and counted), and a
    prompt that leaves no room is an error, not a request."""
    monkeypatch.setattr("time.sleep", lambda s: None)
    prompts = _prompts({"fwe": "good"})[:2]  # prompt_tokens 3, max_new_tokens 8
    store = ResultStore(tmp_path / "r.jsonl")
    run_prompts(server.url, "dense", "f", prompts[:1], store, progress=False, context_len=7)
    assert server.requests[-1]["sampling_params"]["max_new_tokens"] == 4
    counts = run_prompts(server.url, "dense", "f", prompts[1:], store, progress=False, context_len=3)
    assert counts["errors"] == 1 and "leaves no room" in store.samples[("dense", "fwe", 2048, 1)]["error"]
    s = report.summarize(prompts, [SYSTEMS["dense"]], store, {"dense": "f"})
    assert s["systems"]["dense"]["generation_cut_to_context"] == 1
    assert s["systems"]["dense"]["status"] == "incomplete"


def test_a_cut_last_line_is_dropped_and_the_run_resumes(server, tmp_path, monkeypatch):
    """A run killed mid-write (SIGTERM at a device call's limit) leaves a cut last line: the next
    load drops it from the file, reruns only that sample, and the file is valid JSONL again."""
    monkeypatch.setattr("time.sleep", lambda s: None)
    prompts = _prompts({"niah_single_1": "good"})
    path = tmp_path / "r.jsonl"
    run_prompts(server.url, "dense", "fp", prompts, ResultStore(path), progress=False)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:25])  # the last record cut mid-line
    store = ResultStore(path)
    assert len(store.samples) == 2
    assert run_prompts(server.url, "dense", "fp", prompts, store, progress=False)["run"] == 1
    assert [json.loads(ln)["kind"] for ln in path.read_text().splitlines()] == ["sample"] * 3


def test_a_bad_line_inside_the_file_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"kind": "dsl", "system": "dense"}\nnot json\n{"kind": "dsl", "system": "x"}\n')
    with pytest.raises(ValueError, match="byte 35 is not JSON"):
        ResultStore(path)


def test_a_last_record_without_its_newline_gets_one(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"kind": "dsl", "system": "dense"}')
    store = ResultStore(path)
    store.add({"kind": "dsl", "system": "x"})
    assert [json.loads(ln)["system"] for ln in path.read_text().splitlines()] == ["dense", "x"]


def test_ratio_sums_every_server_that_ran_the_system(tmp_path):
    """A resumed or split run has several servers' stats: the ratio is bf16 bytes of every token
    they sealed over every byte kept, and a server that ran no prompt (it repeats an earlier
    one's stats) is not counted twice."""
    store = ResultStore(tmp_path / "r.jsonl")

    def stats(tokens, bpt, run):
        store.add({"kind": "stats", "system": "mosaickv", "system_fp": "fm", "counts": {"run": run},
                   "mosaickv": {"sealed_tokens": tokens, "sealed_bytes_per_token": bpt,
                                "dense_bytes_per_token": 100.0, "sealed_ratio": 100.0 / bpt}})

    stats(1000, 25.0, run=10)  # 4x
    stats(3000, 50.0, run=30)  # 2x
    stats(3000, 50.0, run=0)  # a rerun with nothing left to do
    dense_p = _prompts({"niah_single_1": "good"})
    s = report.summarize(dense_p, [SYSTEMS["mosaickv"]], store, {"mosaickv": "fm"})
    entry = s["systems"]["mosaickv"]
    assert entry["ratio"] == pytest.approx(100 * 4000 / (1000 * 25 + 3000 * 50))
    assert entry["ratio_source"].endswith("summed over the 2 servers that ran it)")
    assert [r["sealed_tokens"] for r in entry["ratio_per_server"]] == [1000, 3000]


def test_report_only_starts_no_server_and_counts_what_is_missing(tmp_path, monkeypatch):
    """--report-only summarizes a samples file (e.g. a GPU run's, on a CPU with --platform gpu):
    no server starts, and samples not in the file are counted as missing, not run."""
    from mosaickv_sglang.eval import ruler, ruler_gen

    def no_server(*a, **k):
        raise AssertionError("--report-only must not start a server")
    monkeypatch.setattr(ruler, "running_server", no_server)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 8192}')
    prompts = _prompts({"niah_single_1": "good"})
    ruler_gen.export(prompts, tmp_path / "p.jsonl.xz", {"format": ruler_gen.FORMAT, "seed": 1})
    out = tmp_path / "s.json"
    assert ruler.main(["--prompts", str(tmp_path / "p.jsonl.xz"), "--model", str(model),
                       "--tasks", "niah_single_1",
                       "--platform", "gpu", "--report-only", "--json", str(out)]) == 1
    s = json.loads(out.read_text())
    assert s["server_args_common"] == ["--dtype", "bfloat16"]
    assert s["systems"]["mosaickv"]["status"] == "incomplete"
    assert s["systems"]["dense"]["missing_samples"] == len(prompts)


def test_cells_replace_tasks_and_lengths(tmp_path):
    from mosaickv_sglang.eval import ruler

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 8192}')
    base = ["--model", str(model), "--json", str(tmp_path / "s.json")]
    args = ruler.parse_args(base + ["--cells", "niah_single_2@8192", "vt@2048"])
    assert args.tasks == ["niah_single_2", "vt"] and args.length == [2048, 8192]
    for extra in (["--tasks", "vt"], ["--length", "2048"]):
        with pytest.raises(SystemExit):
            ruler.parse_args(base + ["--cells", "vt@2048"] + extra)
    with pytest.raises(SystemExit):
        ruler.parse_args(base + ["--cells", "vt@two"])


def test_a_sample_served_after_an_unsupported_record_supersedes_it(tmp_path):
    """A server that failed to start (e.g. killed while starting) and a later one that served the
    same system: its samples say it runs; only a same-fingerprint sample clears the record."""
    from mosaickv_sglang.eval.runner import ResultStore

    path = tmp_path / "r.jsonl"
    store = ResultStore(path)
    store.add({"kind": "unsupported", "system": "lo", "system_fp": "a", "reason": "exited"})
    store.add({"kind": "sample", "system": "lo", "system_fp": "b", "task": "vt", "length": 2048,
               "index": 0})
    assert store.system_record("lo", "a")["kind"] == "unsupported"  # another config's sample
    store.add({"kind": "sample", "system": "lo", "system_fp": "a", "task": "vt", "length": 2048,
               "index": 0})
    assert store.system_record("lo", "a") is None
    assert ResultStore(path).system_record("lo", "a") is None  # the same when loaded


def test_a_server_stopped_early_counts_by_its_last_checkpoint(tmp_path, monkeypatch):
    """A MosaicKV server's stats are checkpointed while it runs; one stopped before its final
    record (a call's time limit) is counted by its last checkpoint, one that finished by its
    final record only."""
    import threading

    from mosaickv_sglang.eval import ruler

    store = ResultStore(tmp_path / "r.jsonl")
    st = {"sealed_tokens": 0, "sealed_bytes_per_token": 25.0, "dense_bytes_per_token": 100.0,
          "sealed_ratio": 4.0}

    def fake_stats(url):
        st["sealed_tokens"] += 1000
        if st["sealed_tokens"] > 3000:
            raise ConnectionError("server gone")
        return dict(st)
    monkeypatch.setattr(ruler, "mosaickv_stats", fake_stats)
    monkeypatch.setattr(ruler, "CHECKPOINT_EVERY_S", 0.01)
    ruler._checkpoints("http://x", store, "mosaickv", "fm", "cut", threading.Event())
    assert store.checkpoints["mosaickv"]["cut"]["mosaickv"]["sealed_tokens"] == 3000  # the last
    # a server that finished: its checkpoint is superseded by its final record
    store.add({"kind": "checkpoint", "system": "mosaickv", "system_fp": "fm", "server": "done",
               "mosaickv": {**st, "sealed_tokens": 500}})
    store.add({"kind": "stats", "system": "mosaickv", "system_fp": "fm", "server": "done",
               "counts": {"run": 3}, "mosaickv": {**st, "sealed_tokens": 1000,
                                                  "sealed_bytes_per_token": 50.0}})
    assert ResultStore(store.path).server_stats("mosaickv", "fm") == [
        ({**st, "sealed_tokens": 1000, "sealed_bytes_per_token": 50.0}, False),
        ({**st, "sealed_tokens": 3000}, True)]
    s = report.summarize(_prompts({"niah_single_1": "good"}), [SYSTEMS["mosaickv"]], store,
                         {"mosaickv": "fm"})
    entry = s["systems"]["mosaickv"]
    assert entry["ratio"] == pytest.approx(100 * 4000 / (1000 * 50 + 3000 * 25))
    assert entry["ratio_source"].endswith("2 servers that ran it; 1 stopped early: their last "
                                          "stats checkpoint)")


def test_fingerprint_follows_the_resolved_config(monkeypatch):
    """A changed default (same server arguments, another config) must not resume old samples;
    SGLang's own systems keep their fingerprint (the dense/FP8 seed rows still resume)."""
    from mosaickv_sglang.config import MosaicConfig
    from mosaickv_sglang.eval import systems as systems_mod
    from mosaickv_sglang.eval.ruler import system_fingerprint

    default = SYSTEMS["mosaickv"]
    before = system_fingerprint(default, ["--x"], [], "model")
    monkeypatch.setattr(systems_mod.System, "mosaic_config",
                        lambda self: MosaicConfig.from_dict({"read_rule": "chunk",
                                                             "basis_fit": "group"}))
    assert system_fingerprint(default, ["--x"], [], "model") != before
    dense = SYSTEMS["dense"]
    assert system_fingerprint(dense, ["--x"], ["--a"], "model") == \
        fingerprint([dense.server_args(), ["--x"], "model", ["--a"]])
