"""Measured tables are generated from experiments/results/*.json and still match them."""

import os
import re

import pytest

from experiments.studies import tables


def readme() -> str:
    with open(tables.README) as f:
        return f.read()


def blocks(text):
    return {m.group(2): m for m in tables.BLOCK.finditer(text)}


def edit_one_number(body: str) -> str:
    """``body`` with the first decimal number of its first table row changed in its last digit."""
    row = next(
        line
        for line in body.splitlines()
        if line.startswith("| ") and not line.startswith("| method") and re.search(r"\d\.\d", line)
    )
    num = re.search(r"\d+\.\d+", row)
    edited = num.group()[:-1] + str((int(num.group()[-1]) + 1) % 10)
    return body.replace(row, row[: num.start()] + edited + row[num.end() :], 1)


def test_the_readme_keeps_the_headlines_and_links_every_study_file():
    """The study tables live in experiments/results/*.md; the README has one generated block
    (the headline few) and a link to each study file."""
    text = readme()
    assert set(blocks(text)) == {"headlines"}
    for fname, _, _ in tables.DOCUMENTS.values():
        assert f"](experiments/results/{fname})" in text, fname


def test_every_generated_block_and_study_file_equals_its_json():
    assert tables.mismatches(readme()) == []
    assert tables.stale_documents() == []


def test_editing_one_number_of_the_readme_fails_the_check():
    text = readme()
    m = blocks(text)["headlines"]
    edited = text[: m.start(3)] + edit_one_number(m.group(3)) + text[m.end(3) :]
    assert edited != text
    assert tables.mismatches(edited) == ["headlines"]
    assert tables.mismatches(tables.regenerate(edited)) == []


@pytest.mark.parametrize("name", sorted(tables.DOCUMENTS))
def test_editing_one_number_of_a_study_file_fails_the_check(name, tmp_path, monkeypatch):
    fname = tables.DOCUMENTS[name][0]
    with open(os.path.join(tables.RESULTS, fname)) as f:
        text = f.read()
    # a copy of the results folder with one number of this study's markdown edited
    for other in os.listdir(tables.RESULTS):
        os.symlink(os.path.join(tables.RESULTS, other), tmp_path / other)
    os.remove(tmp_path / fname)
    (tmp_path / fname).write_text(edit_one_number(text))
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    assert tables.stale_documents() == [name]


def test_the_generated_text_does_not_depend_on_the_hash_seed():
    """Sets of method names are iterated in hash order, which changes with PYTHONHASHSEED
    from one process to the next: every table must come out alike (CI's clean clone once
    wrote two floors in the other order)."""
    import subprocess
    import sys

    code = ("from experiments.studies import tables; "
            "print(''.join(r() for _, r in sorted(tables.RENDERERS.items())))")  # fmt: skip
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout  # fmt: skip
        for seed in (1, 2, 3, 4)
    }
    assert len(outs) == 1
