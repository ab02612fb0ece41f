"""Data-parallel training with a jaxcomm optimizer: ``train_and_evaluate(config, workdir)``.

The training step runs under ``jax.shard_map`` over a ``("data",)`` mesh of
``config.n_workers`` devices (0: all of them; 8 fake CPU devices here). Every
piece of state (params, BatchNorm statistics, optimizer state with compressor
residuals / PowerSGD Q / keys / counters, the step counter) carries a leading
worker axis sharded over ``"data"``, so local SGD / DiLoCo workers can drift
and error-feedback residuals stay per worker. ``config.steps_per_call``
micro-steps run inside one jitted ``lax.scan`` with donated state; each worker
draws its batch on device from ``(seed, worker, step)``, so there is no host
sync inside the step. Between calls: eval (worker 0's params; the others wait), JSONL metrics,
orbax checkpoints (SHA-256 checksummed; verified on resume, falling back to the
newest good one: :func:`experiments.checkpoints.restore_latest_good`), a tqdm
bar. A ``workdir`` holding a checkpoint resumes from it, bit for bit.

Components are picked by name: ``config.model.name`` (:data:`models.MODELS`),
``config.data.name`` (:data:`data.DATASETS`), ``config.compressor.name`` (a
``jaxcomm`` factory, called as ``getattr(jaxcomm, name)(**kwargs,
axis_name="data")``), ``config.optimizer.name`` (an optax optimizer),
``config.policy`` and ``config.wrapper.name`` (how they are composed:
:func:`experiments.optimizers.make_optimizer`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import checkpoints, models, optimizers
from experiments import data as data_lib
from experiments.optimizers import AXIS
from experiments.studies import runs
from jaxcomm import distributed, netsim

# config.on_nonfinite: what a run does when its training loss or state turns NaN/Inf
ON_NONFINITE = ("abort", "continue")


class TrainState(NamedTuple):
    """Everything a run needs to continue; every leaf has a leading worker axis."""

    step: Any  # (n,) int32: steps done; also the data position
    params: Any
    batch_stats: Any  # BatchNorm running statistics (identical on all workers), or {}
    opt_state: Any


class Result(NamedTuple):
    state: TrainState  # final state, numpy on the host; PRNG keys as raw key data
    metrics: list[dict]  # one dict per eval


# --- config validation ---------------------------------------------------------------------


def _positive_float(value: Any, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{key}: expected a finite number > 0, got {value!r}")
    return float(value)


def n_workers_of(config: ml_collections.ConfigDict) -> int:
    n = config.get("n_workers", 0) or jax.device_count()
    if n > jax.device_count():
        raise ValueError(
            f"config.n_workers: {n} > {jax.device_count()} devices; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax"
        )
    if jax.process_count() > 1 and n != jax.device_count():
        raise ValueError(
            f"config.n_workers: {n}, but with {jax.process_count()} processes every one of the "
            f"{jax.device_count()} devices is a worker; set config.n_workers=0"
        )
    return n


def validate(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Check every config value (raises ``ValueError`` naming the key); returns the optimizer.

    Runs before any data is read or any function compiled.
    """
    for key in ("seed", "model", "data", "compressor", "optimizer", "wrapper", "num_train_steps"):
        if key not in config:
            raise ValueError(f"config.{key}: missing")
    optimizers.choice(config.model.name, "config.model.name", tuple(models.MODELS))
    optimizers.choice(config.data.name, "config.data.name", data_lib.DATASETS)
    lm = config.model.name in models.LM_MODELS
    if lm != (config.data.name in data_lib.LM_DATASETS):
        raise ValueError(
            f"config.model.name / config.data.name: language models {list(models.LM_MODELS)} go "
            f"with text datasets {list(data_lib.LM_DATASETS)} and vice versa, got "
            f"{config.model.name!r} with {config.data.name!r}"
        )
    if lm:
        optimizers.positive_int(config.data.get("seq_len"), "config.data.seq_len", 2)
    if config.data.name == "cifar10":
        data_lib.check_cifar_dir(config.data.get("dir"))
    # 0 (classification): the whole shard every step (full-batch gradient descent)
    optimizers.positive_int(config.data.get("batch_size"), "config.data.batch_size", 1 if lm else 0)
    steps = optimizers.positive_int(config.num_train_steps, "config.num_train_steps")
    per_call = optimizers.positive_int(config.get("steps_per_call", 1), "config.steps_per_call")
    for key in ("eval_every", "checkpoint_every", "stop_after"):
        value = optimizers.positive_int(config.get(key, 0), f"config.{key}", 0)
        if value % per_call:
            raise ValueError(
                f"config.{key}: {value} must be a multiple of config.steps_per_call={per_call}"
            )
    if steps % per_call:
        raise ValueError(
            f"config.num_train_steps: {steps} must be a multiple of steps_per_call={per_call}"
        )
    if not config.netsim.gbps > 0:
        raise ValueError(f"config.netsim.gbps: expected > 0, got {config.netsim.gbps}")
    optimizers.choice(config.get("on_nonfinite", "abort"), "config.on_nonfinite", ON_NONFINITE)
    _positive_float(config.optimizer.get("learning_rate"), "config.optimizer.learning_rate")
    _positive_float(config.optimizer.get("lr_scale", 1.0), "config.optimizer.lr_scale")
    n_workers_of(config)
    return optimizers.make_optimizer(config)


# --- the step ------------------------------------------------------------------------------


def _loss_fn(model, lm: bool) -> Callable:
    def loss_fn(params, batch_stats, x, y):
        variables = {"params": params}
        if batch_stats:
            variables["batch_stats"] = batch_stats
            logits, mut = model.apply(variables, x, train=True, mutable=["batch_stats"])
            batch_stats = mut["batch_stats"]
        else:
            logits = model.apply(variables, x, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, batch_stats

    return loss_fn


def make_train_call(model, tx, mesh, ds: data_lib.Dataset, config) -> Callable:
    """jit(shard_map(scan of ``steps_per_call`` steps)), state donated -> (state, losses).

    ``model`` needs only ``apply(variables, x, train=...)`` (a flax module, or
    :class:`experiments.digits.Net`); ``config`` only ``seed``,
    ``data.batch_size`` (0: the whole shard every step) and ``steps_per_call``.
    """
    loss_fn = _loss_fn(model, ds.is_lm)
    batch_size, seq_len = config.data.batch_size, ds.seq_len

    def call(state: TrainState, x, y):
        state = jax.tree.map(lambda a: a[0], state)
        x = x[0]
        y = None if y is None else y[0]
        key = data_lib.worker_key(config.seed, jax.lax.axis_index(AXIS))

        def body(s: TrainState, _):
            if batch_size:
                bx, by = data_lib.sample_batch(x, y, key, s.step, batch_size, seq_len)
            else:  # data.batch_size 0: the worker's whole shard every step, in order
                bx, by = x, y
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, stats), grads = grad_fn(s.params, s.batch_stats, bx, by)
            updates, opt_state = tx.update(grads, s.opt_state, s.params)
            params = optax.apply_updates(s.params, updates)
            stats = jax.lax.pcast(jax.lax.pmean(stats, AXIS), AXIS, to="varying")
            return TrainState(s.step + 1, params, stats, opt_state), loss

        state, losses = jax.lax.scan(body, state, None, length=config.steps_per_call)
        # One all-reduce of the call's losses, not one per step beside the gradient exchange.
        return jax.tree.map(lambda a: a[None], state), jax.lax.pmean(losses, AXIS)

    spec = P(AXIS)
    fn = jax.shard_map(call, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, P()))
    return jax.jit(fn, donate_argnums=0)


def make_eval(model, ds: data_lib.Dataset, batch_size: int) -> Callable[[Any, Any], dict]:
    """Test loss and accuracy (next-token accuracy for LM) of one worker's params."""

    @jax.jit
    def per_example(params, stats, x, y):
        variables = {"params": params, **({"batch_stats": stats} if stats else {})}
        logits = model.apply(variables, x, train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        hit = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        if ds.is_lm:  # a window is one example: its mean over positions
            return loss.mean(-1), hit.mean(-1)
        return loss, hit

    def evaluate(params, stats) -> dict:
        losses, hits = [], []
        for i in range(0, len(ds.x_test), batch_size):
            if ds.is_lm:
                w = ds.x_test[i : i + batch_size]
                x, y = w[:, :-1], w[:, 1:]
            else:
                x, y = ds.x_test[i : i + batch_size], ds.y_test[i : i + batch_size]
            loss, hit = per_example(params, stats, x, y)
            losses.append(np.asarray(loss, np.float64))
            hits.append(np.asarray(hit, np.float64))
        loss, hit = np.concatenate(losses), np.concatenate(hits)
        se = lambda v: float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
        # standard errors over the evaluation examples (LM: windows of equal length)
        return {
            "eval_loss": float(loss.mean()),
            "accuracy": float(hit.mean()),
            "eval_loss_se": se(loss),
            "accuracy_se": se(hit),
            "eval_examples": int(len(loss)),
        }

    return evaluate


# --- the loop ------------------------------------------------------------------------------


class NonFiniteError(FloatingPointError):
    """The training loss or state turned NaN/Inf under ``config.on_nonfinite="abort"``."""


def _nonfinite_error(step: int, what: str, mngr: ocp.CheckpointManager, config) -> NonFiniteError:
    lr = config.optimizer.learning_rate * config.optimizer.get("lr_scale", 1.0)
    last = checkpoints.last_good(mngr)
    where = "" if last == "none saved" else f" in {mngr.directory}"
    return NonFiniteError(
        f"step {step}: the training {what} is NaN/Inf: the run diverged. Stopped without "
        f"saving (last good checkpoint: {last}{where}). Lower config.optimizer.learning_rate "
        f"(the peak rate is {lr:g}), wrap the optimizer in jaxcomm.skip_nonfinite (it skips "
        f"steps whose update is NaN/Inf), or set config.on_nonfinite=continue to train on."
    )


def _preemption_sync_point(counter: int) -> bool:
    """Whether every process reached JAX's preemption sync point (a SIGTERM to any of them).

    Multi-process runs under ``jax.distributed`` only, whose preemption service
    catches SIGTERM; ``counter`` grows by one per training call on every process.
    """
    if jax.process_count() == 1 or not jax.distributed.is_initialized():
        return False
    if not jax.config.jax_enable_preemption_service:
        return False
    return multihost_utils.reached_preemption_sync_point(counter)


def _jsonl(row: dict) -> str:
    """``row`` as one line of strict JSON: NaN/Inf written as null."""
    return json.dumps(runs.json_ready(row), allow_nan=False) + "\n"


def check_workdir(workdir: str) -> None:
    """Create ``workdir`` if needed and check that this process can write in it."""
    try:
        os.makedirs(workdir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".jaxcomm_write_check", dir=workdir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"--workdir {workdir!r}: cannot write there ({type(e).__name__}: "
            f"{e.strerror or e}); give a directory this process can create and write to"
        ) from None


def _read_metrics(path: str, upto: int) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def build_model(config: ml_collections.ConfigDict, ds: data_lib.Dataset) -> tuple:
    """``(model, params, batch_stats)``: ``config.model`` for ``ds``, initialised from the seed."""
    kwargs = dict(config.model.get("kwargs", {}))
    if not ds.is_lm:
        kwargs["num_classes"] = ds.num_classes
    model = models.build(config.model.name, **kwargs)
    variables = model.init(jax.random.key(config.seed), ds.example_input(), train=False)
    return model, variables["params"], variables.get("batch_stats", {})


def _auto_optimizer(config, params, mesh, workdir: str, lead: bool):
    """The optimizer with jaxcomm.auto's choice; ``workdir/auto_choice.json`` records it.

    A run resuming in ``workdir`` decides from the recorded costs, so the choice
    (and with it the optimizer state's layout) is the one its checkpoints hold.
    """
    path = os.path.join(workdir, "auto_choice.json")
    costs = rounds = None
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        costs = {r["name"]: r["seconds"] for r in recorded["rows"]}
        rounds = recorded.get("rounds")  # None in a record from before the rounds rule
        if rounds is not None:  # null: a round after the candidate left play
            rounds = {k: [float("nan") if x is None else x for x in v] for k, v in rounds.items()}
    tx = optimizers.make_optimizer(config, params, mesh, costs, rounds)
    kw = {k: v for k, v in config.compressor.kwargs.items() if k != "warmup_steps"}
    # the choice make_optimizer made (its measurement is cached), for the record
    choice = jaxcomm.policy.choose(params, mesh, AXIS, **kw, costs=costs, rounds=rounds)
    if lead and costs is None:
        os.makedirs(workdir, exist_ok=True)
        rows = [r._asdict() for r in choice.rows]
        record = {"choice": choice.name, "reason": choice.reason, "rows": rows,
                  "rounds": choice.rounds}  # fmt: skip
        with open(path + ".tmp", "w") as f:
            json.dump(runs.json_ready(record), f, indent=1, allow_nan=False)
        os.replace(path + ".tmp", path)
    return tx


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> Result:
    """Train per ``config``; write checkpoints, metrics.jsonl and metrics.png to ``workdir``.

    A training loss or state that turns NaN/Inf raises :class:`NonFiniteError`
    (nothing non-finite is saved) unless ``config.on_nonfinite="continue"``.
    In a multi-process run, a SIGTERM to any process (JAX's preemption
    service) makes every process save a checkpoint at the same step and return.
    """
    tx = validate(config)
    n = n_workers_of(config)
    check_workdir(workdir)
    ds = data_lib.load(config.data, n, seed=config.seed)
    if not ds.is_lm and config.data.batch_size > ds.x_train.shape[1]:
        raise ValueError(
            f"config.data.batch_size: {config.data.batch_size} > {ds.x_train.shape[1]} examples "
            "per worker"
        )
    model, params, stats = build_model(config, ds)
    mesh = distributed.global_mesh(AXIS, n)
    lead = jax.process_index() == 0  # only process 0 evaluates, writes metrics and plots
    if config.compressor.name == "auto":  # measured on this mesh, now that it exists
        tx = _auto_optimizer(config, params, mesh, workdir, lead)

    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape), t)
    state = TrainState(
        jnp.zeros((n,), jnp.int32), stack(params), stack(stats), stack(tx.init(params))
    )

    mngr = checkpoints.checkpoint_manager(workdir)
    try:
        start, state = checkpoints.restore_latest_good(mngr, state, n, workdir, config)
    except Exception:
        mngr.close()
        raise
    if start and lead:
        print(f"resumed from the checkpoint of step {start} in {workdir}", flush=True)
    state = distributed.shard_rows(state, mesh, AXIS)
    x_train, y_train = distributed.shard_rows((ds.x_train, ds.y_train), mesh, AXIS)

    report = jaxcomm.accounting.wire_report(tx, params, n)
    bytes_per_comm = sum(c.nbytes for c in report)
    link = netsim.Link.from_gbps(config.netsim.gbps, latency_s=config.netsim.latency_us * 1e-6)
    time_per_comm = netsim.exchange_time(report, n, link) if report else 0.0
    compute_s = config.netsim.get("compute_s", 0.0)

    t_compile = time.perf_counter()
    train_call = make_train_call(model, tx, mesh, ds, config).lower(state, x_train, y_train)
    train_call = train_call.compile()
    compile_s = time.perf_counter() - t_compile
    evaluate = make_eval(model, ds, config.get("eval_batch_size", 1024))
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    metrics = _read_metrics(metrics_path, start)
    if lead:
        with open(metrics_path, "w") as f:
            f.writelines(_jsonl(r) for r in metrics)
    train_s = metrics[-1].get("train_s", 0.0) if metrics else 0.0

    from tqdm import tqdm

    per_call, total = config.steps_per_call, config.num_train_steps
    # stop_after: end the run early on the same schedule (a probe of a long run's first steps)
    total = min(
        total, optimizers.positive_int(config.get("stop_after", 0), "config.stop_after", 0) or total
    )
    eval_every, ckpt_every = config.get("eval_every", 0), config.get("checkpoint_every", 0)
    abort = config.get("on_nonfinite", "abort") == "abort"
    show = config.get("progress", True) and lead
    bar = tqdm(total=total, initial=start, unit="step", disable=not show)
    name = f"timeline.p{jax.process_index()}.jsonl"  # each call's times (config.timeline)
    timeline = config.get("timeline", False) and open(os.path.join(workdir, name), "a")
    t0, step, losses, call_s = time.perf_counter(), start, [], []
    try:
        while step < total:
            t_call, wall_call = time.perf_counter(), time.time()
            state, call_losses = train_call(state, x_train, y_train)
            state = jax.block_until_ready(state)  # one collective program in flight (XLA:CPU)
            call_s.append(time.perf_counter() - t_call)
            times = {"step": step + per_call, "call_start": wall_call, "call_end": time.time()}
            train_s += call_s[-1]
            step += per_call
            call_losses = np.asarray(call_losses)  # the worker mean: alike on every process
            losses.extend(call_losses.tolist())
            if abort and not np.isfinite(call_losses).all():
                first = int(np.flatnonzero(~np.isfinite(call_losses))[0])
                raise _nonfinite_error(step - per_call + 1 + first, "loss", mngr, config)
            sent = optimizers.comm_steps(config, step) * bytes_per_comm
            bar.set_postfix(loss=f"{losses[-1]:.4f}", MB_sent=f"{sent / 1e6:.2f}", refresh=False)
            bar.update(per_call)
            if (eval_every and step % eval_every == 0) or step == total:
                # Worker 0's params live on process 0 (the mesh puts its devices first):
                # evaluating them needs no communication.
                # call_s: each training call's seconds since the last row (steady state: median)
                row = {"step": step, "loss": float(np.mean(losses)), "call_s": call_s}
                losses, call_s = [], []
                if lead:
                    variables = distributed.local_row((state.params, state.batch_stats), 0)
                    row.update(evaluate(*variables))
                    row.update(
                        wire_bytes=int(sent),
                        sim_time_s=optimizers.comm_steps(config, step) * time_per_comm
                        + step * compute_s,
                        train_s=train_s,
                        compile_s=compile_s,
                        processes=jax.process_count(),
                        wall_s=time.perf_counter() - t0,
                    )
                    with open(metrics_path, "a") as f:
                        f.write(_jsonl(row))
                    bar.write(
                        f"step {step}: loss {row['loss']:.4f} eval_loss {row['eval_loss']:.4f} "
                        f"acc {row['accuracy']:.4f} sent {sent / 1e6:.2f} MB "
                        f"train {train_s:.2f}s sim {row['sim_time_s']:.3f}s"
                    )
                    times["evaluated"] = time.time()
                metrics.append(row)
                # The others wait for it (a collective: a dead peer fails it at once), else
                # they compute meanwhile and process 0's next timed call has the CPU to itself
                multihost_utils.sync_global_devices(f"jaxcomm evaluated {step}")
            if timeline:
                timeline.write(json.dumps({**times, "free": time.time()}) + "\n")
            saved = None
            if (ckpt_every and step % ckpt_every == 0) or step == total:
                saved = checkpoints.save_state(mngr, step, state, config)
            preempted = _preemption_sync_point(step // per_call)
            if preempted and saved is None:
                saved = checkpoints.save_state(mngr, step, state, config)
            if saved is False and abort:
                raise _nonfinite_error(step, "state", mngr, config)
            if preempted:
                if lead:
                    what = "saved its checkpoint" if saved else "saved nothing (NaN/Inf state)"
                    bar.write(
                        f"preempted (SIGTERM) at step {step}: {what} in {workdir}; the same "
                        "command resumes the run"
                    )
                break
    finally:
        bar.close()
        timeline and timeline.close()
        mngr.wait_until_finished()
        mngr.close()
    if lead and metrics and config.get("plot", True):
        plot_metrics(metrics, os.path.join(workdir, "metrics.png"), config.netsim.gbps)
    host = distributed.gather(tuple(state))  # every process takes part; keys as key data
    return Result(TrainState(*host), metrics)


def plot_metrics(rows: list[dict], path: str, gbps: float) -> None:
    """Accuracy vs step, vs bytes sent per worker, vs simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = [100 * r["accuracy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    xs = [
        ([r["step"] for r in rows], "step"),
        ([r["wire_bytes"] / 1e6 for r in rows], "MB sent per worker"),
        ([r["sim_time_s"] for r in rows], f"simulated time at {gbps:g} Gbps (s)"),
    ]
    for ax, (x, label) in zip(axes, xs):
        ax.plot(x, acc, marker="o", ms=3)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
