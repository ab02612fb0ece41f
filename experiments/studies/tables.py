r"""README tables generated from results JSON, and the check that they still match.

A generated block in ``README.md`` sits between two markers naming its source:

    <!-- generated: lm_study -->
    ... (written by this module; do not edit by hand) ...
    <!-- /generated: lm_study -->

Each study's tables are also written as markdown beside its JSON
(:data:`DOCUMENTS`, e.g. ``experiments/results/lm_study.md``), generated the same way.

Commands:
  python -m experiments.studies.tables            # rewrite every block and study file
  python -m experiments.studies.tables --check    # exit 1 naming each one that differs

``tests/test_tables.py`` runs the check, so a table edited by hand (or a JSON
re-measured without regenerating) fails the suite.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable

from experiments.bench import (
    accelerator,
    auto_report,
    buckets,
    floor,
    overlap,
    step_parts_report,
)
from experiments.studies import netstudy, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "experiments", "results")
README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- /generated: \2 -->)", re.S)


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _lm_study() -> str:
    return report.lm_markdown(_load("lm_study.json"), step_times=False)


def _netstudy() -> str:
    return netstudy.report(_load("netstudy.json"), None)


def _overlap() -> str:
    return overlap.report(_load("overlap.json"))


def _buckets() -> str:
    return buckets.report(_load("buckets.json"))


def _floor() -> str:
    return floor.report(_load("floor.json"))


def _accelerator() -> str:
    return accelerator.report(_load("accelerator.json"))


def _auto() -> str:
    return auto_report.report(_load("auto.json"))


def _step_parts() -> str:
    return step_parts_report.report(_load("step_parts.json"))


RENDERERS: dict[str, Callable[[], str]] = {
    "accelerator": _accelerator,
    "auto": _auto,
    "buckets": _buckets,
    "floor": _floor,
    "lm_study": _lm_study,
    "netstudy": _netstudy,
    "overlap": _overlap,
    "step_parts": _step_parts,
}
# Each study's tables also live as markdown beside its JSON: (file, source JSON, title).
DOCUMENTS = {
    "accelerator": (
        "accelerator.md",
        "accelerator.json",
        "On a GPU: every transform against the CPU, and the codecs' cost",
    ),
    "auto": ("auto.md", "auto.json", "jaxcomm.auto on shaped links (2 processes)"),
    "buckets": ("buckets.md", "buckets.json", "Bucketed against per-leaf exchange (2 processes)"),
    "floor": ("floor.md", "floor.json", "Sparsifiers at the floor (fake CPU devices, two layouts)"),
    "lm_study": ("lm_study.md", "lm_study.json", "A GPT-style LM on shaped links"),
    "netstudy": ("netstudy.md", "netstudy.json", "Time to accuracy on shaped links (MLPs)"),
    "overlap": ("overlap.md", "overlap.json", "Streaming DiLoCo: the exchange beside the steps"),
    "step_parts": (
        "step_parts.md",
        "step_parts.json",
        "Where a small step goes (2 processes)",
    ),
}


def render(name: str) -> str:
    if name not in RENDERERS:
        raise KeyError(f"generated block {name!r}: no renderer; known: {sorted(RENDERERS)}")
    return RENDERERS[name]().rstrip("\n") + "\n"


def _lm_study_full() -> str:
    return report.lm_markdown(_load("lm_study.json"))


# A study file that holds more than its README block (which points to it).
FULL: dict[str, Callable[[], str]] = {"lm_study": _lm_study_full}


def document(name: str) -> str:
    """The full markdown file of study ``name``: a header, the JSON's note, the tables."""
    _, source, title = DOCUMENTS[name]
    note = _load(source).get("note", "")
    head = (
        f"# {title}\n\nGenerated from `{source}` by `python -m experiments.studies.tables`; "
        "do not edit.\n\n"
    )
    body = FULL[name]().rstrip("\n") + "\n" if name in FULL else render(name)
    return head + (note.strip() + "\n\n" if note else "") + body


def stale_documents() -> list[str]:
    """Names of the study markdown files that are missing or differ from a fresh render."""
    bad = []
    for name, (fname, _, _) in DOCUMENTS.items():
        path = os.path.join(RESULTS, fname)
        if not os.path.exists(path):
            bad.append(name)
            continue
        with open(path) as f:
            if f.read() != document(name):
                bad.append(name)
    return bad


def mismatches(text: str) -> list[str]:
    """Names of the generated blocks in ``text`` whose body differs from a fresh render."""
    return [m.group(2) for m in BLOCK.finditer(text) if m.group(3) != render(m.group(2))]


def regenerate(text: str) -> str:
    """``text`` with every generated block's body rendered afresh."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def main(argv: list[str]) -> int:
    with open(README) as f:
        text = f.read()
    if "--check" in argv:
        bad = [f"README.md block {n!r}" for n in mismatches(text)]
        bad += [f"experiments/results/{DOCUMENTS[n][0]}" for n in stale_documents()]
        for what in bad:
            print(f"{what} differs from its JSON; run python -m experiments.studies.tables")
        return 1 if bad else 0
    new = regenerate(text)
    if new != text:
        with open(README, "w") as f:
            f.write(new)
    for name, (fname, _, _) in DOCUMENTS.items():
        with open(os.path.join(RESULTS, fname), "w") as f:
            f.write(document(name))
    print(f"{len(BLOCK.findall(new))} generated blocks in README.md; {len(DOCUMENTS)} study files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
