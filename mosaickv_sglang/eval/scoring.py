"""RULER's metrics, re-implemented so that scoring runs where the package is absent (the GPU box).

Same definitions as ``long_context_eval.eval`` (tests/test_ruler_scoring.py compares them with
the package's own functions on CPU): a prediction is stripped, control characters become
newlines; ``string_match_all`` = the fraction of references found in it (case-insensitive),
``string_match_part`` = 1 if any reference is found. Scores are in points (0-100).
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str | None) -> str:
    if prediction is None:
        return ""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    pred = postprocess(prediction).lower()
    return 100.0 * sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    pred = postprocess(prediction).lower()
    return 100.0 * max(r.lower() in pred for r in references)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str, references: list[str]) -> float:
    """Points (0-100) of one sample; `metric` as the prompt records it."""
    if metric not in METRICS:
        raise ValueError(f"unknown RULER metric {metric!r}; known: {sorted(METRICS)}")
    if not references:
        raise ValueError("a RULER sample needs at least one reference")
    return METRICS[metric](prediction, references)
