"""The goodput bench's workload and the log its replicas write (both sides share them).

The workload is the LM study's (:mod:`experiments.configs.lm_shakespeare`,
variants ``diloco`` and ``streaming``): its GPT, Shakespeare stream, batch,
AdamW and warm-up/cosine schedule, with the bench's overrides (a shorter
schedule, smaller model kwargs for a smoke run). Replica ``i`` of ``n`` trains on
``data.shakespeare(n)``'s stream ``i`` at the windows the harness's worker ``i``
draws (``data.sample_batch`` at its step count: its data position).

Each replica incarnation appends JSON lines to ``RUN/replica_<i>.jsonl``:
``{"event": "ready", "t"}`` once it is built (compiled, manager up), one line per
outer sync (``round``: the manager's step before it, ``rounds``: after it,
``committed``, ``healed``: it loaded a peer's state in this sync, ``participants``,
``steps``: its own inner steps since its last sync line, ``position``: the data
position after the sync, ``sync_s``, ``loss``) and a final line (``final``,
``position``, ``rounds``, ``params``: SHA-256, ``eval_loss``, ``eval_loss_se``).
Every line carries ``incarnation`` and ``t`` (wall time, ``time.time()``).
"""

from __future__ import annotations

import json
import pathlib
import time

import ml_collections

from experiments import data as data_lib
from experiments.configs import lm_shakespeare

METHODS = ("diloco", "streaming")
STREAMING = ("study", "no_overlap")


def config(args) -> ml_collections.ConfigDict:
    """The study's variant ``args.method`` with the bench's overrides applied.

    ``args``: ``method``, ``steps`` (0: the config's 2,000), ``model`` (a JSON object
    of model kwargs over the study's; "" none), ``seq_len``, ``batch_size`` and
    ``test_windows`` (0: the config's), ``seed``.
    """
    if args.method not in METHODS:
        raise ValueError(f"--method: one of {METHODS}, got {args.method!r}")
    c = lm_shakespeare.get_config(args.method)
    c.seed = args.seed
    if args.steps:
        c.num_train_steps = args.steps
    if args.model:
        c.model.kwargs = {**c.model.kwargs, **json.loads(args.model)}
    for key in ("seq_len", "batch_size", "test_windows"):
        if getattr(args, key):
            c.data[key] = getattr(args, key)
    every, fragments = sync_period(c)
    if c.num_train_steps % every:
        raise ValueError(f"--steps: {c.num_train_steps} must be a multiple of H={every}")
    if c.model.kwargs.get("max_len", c.data.seq_len) < c.data.seq_len:
        raise ValueError(f"--seq_len: {c.data.seq_len} > the model's max_len")
    return c


def sync_period(c: ml_collections.ConfigDict) -> tuple[int, int]:
    """``(H, fragments)``: inner steps per round, and the fragments it syncs in turn."""
    return int(c.wrapper.every), int(c.wrapper.get("fragments", 1))


def overlap(c: ml_collections.ConfigDict, streaming: str) -> tuple[int, float]:
    """``(delay, mix)`` of the variant's outer loop: Streaming DiLoCo's at the study's values
    (``delay=1, mix=0.5``), or none with ``streaming="no_overlap"`` (DiLoCo: none)."""
    if streaming not in STREAMING:
        raise ValueError(f"--streaming: one of {STREAMING}, got {streaming!r}")
    if streaming == "no_overlap":
        return 0, 0.0
    delay, (every, fragments) = int(c.wrapper.get("delay", 0)), sync_period(c)
    if delay >= every // fragments:  # torchft's rule: a fragment is synced before it is sent again
        raise ValueError(f"delay: {delay} must be below H / fragments = {every // fragments}")
    return delay, float(c.wrapper.get("mix", 0.0))


def dataset(c: ml_collections.ConfigDict, replicas: int) -> data_lib.Dataset:
    """The study's text dealt into ``replicas`` streams (one a replica), as the harness loads it."""
    return data_lib.load(c.data, replicas, seed=c.seed)


class Log:
    """One replica incarnation's lines in ``run_dir/replica_<i>.jsonl`` (appended).

    The first sync line also writes its time to ``run_dir/joined_<i>_<incarnation>``
    (the launcher kills only replicas that have joined), the final line
    ``run_dir/done_<i>`` (the run is over: nothing is restarted after it).
    """

    def __init__(self, run_dir: str, replica: int, incarnation: int) -> None:
        self.dir, self.replica, self.incarnation = pathlib.Path(run_dir), replica, incarnation
        self._f = open(self.dir / f"replica_{replica}.jsonl", "a")  # noqa: SIM115
        self._joined = False

    def write(self, **line) -> None:
        line = {"incarnation": self.incarnation, "t": time.time(), **line}
        self._f.write(json.dumps(line) + "\n")
        self._f.flush()

    def sync(self, **line) -> None:
        self.write(**line)
        if not self._joined:  # the file holds the time
            path = self.dir / f"joined_{self.replica}_{self.incarnation}"
            path.with_suffix(".tmp").write_text(repr(time.time()))
            path.with_suffix(".tmp").replace(path)
            self._joined = True

    def final(self, **line) -> None:
        self.write(final=True, **line)
        self._f.close()
        (self.dir / f"done_{self.replica}").touch()


def read(run_dir: str, replica: int) -> list[dict]:
    """Replica ``replica``'s lines, every incarnation, in order ([] if it wrote none)."""
    path = pathlib.Path(run_dir) / f"replica_{replica}.jsonl"
    if not path.exists():
        return []
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def write_inner(path: str, times: list[float], steps: int) -> None:
    """A replica's ``--inner_out``: the median of ``times`` (seconds a call of ``steps``)."""
    import statistics

    with open(path, "w") as f:
        json.dump({"step_s": statistics.median(times) / steps, "calls": len(times),
                   "steps": steps}, f)  # fmt: skip
