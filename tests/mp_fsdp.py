"""jaxcomm.fsdp across processes: dense and compressed, against the same step on one process.

Run under ``experiments.launch`` (e.g. 2 processes x 1 device) or as one process
with fake devices; process 0 writes the final flat master weights of each run and
each run's losses to ``OUT`` (.npz). ``tests/test_fsdp.py`` compares them with
the same runs on 2 fake devices in one process.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from jaxcomm import distributed

AXIS = "data"
STEPS = 4


def init_params() -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": np.asarray(jax.random.normal(k1, (20, 48)) * 0.3),
        "b1": np.zeros((48,), np.float32),
        "w2": np.asarray(jax.random.normal(k2, (48, 10)) * 0.3),
    }


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Global batches (the same on every process): 4 rows per worker."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS, 4 * n, 20)).astype(np.float32)
    y = rng.integers(0, 10, (STEPS, 4 * n)).astype(np.int32)
    return list(zip(x, y))


def trainers(mesh) -> dict:
    grads = jaxcomm.int8(
        axis_name=AXIS, error_feedback=True, exchange="reduce_scatter", min_size=0,
        key=jax.random.key(1),
    )  # fmt: skip
    return {
        "dense": jaxcomm.fsdp(loss_fn, optax.adamw(1e-2), mesh),
        "int8": jaxcomm.fsdp(
            loss_fn, optax.adamw(1e-2), mesh, weights="int8", gradients=grads, block_size=32
        ),
    }


def run_all(mesh) -> dict[str, np.ndarray]:
    out = {}
    for name, trainer in trainers(mesh).items():
        state, losses = trainer.init(init_params()), []
        for b in batches(mesh.size):
            state, loss = trainer.step(state, b)
            losses.append(float(distributed.gather(loss)))
        out[f"{name}_params"] = np.asarray(distributed.gather(state.params))
        out[f"{name}_losses"] = np.asarray(losses, np.float32)
    return out


def main(out: str) -> None:
    info = distributed.initialize()
    results = run_all(distributed.global_mesh(AXIS))
    if info.process_id == 0:
        np.savez(out, processes=info.num_processes, **results)


if __name__ == "__main__":
    main(sys.argv[1])
