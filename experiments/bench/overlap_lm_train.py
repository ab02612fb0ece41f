r"""The LM study's Streaming DiLoCo as users run it: each fragment's exchange overlapped.

The harness (:mod:`experiments.train`) runs ``steps_per_call`` steps in one
compiled call, so a Streaming DiLoCo fragment's exchange runs inside the step
that sends it (its ``delay`` only fixes when the result is merged). Here the
same variant of :mod:`experiments.configs.lm_shakespeare` (``--variant``:
``streaming``, ``streaming_int8``, ``streaming_q4``) trains with
``transform(overlap=True)`` through :class:`jaxcomm.loco.Overlap`: one compiled
call per inner step, and each fragment's exchange and outer step run in a
host thread during the ``delay`` steps that follow its send. The arithmetic is
the harness's (the rule, the model, each worker's batches, AdamW and its
schedule); ``tests/test_overlap_lm.py`` holds the two runs' curves equal.

It writes ``metrics.jsonl`` in the harness's row format (``step``, ``loss``:
the training loss's mean over the steps since the last row and over the
workers, ``eval_loss`` with its standard error and ``accuracy`` of worker 0's
params, ``train_s``: seconds of training steps, evaluations excluded, with
the waits for landing exchanges, ``wire_bytes``: the bytes sent so far, from
the rule's byte ledger), every ``--eval_every`` steps, so the LM study runs,
probes and judges these runs as it does the harness's. Before an evaluation
every exchange in flight is joined (:meth:`Overlap.drain`: exact) and the
losses are averaged across processes while no exchange is in flight (the
overlap needs the step to run no collective of its own); the other processes
wait for the evaluation at a barrier, as the harness's do. No checkpoints (the
study takes none).

Command (2 processes; ``experiments.launch`` sets the rendezvous)::

  python -m experiments.launch --processes=2 -- python -m experiments.bench.overlap_lm_train \
      --variant=streaming_int8 --workdir=runs/overlap_int8
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
import optax
from absl import app, flags
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import data as data_lib
from experiments import optimizers, train
from experiments.configs import lm_shakespeare
from jaxcomm import distributed

FLAGS = flags.FLAGS
AXIS = "data"
VARIANTS = ("streaming", "streaming_int8", "streaming_q4")


def define_flags() -> None:
    flags.DEFINE_enum("variant", "streaming_int8", VARIANTS, "the study's Streaming DiLoCo variant")
    flags.DEFINE_string("workdir", None, "where metrics.jsonl is written")
    flags.DEFINE_integer("seed", 0, "the run's seed (as the harness's config.seed)")
    flags.DEFINE_integer("steps", 0, "the schedule's steps (0: the config's)")
    flags.DEFINE_integer("stop_after", 0, "stop after this many steps of the schedule (0: all)")
    flags.DEFINE_integer("eval_every", 0, "steps between evaluations (0: the config's)")


def rule_of(config) -> jaxcomm.loco.StreamingDiLoCo:
    """The variant's rule, built from its config as the harness's optimizer is."""
    w = config.wrapper
    inner = optax.adamw(optimizers.learning_rate(config), **dict(config.optimizer.kwargs))
    comp = None
    if config.compressor.name != "allreduce":
        comp = optimizers.make_compressor(config)
    return jaxcomm.loco.StreamingDiLoCo(
        inner, every=int(w.every), fragments=int(w.fragments), delay=int(w.delay),
        mix=float(w.mix), axis_name=AXIS, compressor=comp,
    )  # fmt: skip


def make_step(model, tx, mesh, ds: data_lib.Dataset, config):
    """One inner step per call, per worker: ``(params, opt_state, x, y, step) -> (params,
    opt_state, loss, step + 1)``, every leaf with a leading worker axis (no collective)."""
    batch, seq = config.data.batch_size, ds.seq_len

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, x, y, count):
        key = data_lib.worker_key(config.seed, jax.lax.axis_index(AXIS))
        bx, by = data_lib.sample_batch(x, y, key, count, batch, seq)
        loss, grads = jax.value_and_grad(loss_fn)(params, bx, by)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, count + 1

    def per_worker(*args):
        out = step(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    # no donation: a fragment's exchange thread still reads the params a step returned
    spec = P(AXIS)
    return jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=spec, out_specs=spec))


def _local_mean(losses: list) -> np.ndarray:
    """``[sum, count]`` of this process's rows of the per-worker losses."""
    rows = [np.asarray(s.data) for x in losses for s in x.addressable_shards]
    return np.array([sum(float(r.sum()) for r in rows), sum(r.size for r in rows)])


def run(config, workdir: str) -> None:
    """Train ``config`` (a Streaming DiLoCo variant) with the overlap; write the rows."""
    n = train.n_workers_of(config)
    ds = data_lib.load(config.data, n, seed=config.seed)
    model, params, _ = train.build_model(config, ds)
    mesh = distributed.global_mesh(AXIS, n)
    lead = jax.process_index() == 0
    rule = rule_of(config)
    tx = rule.transform(overlap=True)
    stack = lambda t: jax.tree.map(
        lambda a: np.broadcast_to(np.asarray(a)[None], (n,) + a.shape), t
    )
    p, s = distributed.shard_rows((stack(params), stack(tx.init(params))), mesh, AXIS)
    count = distributed.shard_rows(np.zeros((n,), np.int32), mesh, AXIS)
    x, y = distributed.shard_rows((ds.x_train, ds.y_train), mesh, AXIS)
    fn, ov = make_step(model, tx, mesh, ds, config), jaxcomm.loco.Overlap(rule, mesh)
    per_sync = sum(c.nbytes for c in jaxcomm.accounting.wire_report(rule.transform(), params, n))
    evaluate = train.make_eval(model, ds, config.get("eval_batch_size", 1024))
    total = config.num_train_steps
    stop = min(total, config.get("stop_after", 0) or total)
    every = config.eval_every
    path = os.path.join(workdir, "metrics.jsonl")
    if lead:
        os.makedirs(workdir, exist_ok=True)
        open(path, "w").close()
    ov.warm_up(p, s)  # compile each fragment's exchange now, not in its first send's thread
    train_s, losses, t0 = 0.0, [], time.perf_counter()
    for step in range(1, stop + 1):
        t = time.perf_counter()
        p, s, loss, count = jax.block_until_ready(ov.step(fn, p, s, x, y, count))
        losses.append(loss)
        if step % every == 0 or step == stop:
            s = jax.block_until_ready(ov.drain(s))  # no exchange in flight from here
            train_s += time.perf_counter() - t
            mean = distributed.gather(_local_mean(losses)).reshape(-1, 2).sum(0)
            losses = []
            if lead:
                row = {"step": step, "loss": float(mean[0] / mean[1]),
                       **evaluate(distributed.local_row(p, 0), {}), "train_s": train_s,
                       "wire_bytes": int(optimizers.comm_steps(config, step) * per_sync),
                       "processes": jax.process_count(), "wait_s": ov.wait_s,
                       "wall_s": time.perf_counter() - t0}  # fmt: skip
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            # the others wait for the evaluation, as the harness's do (experiments.train)
            multihost_utils.sync_global_devices(f"jaxcomm evaluated {step}")
        else:
            train_s += time.perf_counter() - t


def main(argv) -> None:
    del argv
    distributed.initialize()
    config = lm_shakespeare.get_config(FLAGS.variant)
    config.seed = FLAGS.seed
    if FLAGS.steps:
        config.num_train_steps = FLAGS.steps
    config.stop_after = FLAGS.stop_after
    if FLAGS.eval_every:
        config.eval_every = FLAGS.eval_every
    run(config, FLAGS.workdir)


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("workdir")
    app.run(main)
