"""RULER generation with the package's generators: task specs, the punkt shim, determinism,
caching, and the export file the GPU machine reads."""
import subprocess

import pytest

from mosaickv_sglang.assets.smollm2 import DEFAULT_OUT as SMOLLM2
from mosaickv_sglang.eval import ruler_gen
from mosaickv_sglang.eval.punkt_shim import sent_tokenize
from mosaickv_sglang.eval.ruler_gen import Prompt

needs_model = pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(),
                                 reason="SmolLM2 assets not built: run bash scripts/setup.sh")


def test_task_specs_come_from_the_package():
    gen = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
           "freq_words_extraction": 50, "qa": 32}
    for task in ruler_gen.TASKS:
        spec = ruler_gen.task_spec(task)
        assert spec["script"].is_file()
        assert spec["max_new_tokens"] == gen[spec["family"]]
        template = next(a for a in spec["args"] if a.startswith("--template="))
        assert "{context}" in template  # the generator fills it; the answer prefix ends it
    assert ruler_gen.task_spec("qa_2")["metric"] == "string_match_part"
    assert ruler_gen.task_spec("vt")["args"][-2:] == ["--num_chains=1", "--num_hops=4"]
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
        ruler_gen.task_spec("niah_single_9")


def test_punkt_shim_splits_sentences_and_keeps_the_text():
    text = 'It was Mr. Smith. He said "Stop!" Then 3 dogs ran, e.g. fast. The U.S. Army came. end'
    sents = sent_tokenize(text)
    assert sents == ["It was Mr. Smith.", 'He said "Stop!"', "Then 3 dogs ran, e.g. fast.",
                     "The U.S. Army came. end"]
    assert " ".join(sents) == text  # RULER joins them back with single spaces


@needs_model
def test_generation_is_deterministic_and_cached(tmp_path, monkeypatch):
    outs = []
    for cache in ("a", "b"):
        monkeypatch.setattr(ruler_gen, "CACHE_DIR", tmp_path / cache)
        outs.append(ruler_gen.generate("niah_single_1", 2048, 2, seed=7))
    assert outs[0] == outs[1]
    p = outs[0][0]
    assert p.input.endswith("mentioned in the provided text is") and p.outputs[0] in p.input
    assert p.prompt_tokens + p.max_new_tokens <= 2048 and p.metric == "string_match_all"
    from transformers import AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(SMOLLM2)(p.input)["input_ids"]) == p.prompt_tokens

    def no_subprocess(*a, **k):
        raise AssertionError("cached prompts must not be generated again")
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert ruler_gen.generate("niah_single_1", 2048, 2, seed=7) == outs[1]  # from cache b
    with pytest.raises(AssertionError, match="must not be generated"):
        ruler_gen.generate("niah_single_1", 2048, 2, seed=8)  # another seed is another set


def _prompt(task="vt", length=2048, index=0):
    return Prompt(task, length, index, f"ctx {task} {index} Answer:", ["A"], 30, 5,
                  "string_match_all")


def test_export_roundtrip_and_select(tmp_path):
    prompts = [_prompt(t, n, i) for n in (2048, 4096) for t in ("vt", "qa_1") for i in range(3)]
    path = tmp_path / "p.jsonl.xz"
    assert ruler_gen.export(prompts, path, {"format": ruler_gen.FORMAT, "seed": 1}) > 0
    meta, back = ruler_gen.load(path)
    assert back == prompts and meta["seed"] == 1
    sub = ruler_gen.select(back, ["qa_1"], [4096], 2)
    assert [p.key for p in sub] == ["qa_1/4096/0", "qa_1/4096/1"]
    with pytest.raises(ValueError, match=r"no samples for \['cwe@2048'\]"):
        ruler_gen.select(back, ["cwe"], [2048])
    with pytest.raises(ValueError, match="fewer than 5 samples"):
        ruler_gen.select(back, ["vt"], [2048], 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "vt"}\n')
    with pytest.raises(ValueError, match="not a RULER prompts file"):
        ruler_gen.load(bad)


def test_select_skips_cells_the_file_excludes():
    prompts = [_prompt("vt", 2048, 0), _prompt("qa_2", 4096, 0), _prompt("vt", 4096, 0)]
    got = ruler_gen.select(prompts, ["vt", "qa_2"], None, None, excluded=["qa_2@2048"])
    assert [p.key for p in got] == ["vt/2048/0", "qa_2/4096/0", "vt/4096/0"]  # file order
    with pytest.raises(ValueError, match=r"no samples for \['qa_2@2048'\]"):
        ruler_gen.select(prompts, ["vt", "qa_2"])


def test_select_by_cells_takes_exactly_those_task_lengths():
    prompts = [_prompt(t, n, i) for n in (2048, 4096) for t in ("vt", "qa_1") for i in range(2)]
    got = ruler_gen.select(prompts, samples=1, cells=["qa_1@4096", "vt@2048"])
    assert [p.key for p in got] == ["vt/2048/0", "qa_1/4096/0"]  # file order, only those cells
    with pytest.raises(ValueError, match=r"no samples for \['cwe@2048'\]"):
        ruler_gen.select(prompts, cells=["vt@2048", "cwe@2048"])
    for bad in ("vt", "vt@2k", "nope@2048"):
        with pytest.raises(ValueError, match=f"cell '{bad}'"):
            ruler_gen.select(prompts, cells=[bad])
