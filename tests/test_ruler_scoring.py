"""Our RULER metrics equal the package's own (long_context_eval.eval.synthetic.constants), which
the GPU machine does not have; and the postprocessing matches the package's evaluate.py."""
import random
import string

import pytest

from mosaickv_sglang.eval import scoring
from mosaickv_sglang.eval.ruler_gen import package_module


@pytest.fixture(scope="module")
def package_metrics():
    return package_module("long_context_eval.eval.synthetic.constants")


def _random_case(rng: random.Random):
    words = ["".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(1, 6)))
             for _ in range(8)]
    refs = rng.sample(words, rng.randint(1, 4))
    noise = rng.choices(words + [" ", "\n", "\t", "\x01", ".", "Answer:"], k=rng.randint(0, 12))
    pred = " ".join(rng.choice([w, w.upper(), w.lower()]) for w in noise)
    return pred, refs


def test_metrics_match_the_package(package_metrics, seed):
    rng = random.Random(seed)
    cases = [_random_case(rng) for _ in range(400)] + [("  The Number is 7120868.\n", ["7120868"]),
                                                       ("France", ["france", "Paris"]), ("", ["x"])]
    for ours, theirs in ((scoring.string_match_all, package_metrics.string_match_all_per_sample),
                         (scoring.string_match_part, package_metrics.string_match_part_per_sample)):
        for pred, refs in cases:
            want = theirs([scoring.postprocess(pred)], [refs])[0]
            assert ours(pred, refs) == pytest.approx(want), (ours.__name__, pred, refs, seed)
    # the package's task -> metric map is what prompts record
    assert package_metrics.TASKS["qa"]["metric_fn"].__name__ == "string_match_part"
    assert package_metrics.TASKS["niah"]["metric_fn"].__name__ == "string_match_all"


def test_postprocess_like_the_package():
    # evaluate.py: strip, control characters -> newline, strip
    assert scoring.postprocess("  a\x00b\tc \n") == "a\nb\nc"
    assert scoring.postprocess(None) == ""


def test_score_rejects_unknown_metric_and_empty_references():
    with pytest.raises(ValueError, match="unknown RULER metric 'rouge'"):
        scoring.score("rouge", "x", ["x"])
    with pytest.raises(ValueError, match="at least one reference"):
        scoring.score("string_match_all", "x", [])
    assert scoring.score("string_match_all", "7 and 9", ["7", "9", "8"]) == pytest.approx(200 / 3)
    assert scoring.score("string_match_part", "nine", ["9", "Nine"]) == 100.0
