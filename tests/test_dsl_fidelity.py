"""DSL fidelity questions and their scoring (the server part runs in test_ruler_e2e.py)."""
import pytest

from mosaickv_sglang.eval import dsl_fidelity
from mosaickv_sglang.eval.ruler_gen import Prompt


def _multikey(index, values, answer):
    needles = " ".join(f"One of the special magic numbers for key-{i} is: {v}." for i, v in
                       enumerate(values))
    return Prompt("niah_multikey_1", 2048, index, f"Text. {needles} More. The number is",
                  [answer], 128, 50, "string_match_all")


def test_questions_take_the_needle_values_as_options():
    prompts = [_multikey(0, ["111", "222", "333", "444"], "333"),
               Prompt("vt", 2048, 0, "x", ["y"], 30, 1, "string_match_all"),
               _multikey(1, ["555", "666", "777", "888"], "555")]
    qs = dsl_fidelity.questions_from(prompts, 2)
    assert [q.options for q in qs] == [["111", "222", "333", "444"], ["555", "666", "777", "888"]]
    assert [q.answer for q in qs] == ["333", "555"]
    with pytest.raises(ValueError, match="3 DSL questions need 3"):
        dsl_fidelity.questions_from(prompts, 3)
    with pytest.raises(ValueError, match="needles holding the answer"):
        dsl_fidelity.questions_from([_multikey(0, ["1", "2"], "9")], 1)


def test_accuracy_and_agreement():
    qs = dsl_fidelity.questions_from([_multikey(i, ["1", "2", "3", "4"], "2") for i in range(4)], 4)
    answers = {"dense": {"select": ["2", "2", "1", "2"], "fork": ["2", "2", "2", "2"]},
               "mosaickv": {"select": ["2", "3", "1", "2"], "fork": ["2", "2", "2", "1"]}}
    s = dsl_fidelity.summarize(qs, answers)
    assert s["systems"]["dense"]["select"] == {"accuracy": 75.0, "agreement_with_dense": 100.0}
    assert s["systems"]["mosaickv"]["select"] == {"accuracy": 50.0, "agreement_with_dense": 75.0}
    assert s["systems"]["mosaickv"]["fork"] == {"accuracy": 75.0, "agreement_with_dense": 75.0}
    assert "| mosaickv | 50 | 75 | 75 | 75 |" in dsl_fidelity.markdown(s)
