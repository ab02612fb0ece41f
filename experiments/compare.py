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

# label -> factory of the full optimizer (learning rate -> optax transform).
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
    # DGC keeps momentum 0.9 itself (lr scaled by 1 - momentum); no warm-up, so the
    # reported bytes are the steady-state 1%.
    "DGC 1%": lambda lr: jaxcomm.dgc_sgd(lr * 0.1, 0.01, axis_name=AXIS),
    "PowerSGD r=2": lambda lr: optax.chain(
        jaxcomm.powersgd(2, key=KEY, axis_name=AXIS), optax.sgd(lr)
    ),
    "EF-sign": lambda lr: optax.chain(jaxcomm.ef_sign(axis_name=AXIS), optax.sgd(lr)),
    "QSGD 16 levels": lambda lr: optax.chain(
        jaxcomm.qsgd(16, key=KEY, axis_name=AXIS), optax.sgd(lr)
    ),
    "local SGD H=8": lambda lr: jaxcomm.local_sgd(optax.sgd(lr), every=8, axis_name=AXIS),
}
# Methods that communicate on one step in `every` (wire_report describes a communicating step).
EVERY = {"local SGD H=8": 8}
QUICK_METHODS = [m for m in METHODS if m != "top-k 1% no EF"]

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", True, "quick preset (400 steps, MLP 128); --noquick: 2000, MLP 256")
flags.DEFINE_integer("steps", None, "training steps (full local batch each); default per preset")
flags.DEFINE_enum("model", "mlp", ["logreg", "mlp"], "model")
flags.DEFINE_integer("hidden", None, "MLP hidden width; default per preset")
flags.DEFINE_integer("eval_every", 20, "evaluate every this many steps (time-to-accuracy)")
flags.DEFINE_float("target_drop", 0.01, "target accuracy = dense fp32's final accuracy - this")
flags.DEFINE_float("lr", 0.3, "SGD learning rate, the same for every method")
flags.DEFINE_list("methods", QUICK_METHODS, "which methods to run")
flags.DEFINE_list("gbps", ["1", "10", "100"], "link bandwidths for the simulated time")
flags.DEFINE_float("latency_us", 10.0, "per-message latency for the simulated time")
flags.DEFINE_string("outdir", "compare_out", "where to write compare.json and compare.png")


def run_method(label: str, split: digits.Split, params, steps: int, hidden: int) -> dict:
    tx = METHODS[label](FLAGS.lr)
    t0 = time.perf_counter()
    curve = digits.train_curve(
        tx, steps=steps, eval_every=FLAGS.eval_every, model=FLAGS.model, hidden=hidden, split=split
    )
    wall = time.perf_counter() - t0
    report = jaxcomm.accounting.wire_report(tx, params, 8)
    every = EVERY.get(label, 1)
    row = {
        "method": label,
        "accuracy": curve.result.accuracy,
        "train_loss": curve.result.train_loss,
        "bytes_per_step": sum(c.nbytes for c in report) / every,
        "traffic_per_step": jaxcomm.accounting.traffic_bytes(report, 8) / every,
        "curve_steps": curve.steps,
        "curve_accuracy": curve.accuracy,
        "comm_every": every,
        "wall_s_here": wall,
    }
    for g in FLAGS.gbps:
        link = netsim.Link.from_gbps(float(g), latency_s=FLAGS.latency_us * 1e-6)
        per_comm = netsim.exchange_time(report, 8, link)
        row[f"comm_per_step_{g}gbps"] = per_comm / every
        row[f"comm_s_{g}gbps"] = (steps // every) * per_comm
    return row


def time_to_accuracy(row: dict, target: float) -> dict[str, float | None]:
    """Simulated communication time at which ``row`` first reaches ``target`` (None: never)."""
    hit = next((s for s, a in zip(row["curve_steps"], row["curve_accuracy"]) if a >= target), None)
    out = {}
    for g in FLAGS.gbps:
        key = f"comm_per_step_{g}gbps"
        out[g] = None if hit is None else (hit // row["comm_every"]) * row[key] * row["comm_every"]
    return out


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.methods) - set(METHODS))
    if unknown:
        raise app.UsageError(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
    steps = FLAGS.steps or (400 if FLAGS.quick else 2000)
    hidden = FLAGS.hidden or (128 if FLAGS.quick else 256)
    if steps % FLAGS.eval_every:
        raise app.UsageError(f"--steps {steps} must be a multiple of --eval_every")
    split = digits.load(8)
    params = digits.init_params(FLAGS.model, jax.random.key(0), hidden=hidden)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"digits, {FLAGS.model} ({n_params} params), 8 workers, {steps} steps, "
        f"sgd lr {FLAGS.lr}; comm time = netsim ring time per communicating step, "
        f"{FLAGS.latency_us} us latency"
    )
    rows = []
    for m in FLAGS.methods:
        rows.append(run_method(m, split, params, steps, hidden))
        print(f"  {m}: acc {rows[-1]['accuracy']:.4f} ({rows[-1]['wall_s_here']:.1f}s)", flush=True)
    dense = next((r for r in rows if r["method"] == "dense fp32"), rows[0])
    target = dense["accuracy"] - FLAGS.target_drop
    head = f"{'method':<17} {'test acc':>8} {'bytes/step':>11} {'vs dense':>9}"
    head += "".join(f" {'tta @' + g + 'G':>10}" for g in FLAGS.gbps)
    print(head)
    for r in rows:
        r["compression"] = dense["traffic_per_step"] / max(r["traffic_per_step"], 1e-12)
        r["time_to_target_s"] = time_to_accuracy(r, target)
        line = f"{r['method']:<17} {r['accuracy']:>8.4f} {r['bytes_per_step']:>11,.0f}"
        line += f" {r['compression']:>8.1f}x"
        for g in FLAGS.gbps:
            t = r["time_to_target_s"][g]
            line += f" {'never':>10}" if t is None else f" {t:>9.4f}s"
        print(line)
    print(
        "bytes/step = what one worker contributes per step (averaged over local SGD's rounds); "
        "vs dense = dense ring traffic / method's traffic (all-gathers cost (n-1)x their piece); "
        f"tta = simulated comm time to reach {100 * target:.1f}% test accuracy "
        f"(dense fp32 final - {100 * FLAGS.target_drop:g} pt), evaluated every "
        f"{FLAGS.eval_every} steps"
    )
    os.makedirs(FLAGS.outdir, exist_ok=True)
    with open(os.path.join(FLAGS.outdir, "compare.json"), "w") as f:
        json.dump(
            {"flags": FLAGS.flag_values_dict(), "target": target, "rows": rows},
            f,
            indent=1,
            default=str,
        )
    _plot(rows, os.path.join(FLAGS.outdir, "compare.png"))
    print(f"wrote {FLAGS.outdir}/compare.json and compare.png")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        # a legend, not annotations: several methods share an accuracy and overlap
        ax.scatter(r["traffic_per_step"], 100 * r["accuracy"], s=40, label=r["method"])
        g = FLAGS.gbps[len(FLAGS.gbps) // 2]
        per = r[f"comm_per_step_{g}gbps"]
        ax2.plot(
            [s * per for s in r["curve_steps"]],
            [100 * a for a in r["curve_accuracy"]],
            label=r["method"],
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker per step (ring/all-gather traffic, log)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits, 8 workers: accuracy vs communication")
    ax.grid(alpha=0.3)
    ax2.set_xscale("symlog", linthresh=1e-4)
    ax2.set_xlabel(f"simulated communication time at {g} Gbps (s)")
    ax2.set_ylabel("test accuracy (%)")
    ax2.set_ylim(80, 100)
    ax2.legend(fontsize=7)
    ax.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
