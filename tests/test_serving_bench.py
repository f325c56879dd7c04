"""benchmarks/serving_bench.py helpers that turn server stats into a point's numbers."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_bench.py"
spec = importlib.util.spec_from_file_location("serving_bench", SCRIPT)
serving_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serving_bench)


def _stats(steps, ms, slowest=(), kind="decode", counted=None):
    return {kind: {"profile": {"sampled_steps": steps, "every": 4, "ms_per_step": ms,
                               "steps": steps * 4 if counted is None else counted,
                               "slowest": list(slowest)}}}


def test_point_profile_is_the_difference_of_running_averages():
    before = _stats(2, {"kernels": 1.0, "host_plan": 3.0})
    after = _stats(6, {"kernels": 2.5, "host_plan": 3.0, "merge": 0.5})  # 4 new steps
    got = serving_bench.point_profile(before, after)
    # kernels: (2.5*6 - 1.0*2) / 4; a phase new in this point counts from 0
    assert got == {"sampled_steps": 4,
                   "ms_per_step": {"kernels": 3.25, "host_plan": 3.0, "merge": 0.75},
                   "slowest": []}


def test_point_profile_keeps_only_the_slowest_steps_inside_the_point():
    old = {"step": 8, "ms": 900.0, "phases": {"seal": 890.0}}  # before the point: left out
    new = {"step": 20, "ms": 400.0, "phases": {"seal": 390.0}}
    before = _stats(2, {"seal": 1.0}, [old], kind="prefill", counted=8)
    after = _stats(5, {"seal": 2.0}, [old, new], kind="prefill", counted=20)
    got = serving_bench.point_profile(before, after, "prefill")
    assert got["sampled_steps"] == 3 and got["slowest"] == [new]
    assert serving_bench.point_profile(before, after, "decode") is None  # no decode profile


def test_point_profile_of_the_forced_steps():
    """`part="forced"`: the decode graph's host-work steps, timed apart from the sampling, with
    the slowest kept by the whole profile's step count."""
    old = {"step": 5, "ms": 30.0, "phases": {"seal": 28.0}}
    new = {"step": 70, "ms": 45.0, "phases": {"seal": 40.0}}
    before = _stats(2, {"kernels": 1.0}, counted=10)
    before["decode"]["profile"]["forced"] = {"sampled_steps": 1, "ms_per_step": {"seal": 28.0},
                                             "slowest": [old], "steps": 10}
    after = _stats(20, {"kernels": 1.0}, counted=80)
    after["decode"]["profile"]["forced"] = {"sampled_steps": 3, "ms_per_step": {"seal": 36.0},
                                            "slowest": [new, old], "steps": 80}
    got = serving_bench.point_profile(before, after, "decode", "forced")
    assert got == {"sampled_steps": 2, "ms_per_step": {"seal": 40.0}, "slowest": [new]}
    # no forced step in the profile (eager mode, or the profile off): none
    assert serving_bench.point_profile(_stats(1, {}), _stats(2, {}), "decode", "forced") is None


def test_point_profile_without_new_sampled_steps_is_none():
    assert serving_bench.point_profile(None, None) is None
    assert serving_bench.point_profile(_stats(3, {"kernels": 1.0}),
                                       _stats(3, {"kernels": 1.0})) is None
    assert serving_bench.point_profile({"decode": None}, _stats(1, {"kernels": 2.0})) == \
        {"sampled_steps": 1, "ms_per_step": {"kernels": 2.0}, "slowest": []}


def test_batches_parse_ints_and_max_and_name_bad_items():
    assert serving_bench.parse_batches("1,8,max") == [1, 8, "max"]
    for bad in ("0", "1,x", "-2", "1,,2"):
        with pytest.raises(SystemExit, match="positive ints or 'max'"):
            serving_bench.parse_batches(bad)


def test_each_dense_system_names_one_attention_backend():
    """`dense_flashinfer` / `fp8_flashinfer` serve the same caches as `dense` / `fp8` with
    FlashInfer's attention whatever --dense-backend says; the plain ones take --dense-backend;
    MosaicKV takes neither (the plugin sets its own)."""
    def backends(system, dense_backend="triton"):
        args = serving_bench.system_args(system, dense_backend)
        return [args[i + 1] for i, a in enumerate(args) if a == "--attention-backend"]

    assert backends("dense") == ["triton"] and backends("fp8", "torch_native") == ["torch_native"]
    assert backends("dense_flashinfer") == backends("fp8_flashinfer", "torch_native") == ["flashinfer"]
    assert backends("mosaickv") == []
    fp8 = serving_bench.system_args("fp8_flashinfer", "triton")
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    with pytest.raises(SystemExit, match="unknown system"):
        serving_bench.system_args("dense_flashinfer2", "triton")


def test_mosaickv_systems_merge_their_config_over_the_given_one():
    import json

    assert serving_bench.system_args("mosaickv", "triton") == ["--kv-backend", "mosaickv"]
    args = serving_bench.system_args("mosaickv_graph", "triton", '{"hot_buffer_fraction": 0.05}')
    assert args[:2] == ["--kv-backend", "mosaickv"] and args[2] == "--mosaickv-config"
    assert json.loads(args[3]) == {"hot_buffer_fraction": 0.05, "decode_cuda_graph": "breakable"}
    plain = serving_bench.system_args("mosaickv", "triton", '{"hot_buffer_fraction": 0.05}')
    assert json.loads(plain[3]) == {"hot_buffer_fraction": 0.05}
    daemon = serving_bench.system_args("mosaickv_daemon", "triton", '{"daemon_workers": 8}')
    assert json.loads(daemon[3]) == {"daemon_workers": 8, "daemon": "process"}


class _FakeGenerate:
    """A /generate that streams SGLang-like cumulative chunks: output id i+1 = (first id + i)."""

    def __init__(self, broken: bool = False):
        import http.server
        import json
        import threading

        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((len(body["input_ids"]),
                                      body["sampling_params"]["max_new_tokens"]))
                self.send_response(200)
                self.end_headers()
                if fake.broken:  # a scheduler that died: the stream ends with no data
                    return
                first, n = body["input_ids"][0], body["sampling_params"]["max_new_tokens"]
                for i in range(1, n + 1):
                    out = {"output_ids": [first + j for j in range(i)],
                           "meta_info": {"completion_tokens": i,
                                         "cached_tokens": len(body["input_ids"]) // 2}}
                    if body.get("return_logprob"):
                        out["meta_info"]["output_token_logprobs"] = [
                            [-0.5 * j, first + j, None] for j in range(i)]
                    self.wfile.write(f"data: {json.dumps(out)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):
                pass

        self.broken = broken
        self.requests = []  # (prompt length, max_new_tokens) per /generate
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_batch_reports_each_requests_greedy_output_digest():
    import hashlib
    import json
    import random

    fake = _FakeGenerate()
    row = serving_bench.run_batch(fake.url, ctx=40, batch=3, n_out=5, seed=7, vocab=1000)
    fake.server.shutdown()
    rng = random.Random(7)
    firsts = [[rng.randrange(100, 1000) for _ in range(35)][0] for _ in range(3)]
    want = [hashlib.sha1(json.dumps([f + j for j in range(5)]).encode()).hexdigest()[:16]
            for f in firsts]
    assert row["output_sha1"] == want and row["tokens"] == [5, 5, 5]


def test_itl_p99_all_decoding_leaves_out_the_waits_while_later_prompts_prefill():
    # request A decodes from 1 s, then waits ~4 s while B's prompt prefills; B's first token
    # comes at 5 s: from then on both decode at 10 ms a token
    recs = [{"start": 100.0, "stamps": [1.0, 1.01, 5.0, 5.01, 5.02]},
            {"start": 100.5, "stamps": [4.5, 4.51, 4.52, 4.53]}]
    got = serving_bench.latency_stats(recs)
    assert got["ttft_s_p50"] == pytest.approx(3.0) and got["ttft_s_max"] == pytest.approx(5.0)
    assert got["itl_ms_p99"] == pytest.approx(3990.0)  # the wait is among all the gaps
    assert got["itl_ms_max"] == pytest.approx(3990.0)
    assert got["itl_ms_p99_all_decoding"] == pytest.approx(10.0)
    # both decode from 5.0 s to A's last token at 5.02 s: 2 tokens each in 0.02 s
    assert serving_bench.latency_stats(recs, min_steady_steps=2)["decode_tok_s"] == \
        pytest.approx(4 / 0.02)
    assert got["decode_tok_s"] is None and "no steady window of 8 steps" in got["decode_note"]


def test_decode_rate_counts_only_tokens_made_while_every_request_decodes():
    # the 32K x 19 shape on the H100 (2026-12-05): A decodes all its tokens at 10 ms a step
    # long before B's prompt is in; the old rate (every token after each request's first, over
    # the last first token to the last token) called that 20 tokens in 0.09 s
    a = [1.0 + 0.01 * i for i in range(11)]
    b = [5.0 + 0.01 * i for i in range(11)]
    got = serving_bench.latency_stats([{"start": 0.0, "stamps": a}, {"start": 0.0, "stamps": b}])
    assert got["decode_tok_s"] is None and "0 tokens of the slowest" in got["decode_note"]
    assert got["output_tok_s"] == pytest.approx(22 / 5.1)
    # overlapping: B starts at 1.05 s; both decode from 1.05 to 1.10 s, 2 tokens a 10 ms step
    b = [1.05 + 0.005 * i for i in range(21)]
    got = serving_bench.latency_stats([{"start": 0.0, "stamps": a}, {"start": 0.0, "stamps": b}],
                                      min_steady_steps=5)
    assert got["steady_s"] == pytest.approx(0.05)
    assert got["decode_tok_s"] == pytest.approx((5 + 10) / 0.05)


def _with_and_without(batch: int, n_out: int, **option):
    """One point run with `option` and then plainly, on one fake server: (row, plain, fake)."""
    fake = _FakeGenerate()
    row = serving_bench.run_batch(fake.url, ctx=40, batch=batch, n_out=n_out, seed=7,
                                  vocab=1000, **option)
    plain = serving_bench.run_batch(fake.url, ctx=40, batch=batch, n_out=n_out, seed=7,
                                    vocab=1000)
    fake.server.shutdown()
    return row, plain, fake


def test_prefill_first_prefills_the_batch_then_decodes_the_same_prompts():
    row, plain, fake = _with_and_without(3, 12, prefill_first=True)
    assert sorted(fake.requests[:3]) == [(28, 1)] * 3  # the prompts, one token each
    assert sorted(fake.requests[3:]) == [(28, 12)] * 6  # then with the output length
    assert row["prefill_first"] and "ttft_cached_s_p50" in row and not plain["prefill_first"]
    assert row["output_sha1"] == plain["output_sha1"] and row["tokens"] == [12] * 3
    assert row["cached_tokens"] == [14] * 3  # the fake says half of each 28-token prompt


def test_log_probs_are_kept_on_request_and_compared_while_the_ids_agree():
    row, plain, _ = _with_and_without(2, 4, logprobs=True)
    assert row["output_logprobs"] == [[0.0, -0.5, -1.0, -1.5]] * 2
    assert "output_logprobs" not in plain and "output_ids" not in plain
    other = {"output_ids": [list(row["output_ids"][0]), list(row["output_ids"][1])],
             "output_logprobs": [[0.0, -0.5, -1.0, -1.5], [0.0, -0.5, -1.25, -9.0]]}
    other["output_ids"][1][3] += 1  # request 2 parts at its last token: -9.0 not compared
    diff, tokens = serving_bench.logprob_agreement(row, other)
    assert diff == pytest.approx(0.25) and tokens == 4 + 3


def test_the_warm_up_request_uses_a_prompt_no_point_uses(capsys):
    fake = _FakeGenerate()
    warm = serving_bench.warm_up(fake.url, "mosaickv", 40, vocab=1000)
    point = serving_bench.run_batch(fake.url, ctx=40, batch=1, n_out=16, seed=40 + 1, vocab=1000)
    fake.server.shutdown()
    assert warm["tokens"] == [serving_bench.WARMUP_OUTPUT]
    assert warm["output_sha1"] != point["output_sha1"]  # another prompt (outputs echo its first id)
    assert "[mosaickv] warm-up: 40 tokens in" in capsys.readouterr().out


def test_a_batch_whose_server_streams_nothing_fails_clearly():
    fake = _FakeGenerate(broken=True)
    with pytest.raises(RuntimeError, match="3 of 3 requests at context 40 got no output"):
        serving_bench.run_batch(fake.url, ctx=40, batch=3, n_out=5, seed=7, vocab=1000)
    fake.server.shutdown()


def test_the_table_says_which_systems_gave_identical_greedy_outputs(capsys):
    row = {"context": 8, "batch": 2, "ttft_s_p50": 1.0, "decode_tok_s": 2.0, "itl_ms_p50": 3.0,
           "itl_ms_p99": 4.0, "max_total_num_tokens": 10, "mosaickv": None}
    serving_bench.print_table([{**row, "system": "mosaickv", "output_sha1": ["a", "b"]},
                               {**row, "system": "mosaickv_graph", "output_sha1": ["a", "c"]}])
    assert "mosaickv_graph identical to mosaickv in 1 of 2 requests" in capsys.readouterr().out


def test_itl_max_shows_a_single_stall_that_p99_hides():
    # one request, 300 gaps of 10 ms and one of 4 s in the middle (a compile): p99 stays 10 ms
    stamps = [0.01 * i for i in range(151)]
    stamps += [stamps[-1] + 4.0 + 0.01 * i for i in range(151)]
    got = serving_bench.latency_stats([{"start": 0.0, "stamps": stamps}])
    assert got["itl_ms_p99"] == pytest.approx(10.0)
    assert got["itl_ms_max"] == pytest.approx(4000.0)


def test_tokens_held_is_mosaickv_tokens_that_fit_not_its_slots():
    dense = {"internal_states": [{"memory_usage": {"token_capacity": 855889}}]}
    assert serving_bench.tokens_held(dense) == 855889
    mosaic = {"internal_states": [{"memory_usage": {"token_capacity": 3015936},
                                   "mosaickv": {"capacity": {"slots": 3015936,
                                                             "tokens_that_fit": 2292480}}}]}
    assert serving_bench.tokens_held(mosaic) == 2292480
    capped = {"internal_states": [{"memory_usage": {"token_capacity": 4096},
                                   "mosaickv": {"capacity": {"slots": 4096,
                                                             "tokens_that_fit": 7040}}}]}
    assert serving_bench.tokens_held(capped) == 4096  # the slots bind (--max-total-tokens)
    assert serving_bench.tokens_held({"max_total_num_tokens": 7}) == 7


def test_prefix_misses_counts_requests_that_prefilled_again():
    # 872-token prompts: 871 and 768 (whole pages of it) are hits, 0 a miss, None unknown
    assert serving_bench.prefix_misses({"cached_tokens": [871, 0, 768, None]}, 872) == 1
    assert serving_bench.prefix_misses({"cached_tokens": [0, 0, 768]}, 872) == 2  # the CPU run
    assert serving_bench.prefix_misses({}, 872) == 0


def test_largest_batch_keeps_a_margin_of_an_estimated_capacity_only():
    mosaic = {"internal_states": [{"memory_usage": {"token_capacity": 872320},
                                   "mosaickv": {"capacity": {"slots": 872320,
                                                             "tokens_that_fit": 653184}}}]}
    capped = {"internal_states": [{"memory_usage": {"token_capacity": 4096},
                                   "mosaickv": {"capacity": {"slots": 4096,
                                                             "tokens_that_fit": 7040}}}]}
    dense = {"internal_states": [{"memory_usage": {"token_capacity": 240668}}]}
    assert serving_bench.capacity_estimated(mosaic)
    assert not serving_bench.capacity_estimated(capped)  # the slots bind: counted, not estimated
    assert not serving_bench.capacity_estimated(dense)
    # a batch's prompts live in the arena between the phases: the hot buffer is not counted
    cpu = {"internal_states": [{"memory_usage": {"token_capacity": 8192},
                                "mosaickv": {"capacity": {"slots": 8192, "hot_buffer_tokens": 8192,
                                                          "tokens_that_fit": 13824}}}]}
    assert serving_bench.tokens_held(cpu) == 8192  # what the capacity column reports
    assert serving_bench.batch_tokens(cpu) == 13824 - 8192 and serving_bench.capacity_estimated(cpu)
    assert serving_bench.batch_tokens(dense) == 240668
    assert serving_bench.batch_tokens(mosaic) == 653184  # no hot_buffer_tokens given
    # the H100 case: 653,184 estimated after one 32K prompt sized 19 (605,184 held after them)
    assert serving_bench.largest_batch(653184, 32768, 128, estimated=False) == 19
    assert serving_bench.largest_batch(653184, 32768, 128, estimated=True) == 17
    assert 17 * (32768 + 128 + serving_bench.PAGE_MARGIN) <= 605184
    assert serving_bench.largest_batch(240668, 32768, 128, estimated=False) == 7
    assert serving_bench.largest_batch(None, 32768, 128, estimated=True) is None
    assert serving_bench.largest_batch(653184, 32768, 128, True, margin=0.0) == 19


def test_a_larger_batch_the_estimate_holds_after_the_largest_ran_is_tried_and_kept_if_it_fit():
    """The H100 case (2026-12-06): 17 sized at 32K on the estimate less 10%, 621,824 tokens held
    after it; 18 holds them less 2%: measured, and the largest batch only if none of its prompts
    was evicted (prefilled again)."""
    def row(batch, misses=0):
        return {"context": 32768, "output": 16, "batch": batch, "prefix_misses": misses,
                "is_largest_batch": True}

    asked = []

    def measure(misses):
        def run(b):
            asked.append(b)
            return {**row(b, misses), "is_largest_batch": None}
        return run

    first = row(17)
    grown = serving_bench.grow_largest("u", "mosaickv", first, 0.02, measure(0),
                                       capacity=(621824, True))
    assert asked == [18] and grown["batch"] == 18 and grown["grown_from"] == 17
    assert grown["is_largest_batch"] and not first["is_largest_batch"]
    # the larger batch lost prompts: it is reported, the first stays the largest
    first = row(17)
    grown = serving_bench.grow_largest("u", "mosaickv", first, 0.02, measure(3),
                                       capacity=(621824, True))
    assert grown["batch"] == 18 and not grown["is_largest_batch"] and first["is_largest_batch"]
    # nothing larger fits, or the first batch lost prompts itself: nothing measured
    asked.clear()
    assert serving_bench.grow_largest("u", "m", row(17), 0.02, measure(0),
                                      capacity=(600000, True)) is None
    assert serving_bench.grow_largest("u", "m", row(17, misses=1), 0.02, measure(0),
                                      capacity=(900000, True)) is None
    assert asked == []
