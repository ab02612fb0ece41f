"""The library as it was at a git revision, importable beside today's: old code timed in one run.

``jaxcomm_at(rev)`` extracts ``jaxcomm/`` at ``rev`` (``git archive``) into a
temporary directory as the package ``jaxcomm_<rev>`` (its imports of
``jaxcomm`` renamed to it) and imports it, so that a benchmark can time
today's transform and the old one in the same process, in interleaved
rounds: ``jaxcomm_at("1d3d5b8").threshold(0.001, axis_name="data")``.
``None`` where the repository's history is not at hand (no git, or a copy
without ``.git``).
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def jaxcomm_at(rev: str) -> ModuleType | None:
    """The ``jaxcomm`` package at git revision ``rev``, imported as ``jaxcomm_<rev>``."""
    if not re.fullmatch(r"[0-9A-Za-z._/-]+", rev):
        raise ValueError(f"rev: expected a git revision name, got {rev!r}")
    try:
        tar = subprocess.run(
            ["git", "-C", ROOT, "archive", "--format=tar", rev, "jaxcomm"],
            capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    name = "jaxcomm_" + re.sub(r"\W", "_", rev)
    where = tempfile.mkdtemp(prefix="revision_")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(where, filter="data")
    os.rename(os.path.join(where, "jaxcomm"), os.path.join(where, name))
    for folder, _, files in os.walk(os.path.join(where, name)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path) as fh:
                    text = fh.read()
                with open(path, "w") as fh:
                    fh.write(re.sub(r"\bjaxcomm\b", name, text))
    sys.path.insert(0, where)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(where)
