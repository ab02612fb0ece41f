r"""Sharded training on the LM study's workload: bytes, memory and step time per variant.

Rows (``--variants``), all AdamW on the study's schedule and GPT
(:mod:`experiments.configs.lm_shakespeare`, 875,520 parameters):

- ``replicated``: :func:`jaxcomm.data_parallel` with the dense all-reduce
  (every worker holds the whole model and optimizer state);
- ``fsdp``: :func:`jaxcomm.fsdp`, float32 weight all-gather, dense
  reduce-scatter;
- ``fsdp_bf16w``: the weights gathered as bfloat16;
- ``fsdp_q8w``: the weights gathered as int8 with 256-entry block scales
  (ZeRO++'s qwZ);
- ``fsdp_q8w_q8g``: and the gradient reduce-scattered as int8 with error
  feedback over the all-to-all (qgZ-like).

Per row: the bytes one worker puts into the step's collectives (the byte
ledger's operands, equal to the compiled HLO's: ``tests/test_fsdp.py``),
parameter and optimizer bytes per worker read from the arrays' shardings, the
median step time after ``--warmup`` steps (each step waited for), and the
training loss of the last step. Each link (``--rates``; root and iproute2
for shaped ones) is one ``experiments.launch`` of ``--processes`` processes.

Command:
  python -m experiments.bench.fsdp --rates=loopback,100mbit --steps=30
Output: ``--out`` (JSON) and a markdown table beside it.
Time-to-target over the study's whole schedule is not measured here (the LM
study's harness runs replicated state only).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
import optax
from absl import app, flags

import jaxcomm
from experiments import data as data_lib
from experiments import optimizers, train
from experiments.configs import lm_shakespeare
from experiments.studies import runs
from jaxcomm.parallel import is_worker_state

FLAGS = flags.FLAGS
AXIS = "data"
VARIANTS = ("replicated", "fsdp", "fsdp_bf16w", "fsdp_q8w", "fsdp_q8w_q8g")


def define_flags() -> None:
    flags.DEFINE_list("variants", list(VARIANTS), "rows")
    flags.DEFINE_list("rates", ["loopback"], "links (loopback, or a tc rate such as 100mbit)")
    flags.DEFINE_integer("processes", 2, "processes (one CPU device each)")
    flags.DEFINE_integer("steps", 30, "timed steps per row (after the warm-up)")
    flags.DEFINE_integer("warmup", 5, "steps before timing (compile included)")
    flags.DEFINE_string("out", "experiments/results/fsdp.json", "JSON written")
    flags.DEFINE_string("worker", "", "internal: run the rows here and write this JSON")


def setup(n: int):
    """The study's model's params, its loss and a global-batch sampler for ``n`` workers."""
    config = lm_shakespeare.get_config("dense")
    ds = data_lib.load(config.data, n, seed=config.seed)
    model, params, _ = train.build_model(config, ds)

    def loss_fn(p, batch):
        x, y = batch
        logits = model.apply({"params": p}, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    seq, per = config.data.seq_len, config.data.batch_size

    def batch(i: int):
        """Step ``i``'s global batch: ``per`` windows from each worker's own stream (the same
        for every row)."""
        rng = np.random.default_rng([config.seed, i])
        xs, ys = [], []
        for w in range(n):
            stream = np.asarray(ds.x_train[w])
            starts = rng.integers(0, stream.shape[0] - seq - 1, per)
            win = np.stack([stream[s : s + seq + 1] for s in starts])
            xs.append(win[:, :-1])
            ys.append(win[:, 1:])
        return np.concatenate(xs).astype(np.int32), np.concatenate(ys).astype(np.int32)

    return params, loss_fn, batch


def on_device(tree) -> int:
    """Bytes of ``tree`` on the first device (from the arrays' shardings)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def row(name: str, mesh, params, loss_fn, batch, steps: int, warmup: int) -> dict:
    config = lm_shakespeare.get_config("dense")
    # the study's AdamW on its warm-up + cosine schedule (element-wise: fsdp takes it as is)
    inner = optax.adamw(optimizers.learning_rate(config), **config.optimizer.kwargs)
    n = mesh.size
    if name == "replicated":
        tx = optax.chain(jaxcomm.allreduce(axis_name=AXIS), inner)

        @jaxcomm.data_parallel(mesh, mean_outputs=(2,))
        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        state = (params, jaxcomm.init_state(tx, params, mesh))
        sent = jaxcomm.wire_bytes(tx, params, n)

        def run(state, b):
            p, s, loss = step(*state, b)
            return (p, s), loss

        def memory(state):
            comm = [x for x in jax.tree.leaves(state[1], is_leaf=is_worker_state)
                    if is_worker_state(x)]  # fmt: skip
            return {
                "params": on_device(state[0]),
                "opt_state": on_device(state[1]) - on_device(comm),
                "comm_state": on_device(comm),
            }
    else:
        weights = {"fsdp_bf16w": "bfloat16", "fsdp_q8w": "int8", "fsdp_q8w_q8g": "int8"}
        grads = None
        if name == "fsdp_q8w_q8g":
            grads = jaxcomm.int8(
                axis_name=AXIS, error_feedback=True, exchange="reduce_scatter", min_size=0,
                key=jax.random.key(0),
            )  # fmt: skip
        trainer = jaxcomm.fsdp(
            loss_fn, inner, mesh, weights=weights.get(name, "float32"), gradients=grads
        )
        state = trainer.init(params)
        run, memory = trainer.step, trainer.memory
        sent = None
    times, loss = [], None
    b = batch(0)
    for i in range(warmup + steps):
        t = time.perf_counter()
        state, loss = run(state, b)
        jax.block_until_ready(loss)
        if i >= warmup:
            times.append(time.perf_counter() - t)
        b = batch(i + 1)
    if sent is None:
        sent = sum(c.nbytes for c in trainer.wire_report(state, b))
    return {
        "variant": name, "bytes_per_step": int(sent), **memory(state),
        "step_ms": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
        "step_ms_max": 1e3 * max(times), "loss": float(np.asarray(loss)),
    }  # fmt: skip


def worker(out: str) -> None:
    from jaxcomm import distributed

    info = distributed.initialize()
    mesh = distributed.global_mesh(AXIS)
    params, loss_fn, batch = setup(mesh.size)
    rows = [row(v, mesh, params, loss_fn, batch, FLAGS.steps, FLAGS.warmup) for v in FLAGS.variants]
    if info.process_id == 0:
        runs.save_json(out, {"processes": info.num_processes, "rows": rows})


def markdown(results: dict) -> str:
    lines = [
        "Sharded training (`python -m experiments.bench.fsdp`), the LM study's GPT and AdamW, "
        f"{results['processes']} processes; bytes: one worker's collective operands per step; "
        "memory: one worker's parameters, optimizer state and gradient residuals; step: median "
        "(min–max) ms; loss: the last step's, on the same batches for every row.",
        "",
        "| link | variant | MB/step | vs fsdp | params MB | optimizer MB | residual MB "
        "| step ms | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for link in results["links"]:
        base = next((r for r in link["rows"] if r["variant"] == "fsdp"), None)
        for r in link["rows"]:
            ratio = f"{r['bytes_per_step'] / base['bytes_per_step']:.2f}x" if base else "—"
            lines.append(
                f"| {link['rate']} | {r['variant']} | {r['bytes_per_step'] / 1e6:.2f} | {ratio} "
                f"| {r['params'] / 1e6:.2f} | {r['opt_state'] / 1e6:.2f} "
                f"| {r.get('comm_state', 0) / 1e6:.2f} | {r['step_ms']:.0f} "
                f"({r['step_ms_min']:.0f}–{r['step_ms_max']:.0f}) | {r['loss']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    if FLAGS.worker:
        worker(FLAGS.worker)
        return
    results = {"processes": FLAGS.processes, "links": []}
    for rate in FLAGS.rates:
        tmp = f"{FLAGS.out}.{rate}.part"
        argv = [
            sys.executable, "-m", "experiments.launch", f"--processes={FLAGS.processes}",
            "--devices_per_process=1", *([] if rate == "loopback" else [f"--rate={rate}"]), "--",
            sys.executable, "-m", "experiments.bench.fsdp", f"--worker={tmp}",
            f"--variants={','.join(FLAGS.variants)}", f"--steps={FLAGS.steps}",
            f"--warmup={FLAGS.warmup}",
        ]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        with open(tmp) as f:
            part = json.load(f)
        os.remove(tmp)
        results["links"].append({"rate": rate, "rows": part["rows"]})
        print(
            f"{rate}: " + ", ".join(f"{r['variant']} {r['step_ms']:.0f} ms" for r in part["rows"])
        )
    results["command"] = " ".join(["python", "-m", "experiments.bench.fsdp", *sys.argv[1:]])
    runs.save_json(FLAGS.out, results)
    with open(os.path.splitext(FLAGS.out)[0] + ".md", "w") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    define_flags()
    app.run(main)
