"""The notebooks in colab/ execute top to bottom and are committed clean.

Each notebook runs in a fresh IPython kernel of *this* interpreter (a kernelspec
written to a temporary JUPYTER_PATH, so neither a user-level kernel nor the
PATH's python is picked up), with the 8-device XLA_FLAGS of conftest.py in its
environment. A cell that raises fails the test. ``pytest -q`` runs them with
``JAXCOMM_QUICK=1`` (the same cells and assertions at smaller sizes); the
``slow`` tests run them as a user does, in full mode (CI runs both).
"""

from __future__ import annotations

import json
import pathlib
import sys

import nbclient  # the test extra installs these: a missing one fails, never skips
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
KERNEL = "jaxcomm-tests"


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert names[:3] == [
        "01_quickstart.ipynb",
        "02_is_the_network_the_bottleneck.ipynb",
        "03_error_feedback_dgc_powersgd.ipynb",
    ], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs_and_has_a_badge(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count)
    ]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; strip them before committing"
    badge = f"https://colab.research.google.com/github/jaxcomm/jaxcomm/blob/main/colab/{path.name}"
    assert badge in nb.cells[0].source, f"{path.name}: first cell needs the Open in Colab badge"
    first_code = next(c for c in nb.cells if c.cell_type == "code").source
    assert '"google.colab" in sys.modules' in first_code and "pip" in first_code


@pytest.fixture(params=["quick", pytest.param("full", marks=pytest.mark.slow)])
def kernel_env(request, tmp_path, monkeypatch):
    """A kernelspec for this interpreter, found first on JUPYTER_PATH; quick or full mode."""
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    if request.param == "quick":
        monkeypatch.setenv("JAXCOMM_QUICK", "1")
    else:
        monkeypatch.delenv("JAXCOMM_QUICK", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=600,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on failure
    images = sum(
        1
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    )
    assert images >= 1, f"{path.name}: expected inline plots, got none"
