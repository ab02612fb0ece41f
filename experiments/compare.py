r"""Compare gradient compressors on real data: accuracy, bytes, simulated network time.

Trains the same model on scikit-learn's digits across 8 simulated workers
(8 fake CPU devices; real devices unchanged) with each method, then prints
one table: final test accuracy, bytes each worker contributes per step,
compression vs dense fp32, and the communication time the whole run would
take on an 8-worker ring at 1 / 10 / 100 Gbps (``jaxcomm.netsim``, 10 µs
latency). Writes ``compare.json`` and ``compare.png`` to ``--outdir``.

Command (the README's main job; ~1 minute on 2 CPU cores):
  python -m experiments.compare
Longer run:
  python -m experiments.compare --steps 2000 --model mlp --hidden 256

Expected (quick preset): every method within ~2 points of dense fp32
(~96-97% test accuracy), top-k / threshold at 1% sending ~2% of dense bytes.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from absl import app, flags

import jaxcomm
from experiments import digits
from jaxcomm import netsim

AXIS = digits.AXIS
KEY = jax.random.key(0)

# label -> (factory of the full optimizer, learning-rate note). Methods whose
# transform does not exist in this version of jaxcomm are skipped.
METHODS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "dense fp32": lambda lr: optax.chain(jaxcomm.allreduce(axis_name=AXIS), optax.sgd(lr)),
    "bf16 cast": lambda lr: optax.chain(jaxcomm.cast(jnp.bfloat16, axis_name=AXIS), optax.sgd(lr)),
    "top-k 1% +EF": lambda lr: optax.chain(jaxcomm.topk(0.01, axis_name=AXIS), optax.sgd(lr)),
    "top-k 1% no EF": lambda lr: optax.chain(
        jaxcomm.topk(0.01, axis_name=AXIS, error_feedback=False), optax.sgd(lr)
    ),
    "threshold 1% +EF": lambda lr: optax.chain(
        jaxcomm.threshold(0.01, axis_name=AXIS), optax.sgd(lr)
    ),
    "random-k 10% +EF": lambda lr: optax.chain(
        jaxcomm.randomk(0.1, key=KEY, axis_name=AXIS), optax.sgd(lr)
    ),
}

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 400, "training steps (full local batch each)")
flags.DEFINE_enum("model", "mlp", ["logreg", "mlp"], "model")
flags.DEFINE_integer("hidden", 128, "MLP hidden width")
flags.DEFINE_float("lr", 0.3, "SGD learning rate, the same for every method")
flags.DEFINE_list("methods", list(METHODS), "which methods to run")
flags.DEFINE_list("gbps", ["1", "10", "100"], "link bandwidths for the simulated time")
flags.DEFINE_float("latency_us", 10.0, "per-message latency for the simulated time")
flags.DEFINE_string("outdir", "compare_out", "where to write compare.json and compare.png")


def run_method(label: str, split: digits.Split, params) -> dict:
    tx = METHODS[label](FLAGS.lr)
    t0 = time.perf_counter()
    result = digits.train(
        tx, steps=FLAGS.steps, model=FLAGS.model, hidden=FLAGS.hidden, split=split
    )
    wall = time.perf_counter() - t0
    report = jaxcomm.accounting.wire_report(tx, params, 8)
    row = {
        "method": label,
        "accuracy": result.accuracy,
        "train_loss": result.train_loss,
        "bytes_per_step": sum(c.nbytes for c in report),
        "traffic_per_step": jaxcomm.accounting.traffic_bytes(report, 8),
        "wall_s_here": wall,
    }
    for g in FLAGS.gbps:
        link = netsim.Link.from_gbps(float(g), latency_s=FLAGS.latency_us * 1e-6)
        row[f"comm_s_{g}gbps"] = FLAGS.steps * netsim.exchange_time(report, 8, link)
    return row


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.methods) - set(METHODS))
    if unknown:
        raise app.UsageError(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
    split = digits.load(8)
    params = digits.init_params(FLAGS.model, jax.random.key(0), hidden=FLAGS.hidden)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"digits, {FLAGS.model} ({n_params} params), 8 workers, {FLAGS.steps} steps, "
        f"sgd lr {FLAGS.lr}; comm time = steps x netsim ring time, {FLAGS.latency_us} us latency"
    )
    rows = [run_method(m, split, params) for m in FLAGS.methods]
    dense = next((r for r in rows if r["method"] == "dense fp32"), rows[0])
    head = f"{'method':<18} {'test acc':>8} {'bytes/step':>11} {'vs dense':>9}"
    head += "".join(f" {'comm @' + g + 'G':>11}" for g in FLAGS.gbps)
    print(head)
    for r in rows:
        r["compression"] = dense["traffic_per_step"] / max(r["traffic_per_step"], 1e-12)
        line = f"{r['method']:<18} {r['accuracy']:>8.4f} {r['bytes_per_step']:>11,d}"
        line += f" {r['compression']:>8.1f}x"
        line += "".join(f" {r[f'comm_s_{g}gbps']:>10.4f}s" for g in FLAGS.gbps)
        print(line)
    print("vs dense = dense ring traffic / method's traffic (all-gathers cost (n-1)x their piece)")
    os.makedirs(FLAGS.outdir, exist_ok=True)
    with open(os.path.join(FLAGS.outdir, "compare.json"), "w") as f:
        json.dump({"flags": FLAGS.flag_values_dict(), "rows": rows}, f, indent=1, default=str)
    _plot(rows, os.path.join(FLAGS.outdir, "compare.png"))
    print(f"wrote {FLAGS.outdir}/compare.json and compare.png")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["traffic_per_step"], 100 * r["accuracy"], s=40)
        ax.annotate(
            r["method"],
            (r["traffic_per_step"], 100 * r["accuracy"]),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker per step (ring/all-gather traffic, log)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits, 8 workers: accuracy vs communication")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
