"""jaxcomm.fsdp across processes: dense and compressed, against the same step on one process.

Run under ``experiments.launch`` (e.g. 2 processes x 1 device) or as one process
with fake devices; process 0 writes the final flat master weights of each run and
each run's losses to ``OUT`` (.npz). ``tests/test_fsdp.py`` compares 2 processes
x 1 device with 1 process x 2 devices. The model, data and loss are
``tests/mp_parallel.py``'s.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax

import jaxcomm
from jaxcomm import distributed
from tests.mp_parallel import batches, init_params, loss_fn  # the same MLP, data and loss

AXIS = "data"


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
