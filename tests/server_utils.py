"""Start/stop a real SGLang server on CPU (MosaicKV CPU platform) for end-to-end tests.

Servers run in their own process group and are always torn down; start-up is 20-70 s on two
cores, so each test module shares its servers.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".assets" / "SmolLM2-135M-Instruct"


def cpu_env() -> dict:
    env = dict(os.environ, MOSAICKV_CPU_PLATFORM="1")
    env.pop("SGLANG_PLUGINS", None)
    return env


def make_tiny_llama(out: Path) -> Path:
    """A 2-layer random Llama with the SmolLM2 tokenizer and peaked logits (no greedy ties)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, tie_word_embeddings=False, initializer_range=0.2)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2 / name, out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, payload: dict | None = None, timeout: float = 120.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read() or b"null")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (launcher, scheduler, detokenizer), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@contextmanager
def running_server(model: Path, log: Path, *args: str, startup_s: float = 300):
    """Yield SimpleNamespace(url, log, proc) for `python -m sglang.launch_server` with args."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=cpu_env(),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if request(f"{url}/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not healthy after {startup_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield SimpleNamespace(url=url, log=log, proc=proc)
    finally:
        stop(proc)


def mosaickv_stats(url: str) -> dict:
    _, info = request(f"{url}/get_server_info")
    return info["internal_states"][0]["mosaickv"]
