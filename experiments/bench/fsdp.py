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

Time to target (``--seeds=0,1,2``; may share the cores, nothing in them is
timed but the training calls' seconds, which the table does not use): each
variant trains the LM study's whole schedule once per seed on loopback, from
the study's init and on its batches (drawn as the harness draws them, so
``fsdp`` and ``replicated`` follow the study's dense trajectory), its
validation loss on the study's windows every ``eval_every`` steps, appended
to ``--trajectories`` (resumed). The table beside it
(:mod:`experiments.bench.fsdp_report`) gives each variant's finals against
dense FSDP's and its estimated time to target on each link of ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from absl import app, flags

import jaxcomm
from experiments import data as data_lib
from experiments import optimizers, train
from experiments.bench import fsdp_report
from experiments.configs import lm_shakespeare
from experiments.studies import runs, tables
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
    flags.DEFINE_list(
        "seeds",
        [],
        "trajectories instead of timing rows: each variant's whole "
        "schedule once per seed, on loopback, appended to --trajectories",
    )
    flags.DEFINE_string(
        "trajectories",
        "experiments/results/fsdp_trajectories.json",
        "JSON of the trajectories (resumed: a variant and seed in it is skipped)",
    )
    flags.DEFINE_integer("trajectory_steps", 0, "steps of a trajectory (0: the study's schedule)")
    flags.DEFINE_integer("eval_every", 0, "steps between evaluations (0: the study's)")


def _study(n: int, seed: int | None = None):
    """The study's dense config (``seed`` for its init and data), data, model and params."""
    config = lm_shakespeare.get_config("dense")
    if seed is not None:
        config.seed = seed
    ds = data_lib.load(config.data, n, seed=config.seed)
    model, params, _ = train.build_model(config, ds)
    return config, ds, model, params


def _loss(model):
    def loss_fn(p, batch):
        x, y = batch
        logits = model.apply({"params": p}, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def _sampler(config, ds, n: int):
    """Step ``i``'s global batch: each worker's windows drawn as the study's harness draws
    them (:func:`experiments.data.sample_batch` with
    :func:`experiments.data.worker_key`, then the step), worker after worker."""
    seq, per = config.data.seq_len, config.data.batch_size
    draw = jax.jit(lambda x, w, i: data_lib.sample_batch(
        x, None, data_lib.worker_key(config.seed, w), i, per, seq))  # fmt: skip

    def batch(i: int):
        xs, ys = zip(*(draw(ds.x_train[w], w, i) for w in range(n)))
        return np.concatenate(xs).astype(np.int32), np.concatenate(ys).astype(np.int32)

    return batch


def setup(n: int, seed: int | None = None):
    """The study's model's params, its loss and a global-batch sampler for ``n`` workers."""
    config, ds, model, params = _study(n, seed)
    return params, _loss(model), _sampler(config, ds, n)


def on_device(tree) -> int:
    """Bytes of ``tree`` on the first device (from the arrays' shardings)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


class Trainer(NamedTuple):
    """One variant built: its first state, ``run(state, batch) -> (state, loss)``, and
    ``memory(state)``, ``wire(state, batch)`` (bytes a step sends), ``full(state)`` (the
    whole model's params)."""

    state: Any
    run: Callable
    memory: Callable
    wire: Callable
    full: Callable


def build(name: str, mesh, params, loss_fn, seed: int = 0) -> Trainer:
    """A variant (:data:`VARIANTS`) with the study's AdamW on its warm-up + cosine
    schedule (element-wise: fsdp takes it as is)."""
    config = lm_shakespeare.get_config("dense")
    inner = optax.adamw(optimizers.learning_rate(config), **config.optimizer.kwargs)
    if name == "replicated":
        tx = optax.chain(jaxcomm.allreduce(axis_name=AXIS), inner)

        @jaxcomm.data_parallel(mesh, mean_outputs=(2,))
        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

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

        sent = jaxcomm.wire_bytes(tx, params, mesh.size)
        state = (params, jaxcomm.init_state(tx, params, mesh))
        return Trainer(state, run, memory, lambda *_: sent, lambda state: state[0])
    weights = {"fsdp_bf16w": "bfloat16", "fsdp_q8w": "int8", "fsdp_q8w_q8g": "int8"}
    grads = None
    if name == "fsdp_q8w_q8g":
        grads = jaxcomm.int8(
            axis_name=AXIS, error_feedback=True, exchange="reduce_scatter", min_size=0,
            key=jax.random.key(seed),  # the stochastic rounding's: one stream per seed
        )  # fmt: skip
    trainer = jaxcomm.fsdp(
        loss_fn, inner, mesh, weights=weights.get(name, "float32"), gradients=grads
    )
    return Trainer(
        trainer.init(params), trainer.step, trainer.memory,
        lambda state, b: sum(c.nbytes for c in trainer.wire_report(state, b)), trainer.params,
    )  # fmt: skip


def row(name: str, mesh, params, loss_fn, batch, steps: int, warmup: int) -> dict:
    t = build(name, mesh, params, loss_fn)
    state, times, loss = t.state, [], None
    b = batch(0)
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, loss = t.run(state, b)
        jax.block_until_ready(loss)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        b = batch(i + 1)
    return {
        "variant": name, "bytes_per_step": int(t.wire(state, b)), **t.memory(state),
        "step_ms": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
        "step_ms_max": 1e3 * max(times), "loss": float(np.asarray(loss)),
    }  # fmt: skip


def trajectory(name: str, mesh, seed: int, steps: int, eval_every: int) -> dict:
    """``steps`` of the study's schedule from seed ``seed``'s init and data: the validation
    loss (the study's windows, :func:`experiments.train.make_eval`) every ``eval_every``
    steps and at the last, with the training calls' seconds so far."""
    config, ds, model, params = _study(mesh.size, seed)
    loss_fn, batch = _loss(model), _sampler(config, ds, mesh.size)
    t = build(name, mesh, params, loss_fn, seed)
    evaluate = train.make_eval(model, ds, config.get("eval_batch_size", 1024))
    state, curve, train_s = t.state, [], 0.0
    for i in range(steps):
        b = batch(i)
        start = time.perf_counter()
        state, loss = t.run(state, b)
        jax.block_until_ready(loss)
        train_s += time.perf_counter() - start
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), t.full(state))
            curve.append({"step": i + 1, "loss": float(np.asarray(loss)),
                          **evaluate(local, None), "train_s": train_s})  # fmt: skip
    return {"variant": name, "seed": seed, "steps": steps, "curve": curve}


def worker(out: str) -> None:
    from jaxcomm import distributed

    info = distributed.initialize()
    mesh = distributed.global_mesh(AXIS)
    if FLAGS.seeds:  # one trajectory: one variant, one seed
        steps, every = _schedule()
        run = trajectory(FLAGS.variants[0], mesh, int(FLAGS.seeds[0]), steps, every)
        if info.process_id == 0:
            runs.save_json(out, run)
        return
    params, loss_fn, batch = setup(mesh.size)
    rows = [row(v, mesh, params, loss_fn, batch, FLAGS.steps, FLAGS.warmup) for v in FLAGS.variants]
    if info.process_id == 0:
        runs.save_json(out, {"processes": info.num_processes, "rows": rows})


def _schedule() -> tuple[int, int]:
    """A trajectory's steps and evaluation period (the flags', else the study's)."""
    config = lm_shakespeare.get_config("dense")
    return (FLAGS.trajectory_steps or config.num_train_steps,
            FLAGS.eval_every or config.eval_every)  # fmt: skip


def _launch(rate: str, out: str, *args: str) -> None:
    argv = [
        sys.executable, "-m", "experiments.launch", f"--processes={FLAGS.processes}",
        "--devices_per_process=1", *([] if rate == "loopback" else [f"--rate={rate}"]), "--",
        sys.executable, "-m", "experiments.bench.fsdp", f"--worker={out}", *args,
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def trajectories() -> dict:
    """Every variant x seed not yet in ``--trajectories``, one launch each, saved after each."""
    steps, every = _schedule()
    path = FLAGS.trajectories
    traj = {"processes": FLAGS.processes, "steps": steps, "eval_every": every, "runs": []}
    if os.path.exists(path):
        with open(path) as f:
            traj = json.load(f)
        if (traj["processes"], traj["steps"], traj["eval_every"]) != (FLAGS.processes, steps,
                                                                       every):  # fmt: skip
            raise ValueError(f"--trajectories={path} holds another schedule or process count")
    done = {(r["variant"], r["seed"]) for r in traj["runs"]}
    for seed in map(int, FLAGS.seeds):
        for v in FLAGS.variants:
            if (v, seed) in done:
                continue
            tmp, start = f"{path}.part", time.perf_counter()
            if os.path.exists(tmp):  # an earlier launch's, stopped before it was read
                os.remove(tmp)
            _launch("loopback", tmp, f"--variants={v}", f"--seeds={seed}",
                    f"--trajectory_steps={steps}", f"--eval_every={every}")  # fmt: skip
            with open(tmp) as f:
                run = json.load(f)
            os.remove(tmp)
            traj["runs"].append({**run, "process_wall_s": time.perf_counter() - start})
            runs.save_json(path, traj)
            print(f"{v} seed {seed}: val {run['curve'][-1]['eval_loss']:.4f}", flush=True)
    return traj


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
    if FLAGS.seeds:
        traj = trajectories()
        timing = None
        if os.path.exists(FLAGS.out):
            with open(FLAGS.out) as f:
                timing = json.load(f)
        text = fsdp_report.markdown(traj, timing)
        print(text)
        if os.path.abspath(FLAGS.trajectories) == os.path.join(
            tables.RESULTS, "fsdp_trajectories.json"
        ):
            tables.main([])  # its .md, generated beside the JSON
        return
    results = {"processes": FLAGS.processes, "links": []}
    for rate in FLAGS.rates:
        tmp = f"{FLAGS.out}.{rate}.part"
        _launch(rate, tmp, f"--variants={','.join(FLAGS.variants)}", f"--steps={FLAGS.steps}",
                f"--warmup={FLAGS.warmup}")  # fmt: skip
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
