"""The candidates, their measured rows and the choice among them: :func:`measure`,
:func:`decide`, :func:`choose`."""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import accounting, calibrate, checks, methods
from jaxcomm.policy.timing import check_statistic, program, settle, summary, time_samples


class Candidate(NamedTuple):
    """A named exchange: ``make(axis_name)`` builds its optax transform (taking gradients)."""

    name: str
    make: Callable[[Any], optax.GradientTransformation]


#: The candidates :func:`choose` measures unless told otherwise; every lossy one
#: keeps error feedback (the accuracy guard). They compress every leaf
#: (``min_size=0``): a small leaf costs few bytes either way, and leaving it
#: dense would add a collective whose latency dominates on a slow link.
def candidate(name: str, method: str, **options: Any) -> Candidate:
    """A candidate named ``name``: method ``method`` of :mod:`jaxcomm.methods` with
    ``options`` (a key from seed 0 where it takes one), built on the axis it is given."""
    return Candidate(name, lambda ax: methods.make(method, **options, axis_name=ax))


DEFAULT_CANDIDATES: tuple[Candidate, ...] = (
    candidate("dense", "allreduce"),
    candidate("bf16", "cast", dtype=jnp.bfloat16, min_size=0),
    candidate("powersgd_r2", "powersgd", rank=2),
    # rank 4: what PowerSGD's paper trained its language model with; on the LM of
    # experiments/results/lm_study.md rank 4 reached dense's target and rank 2 did not (auto's
    # rank-2 choice ended at 2.6251 against 2.6095): with ``max_ratio`` a user who caps the
    # compression still has a low-rank candidate (rank 4 compresses that LM 31x, rank 2 58x)
    candidate("powersgd_r4", "powersgd", rank=4),
    candidate("int8_ef", "int8", error_feedback=True, min_size=0),
    candidate("topk_1pct", "topk", ratio=0.01, min_size=0),
)


class Row(NamedTuple):
    """One candidate as :func:`choose` measured it.

    Attributes:
      name: the candidate's name.
      seconds: measured cost per step (program time minus the baseline's), >= 0.
      wire_bytes: bytes one worker puts on the wire per step (its wire report).
      ratio: dense's wire bytes / this candidate's.
      predicted_s: the alpha-beta prediction of its collectives from a
        calibration (``nan`` without one).
      excluded: why it may not be chosen (``""``: eligible).
      wins: the share of the timed rounds in which its cost was at most
        ``(1 - margin)`` x dense's in the same round (``nan``: not known, the
        costs were given without rounds).
    """

    name: str
    seconds: float
    wire_bytes: int
    ratio: float
    predicted_s: float
    excluded: str
    wins: float = math.nan


class Choice(NamedTuple):
    """What :func:`choose` decided, with every candidate's row and the reason.

    ``rounds``: the per-round costs the decision read (:func:`measure` with
    ``rounds=True``; ``None`` where none were given): with the rows' seconds,
    what a resumed run passes back to :func:`choose` to make the same choice.
    """

    name: str
    rows: tuple[Row, ...]
    n: int
    reason: str
    rounds: dict[str, list[float]] | None = None

    def row(self, name: str) -> Row:
        """The row of candidate ``name``."""
        for r in self.rows:
            if r.name == name:
                return r
        raise ValueError(f"name: no candidate {name!r}; have {[r.name for r in self.rows]}")

    def table(self) -> str:
        """A text table of the candidates (ms per step, MB on the wire) and the choice."""
        lines = [
            f"exchange policy over {self.n} workers: {self.name} ({self.reason})",
            f"{'candidate':<14}{'measured ms':>12}{'predicted ms':>14}{'MB/step':>10}"
            f"{'ratio':>8}{'wins':>6}  note",
        ]
        for r in self.rows:
            mark = "<- chosen" if r.name == self.name else r.excluded
            pred = "-" if math.isnan(r.predicted_s) else f"{r.predicted_s * 1e3:.2f}"
            wins = "-" if math.isnan(r.wins) else f"{r.wins:.0%}"
            lines.append(
                f"{r.name:<14}{r.seconds * 1e3:>12.2f}{pred:>14}{r.wire_bytes / 1e6:>10.3f}"
                f"{r.ratio:>8.1f}{wins:>6}  {mark}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def drifted(self, step_s: float, compute_s: float, tolerance: float = 0.2) -> bool:
        """Whether a measured step time left the prediction by more than ``tolerance``.

        ``step_s``: a measured training step with the chosen exchange;
        ``compute_s``: the same step with no communication. The prediction is
        ``compute_s`` + the chosen candidate's measured cost. True: the link
        or the load changed; call :func:`choose` again with ``refresh=True``.
        """
        predicted = compute_s + self.row(self.name).seconds
        if not predicted > 0:
            raise ValueError(f"compute_s: the predicted step must be > 0, got {predicted}")
        return abs(step_s - predicted) > tolerance * predicted


_CACHE: dict[Any, dict[str, float]] = {}


def clear_cache() -> None:
    """Forget every cached :func:`measure` result of this process."""
    _CACHE.clear()


def check_candidates(candidates) -> tuple[Candidate, ...]:
    cands = tuple(candidates)
    if not cands or not all(isinstance(c, Candidate) for c in cands):
        raise TypeError(
            f"candidates: expected a non-empty sequence of Candidate, got {candidates!r}"
        )
    names = [c.name for c in cands]
    if "dense" not in names:
        raise ValueError(f"candidates: must include one named 'dense' (the reference); got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"candidates: names must be unique, got {names}")
    return cands


#: The share of timed rounds in which a compressed candidate must beat dense by the margin
#: (:func:`wins_over_dense`) to be chosen: its least cost alone can come from one lucky
#: round. On 2 CPU processes over loopback, where each step's exchange costs well under a
#: millisecond, the order of the candidates' least costs changed from run to run.
MIN_WINS = 0.8


def _check_options(margin, max_ratio, repeats, min_wins: float = MIN_WINS) -> None:
    checks.check_float(margin, "margin", low=0, strict=False, high=1, high_strict=True)
    checks.check_float(min_wins, "min_wins", low=0, strict=False, high=1, high_strict=False)
    if max_ratio is not None:
        checks.check_float(max_ratio, "max_ratio", low=1, strict=False)
    checks.check_int(repeats, "repeats", 1)


def decide(rows: Sequence[Row], margin: float, min_wins: float = MIN_WINS) -> tuple[str, str]:
    """The chosen name and why, from measured rows (one named ``"dense"``).

    Among the eligible compressed candidates whose cost is at most
    ``(1 - margin)`` x dense's and that were so in at least ``min_wins`` of the
    rounds (``wins``; ``nan``, not known, passes), the one of least cost: a
    slower candidate that wins steadily beats a faster one that won a few
    lucky rounds. None: dense. Dense's cost 0 is beaten by nothing.
    """
    _check_options(margin, None, 1, min_wins)
    ref = next(r for r in rows if r.name == "dense")
    eligible = [r for r in rows if not r.excluded and r.name != "dense"]
    if not eligible:
        return "dense", "no compressed candidate is eligible"
    fast = [r for r in eligible if ref.seconds > 0 and r.seconds <= (1 - margin) * ref.seconds]
    sure = [r for r in fast if math.isnan(r.wins) or r.wins >= min_wins]
    if not fast:
        best = min(eligible, key=lambda r: r.seconds)
        return "dense", (
            f"the fastest compressed candidate, {best.name}, is not {margin:.0%} faster than dense"
        )
    if not sure:
        best = min(fast, key=lambda r: r.seconds)
        return "dense", (
            f"the fastest compressed candidate, {best.name}, was {margin:.0%} faster than dense "
            f"in {best.wins:.0%} of the rounds, fewer than {min_wins:.0%}: within the noise"
        )
    best = min(sure, key=lambda r: r.seconds)
    gain = ref.seconds / max(best.seconds, 1e-9)
    return best.name, f"{gain:.1f}x less exchange time than dense"


def measure(
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
    repeats: int = 5,
    drop: bool = True,
    refresh: bool = False,
    statistic: str = "min",
    rounds: bool = False,
) -> dict[str, Any]:
    """Seconds each candidate's exchange adds to a step, measured on ``mesh`` (cached).

    One compiled ``shard_map`` program per candidate draws a per-worker
    gradient shaped like ``params`` and runs the candidate's ``update`` on
    the state the previous call returned (after :data:`WARM_STEPS` untimed
    steps from ``init``: a step in training's steady state); a baseline
    program only draws it. ``repeats`` rounds time every program once each,
    in a fresh order each round (:func:`time_samples`); a candidate's cost is
    its minimum (``statistic="median"``: its median, for predictions of
    training's median step) minus the baseline's (floored at 0), at the
    slowest process (``drop=False`` keeps timing every candidate to the end,
    for predictions of all of them rather than a choice). **Every process
    must call it** with the same arguments. The samples are cached: a call
    that differs only in ``statistic`` or ``rounds`` reads them again.

    Returns:
      ``{candidate name: seconds}``; with ``rounds=True``, ``{candidate name:
      [its cost in each round]}`` (its sample minus the baseline's sample of
      the same round, floored at 0; ``nan`` where it was no longer timed):
      what :func:`choose` compares round by round.
    """
    cands = check_candidates(candidates)
    checks.check_int(repeats, "repeats", 1)
    check_statistic(statistic)
    calibrate.axis_size(mesh, axis_name)
    shapes = _shapes(params)
    key = (
        tuple(int(d.id) for d in mesh.devices.flat), axis_name, str(jax.tree.structure(shapes)),
        tuple((s.shape, str(s.dtype)) for s in jax.tree.leaves(shapes)),
        tuple(c.name for c in cands), repeats, drop,
    )  # fmt: skip
    if key not in _CACHE or refresh:
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        programs = [program(mesh, axis_name, zeros, tx) for tx in [None, *_build(cands, axis_name)]]
        # dense stays in play: the rounds rule compares every candidate with it round by round
        keep = [0] + [1 + i for i, c in enumerate(cands) if c.name == "dense"]
        _CACHE[key] = time_samples(programs, repeats, drop=drop, settle=settle(mesh, axis_name),
                                   keep=keep)  # fmt: skip
    base, *samples = _CACHE[key]
    if rounds:
        return {
            c.name: [math.nan if math.isnan(t) else max(t - b, 0.0) for t, b in zip(s, base)]
            for c, s in zip(cands, samples)
        }
    b = summary(base, statistic)
    return {c.name: max(summary(s, statistic) - b, 0.0) for c, s in zip(cands, samples)}


def wins_over_dense(rounds: dict[str, Sequence[float]], margin: float) -> dict[str, float]:
    """Per candidate, the share of rounds (where both were timed) it cost <= (1 - margin) x dense.

    ``rounds``: :func:`measure`'s ``rounds=True`` result (one name ``"dense"``).
    A round in which dense cost 0 counts as lost (nothing beats nothing). ``nan``
    for dense itself and where no round timed both.
    """
    if "dense" not in rounds:
        raise ValueError(f"rounds: no rounds of 'dense' to compare with; have {sorted(rounds)}")
    ref = rounds["dense"]
    out = {}
    for name, costs in rounds.items():
        pairs = [(c, d) for c, d in zip(costs, ref) if not (math.isnan(c) or math.isnan(d))]
        # a round where dense cost nothing (its sample no slower than the baseline's) is lost
        won = sum(d > 0 and c <= (1 - margin) * d for c, d in pairs)
        out[name] = won / len(pairs) if pairs and name != "dense" else math.nan
    return out


def _shapes(params: Any) -> Any:
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)


def _build(cands, axis_name) -> list[optax.GradientTransformation]:
    return [c.make(axis_name) for c in cands]


def _sure_wins(
    rounds: dict[str, Sequence[float]] | None, margin: float, cands: Sequence[Candidate]
) -> dict[str, float]:
    """Each candidate's share of the rounds won over dense (``{}`` without rounds)."""
    wins: dict[str, float] = {}
    if rounds is not None:
        known = wins_over_dense(rounds, margin)
        for c in cands:
            w = known.get(c.name, math.nan)
            # with rounds, a candidate never compared with dense (absent, or no round shared
            # with it) is not sure: 0, not the nan that passes
            wins[c.name] = 0.0 if c.name != "dense" and math.isnan(w) else w
    return wins


def choose(
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
    margin: float = 0.1,
    max_ratio: float | None = None,
    calibration: calibrate.Calibration | None = None,
    repeats: int = 5,
    costs: dict[str, float] | None = None,
    refresh: bool = False,
    rounds: dict[str, Sequence[float]] | None = None,
    min_wins: float = MIN_WINS,
) -> Choice:
    """Measure every candidate's exchange of a gradient like ``params`` on ``mesh``; choose.

    Multi-process: **every process must call it** with the same arguments
    (the programs are collectives over the whole mesh); all get the same choice.

    Args:
      params: the parameters (or ``jax.ShapeDtypeStruct`` leaves) of one worker.
      mesh: the ``jax.sharding.Mesh`` training runs on.
      axis_name: its data-parallel axis, >= 2 devices.
      candidates: :class:`Candidate` s to measure; one must be named ``"dense"``.
      margin: a compressed candidate is chosen only if its cost is at most
        ``(1 - margin)`` x dense's, in [0, 1).
      max_ratio: the accuracy guard's cap: candidates whose wire bytes are
        more than ``max_ratio`` times smaller than dense's are not chosen;
        ``None``: no cap.
      calibration: optional; adds each candidate's alpha-beta prediction.
      repeats: timed rounds of :func:`measure`, >= 1.
      costs: ``{name: seconds}`` measured before (e.g. a saved
        :func:`measure`); ``None``: :func:`measure` now (and its rounds).
      refresh: measure again even if this process has cached costs.
      rounds: ``{name: [cost per round]}`` (:func:`measure` with
        ``rounds=True``) beside given ``costs``; without them (and with
        ``costs`` given) the rounds rule is not applied.
      min_wins: a compressed candidate is chosen only if it beat dense by the
        margin in at least this share of the rounds (:func:`wins_over_dense`;
        :data:`MIN_WINS`), in [0, 1].

    Returns:
      A :class:`Choice` (``print(choice)`` shows the table).

    Example:
      >>> choice = jaxcomm.policy.choose(params, mesh, "data")
      >>> print(choice)
    """
    cands = check_candidates(candidates)
    _check_options(margin, max_ratio, repeats, min_wins)
    n = calibrate.axis_size(mesh, axis_name)
    if costs is None and rounds is not None:
        raise ValueError("rounds: give them with the costs they were measured with (costs=...)")
    if costs is None:
        costs = measure(params, mesh, axis_name, candidates=cands, repeats=repeats,
                        refresh=refresh)  # fmt: skip
        rounds = measure(params, mesh, axis_name, candidates=cands, repeats=repeats,
                         rounds=True)  # fmt: skip
    missing = [c.name for c in cands if c.name not in costs]
    if missing:
        raise ValueError(f"costs: no seconds for candidates {missing}")
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _shapes(params))
    reports = [accounting.wire_report(tx, zeros, n) for tx in _build(cands, axis_name)]
    wire = [sum(c.nbytes for c in rep) for rep in reports]
    dense_bytes = wire[[c.name for c in cands].index("dense")]
    wins = _sure_wins(rounds, margin, cands)
    rows = []
    for c, b, rep in zip(cands, wire, reports):
        ratio = dense_bytes / b if b else math.inf
        capped = max_ratio is not None and ratio > max_ratio
        pred = calibrate.exchange_time(rep, calibration) if calibration is not None else math.nan
        excluded = f"compresses {ratio:.0f}x > max_ratio {max_ratio:g}" if capped else ""
        rows.append(Row(c.name, float(costs[c.name]), int(b), ratio, pred, excluded,
                        wins.get(c.name, math.nan)))  # fmt: skip
    name, reason = decide(rows, margin, min_wins)
    kept = None if rounds is None else {k: list(v) for k, v in rounds.items()}
    return Choice(name, tuple(rows), n, reason, kept)
