r"""Can a fragment's exchange overlap inner steps on XLA:CPU + gloo? Measured, two processes.

Command (root for the shaped link; ~2 min):
  python -m experiments.bench.overlap --rate=10mbit --out=experiments/results/overlap.json

Two processes (``experiments.launch``, one CPU device each, gloo) on a link
shaped to ``--rate`` run, ``--repeats`` times each:

* ``inner``: ``--inner_steps`` inner steps (a local jitted computation of
  matmuls, no collective), each timed to completion: the inner-step time
  with no communication;
* ``exchange``: one all-reduce of a ``--fragment_mb`` fragment (the
  Streaming DiLoCo sync of one fragment), timed alone;
* ``async``: the exchange dispatched without waiting (JAX's asynchronous
  dispatch), then the inner steps, each timed, then the exchange waited for;
* ``thread``: the exchange run and waited for in a host thread while the
  main thread runs the inner steps.

The verdict of the issue: with a fragment in flight, the mean inner-step
time is <= 1.15x the inner step with no communication, and the wall clock
of the inner steps + the sync is <= 1.1 x max(inner steps, exchange).
Process 0 writes the mean inner-step time (and the slowest step), the
median wall clock of each kind and the verdict to ``--out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("rate", "10mbit", "shaped link rate; 'loopback' for none")
    flags.DEFINE_float("fragment_mb", 1.0, "fragment size in MB (float32)")
    flags.DEFINE_integer("dim", 768, "matmul size of an inner step")
    flags.DEFINE_integer("matmuls", 4, "matmuls per inner step")
    flags.DEFINE_integer("inner_steps", 10, "inner steps per sync (the overlap window)")
    flags.DEFINE_integer("repeats", 5, "repeats of each measurement (medians reported)")
    flags.DEFINE_string("out", "experiments/results/overlap.json", "JSON written by process 0")
    flags.DEFINE_bool("worker", False, "internal: run as one launched process")


def _programs():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    jaxcomm.distributed.initialize()
    mesh = jaxcomm.distributed.global_mesh("data")
    n = mesh.devices.size
    local = jax.local_devices()[0]
    x = jax.device_put(jnp.full((FLAGS.dim, FLAGS.dim), 1.0 / FLAGS.dim, jnp.float32), local)

    @jax.jit
    def inner(x):
        for _ in range(FLAGS.matmuls):
            x = jnp.tanh(x @ x + 0.5)
        return x

    m = int(FLAGS.fragment_mb * 1e6 // 4)
    frag = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones((1, m), np.float32), (n, m)
    )
    exchange = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )  # fmt: skip
    )
    return inner, x, exchange, frag


def _timed_inner(inner, x, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = inner(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


def _round(kind, inner, x, exchange, frag):
    """One measurement: (inner-step times, wall clock)."""
    t0 = time.perf_counter()
    if kind == "inner":
        times = _timed_inner(inner, x, FLAGS.inner_steps)
    elif kind == "exchange":
        exchange(frag).block_until_ready()
        times = []
    elif kind == "async":
        out = exchange(frag)
        times = _timed_inner(inner, x, FLAGS.inner_steps)
        out.block_until_ready()
    else:
        box = []
        th = threading.Thread(target=lambda: box.append(exchange(frag).block_until_ready()))
        th.start()
        times = _timed_inner(inner, x, FLAGS.inner_steps)
        th.join()
    return times, time.perf_counter() - t0


def worker() -> None:
    import jax
    import numpy as np

    from jaxcomm import distributed

    inner, x, exchange, frag = _programs()
    inner(x).block_until_ready()
    exchange(frag).block_until_ready()
    kinds = ("inner", "exchange", "async", "thread")
    rows = {k: {"step_s": [], "wall_s": []} for k in kinds}
    for _ in range(FLAGS.repeats):
        for kind in kinds:  # interleaved, so drift on a shared machine hits every kind alike
            distributed.barrier("overlap " + kind)
            times, wall = _round(kind, inner, x, exchange, frag)
            rows[kind]["step_s"] += times
            rows[kind]["wall_s"].append(wall)
    if jax.process_index() != 0:
        return
    mean = lambda v: float(np.mean(v)) if v else None
    result = {
        k: {"step_s": mean(r["step_s"]), "max_step_s": max(r["step_s"], default=None),
            "wall_s": float(np.median(r["wall_s"]))}
        for k, r in rows.items()
    }  # fmt: skip
    base, comm = result["inner"]["step_s"], result["exchange"]["wall_s"]
    window = result["inner"]["wall_s"]
    for kind in ("async", "thread"):
        r = result[kind]
        r["step_ratio"] = r["step_s"] / base
        r["wall_ratio"] = r["wall_s"] / max(window, comm)
        r["overlaps"] = r["step_ratio"] <= 1.15 and r["wall_ratio"] <= 1.1
    result["config"] = {
        k: getattr(FLAGS, k) for k in ("rate", "fragment_mb", "dim", "matmuls", "inner_steps",
                                       "repeats")
    }  # fmt: skip
    result["serial_s"] = window + comm
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1), flush=True)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.worker:
        worker()
        return
    flags_ = [f"--{k}={getattr(FLAGS, k)}" for k in ("fragment_mb", "dim", "matmuls",
                                                     "inner_steps", "repeats", "rate")]  # fmt: skip
    out = os.path.abspath(FLAGS.out)
    argv = [
        sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1",
        *([] if FLAGS.rate == "loopback" else [f"--rate={FLAGS.rate}"]), "--",
        sys.executable, "-m", "experiments.bench.overlap", "--worker", f"--out={out}", *flags_,
    ]  # fmt: skip
    subprocess.run(argv, check=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
