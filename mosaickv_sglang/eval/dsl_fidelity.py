"""Frontend-DSL fidelity: multiple-choice questions over long contexts, answered by SGLang programs.

Questions come from RULER's niah_multikey_1 haystacks (essays with four "special magic number"
needles, one queried): the options are the four needle values found in the text, so every
distractor is in the context too. Two programs answer each question, on every system:

* ``select``: the RULER prompt (ending in the answer prefix) + ``sgl.select`` over the options;
* ``fork``: the same context forked in two (one shared, compressed prefix): one branch generates
  a free answer greedily, the other selects; the program answers the option its free answer
  names, else the selected one.

Reported per system and program: accuracy, and agreement with dense (same answer).
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .ruler_gen import Prompt

TASK = "niah_multikey_1"
_NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
PROGRAMS = ("select", "fork")


@dataclass(frozen=True)
class Question:
    key: str  # Prompt.key of the RULER prompt it is built from
    context: str  # the prompt, ending in the answer prefix
    options: list[str]
    answer: str


def questions_from(prompts: list[Prompt], n: int) -> list[Question]:
    """The first `n` niah_multikey_1 prompts as 4-option questions (options: the needles' values)."""
    out = []
    for p in prompts:
        if p.task != TASK or len(out) == n:
            continue
        values = [v for _, v in _NEEDLE.findall(p.input)]
        if p.outputs[0] not in values or len(set(values)) < 2:
            raise ValueError(f"{p.key}: expected {TASK} needles holding the answer, found {values}")
        out.append(Question(p.key, p.input, sorted(set(values)), p.outputs[0]))
    if len(out) < n:
        raise ValueError(f"{n} DSL questions need {n} {TASK} prompts, got {len(out)}")
    return out


def _programs():
    import sglang as sgl

    @sgl.function
    def select_program(s, context, options):
        s += context + " " + sgl.select("answer", choices=options)

    @sgl.function
    def fork_program(s, context, options):
        s += context
        free, chooser = s.fork(2)
        free += sgl.gen("free", max_tokens=16, temperature=0)
        chooser += " " + sgl.select("answer", choices=options)
        named = [o for o in options if o in free["free"]]
        s.set_var("answer", named[0] if len(named) == 1 else chooser["answer"])

    return {"select": select_program, "fork": fork_program}


def answer_all(url: str, questions: list[Question], concurrency: int = 4) -> dict[str, list[str]]:
    """Each program's answers to every question, from the server at `url`."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(url)
    programs = _programs()

    def one(name, q):
        state = programs[name].run(context=q.context, options=q.options, backend=backend)
        return state["answer"]

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return {name: list(pool.map(lambda q, n=name: one(n, q), questions)) for name in PROGRAMS}


def summarize(questions: list[Question], answers: dict[str, dict[str, list[str]]]) -> dict:
    """Per system and program: accuracy (%) and agreement with dense (%); systems without answers skipped."""
    dense = answers.get("dense")
    out = {"questions": len(questions), "task": TASK, "systems": {}}
    for system, by_program in answers.items():
        entry = {}
        for name in PROGRAMS:
            got = by_program[name]
            entry[name] = {
                "accuracy": 100.0 * sum(a == q.answer for a, q in zip(got, questions)) / len(questions),
                "agreement_with_dense": None if dense is None else
                100.0 * sum(a == b for a, b in zip(got, dense[name])) / len(questions)}
        out["systems"][system] = entry
    return out


def markdown(summary: dict) -> str:
    lines = [f"DSL fidelity: {summary['questions']} four-option questions from {summary['task']}",
             "", "| system | select acc | select agree | fork acc | fork agree |",
             "|---|---|---|---|---|"]
    for system, e in summary["systems"].items():
        cells = []
        for name in PROGRAMS:
            agree = e[name]["agreement_with_dense"]
            cells += [f"{e[name]['accuracy']:.0f}", "-" if agree is None else f"{agree:.0f}"]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
