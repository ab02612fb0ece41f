r"""Accuracy vs number of synchronisations: local SGD, DiLoCo, delayed averaging, staleness.

Trains on scikit-learn digits over 8 workers (``experiments.digits``: full
batch per worker shard, one compiled ``shard_map``, params per worker) with
the same data and number of steps for every method:

* synchronous SGD (``jaxcomm.allreduce`` + SGD): one all-reduce per step;
* ``jaxcomm.local_sgd`` with ``every`` in ``--every`` (and ``--warmup_steps``);
* ``jaxcomm.diloco`` (inner SGD, outer Nesterov SGD 0.7/0.9) with the same ``every``;
* ``jaxcomm.delayed_averaging`` with ``delay`` in ``--delays`` (still one
  all-reduce per step, but its result is used ``delay`` steps later);
* ``jaxcomm.stale`` around synchronous SGD with staleness in ``--staleness``
  (delayed like DGA, without the correction).

Synchronisations are read from the optimizer state (counters incremented
only when the exchange executes). Accuracy is the test accuracy of worker 0's
params and of the mean of the workers' params; bytes are one worker's
all-reduce payload (``jaxcomm.wire_bytes``) times the synchronisations.
The default ``--steps 256`` is a multiple of every ``every``, so every run
ends on a synchronisation.

Command (about 10 s on a 2-core CPU; the MLP line about 20 s)::

  python -m experiments.bench.sync_sweep --outdir sync_sweep_out
  python -m experiments.bench.sync_sweep --model mlp --steps 512 --every 1,8,32

Prints a table and writes ``sync_sweep.json`` to ``--outdir``. Expected
(logreg, 256 steps): synchronous SGD 96.0%; local SGD and DiLoCo within about
half a point of it for every ``every`` up to 64 (4 synchronisations instead of
256), the cost showing in local SGD's train loss (0.069 -> 0.091); delayed
averaging with delay 4 within half a point. With ``--model mlp --steps 512``
local SGD every=64 loses 0.7 points and DiLoCo (whose outer Nesterov step
multiplies the step size) overfits, 2-3 points below.
"""

from __future__ import annotations

import json
import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jaxcomm  # noqa: E402
from experiments import digits  # noqa: E402
from jaxcomm import sync  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags; defined only when run as a program, so that importing this
    module does not clash with other experiments' flags of the same name."""
    flags.DEFINE_string("outdir", "sync_sweep_out", "Where sync_sweep.json goes.")
    flags.DEFINE_integer("steps", 256, "Training steps (the same for every method).")
    flags.DEFINE_float("lr", 0.5, "SGD learning rate (inner learning rate for DiLoCo).")
    flags.DEFINE_list("every", ["1", "4", "16", "64"], "Local steps per synchronisation.")
    flags.DEFINE_list("delays", ["0", "1", "4"], "Delays for delayed gradient averaging.")
    flags.DEFINE_list(
        "staleness", ["1", "4"], "Staleness for stale synchronous SGD (may be empty)."
    )
    flags.DEFINE_integer(
        "warmup_steps", 0, "Post-local SGD: initial steps of every-step averaging."
    )
    flags.DEFINE_bool("diloco", True, "Also run DiLoCo for each value of --every.")
    flags.DEFINE_enum("model", "logreg", ["logreg", "mlp"], "Model (see experiments.digits).")
    flags.DEFINE_integer("n_workers", 8, "Workers (fake CPU devices on CPU).")
    flags.DEFINE_integer("seed", 0, "Data split and init seed.")


AX = digits.AXIS


def _syncs(method: str, state) -> int:
    """Synchronisations executed, from worker 0's optimizer state."""
    first = jax.tree.map(lambda x: np.asarray(x)[0], state)
    if method in ("local_sgd", "diloco"):
        return int(first.syncs)
    if method == "delayed_averaging":
        return int(first.count)
    if method == "stale":
        return int(first.inner_state[0].count)
    return int(first[0].count)  # chain(allreduce, sgd): the compressor's step counter


def configs() -> list[tuple[str, str, optax.GradientTransformation]]:
    lr = FLAGS.lr
    dense = lambda: optax.chain(jaxcomm.allreduce(axis_name=AX), optax.sgd(lr))
    out = [("sync_sgd", "", dense())]
    for every in map(int, FLAGS.every):
        tx = sync.local_sgd(
            optax.sgd(lr), every=every, axis_name=AX, warmup_steps=FLAGS.warmup_steps
        )
        out.append(("local_sgd", f"every={every}", tx))
    if FLAGS.diloco:
        for every in map(int, FLAGS.every):
            out.append(
                ("diloco", f"every={every}", sync.diloco(optax.sgd(lr), every=every, axis_name=AX))
            )
    for delay in map(int, FLAGS.delays):
        tx = sync.delayed_averaging(optax.sgd(lr), delay=delay, axis_name=AX)
        out.append(("delayed_averaging", f"delay={delay}", tx))
    for s in map(int, FLAGS.staleness):
        out.append(("stale", f"staleness={s}", sync.stale(dense(), staleness=s)))
    return out


def main(argv):
    del argv
    split = digits.load(FLAGS.n_workers, seed=FLAGS.seed)
    params = digits.init_params(FLAGS.model, jax.random.key(FLAGS.seed))
    rows = []
    header = (
        f"{'method':18s} {'setting':14s} {'syncs':>6s} {'MB/worker':>9s} {'acc w0':>7s} "
        f"{'acc avg':>7s} {'loss':>7s} {'time':>5s}"
    )
    print(f"digits, {FLAGS.model}, {FLAGS.n_workers} workers, {FLAGS.steps} steps, lr {FLAGS.lr}")
    print(header)
    print("-" * len(header))
    for method, setting, tx in configs():
        t0 = time.time()
        r = digits.train(
            tx,
            steps=FLAGS.steps,
            model=FLAGS.model,
            n_workers=FLAGS.n_workers,
            seed=FLAGS.seed,
            split=split,
        )
        seconds = time.time() - t0
        mean_params = jax.tree.map(lambda a: np.asarray(a).mean(0), r.params)
        syncs = _syncs(method, r.opt_state)
        per_sync = jaxcomm.wire_bytes(tx, params, FLAGS.n_workers)
        row = {
            "method": method,
            "setting": setting,
            "steps": FLAGS.steps,
            "syncs": syncs,
            "bytes_per_sync": per_sync,
            "bytes_total": per_sync * syncs,
            "accuracy": r.accuracy,
            "accuracy_mean_params": digits.accuracy(mean_params, split.x_test, split.y_test),
            "train_loss": r.train_loss,
            "seconds": seconds,
        }
        rows.append(row)
        print(
            f"{method:18s} {setting:14s} {syncs:6d} {row['bytes_total'] / 1e6:9.3f} "
            f"{row['accuracy']:7.4f} {row['accuracy_mean_params']:7.4f} "
            f"{row['train_loss']:7.4f} {seconds:5.1f}"
        )
    os.makedirs(FLAGS.outdir, exist_ok=True)
    path = os.path.join(FLAGS.outdir, "sync_sweep.json")
    flags_used = {
        k: FLAGS[k].value
        for k in (
            "steps",
            "lr",
            "every",
            "delays",
            "staleness",
            "warmup_steps",
            "model",
            "n_workers",
            "seed",
        )
    }
    with open(path, "w") as f:
        json.dump({"flags": flags_used, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
