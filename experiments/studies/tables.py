r"""Study tables generated from results JSON, and the check that they still match.

Each study's tables are written as markdown beside its JSON (:data:`DOCUMENTS`, e.g.
``experiments/results/lm_study.md``). The README keeps only the headline few, in a
generated block that sits between two markers naming its renderer:

    <!-- generated: headlines -->
    ... (written by this module; do not edit by hand) ...
    <!-- /generated: headlines -->

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
    fsdp_report,
    goodput_report,
    overlap,
    step_parts_report,
)
from experiments.studies import lm_peers, lm_progress, netstudy, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "experiments", "results")
README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- /generated: \2 -->)", re.S)


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _fsdp_trajectories() -> str:
    timing = _load("fsdp.json") if os.path.exists(os.path.join(RESULTS, "fsdp.json")) else None
    return fsdp_report.markdown(_load("fsdp_trajectories.json"), timing)


def _lm_study() -> str:
    return report.lm_markdown(_load("lm_study.json"))


def _lm_progress() -> str:
    return lm_progress.report(_load("lm_study_learned.json"))


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


def _goodput() -> str:
    return goodput_report.report(_load("goodput.json"))


def _step_parts() -> str:
    return step_parts_report.report(_load("step_parts.json"))


def _step_parts_lm() -> str:
    return step_parts_report.report(_load("step_parts_lm.json"))


def _link(name: str) -> str:
    fname = DOCUMENTS[name][0]
    return f"[`{fname}`](experiments/results/{fname})"


def _auto_headline() -> list[str]:
    results = _load("auto.json")
    steps = auto_report.rows_step(results)
    rates = [r for r in auto_report.RATES if any(s["rate"] == r for s in steps)]
    lines = [
        f"`jaxcomm.auto` ({_link('auto')}), 2 processes on shaped links: its choice per "
        "model and link, and its step time over dense's (where it keeps dense it runs "
        "dense's program):",
        "",
        "| model | " + " | ".join(rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for model in dict.fromkeys(s["model"] for s in steps):
        by = {s["rate"]: s for s in steps if s["model"] == model}
        cells = [
            "—" if r not in by
            else by[r]["choice"] if by[r]["choice"] == "dense"
            else f"{by[r]['choice']}, {by[r]['auto_vs_dense']:.2f}×"
            for r in rates
        ]  # fmt: skip
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    pred = auto_report.rows_prediction(results)
    within = sum(abs(p["ratio"] - 1) <= 0.2 for p in pred)
    lines += [
        "",
        f"- `experiments.advise`'s predicted step is within 20% of the measured one in "
        f"{within} of {len(pred)} cells (dense's and auto's).",
    ]
    return lines


def _overlap_headline() -> list[str]:
    result = _load("overlap.json")
    o = result["streaming"]["overlap"]
    return [
        f"- Streaming DiLoCo beside its exchange ({_link('overlap')}), 2 processes at "
        f"{result['config']['rate']}: with `loco.Overlap` a step with a fragment in flight "
        f"takes {o['step_ratio']:.2f}× the step with no exchange, and a sync period "
        f"{o['period_ratio']:.2f}× the larger of the steps and the exchange (the bar: 1.15×, "
        f"1.1×): **{'met' if o['overlaps'] else 'not met'}**.",
    ]


def _accelerator_headline() -> list[str]:
    results = _load("accelerator.json")
    agree = results.get("agree", [])
    outcomes = [r.get("outcome") for r in agree]
    other = sorted({o for o in outcomes if o != "passed"})
    rest = "".join(f", {outcomes.count(o)} {o}" for o in other)
    return [
        f"- On one {results['device']} ({_link('accelerator')}): every transform against "
        f"the CPU, {len(agree)} cases, {outcomes.count('passed')} passed{rest}; and each "
        "codec's cost on GPT-2 shapes.",
    ]


def _peers_headline() -> list[str]:
    text = lm_peers.headline(_load("lm_study_learned.json"))
    if text is None:
        return []
    return [f"- Beside PyTorch DDP and torchft on the LM ({_link('lm_study_learned')}): {text}"]


def _headlines() -> str:
    """The README's few headline results, each linking the study file with its tables."""
    return "\n".join(
        _auto_headline() + _overlap_headline() + _peers_headline() + _accelerator_headline()
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "accelerator": _accelerator,
    "auto": _auto,
    "buckets": _buckets,
    "floor": _floor,
    "fsdp_trajectories": _fsdp_trajectories,
    "goodput": _goodput,
    "headlines": _headlines,
    "lm_study": _lm_study,
    "lm_study_learned": _lm_progress,
    "netstudy": _netstudy,
    "overlap": _overlap,
    "step_parts": _step_parts,
    "step_parts_lm": _step_parts_lm,
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
    "fsdp_trajectories": (
        "fsdp_trajectories.md",
        "fsdp_trajectories.json",
        "Sharded training (FSDP) on the LM study: time to target",
    ),
    "goodput": (
        "goodput.md",
        "goodput.json",
        "Goodput under failures: jaxcomm's ElasticDiLoCo beside torchft's DiLoCo",
    ),
    "lm_study": ("lm_study.md", "lm_study.json", "A GPT-style LM on shaped links"),
    "lm_study_learned": (
        "lm_study_learned.md",
        "lm_study_learned.json",
        "The LM study in the learned regime: final losses so far",
    ),
    "netstudy": ("netstudy.md", "netstudy.json", "Time to accuracy on shaped links (MLPs)"),
    "overlap": ("overlap.md", "overlap.json", "Streaming DiLoCo: the exchange beside the steps"),
    "step_parts": (
        "step_parts.md",
        "step_parts.json",
        "Where a small step goes (2 processes)",
    ),
    "step_parts_lm": (
        "step_parts_lm.md",
        "step_parts_lm.json",
        "Where the LM study's step goes (2 processes)",
    ),
}


def render(name: str) -> str:
    if name not in RENDERERS:
        raise KeyError(f"generated block {name!r}: no renderer; known: {sorted(RENDERERS)}")
    return RENDERERS[name]().rstrip("\n") + "\n"


def document(name: str) -> str:
    """The full markdown file of study ``name``: a header, the JSON's note, the tables."""
    _, source, title = DOCUMENTS[name]
    note = _load(source).get("note", "")
    head = (
        f"# {title}\n\nGenerated from `{source}` by `python -m experiments.studies.tables`; "
        "do not edit.\n\n"
    )
    return head + (note.strip() + "\n\n" if note else "") + render(name)


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
