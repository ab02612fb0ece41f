r"""Is compression worth it here? Predicted step time of each exchange on this mesh, and a choice.

Command (one process, 8 fake CPU devices; or under ``experiments.launch`` on real links):
  python -m experiments.advise --config=experiments/configs/lm_shakespeare.py
  python -m experiments.launch --processes=2 --rate=10mbit -- \
      python -m experiments.advise --config=experiments/configs/digits_mlp.py --out=advice.json

For the config's model and the current mesh it

1. calibrates the link (:func:`jaxcomm.calibrate.calibrate`: alpha and
   bandwidth of each collective kind) and prints the table;
2. times the config's training step with **no** exchange (the base optimizer
   alone, every worker on its own batch): ``compute_s``, the median call;
3. measures what each candidate exchange of :mod:`jaxcomm.policy` adds to a
   step on this mesh (:func:`jaxcomm.policy.measure`, the median sample: the
   prediction is of training's median step, stalls between processes and all)
   and its alpha-beta prediction from the calibration;
4. prints each candidate's predicted step time and the recommendation
   :func:`jaxcomm.auto` would make, with the reason (an ``auto`` config's
   ``margin``, ``max_ratio`` and ``min_wins`` apply: :func:`guard_options`). The prediction
   (:func:`predicted_step`) is ``compute_s`` + the larger of the measured cost
   and the alpha-beta time of the candidate's collectives: a step cannot move
   its bytes faster than the calibrated link, but a short timed program can
   (a ``tc ... tbf`` link passes its burst at line rate; on the wide MLP at
   10 Mbit/s PowerSGD's measured cost predicted 0.81 of the training step,
   the alpha-beta time 1.25: ``experiments/results/auto.md``).

``--out`` writes all of it as JSON (``experiments/bench/auto.py`` compares the
predictions with measured training steps).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import data as data_lib
from experiments import optimizers, train
from experiments.studies import runs
from jaxcomm import calibrate, distributed, policy

FLAGS = flags.FLAGS


def base_optimizer(config) -> optax.GradientTransformation:
    """The config's optimizer with no exchange (optax's; SGD for the jaxcomm-only ones)."""
    name = config.optimizer.name
    kwargs = dict(config.optimizer.get("kwargs", {}))
    if name in ("sgd", "adam", "adamw"):
        return getattr(optax, name)(optimizers.learning_rate(config), **kwargs)
    return optax.sgd(optimizers.learning_rate(config))


def train_call(config, model, params, stats, mesh, ds, tx) -> Callable[[], Any]:
    """The config's training call with ``tx``, compiled and run once: ``run()`` runs the next.

    Each ``run()`` makes one call (``config.steps_per_call`` steps) on the
    state the previous one returned and waits for it.
    """
    n = mesh.shape[optimizers.AXIS]
    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape), t)
    state = train.TrainState(
        jnp.zeros((n,), jnp.int32), stack(params), stack(stats), stack(tx.init(params))
    )
    held = [distributed.shard_rows(state, mesh, optimizers.AXIS)]
    x, y = distributed.shard_rows((ds.x_train, ds.y_train), mesh, optimizers.AXIS)
    call = train.make_train_call(model, tx, mesh, ds, config).lower(held[0], x, y).compile()

    def run():
        held[0], losses = call(held[0], x, y)
        return jax.block_until_ready(losses)

    run()  # warm-up
    return run


def compute_step_s(config, model, params, stats, mesh, ds, calls: int = 7) -> float:
    """Seconds per training step with no exchange: the config's step, the median of ``calls`` calls.

    The median (not the least) call, like the candidates' costs (``statistic="median"``):
    the prediction is of training's median step.
    """
    run = train_call(config, model, params, stats, mesh, ds, base_optimizer(config))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(calibrate.slowest_process(times)) / config.steps_per_call


def predicted_step(compute_s: float, seconds: float, predicted_s: float) -> float:
    """A candidate's predicted step: ``compute_s`` + max(measured cost, alpha-beta time).

    ``predicted_s`` (the calibration's time of its collectives) may be NaN
    (no calibration): then the measured cost alone.
    """
    bound = predicted_s if predicted_s == predicted_s else 0.0
    return compute_s + max(seconds, bound)


#: the options of an ``auto`` config that change what :func:`jaxcomm.policy.choose` decides
GUARD_OPTIONS = ("margin", "max_ratio", "min_wins")


def guard_options(config) -> dict:
    """The decision's options of a ``compressor.name="auto"`` config (its margin and accuracy
    guard, e.g. the LM's ``max_ratio``), so the recommendation is the one its training makes;
    ``{}`` (the defaults) for any other config."""
    if config.compressor.name != "auto":
        return {}
    kwargs = config.compressor.get("kwargs", {})
    return {k: kwargs[k] for k in GUARD_OPTIONS if k in kwargs}


def advise(config, repeats: int = 7) -> dict:
    """Calibration, no-exchange step, each candidate's cost and predicted step, the choice."""
    train.validate(config)
    n = train.n_workers_of(config)
    ds = data_lib.load(config.data, n, seed=config.seed)
    model, params, stats = train.build_model(config, ds)
    mesh = distributed.global_mesh(optimizers.AXIS, n)
    cal = calibrate.calibrate(mesh, optimizers.AXIS)
    compute_s = compute_step_s(config, model, params, stats, mesh, ds)
    costs = policy.measure(
        params, mesh, optimizers.AXIS, repeats=repeats, drop=False, statistic="median"
    )
    # the same samples, round by round: auto's rule (a compressed candidate must beat dense
    # by the margin in most rounds, not in one lucky one)
    rounds = policy.measure(params, mesh, optimizers.AXIS, repeats=repeats, drop=False, rounds=True)
    choice = policy.choose(params, mesh, optimizers.AXIS, calibration=cal, costs=costs,
                           rounds=rounds, **guard_options(config))  # fmt: skip
    rows = [
        dict(r._asdict(), predicted_step_s=predicted_step(compute_s, r.seconds, r.predicted_s),
             measured_step_s=compute_s + r.seconds, model_step_s=compute_s + r.predicted_s)
        for r in choice.rows
    ]  # fmt: skip
    return {
        "n": n,
        "calibration": cal.table(),
        "compute_s": compute_s,
        "choice": choice.name,
        "reason": choice.reason,
        "rows": rows,
        "table": choice.table(),
    }


def render(result: dict) -> str:
    lines = [
        result["calibration"],
        "",
        f"step with no exchange: {result['compute_s'] * 1e3:.2f} ms",
    ]
    lines.append(
        f"{'exchange':<14}{'+ms':>9}{'alpha-beta ms':>15}{'predicted step ms':>19}{'wins':>6}"
        "  (no-exchange step + the larger; rounds it beat dense by the margin)"
    )
    for r in result["rows"]:
        wins = r.get("wins")
        wins = "-" if wins is None or wins != wins else f"{wins:.0%}"
        lines.append(
            f"{r['name']:<14}{r['seconds'] * 1e3:>9.2f}{r['predicted_s'] * 1e3:>15.2f}"
            f"{r['predicted_step_s'] * 1e3:>19.2f}{wins:>6}"
        )
    lines.append(f"recommendation: {result['choice']} ({result['reason']})")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    distributed.initialize()
    result = advise(FLAGS.config, FLAGS.repeats)
    if jax.process_index() == 0:
        print(render(result), flush=True)
        if FLAGS.out:
            with open(FLAGS.out, "w") as f:
                json.dump(runs.json_ready(result), f, indent=1, allow_nan=False)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "training config file", lock_config=True)
    flags.DEFINE_integer("repeats", 7, "timed rounds of each candidate (their median counts)")
    flags.DEFINE_string("out", "", "also write the advice as JSON here")
    flags.mark_flags_as_required(["config"])
    app.run(main)
