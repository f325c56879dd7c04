"""`--kv-backend mosaickv` end to end: real SGLang servers on CPU.

* tiny random Llama: a lossless MosaicKV config (dense strategies, no selection, pages sealed as
  soon as they fill) gives the same greedy ids as `--kv-backend default`, while its decode steps
  really read sealed pages (stats);
* SmolLM2-135M-Instruct with the default config: coherent answers through /generate and
  /v1/chat/completions, a frontend DSL program with fork/select, a shared prefix stored once,
  and the physical bytes per sealed token >= 3x below bf16.
"""
import json
import threading
import time

import pytest

from server_utils import (SMOLLM2, flush_cache, make_tiny_llama, mosaickv_stats, request,
                          running_server, running_servers)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")]

LOSSLESS = {"k_candidates": ["dense:val=fp32"], "v_candidates": ["dense:val=fp32"],
            "sink_candidates": [],
            "hot_tokens": 0, "select": {"enabled": False},
            "hot_buffer_fraction": 0.5}  # 4096 slots: the hot buffer must hold a 2048 chunk


def _essay_ids(n_tokens: int, offset: int = 0) -> list[int]:
    from transformers import AutoTokenizer

    from mosaickv_sglang.assets.ruler_data import essay_text

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    words = essay_text().split()[offset:offset + n_tokens]
    return tok(" ".join(words))["input_ids"][:n_tokens]


def _greedy(url: str, ids: list[int], n: int) -> dict:
    status, body = request(f"{url}/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                              "ignore_eos": True}}, timeout=900)
    assert status == 200
    return body


# --------------------------------------------------------------------- lossless, tiny model
@pytest.fixture  # one test uses it: tear both servers down right after (idle CPU schedulers spin)
def tiny_pair(tmp_path_factory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    logs = tmp_path_factory.mktemp("logs")
    common = ("--dtype", "float32", "--max-total-tokens", "4096")
    with running_servers((model, logs / "default.log", "--kv-backend", "default",
                          "--page-size", "128", *common),
                         (model, logs / "mosaickv.log", "--kv-backend", "mosaickv",
                          "--mosaickv-config", json.dumps(LOSSLESS), *common)) as (dense, mosaic):
        yield dense, mosaic


def test_lossless_config_matches_default_greedy_ids(tiny_pair):
    dense, mosaic = tiny_pair
    for n_prompt, offset in ((300, 0), (700, 5000), (150, 9000)):
        ids = _essay_ids(n_prompt, offset)
        want = _greedy(dense.url, ids, 40)["output_ids"]
        got = _greedy(mosaic.url, ids, 40)["output_ids"]
        assert got == want, f"prompt of {len(ids)} tokens: mosaickv diverged from default"
    stats = mosaickv_stats(mosaic.url)
    assert stats["sealed_pages"] >= 8, stats  # decode really read sealed pages
    assert set(stats["counters"]["strategies"]) == {"k:dense:val=fp32", "v:dense:val=fp32"}


# --------------------------------------------------------------------- SmolLM2, default config
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    log = tmp_path_factory.mktemp("smol") / "server.log"
    with running_server(SMOLLM2, log, "--kv-backend", "mosaickv", "--dtype", "float32",
                        "--max-total-tokens", "32768", "--context-length", "8192") as srv:
        yield srv


def test_generate_and_chat_answers_are_coherent(smol):
    from transformers import AutoTokenizer

    from mosaickv_sglang.bench.capture import needle_prompt

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    text, answer = needle_prompt(tok, 1500, 0.4, seed=3)
    status, body = request(f"{smol.url}/generate", {
        "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 12}})
    assert status == 200 and answer in body["text"], body["text"]
    status, body = request(f"{smol.url}/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body
    assert mosaickv_stats(smol.url)["sealed_pages"] > 0


def test_frontend_dsl_fork_and_select(smol):
    import sglang as sgl

    @sgl.function
    def pick_and_explain(s, question, options):
        s += question + "\n"
        forks = s.fork(len(options))
        for f, opt in zip(forks, options):
            f += f"One word about {opt}:" + sgl.gen("word", max_tokens=4, temperature=0)
        s += "The answer is " + sgl.select("answer", choices=options)

    sgl.set_default_backend(sgl.RuntimeEndpoint(smol.url))
    state = pick_and_explain.run(question="Which city is the capital of France?",
                                 options=["Paris", "Berlin", "Madrid"])
    assert state["answer"] in ("Paris", "Berlin", "Madrid")
    assert state["answer"] == "Paris"


def test_shared_prefix_is_compressed_once_and_reused(smol):
    flush_cache(smol.url)
    prefix = _essay_ids(2048, 20000)
    ps = 128
    before = mosaickv_stats(smol.url)
    _greedy(smol.url, prefix + _essay_ids(40, 100), 4)  # first request seals the prefix
    after_first = mosaickv_stats(smol.url)
    results = [None] * 8

    def worker(i):
        results[i] = _greedy(smol.url, prefix + _essay_ids(40, 200 + 1000 * i), 4)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = mosaickv_stats(smol.url)
    assert all(r["meta_info"]["cached_tokens"] >= 2048 - ps for r in results), \
        [r["meta_info"]["cached_tokens"] for r in results]
    prefix_pages = 2048 // ps
    assert after_first["sealed_pages"] - before["sealed_pages"] >= prefix_pages - 1
    # 8 more requests added at most their own suffix pages: the prefix was not compressed again
    assert after["sealed_pages"] - after_first["sealed_pages"] <= 8, (after_first, after)
    assert after["counters"]["sealed_pages"] - after_first["counters"]["sealed_pages"] <= 8


def test_physical_bytes_per_token_at_least_3x_below_bf16(smol):
    flush_cache(smol.url)
    emptied = mosaickv_stats(smol.url)
    assert emptied["sealed_pages"] == 0 and emptied["arena_bytes"] == 0  # packed bytes freed
    t0 = time.time()
    _greedy(smol.url, _essay_ids(6000, 40000), 4)
    print(f"6000-token prefill + 4 decode steps: {time.time() - t0:.0f}s")
    stats = mosaickv_stats(smol.url)
    assert stats["sealed_tokens"] >= 5500
    # the running total the pool keeps equals the bytes re-summed from every kept tensor
    kept = sum(n for kind, n in stats["bytes"].items() if kind != "hot_buffer_capacity")
    assert stats["arena_bytes"] == kept and kept <= stats["arena_budget_bytes"]
    ratio = stats["dense_bytes_per_token"] / stats["sealed_bytes_per_token"]
    assert ratio >= 3.0, stats


def test_config_that_does_not_fit_the_model_fails_at_startup(tmp_path):
    """Default bands need head_dim a multiple of 64; the tiny model has 16: a clear start-up
    error naming the key, before any weight is loaded."""
    import subprocess
    import sys

    from server_utils import server_env

    model = make_tiny_llama(tmp_path / "tiny")
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                           "--kv-backend", "mosaickv"], capture_output=True, text=True,
                          timeout=300, env=server_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "k_candidates" in out and "does not fit this model (head_dim 16)" in out, out[-3000:]
    assert "Load weight begin" not in out


def test_a_hot_buffer_smaller_than_a_prefill_chunk_is_refused_at_start_up(tmp_path):
    """4096 slots x 0.25 = 1024 hot tokens cannot hold a 2048-token chunk: the server must
    stop at start-up naming the key, not crash on the first long prompt."""
    model = make_tiny_llama(tmp_path / "tiny")
    with pytest.raises(RuntimeError, match=r"raise hot_buffer_fraction to >= 0\.500"):
        with running_server(model, tmp_path / "refused.log", "--kv-backend", "mosaickv",
                            "--mosaickv-config", json.dumps({**LOSSLESS,
                                                             "hot_buffer_fraction": 0.25}),
                            "--dtype", "float32", "--max-total-tokens", "4096",
                            "--chunked-prefill-size", "2048"):
            pass
