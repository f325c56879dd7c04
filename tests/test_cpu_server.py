"""A real SGLang 0.5.17 HTTP server on CPU through the MosaicKV CPU platform.

One server per module (start-up is 20-45 s on 2 cores), in its own process group, always torn
down. The model is a tiny random Llama written here with the SmolLM2 tokenizer (no model hub);
``--page-size 4`` routes every allocation through the platform's pure-torch paged allocator.
Greedy ids must equal HF transformers fp32 greedy.
"""
import pytest

from server_utils import SMOLLM2, make_tiny_llama, request, running_server

PROMPTS = ["The capital of France is",
           "The capital of France is a city where",  # shares a prefix with the first one
           "Once upon a time, in a small village by the sea, there lived"]

needs_tokenizer = pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(),
                                     reason="SmolLM2 assets not built: run bash scripts/setup.sh")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(tiny_model, log, "--kv-backend", "default", "--dtype", "float32",
                        "--page-size", "4", "--max-total-tokens", "2048") as srv:
        yield srv


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out[p] = (ids, gen[0, len(ids):].tolist())
    return out


@pytest.mark.slow
@needs_tokenizer
def test_greedy_ids_equal_hf_fp32(server, hf_greedy):
    for prompt in PROMPTS + PROMPTS[:1]:  # the repeat is served from the radix cache
        ids, expect = hf_greedy[prompt]
        status, body = request(f"{server.url}/generate", {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
        assert status == 200
        assert body["output_ids"] == expect, prompt
    assert body["meta_info"]["cached_tokens"] > 0


@pytest.mark.slow
@needs_tokenizer
def test_generate_text_and_chat_answer(server):
    status, body = request(f"{server.url}/generate", {
        "text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert status == 200 and body["text"] and body["meta_info"]["completion_tokens"] == 8
    status, body = request(f"{server.url}/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 8, "temperature": 0})
    assert status == 200
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 8


@pytest.mark.slow
@needs_tokenizer
def test_server_ran_on_the_mosaickv_cpu_platform(server):
    # no SGLANG_USE_CPU_ENGINE: only the out-of-tree platform makes SGLang pick these
    log = server.log.read_text()
    for resolved in ("device='cpu'", "attention_backend='torch_native'", "radix_cache_backend=None",
                     "sampling_backend='pytorch'", "page_size=4"):
        assert resolved in log, resolved
    assert "Traceback" not in log


@pytest.mark.slow
@needs_tokenizer
def test_idle_scheduler_sleeps(server):
    """The CPU platform's `sleep_on_idle`: an idle scheduler waits on its sockets instead of
    polling them in a busy loop (without it, ~1 core-second per second per idle server)."""
    import time

    import psutil

    schedulers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if "scheduler" in " ".join(p.cmdline()) or "scheduler" in p.name()]
    assert schedulers, [p.cmdline() for p in psutil.Process(server.proc.pid).children()]
    request(f"{server.url}/health")
    time.sleep(1.5)  # past the request
    before = [sum(p.cpu_times()[:2]) for p in schedulers]
    time.sleep(3)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(schedulers, before)]
    assert max(used) < 0.6, used  # CPU seconds in 3 s of idling
