"""Timing compiled exchange programs on the mesh, the same on every process: what
:func:`jaxcomm.policy.measure` compares."""

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import calibrate, collectives


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


def program(mesh, axis_name, params, tx: optax.GradientTransformation | None):
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


def check_statistic(statistic: str) -> None:
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
        best = [summary(s, "min") for s in samples]
        fastest = min(best[1:])
        if drop:
            playing = [i for i in playing if i in keep or best[i] <= DROP_FACTOR * fastest]
    return samples


def summary(xs: Sequence[float], statistic: str) -> float:
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
    check_statistic(statistic)
    samples = time_samples(programs, repeats, drop=drop, settle=settle)
    return [summary(s, statistic) for s in samples]


def settle(mesh, axis_name) -> Callable[[], Any]:
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
