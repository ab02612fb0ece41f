r"""Does a data-parallel loop on XLA:CPU fake devices finish without block_until_ready?

Each run is a fresh process with 8 fake CPU devices: a 4-layer 256-wide MLP,
top-k 1% + momentum SGD through :func:`jaxcomm.data_parallel`, ``--steps``
steps dispatched back to back with no ``block_until_ready``. It runs
``--runs`` times with the helper's default (on CPU: wait for the previous
step before dispatching the next) and ``--runs`` times with
``wait_previous=False`` (JAX's asynchronous dispatch), and counts the runs
that finish, and those that abort on XLA:CPU's rendezvous timeout (40 s).

Command (about 1 min for the default; an aborting run costs its 40 s timeout):
  python -m experiments.bench.dispatch --runs=10 --out=experiments/results/dispatch.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS

LOOP = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
from jax.sharding import NamedSharding, PartitionSpec as P

steps, wait = int(sys.argv[1]), {"default": None, "async": False}[sys.argv[2]]
rng = np.random.default_rng(0)
params = {f"w{i}": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32) for i in range(4)}


def loss_fn(p, b):
    for i in range(4):
        b = jnp.tanh(b @ p[f"w{i}"])
    return jnp.mean(b**2)


mesh = jax.make_mesh((8,), ("data",))
tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.05, momentum=0.9))


def step(p, s, b):
    u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
    return optax.apply_updates(p, u), s


step = jaxcomm.data_parallel(step, mesh, wait_previous=wait)
p, s = params, jaxcomm.init_state(tx, params, mesh)
b = jax.device_put(rng.normal(size=(64, 256)).astype(np.float32), NamedSharding(mesh, P("data")))
for _ in range(steps):
    p, s = step(p, s, b)
jax.block_until_ready(p)
print("finished")
"""


def define_flags() -> None:
    flags.DEFINE_integer("runs", 10, "runs per mode")
    flags.DEFINE_integer("steps", 200, "steps per run")
    flags.DEFINE_string("out", "experiments/results/dispatch.json", "JSON written")


def one_run(mode: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", LOOP, str(steps), mode], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    out = r.stdout + r.stderr
    return {
        "mode": mode,
        "finished": r.returncode == 0 and "finished" in r.stdout,
        "returncode": r.returncode,
        "rendezvous_timeout": "Termination timeout" in out,
        "wall_s": time.perf_counter() - t,
    }


def main(argv: list[str]) -> None:
    del argv
    runs = []
    for i in range(FLAGS.runs):
        for mode in ("default", "async"):
            runs.append(one_run(mode, FLAGS.steps))
            print(f"run {i} {mode:8s}: {runs[-1]}", flush=True)
    summary = {
        mode: {
            "runs": sum(r["mode"] == mode for r in runs),
            "finished": sum(r["mode"] == mode and r["finished"] for r in runs),
            "rendezvous_timeouts": sum(r["mode"] == mode and r["rendezvous_timeout"] for r in runs),
        }
        for mode in ("default", "async")
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"note": __doc__.split("\n\n")[1], "steps": FLAGS.steps, "summary": summary,
                   "runs": runs}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    define_flags()
    app.run(main)
