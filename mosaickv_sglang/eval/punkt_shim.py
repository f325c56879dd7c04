"""An offline stand-in for NLTK's punkt sentence splitter, and a way to run a RULER generator under it.

RULER's essay haystacks call ``nltk.tokenize.sent_tokenize`` only to choose where needles go
(the sentences are joined back with single spaces, and the text is whitespace-normalised
before), so a splitter that cuts after ``.``/``!``/``?`` before a capital or digit places needles
on sentence boundaries as punkt would, up to abbreviations. punkt's data cannot be downloaded
here; nltk itself is never imported.

    python -m mosaickv_sglang.eval.punkt_shim SCRIPT [ARGS...]   # run SCRIPT as __main__
"""
from __future__ import annotations

import re
import runpy
import sys
import types
from pathlib import Path

# a sentence ends at . ! ? (optionally closed by quotes/brackets) followed by whitespace and a
# new sentence starting with a capital, a digit or an opening quote/bracket
_END = re.compile(r"[.!?][\"')\]]*(?=\s+[\"'(\[]?[A-Z0-9])")
# titles, single initials ("J.") and dotted acronyms ("U.S.", "e.g.") do not end a sentence
_ABBREVIATION = re.compile(r"(?:^|[\s(\"'])(?:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|vs|etc|Inc|Co|Ltd|No|"
                           r"[A-Z]|(?:[A-Za-z]\.)+[A-Za-z])\.$")


def sent_tokenize(text: str, language: str = "english") -> list[str]:
    """Split `text` into sentences (nltk.tokenize.sent_tokenize's signature)."""
    if language != "english":
        raise ValueError(f"punkt_shim: only 'english' is supported, got {language!r}")
    sentences, start = [], 0
    for m in _END.finditer(text):
        if _ABBREVIATION.search(text[max(start, m.start() - 12):m.start() + 1]):
            continue
        sentences.append(text[start:m.end()].strip())
        start = m.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


def install() -> None:
    """Make ``import nltk`` / ``from nltk.tokenize import sent_tokenize`` resolve to this module."""
    nltk = types.ModuleType("nltk")
    tokenize = types.ModuleType("nltk.tokenize")
    tokenize.sent_tokenize = sent_tokenize
    nltk.tokenize = tokenize
    nltk.sent_tokenize = sent_tokenize
    sys.modules["nltk"] = nltk
    sys.modules["nltk.tokenize"] = tokenize


def run_script(script: str, args: list[str]) -> None:
    """Run `script` as ``python script args`` would, with the shim installed."""
    install()
    path = Path(script).resolve()
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m mosaickv_sglang.eval.punkt_shim SCRIPT [ARGS...]")
    run_script(sys.argv[1], sys.argv[2:])
