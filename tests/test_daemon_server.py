"""`daemon: process` end to end on CPU servers (tiny random Llama, fp32, lossless config, so every
output must equal SGLang's default KV cache token for token, whenever the swaps happen; the two
attention paths sum in another order, so a step whose best two tokens are within float noise
(`server_utils.TIE_NAT`) may go either way: `same_greedy_or_tied`):

* greedy ids equal `--kv-backend default` while pages really go through the daemon;
* a stress run (concurrent requests, mixed lengths, shared prefixes, aborts) finishes without
  errors, outputs equal, byte accounting consistent, and no hot page leaked after a flush;
* SIGKILL of the worker in the middle of a run: restarted, nothing lost, outputs equal.
"""
import json
import os
import random
import signal
import threading
import time
import urllib.error

import psutil
import pytest

from server_utils import (LOSSLESS_DAEMON_CONFIG, SMOLLM2, flush_cache, make_tiny_llama,
                          mosaickv_stats, request, running_servers,
                          same_greedy_or_tied)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

# the chunk read rule (the default before 2026-12-07): every full prompt page goes through the
# daemon; under the position rule (the default now) prompt pages before the read rule's window
# are sealed inline and only the window's and generated tokens' pages go to the workers
# (tests/test_traffic_independence.py,
# tests/test_soak_cpu.py, tests/test_daemon_position.py)
CONFIG = {**LOSSLESS_DAEMON_CONFIG, "read_rule": "chunk", "basis_fit": "group"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    logs = tmp_path_factory.mktemp("logs")
    common = ("--dtype", "float32", "--max-total-tokens", "16384", "--page-size", "128")
    with running_servers((model, logs / "default.log", "--kv-backend", "default", *common),
                         (model, logs / "daemon.log", "--kv-backend", "mosaickv",
                          "--mosaickv-config", json.dumps(CONFIG), *common)) as (dense, mosaic):
        yield dense, mosaic


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _greedy(url: str, ids: list[int], n: int):
    payload = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    status, body = request(f"{url}/generate", payload, timeout=900)
    assert status == 200, body
    return body


def _run_all(url: str, jobs: list[tuple[list[int], int]], during=None) -> list:
    """Send every job concurrently; call `during` once they are sent. Returns the answers."""
    out, errors = [None] * len(jobs), []

    def go(i):
        try:
            out[i] = _greedy(url, jobs[i][0], jobs[i][1])
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(f"request {i}: {exc!r}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


def _worker_pids(server) -> list[int]:
    return [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "mosaickv_sglang.daemon.worker" in " ".join(p.cmdline())]


def test_lossless_daemon_matches_default_greedy_ids(pair):
    dense, mosaic = pair
    assert len(_worker_pids(mosaic)) == 1  # one worker process under the scheduler
    rng = random.Random(0)
    for n_prompt in (300, 700, 150):
        ids = _prompt(rng, n_prompt)
        same_greedy_or_tied(_greedy(dense.url, ids, 40), _greedy(mosaic.url, ids, 40))
    # the last request's last page may still be with the worker when it finishes; results are
    # adopted at step boundaries, which an idle server runs when a request (these stats) wakes it
    deadline = time.time() + 60
    while (st := mosaickv_stats(mosaic.url)["daemon"])["adopted_pages"] < 8 and \
            time.time() < deadline:
        time.sleep(0.5)
    assert st["adopted_pages"] >= 8 and st["worker_errors"] == 0, st


def test_stress_concurrent_mixed_shared_aborted_then_accounting(pair):
    dense, mosaic = pair
    rng = random.Random(1)
    prefix = _prompt(rng, 512)
    jobs = []
    for i in range(16):
        body = _prompt(rng, rng.choice((40, 200, 500, 900)))
        jobs.append(((prefix + body) if i % 3 == 0 else body, rng.choice((8, 40, 130))))
    want = [_greedy(dense.url, ids, n) for ids, n in jobs]
    # aborts: long requests sent with a rid, aborted while running (their outputs are not compared)
    aborted = [(_prompt(rng, 600), 1200) for _ in range(3)]
    finished = {}  # rid -> finish reason type, of the requests to abort

    def abort_soon():
        time.sleep(2)
        for i in range(3):
            request(f"{mosaic.url}/abort_request", {"rid": f"abort{i}"})

    def aborted_request(i):
        try:
            payload = {"input_ids": aborted[i][0], "rid": f"abort{i}", "sampling_params": {
                "temperature": 0, "max_new_tokens": aborted[i][1], "ignore_eos": True}}
            _, body = request(f"{mosaic.url}/generate", payload, timeout=900)
            finished[i] = ((body.get("meta_info") or {}).get("finish_reason") or {}).get("type")
        except urllib.error.HTTPError:
            finished[i] = "abort"  # an aborted request may answer with an error status

    extra = [threading.Thread(target=aborted_request, args=(i,)) for i in range(3)]
    extra.append(threading.Thread(target=abort_soon))
    for t in extra:
        t.start()
    got = _run_all(mosaic.url, jobs)
    for t in extra:
        t.join()
    for w, g in zip(want, got):
        same_greedy_or_tied(w, g)
    assert "length" not in finished.values(), finished  # each was aborted, not run to the end
    stats = mosaickv_stats(mosaic.url)
    kept = sum(n for kind, n in stats["bytes"].items() if kind != "hot_buffer_capacity")
    assert stats["arena_bytes"] == kept  # running total == re-summed from every kept tensor
    st = stats["daemon"]
    assert st["worker_errors"] == st["sync_seals_fallback"] == 0, st
    flush_cache(mosaic.url)
    emptied = mosaickv_stats(mosaic.url)
    assert emptied["sealed_pages"] == 0 and emptied["arena_bytes"] == 0
    assert emptied["hot_tokens_in_use"] == 0, emptied  # no hot page leaked
    assert emptied["daemon"]["queued_pages"] == emptied["daemon"]["ready_pages"] == 0


def test_killing_the_worker_mid_run_loses_nothing(pair):
    dense, mosaic = pair
    rng = random.Random(2)
    jobs = [(_prompt(rng, rng.choice((300, 600, 1000))), 200) for _ in range(8)]
    want = [_greedy(dense.url, ids, n) for ids, n in jobs]
    before = mosaickv_stats(mosaic.url)["daemon"]
    (pid,) = _worker_pids(mosaic)
    killed = {}

    def kill_with_pages_inflight():  # the worker holds jobs and the requests are running
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = mosaickv_stats(mosaic.url)["daemon"]
            if st["inflight_pages"] > 0:
                os.kill(pid, signal.SIGKILL)
                killed["inflight"] = st["inflight_pages"]
                return
            time.sleep(0.05)

    got = _run_all(mosaic.url, jobs, during=kill_with_pages_inflight)
    assert killed, "the worker never held a page while the requests ran"
    for w, g in zip(want, got):
        same_greedy_or_tied(w, g)
    after = mosaickv_stats(mosaic.url)["daemon"]
    assert after["restarts"] == before["restarts"] + 1, (killed, after)
    (new_pid,) = _worker_pids(mosaic)
    assert new_pid != pid
    # the new worker serves: its pages are adopted. Under a loaded suite the run above can end
    # before its first result is adopted (seen once), so up to three more requests, each of
    # which must also match dense
    for _ in range(3):
        if after["adopted_pages"] > before["adopted_pages"]:
            break
        ids = _prompt(rng, 700)
        same_greedy_or_tied(_greedy(dense.url, ids, 40), _greedy(mosaic.url, ids, 40))
        after = mosaickv_stats(mosaic.url)["daemon"]
    assert after["adopted_pages"] > before["adopted_pages"], (before, after)
