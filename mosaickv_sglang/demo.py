"""Demo: serve SmolLM2-135M-Instruct with ``--kv-backend mosaickv`` and show what it saves.

Starts ``python -m sglang.launch_server --kv-backend mosaickv`` (CPU platform on a CPU machine),
then drives it like a user would: a multi-turn chat over a long document (the turns share the
document prefix, so the radix tree serves it from the compressed pages), and an SGLang frontend
DSL program with ``fork``/``gen``/``select``. Prints the answers and the memory the compressed
cache keeps versus a bf16 cache, from the server's own byte accounting.

    python -m mosaickv_sglang.demo [--model PATH] [--doc-tokens 3000]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from .launch import SMOLLM2, mosaickv_stats, request, running_server


def _chat(url: str, messages: list[dict], max_tokens: int = 48) -> str:
    _, body = request(f"{url}/v1/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    return body["choices"][0]["message"]["content"].strip()


def _document(model: Path, n_tokens: int) -> str:
    from transformers import AutoTokenizer

    from .assets.ruler_data import essay_text

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(" ".join(essay_text().split()[:n_tokens]))["input_ids"][:n_tokens]
    return tok.decode(ids) + ("\n\nNote for the reader: the secret code of this document is "
                              "7341-ALPHA.")


def multi_turn_chat(url: str, document: str) -> None:
    print("\n== multi-turn chat over a long document ==")
    messages = [{"role": "user", "content": document + "\n\nWhat is the secret code of this "
                 "document? Answer with the code only."}]
    for follow_up in ("Repeat the code once more, in capital letters.",
                      "In one sentence, what is the document above about?"):
        answer = _chat(url, messages)
        print(f"user: {messages[-1]['content'][-90:]!r}\nassistant: {answer}\n")
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": follow_up}]
    print(f"user: {messages[-1]['content']!r}\nassistant: {_chat(url, messages)}")


def dsl_program(url: str) -> None:
    import sglang as sgl

    @sgl.function
    def travel(s, city):
        s += f"A short travel guide to {city}.\n"
        forks = s.fork(2)  # two continuations of the same (cached) prefix, in parallel
        for f, topic in zip(forks, ("food", "sights")):
            f += f"One {topic} tip: " + sgl.gen("tip", max_tokens=24, temperature=0, stop="\n")
        # reading the forks' variables waits for them and joins their text into this state
        s += f"Food: {forks[0]['tip']}\nSights: {forks[1]['tip']}\n"
        s += f"{city} is in " + sgl.select("country", choices=["France", "Japan", "Peru"])

    print("\n== frontend DSL program (fork / gen / select) ==")
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    state = travel.run(city="Paris")
    print(state.text().strip())
    print(f"select -> {state['country']}")


def memory_report(url: str) -> dict:
    st = mosaickv_stats(url)
    print("\n== memory ==")
    if not st["sealed_tokens"]:
        print("no sealed pages yet")
        return st
    dense = st["dense_bytes_per_token"]
    kept = st["sealed_bytes_per_token"]
    print(f"sealed tokens: {st['sealed_tokens']} in {st['sealed_pages']} pages "
          f"(prefix pages reused across turns: {st['counters']['reused_pages']})")
    print(f"bytes per token: bf16 cache {dense:.0f} B, MosaicKV {kept:.0f} B "
          f"(values, scales, headers, page metadata and SVD bases all counted) "
          f"-> {dense / kept:.2f}x smaller")
    print(f"by kind: {json.dumps(st['bytes'])}")
    print(f"strategies chosen (per layer and page): {json.dumps(st['counters']['strategies'])}")
    return st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=SMOLLM2)
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--mosaickv-config", default=None, help="JSON or @file (default config if unset)")
    args = ap.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="mosaickv-demo-")) / "server.log"
    extra = ["--mosaickv-config", args.mosaickv_config] if args.mosaickv_config else []
    import torch

    # bf16 on a GPU; fp32 on a CPU, where SGLang's bf16 matmuls are several times slower.
    # Compression ratios are reported against a bf16 cache either way.
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    print(f"[demo] starting SGLang with --kv-backend mosaickv on {args.model} (log: {log})", flush=True)
    t0 = time.time()
    with running_server(args.model, log, "--kv-backend", "mosaickv", "--dtype", dtype,
                        "--context-length", "8192", "--max-total-tokens", "32768", *extra) as srv:
        print(f"[demo] server up in {time.time() - t0:.0f}s", flush=True)
        multi_turn_chat(srv.url, _document(args.model, args.doc_tokens))
        dsl_program(srv.url)
        memory_report(srv.url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
