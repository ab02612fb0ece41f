"""A link-aware exchange policy: :func:`auto` measures candidates on the mesh, keeps the fastest.

Whether compression pays depends on the link, the model and the backend
(on a fast link a compressor's encode and decode cost more than the bytes
they save). :func:`choose` settles it on the user's own mesh, in seconds:

1. every candidate exchange (:data:`DEFAULT_CANDIDATES`: dense fp32, 16-bit
   words, PowerSGD rank 2 and 4, top-k and int8 with error feedback) is built with the
   user's ``axis_name`` and compiled into one small ``shard_map`` program
   that draws a per-worker gradient shaped like ``params`` and runs the
   candidate's ``update`` on it, its state carried from call to call (after
   a few untimed steps from ``init``: the steady state of training, where
   PowerSGD's ``Q`` is warm-started and residuals are filled); a baseline
   program draws the gradient and exchanges nothing;
2. each program is timed (the minimum of ``repeats`` rounds, each round
   timing every program once; with several processes, the slowest
   process's time, so every process makes the same choice); a candidate's
   *cost* is its time minus the baseline's: what it adds to a step;
3. the choice is the candidate of least cost, where a compressed candidate
   must beat dense by ``margin`` (a tie goes to dense: noise must not make
   compression lose), must have done so in at least ``min_wins`` of the
   rounds (each round's samples compared: one lucky round does not choose)
   and may not compress more than ``max_ratio``. Each round times the
   programs in a fresh order (the same on every process).

With a :class:`jaxcomm.calibrate.Calibration` the table also shows each
candidate's alpha-beta prediction of its collectives
(:func:`jaxcomm.calibrate.exchange_time` of its wire report), the model
``python -m experiments.advise`` prints. :func:`auto` returns the chosen
transform (optionally after a dense warm-up); :meth:`Choice.drifted` says
when a measured step time has moved more than 20% from the prediction, the
cue to call :func:`choose` again with ``refresh=True``.

The choice happens outside ``jit``, once, from the shapes of ``params``:
the transform :func:`auto` returns is an ordinary jaxcomm transform with
static shapes and no host round-trip.
"""

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import accounting, calibrate, checks, collectives, sync
from jaxcomm.compressors import dense, powersgd, quantize, sparse

__all__ = [
    "DEFAULT_CANDIDATES",
    "DROP_FACTOR",
    "LEAD_IN_S",
    "MIN_WINS",
    "SAMPLE_S",
    "STATISTICS",
    "WARM_STEPS",
    "Candidate",
    "Choice",
    "Row",
    "auto",
    "choose",
    "clear_cache",
    "decide",
    "measure",
    "time_programs",
    "time_samples",
    "wins_over_dense",
    "dense_warmup",
]


class Candidate(NamedTuple):
    """A named exchange: ``make(axis_name)`` builds its optax transform (taking gradients)."""

    name: str
    make: Callable[[Any], optax.GradientTransformation]


#: The candidates :func:`choose` measures unless told otherwise; every lossy one
#: keeps error feedback (the accuracy guard). They compress every leaf
#: (``min_size=0``): a small leaf costs few bytes either way, and leaving it
#: dense would add a collective whose latency dominates on a slow link.
DEFAULT_CANDIDATES: tuple[Candidate, ...] = (
    Candidate("dense", lambda ax: dense.allreduce(axis_name=ax)),
    Candidate("bf16", lambda ax: dense.cast(jnp.bfloat16, axis_name=ax, min_size=0)),
    Candidate("powersgd_r2", lambda ax: powersgd.powersgd(2, key=jax.random.key(0), axis_name=ax)),
    # rank 4: what PowerSGD's paper trained its language model with; on the LM of
    # experiments/results/lm_study.md rank 4 reached dense's target and rank 2 did not (auto's
    # rank-2 choice ended at 2.6251 against 2.6095): with ``max_ratio`` a user who caps the
    # compression still has a low-rank candidate (rank 4 compresses that LM 31x, rank 2 58x)
    Candidate("powersgd_r4", lambda ax: powersgd.powersgd(4, key=jax.random.key(0), axis_name=ax)),
    Candidate(
        "int8_ef",
        lambda ax: quantize.int8(
            axis_name=ax, key=jax.random.key(0), error_feedback=True, min_size=0
        ),
    ),  # fmt: skip
    Candidate("topk_1pct", lambda ax: sparse.topk(0.01, axis_name=ax, min_size=0)),
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


class _Stepping:
    """A compiled exchange step as a one-argument call that carries its state along.

    ``step(key, state) -> (total, state)``: each call feeds in the state the
    previous one returned, so what is timed is a step in training's steady
    state (PowerSGD's warm-started ``Q``, a filled residual), not ``init``
    followed by a first update.
    """

    def __init__(self, step, state):
        self.step, self.state = step, state

    def __call__(self, key):
        total, self.state = self.step(key, self.state)
        return total


#: Untimed steps each candidate runs before timing: its state (residual,
#: PowerSGD's ``Q``) leaves the zeros of ``init``.
WARM_STEPS = 3


def _program(mesh, axis_name, params, tx: optax.GradientTransformation | None):
    """Compiled: draw a per-worker gradient like ``params``, run a step of ``tx`` (None: nothing).

    Returns ``(call, key)``: ``call(key)`` runs one step; with a transform
    its state is carried from call to call (:class:`_Stepping`).
    """
    leaves, treedef = jax.tree.flatten(params)
    n = calibrate.axis_size(mesh, axis_name)

    def draw(key):
        key = jax.random.fold_in(key, collectives.axis_index(axis_name))
        keys = jax.random.split(key, len(leaves))
        g = [jax.random.normal(k, jnp.shape(p), jnp.result_type(p)) for k, p in zip(keys, leaves)]
        return treedef.unflatten(g)

    def total(g):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(g))[None]

    key = jax.random.key(0)
    if tx is None:
        fn = jax.shard_map(lambda k: total(draw(k)), mesh=mesh, in_specs=P(),
                           out_specs=P(axis_name), check_vma=False)  # fmt: skip
        compiled = jax.jit(fn).lower(key).compile()
        compiled(key).block_until_ready()  # warm-up
        return compiled, key

    # the state of every worker, stacked on a leading axis sharded over the mesh
    # (made by a jitted function: with several processes each places only its own workers')
    state = jax.jit(
        lambda: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (n, *jnp.shape(a))),
                             tx.init(params)),
        out_shardings=NamedSharding(mesh, P(axis_name)),
    )()  # fmt: skip

    def body(k, s):
        g, s = tx.update(draw(k), jax.tree.map(lambda a: a[0], s), params)
        return total(g), jax.tree.map(lambda a: a[None], s)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis_name)),
                       out_specs=(P(axis_name), P(axis_name)), check_vma=False)  # fmt: skip
    compiled = jax.jit(fn, donate_argnums=1).lower(key, state).compile()
    call = _Stepping(compiled, state)
    for _ in range(WARM_STEPS):
        call(key).block_until_ready()
    return call, key


#: After a round, a candidate slower than this many times the fastest one is timed no more
#: (it cannot be chosen; on a slow link a dense exchange is then timed once, not ``repeats`` times).
DROP_FACTOR = 3.0


#: Seconds one timed sample lasts at least: a sample runs a program this long back to back,
#: so a link's burst allowance (a token bucket, a switch buffer) does not pass for its rate.
SAMPLE_S = 0.05


#: A program whose call takes less than this makes one untimed call right before each timed
#: sample: it spends the link's burst allowance (a tbf bucket refills while the previous
#: sample settles), which would pass the sample's first bytes at line rate (on a 10 Mbit/s
#: link, 32 KiB: 26 ms of sending free in a 50 ms sample).
LEAD_IN_S = 0.5


def _calls_per_sample(programs) -> tuple[list[int], list[bool]]:
    """Back-to-back calls per sample of each program (enough to last :data:`SAMPLE_S`), and
    whether a lead-in call precedes each sample (one call under :data:`LEAD_IN_S`)."""
    once = []
    for compiled, key in programs:
        start = time.perf_counter()
        compiled(key).block_until_ready()
        once.append(time.perf_counter() - start)
    once = calibrate.slowest_process(once)  # every process makes the same calls
    calls = [max(1, min(1000, math.ceil(SAMPLE_S / max(t, 1e-6)))) for t in once]
    return calls, [t < LEAD_IN_S for t in once]


#: How :func:`time_programs` sums up a program's samples: ``"min"`` (the least: what a
#: choice compares, noise taken out) or ``"median"`` (the typical sample: what a prediction of
#: training's median step needs, where stalls between processes come and go).
STATISTICS = ("min", "median")


def _check_statistic(statistic: str) -> None:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic: {statistic!r} is not one of {STATISTICS}")


def time_samples(
    programs,
    repeats: int,
    *,
    drop: bool = True,
    settle: Callable[[], Any] | None = None,
    seed: int = 0,
    keep: Sequence[int] = (0,),
) -> list[list[float]]:
    """Seconds per call of each ``(compiled, arg)`` program in each round (index 0 the baseline).

    ``compiled(arg)`` must return something with ``block_until_ready()``. A
    sample dispatches the program back to back for at least :data:`SAMPLE_S`
    and waits for the last call (after an untimed lead-in call where one call
    is shorter than :data:`LEAD_IN_S`: it spends the link's burst), at the
    slowest process. A round takes one sample of every program still in
    play, in an order drawn anew each round from ``seed`` (the same on every
    process; a fixed order let a program's place decide its time: in
    ``experiments/bench/buckets.py`` one program measured 1.03x and 0.65x
    another identical one), so load spreads over all. With ``drop``, after
    each round (the processes agree on the times first) candidates slower
    than :data:`DROP_FACTOR` x the fastest leave play (never those of
    ``keep``: the baseline, and what the others are compared with round by
    round): every process drops the same ones, so all run the same
    collectives. ``settle()`` (untimed) runs
    after each sample: a collective that returns only when the sample's
    traffic has drained from the link (a process can finish a collective
    while its last bytes to a peer still sit in a queue, and would charge
    them to the next program).

    Returns:
      Per program, its sample of each of the ``repeats`` rounds (``nan`` in
      the rounds after it left play).
    """
    rng = random.Random(seed)
    calls, lead_in = _calls_per_sample(programs)
    samples: list[list[float]] = [[] for _ in programs]
    playing = list(range(len(programs)))
    for _ in range(repeats):
        order = list(playing)
        rng.shuffle(order)
        round_s = []
        for i in order:
            compiled, key = programs[i]
            if lead_in[i]:
                compiled(key).block_until_ready()
            start = time.perf_counter()
            for _ in range(calls[i] - 1):
                compiled(key)
            compiled(key).block_until_ready()
            round_s.append((time.perf_counter() - start) / calls[i])
            if settle is not None:
                jax.block_until_ready(settle())
        # every process keeps the slowest process's time of each sample
        timed = dict(zip(order, calibrate.slowest_process(round_s)))
        for i in range(len(programs)):
            samples[i].append(timed.get(i, math.nan))
        best = [_summary(s, "min") for s in samples]
        fastest = min(best[1:])
        if drop:
            playing = [i for i in playing if i in keep or best[i] <= DROP_FACTOR * fastest]
    return samples


def _summary(xs: Sequence[float], statistic: str) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return min(xs) if statistic == "min" else statistics.median(xs)


def time_programs(
    programs,
    repeats: int,
    *,
    drop: bool = True,
    settle: Callable[[], Any] | None = None,
    statistic: str = "min",
) -> list[float]:
    """Seconds per call of each ``(compiled, arg)`` program (index 0 the baseline).

    :func:`time_samples` summed up per program: the least time per call over
    the rounds it was timed in (``statistic="median"``: the median sample).
    """
    _check_statistic(statistic)
    samples = time_samples(programs, repeats, drop=drop, settle=settle)
    return [_summary(s, statistic) for s in samples]


def _settle(mesh, axis_name) -> Callable[[], Any]:
    """A scalar all-reduce over the mesh, compiled: it returns once every link has drained."""
    fn = jax.shard_map(
        lambda x: collectives.psum(x, axis_name), mesh=mesh, in_specs=P(axis_name),
        out_specs=P(), check_vma=False,
    )  # fmt: skip
    n = calibrate.axis_size(mesh, axis_name)
    x = jax.jit(
        lambda: jnp.zeros((n,), jnp.float32), out_shardings=NamedSharding(mesh, P(axis_name))
    )()
    compiled = jax.jit(fn).lower(x).compile()
    return lambda: compiled(x)


def _check_candidates(candidates) -> tuple[Candidate, ...]:
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
    cands = _check_candidates(candidates)
    checks.check_int(repeats, "repeats", 1)
    _check_statistic(statistic)
    calibrate.axis_size(mesh, axis_name)
    shapes = _shapes(params)
    key = (
        tuple(int(d.id) for d in mesh.devices.flat), axis_name, str(jax.tree.structure(shapes)),
        tuple((s.shape, str(s.dtype)) for s in jax.tree.leaves(shapes)),
        tuple(c.name for c in cands), repeats, drop,
    )  # fmt: skip
    if key not in _CACHE or refresh:
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        programs = [
            _program(mesh, axis_name, zeros, tx) for tx in [None, *_build(cands, axis_name)]
        ]
        # dense stays in play: the rounds rule compares every candidate with it round by round
        keep = [0] + [1 + i for i, c in enumerate(cands) if c.name == "dense"]
        _CACHE[key] = time_samples(programs, repeats, drop=drop, settle=_settle(mesh, axis_name),
                                   keep=keep)  # fmt: skip
    base, *samples = _CACHE[key]
    if rounds:
        return {
            c.name: [math.nan if math.isnan(t) else max(t - b, 0.0) for t, b in zip(s, base)]
            for c, s in zip(cands, samples)
        }
    b = _summary(base, statistic)
    return {c.name: max(_summary(s, statistic) - b, 0.0) for c, s in zip(cands, samples)}


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
    cands = _check_candidates(candidates)
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
    wins: dict[str, float] = {}
    if rounds is not None:
        known = wins_over_dense(rounds, margin)
        for c in cands:
            w = known.get(c.name, math.nan)
            # with rounds, a candidate never compared with dense (absent, or no round shared
            # with it) is not sure: 0, not the nan that passes
            wins[c.name] = 0.0 if c.name != "dense" and math.isnan(w) else w
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


class WarmupState(NamedTuple):
    """State of :func:`dense_warmup`: the step counter, dense's and the chosen transform's."""

    count: jax.Array
    dense: Any
    chosen: Any


def dense_warmup(
    tx: optax.GradientTransformation, steps: int, axis_name: str
) -> optax.GradientTransformation:
    """The dense mean for the first ``steps`` steps, then ``tx`` (its state starts then).

    Both branches are traced; the step counter decides which runs (every
    worker agrees on it), so shapes stay static. ``steps=0`` returns ``tx``.
    """
    steps = checks.check_int(steps, "warmup_steps", 0)
    if steps == 0:
        return tx
    ref = dense.allreduce(axis_name=axis_name)

    def init_fn(params):
        return WarmupState(jnp.zeros([], jnp.int32), ref.init(params), tx.init(params))

    def update_fn(updates, state, params=None):
        checks.check_state(state, WarmupState, "dense_warmup")

        def warm(u, s):
            out, d = ref.update(u, s.dense, params)
            return out, s._replace(dense=d)

        def after(u, s):
            out, c = tx.update(u, s.chosen, params)
            return out, s._replace(chosen=c)

        out, new = sync.typed_cond(state.count < steps, warm, after, updates, state)
        return out, new._replace(count=optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def auto(
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    warmup_steps: int = 0,
    candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
    margin: float = 0.1,
    max_ratio: float | None = None,
    calibration: calibrate.Calibration | None = None,
    repeats: int = 5,
    costs: dict[str, float] | None = None,
    rounds: dict[str, Sequence[float]] | None = None,
    min_wins: float = MIN_WINS,
    log: Callable[[str], None] | None = print,
) -> optax.GradientTransformation:
    """The exchange :func:`choose` picks for ``params`` on ``mesh`` (never slower than dense).

    Args:
      params, mesh, axis_name, candidates, margin, max_ratio, calibration,
        repeats, costs, rounds, min_wins: see :func:`choose`.
      warmup_steps: steps of dense exchange before the chosen one
        (:func:`dense_warmup`), an int >= 0.
      log: called with the choice's table (``None``: silent); only process 0 logs.

    Returns:
      An ``optax.GradientTransformation`` taking gradients and returning the
      worker mean, as the chosen candidate does; chain an optimizer after it.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = optax.chain(jaxcomm.auto(params, mesh, "data"), optax.adamw(1e-3))
    """
    choice = choose(
        params, mesh, axis_name, candidates=candidates, margin=margin, max_ratio=max_ratio,
        calibration=calibration, repeats=repeats, costs=costs, rounds=rounds, min_wins=min_wins,
    )  # fmt: skip
    if log is not None and jax.process_index() == 0:
        log(choice.table())
    make = next(c.make for c in _check_candidates(candidates) if c.name == choice.name)
    return dense_warmup(make(axis_name), warmup_steps, axis_name)
