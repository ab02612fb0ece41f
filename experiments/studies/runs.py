"""One launched training run of a study: the command, its wall time, its metrics rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any


def launched(argv: list[str], workdir: str, keep: Sequence[str]) -> dict:
    """Run ``argv`` (an ``experiments.launch`` command training into ``workdir``).

    Returns ``{"command", "process_wall_s", "curve"}``: the command as a user
    would type it, the seconds the whole command took, and the ``keep`` keys
    of every row of ``workdir/metrics.jsonl``. Raises with the output's tail if
    the command fails.
    """
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {
        "command": " ".join("python" if a == sys.executable else a for a in argv),
        "process_wall_s": round(time.perf_counter() - t0, 2),
        "curve": [{k: r[k] for k in keep} for r in rows],
    }


def json_ready(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, infinity) as ``None``: strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def save_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` as indented JSON, atomically (a study saves after every run)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)
