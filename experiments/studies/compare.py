r"""Compare gradient compressors on real data: accuracy, bytes, and time to accuracy per link rate.

Trains the same MLP (256 hidden units) on scikit-learn's digits across 8
simulated workers (8 fake CPU devices; real devices unchanged) with each
method (a variant of ``experiments/configs/digits_compare.py``, the method
registry: add a method there), then prints one table: final test accuracy and training loss, bytes
each worker sends per step, compression vs dense fp32, the measured compute
per step, and the time to reach the target (dense fp32's final accuracy
minus 1 point) on an 8-worker ring at each link rate.

Data: by default the training set is dealt to workers sorted by label
(``--shards=skewed``: each worker holds one or two digits), so the workers'
gradients disagree and a biased compressor without error feedback drifts;
``--shards=iid`` deals a shuffled split, on which the methods differ much
less (digits is easy: sign without EF was within ~1 point of EF-sign in our
runs).

Time axis = measured compute + modelled communication:

* compute: steps x the measured seconds per compiled training step on this
  machine (median over evaluation chunks; compile and evaluation excluded).
  It covers every worker's forward, backward, encode, decode and in-memory
  exchange; the 8 workers share this machine's cores, so it overstates one
  worker's compute.
* communication: per method, ``jaxcomm.accounting.wire_report`` ->
  ``jaxcomm.netsim.exchange_time`` at each rate (ring all-reduce /
  all-gather, ``--latency_us`` per message), added after the compute (no
  overlap). ``--wire=native`` (default) charges the bytes the algorithm sends,
  as GPU (NCCL) and TPU move them; ``--wire=xla_cpu`` widens bf16 all-reduces
  to f32 as XLA:CPU does.

The baseline is dense all-reduce in fp32 and in bf16. Measured (not modelled)
multi-process runs over shaped links: ``python -m experiments.studies.netstudy``.

Command (the README's main job; ~1 minute on 2 CPU cores, 1.5 on a busy machine):
  python -m experiments.studies.compare
Longer run (1000 steps, MLP 512):
  python -m experiments.studies.compare --noquick
Faster look (fewer methods / steps):
  python -m experiments.studies.compare --methods="dense fp32,EF-sign,sign no EF" --steps=200

Expected (defaults, measured here): dense fp32 and bf16 97.1% test accuracy
(target 96.1%); EF-sign 97.1% (training loss 0.009), sign without EF 95.8%
(loss 0.060), never reaching the target; at 0.01 Gbps PowerSGD, EF-sign and
top-k reach the target first (3.5-10x faster than dense fp32), at 10 Gbps,
where the measured compute decides, dense fp32 does (PowerSGD, of similar
compute, close behind). Writes ``compare.json`` and ``compare.png`` to
``--workdir``.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json
import sys
from collections.abc import Sequence

import jax
from absl import app, flags
from tqdm import tqdm

from experiments import digits
from experiments.configs import digits_compare
from experiments.studies import tta

DEFAULT_METHODS = [
    "dense fp32",
    "dense bf16",
    "top-k 1% +EF",
    "threshold 1% +EF",
    "DGC 1%",
    "PowerSGD r=2",
    "EF-sign",
    "sign no EF",
    "QSGD 16 levels",
    "local SGD H=8",
]

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "shards", "skewed", ["skewed", "iid"], "training data per worker: sorted by label, or shuffled"
)
flags.DEFINE_bool("quick", True, "default preset (400 steps, MLP 256); --noquick: 1000, MLP 512")
flags.DEFINE_integer("steps", None, "training steps (full local shard each); default per preset")
flags.DEFINE_enum("model", "mlp", ["logreg", "mlp"], "model")
flags.DEFINE_integer("hidden", None, "MLP hidden width; default per preset")
flags.DEFINE_integer("eval_every", 20, "evaluate every this many steps (time-to-accuracy)")
flags.DEFINE_float("target_drop", 0.01, "target accuracy = dense fp32's final accuracy - this")
flags.DEFINE_float("lr", 0.5, "SGD learning rate, the same for every method")
flags.DEFINE_list(
    "methods",
    DEFAULT_METHODS,
    f"which methods to run: digits_compare variants, of {list(digits_compare.VARIANTS)}",
)
flags.DEFINE_list("gbps", ["0.01", "0.1", "1", "10"], "link rates (Gbit/s) for the time axis")
flags.DEFINE_float("latency_us", 10.0, "per-message latency of the modelled link")
flags.DEFINE_enum("wire", "native", list(tta.WIRES), "bytes charged: native (GPU/TPU) or xla_cpu")
flags.DEFINE_string("workdir", "compare_out", "where compare.json and compare.png go")
flags.DEFINE_bool("progress", True, "show a progress bar (stderr)")


def main(argv: Sequence[str]) -> None:
    del argv
    unknown = [m for m in FLAGS.methods if m not in digits_compare.VARIANTS]
    if unknown:
        raise app.UsageError(
            f"--methods: unknown {unknown}; choose from {list(digits_compare.VARIANTS)}"
        )
    FLAGS.steps = FLAGS.steps or (400 if FLAGS.quick else 1000)
    FLAGS.hidden = FLAGS.hidden or (256 if FLAGS.quick else 512)
    if FLAGS.steps % FLAGS.eval_every:
        raise app.UsageError(f"--steps {FLAGS.steps} must be a multiple of --eval_every")
    gbps = [float(g) for g in FLAGS.gbps]
    split = digits.load(8)
    if FLAGS.shards == "skewed":
        split = digits.label_skewed(split)
    params = digits.init_params(FLAGS.model, jax.random.key(0), hidden=FLAGS.hidden)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"digits, {FLAGS.model} {FLAGS.hidden} ({n_params:,} params), 8 workers "
        f"({jax.device_count()} {jax.default_backend()} devices), {FLAGS.steps} steps, "
        f"sgd lr {FLAGS.lr}, {FLAGS.shards} shards",
        flush=True,
    )
    bar = tqdm(
        total=FLAGS.steps * len(FLAGS.methods),
        unit="step",
        disable=not FLAGS.progress,
        file=sys.stderr,
    )
    runs = []
    for m in FLAGS.methods:
        bar.set_description(m)
        last = [0]

        def advance(step: int, acc: float, last=last) -> None:
            bar.update(step - last[0])
            bar.set_postfix(acc=f"{acc:.3f}")
            last[0] = step

        runs.append(
            tta.run(
                m,
                split=split,
                steps=FLAGS.steps,
                eval_every=FLAGS.eval_every,
                lr=FLAGS.lr,
                model=FLAGS.model,
                hidden=FLAGS.hidden,
                on_chunk=advance,
            )
        )
    bar.close()
    dense = next((r for r in runs if r.method == "dense fp32"), runs[0])
    target = dense.final_accuracy - FLAGS.target_drop
    kw = {"latency_us": FLAGS.latency_us, "wire": FLAGS.wire}
    print(tta.summary(runs, target, gbps, **kw))
    os.makedirs(FLAGS.workdir, exist_ok=True)
    out = tta.to_json(runs, target, gbps, **kw)
    keys = ("shards", "steps", "model", "hidden", "lr", "eval_every")
    out["flags"] = {k: FLAGS[k].value for k in keys}
    with open(os.path.join(FLAGS.workdir, "compare.json"), "w") as f:
        json.dump(out, f, indent=1)
    tta.plot(runs, target, gbps, os.path.join(FLAGS.workdir, "compare.png"), **kw)
    print(f"wrote {FLAGS.workdir}/compare.json and compare.png")


if __name__ == "__main__":
    app.run(main)
