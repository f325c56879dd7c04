"""`--tp 2` end to end on CPU servers (gloo, the CPU platform's TP defaults): a tiny random Llama
with 4 KV heads (2 per rank), fp32, the lossless config with the daemon on. Greedy ids must equal
the TP=1 server's token for token while pages really go through both ranks' daemons, and both
ranks must log the same swaps (same pages switched at the same adoption step).
"""
import json
import random
import threading
import time

import pytest

from mosaickv_sglang.daemon.swaplog import compare, parse
from server_utils import (LOSSLESS_DAEMON_CONFIG, SMOLLM2, make_tiny_llama, mosaickv_stats,
                          request, running_servers)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

# the chunk read rule: every full prompt page goes through both ranks' daemons (under the
# position rule, the default, only pages of generated tokens do)
CONFIG = {**LOSSLESS_DAEMON_CONFIG, "read_rule": "chunk", "basis_fit": "group"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_kv4"), kv_heads=4)
    logs = tmp_path_factory.mktemp("logs")
    common = ("--dtype", "float32", "--max-total-tokens", "16384", "--kv-backend", "mosaickv",
              "--mosaickv-config", json.dumps(CONFIG))
    with running_servers((model, logs / "tp1.log", *common),
                         (model, logs / "tp2.log", "--tp", "2", *common),
                         startup_s=600) as (tp1, tp2):
        yield tp1, tp2


def _greedy(url: str, ids: list[int], n: int) -> list[int]:
    payload = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                      "ignore_eos": True}}
    status, body = request(f"{url}/generate", payload, timeout=900)
    assert status == 200, body
    out = body["output_ids"]
    assert isinstance(out, list) and len(out) == n, (url, len(ids), body)
    return out


def _concurrent(url: str, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    """The jobs' greedy ids, requested at once. A worker's exception is raised here, in the
    test's thread (a thread's exception would only be a warning, and two failed servers would
    compare [None, ...] == [None, ...])."""
    out: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def go(i):
        try:
            out[i] = _greedy(url, *jobs[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert all(o is not None for o in out), out
    return out


def test_tp2_greedy_ids_equal_tp1_and_ranks_swap_the_same_pages(servers):
    tp1, tp2 = servers
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 700, 150)]
    for ids in prompts:
        assert _greedy(tp2.url, ids, 40) == _greedy(tp1.url, ids, 40)
    # a concurrent batch: adoption points fall between batched decode steps
    jobs = [([rng.randrange(100, 40000) for _ in range(rng.choice((200, 500, 900)))], 60)
            for _ in range(6)]
    assert _concurrent(tp2.url, jobs) == _concurrent(tp1.url, jobs)
    st = mosaickv_stats(tp2.url)["daemon"]  # rank 0's pool
    assert st["adopted_pages"] >= 8 and st["worker_errors"] == st["sync_seals_fallback"] == 0, st
    # each rank logs its swap line after the agreed adoption point: read until the ranks' logs
    # are equally long (a rank a line behind is still writing) or differ in content
    deadline = time.time() + 30
    while True:
        text = tp2.log.read_text()
        ok, report = compare(text)
        if ok or "differs" in report or time.time() > deadline:
            break
        time.sleep(0.5)
    assert ok, report
    # the log is read after the stats: it may hold later adoption points, never fewer
    assert sum(n for _, n, _, _ in parse(text)[0]) >= st["swaps"]["pages"] >= st["adopted_pages"]
