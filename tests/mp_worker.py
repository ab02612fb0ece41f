"""A few training steps of jaxcomm transforms on whatever processes/devices this run has.

Run as one process (``XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m
tests.mp_worker OUT``) or under ``experiments.launch`` (2 processes x 2 devices):
the same global data, the same transforms, the same shard_map; process 0 writes the
final params of every transform to ``OUT`` (an .npz). ``tests/test_distributed.py``
compares the layouts.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting, distributed

AXIS = "data"
STEPS = 4


def transforms() -> dict[str, optax.GradientTransformation]:
    return {
        "allreduce": jaxcomm.allreduce(axis_name=AXIS),
        "topk": jaxcomm.topk(0.05, axis_name=AXIS, min_size=0),
        "powersgd": jaxcomm.powersgd(rank=2, axis_name=AXIS, key=jax.random.key(3)),
    }


def init_params() -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (20, 48)) * 0.3,
        "b1": jnp.zeros((48,)),
        "w2": jax.random.normal(k2, (48, 10)) * 0.3,
    }


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-worker batches: (n, STEPS, 16, 20) inputs and labels, a function of the worker."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, STEPS, 16, 20)).astype(np.float32)
    return x, rng.integers(0, 10, size=(n, STEPS, 16)).astype(np.int32)


def run(name: str, tx: optax.GradientTransformation, mesh) -> tuple[np.ndarray, str]:
    n = mesh.size
    params = init_params()
    state = jax.tree.map(
        lambda a: np.broadcast_to(np.asarray(a)[None], (n,) + a.shape), tx.init(params)
    )
    state = distributed.shard_rows(state, mesh, AXIS)
    params = distributed.shard_rows(
        jax.tree.map(lambda a: np.broadcast_to(np.asarray(a)[None], (n,) + a.shape), params),
        mesh,
        AXIS,
    )
    x, y = distributed.shard_rows(data(n), mesh, AXIS)

    def step(params, state, x, y):
        params, state, x, y = jax.tree.map(lambda a: a[0], (params, state, x, y))
        for t in range(STEPS):
            grads = jax.grad(loss_fn)(params, x[t], y[t])
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda a: a[None], (params, state))

    spec = P(AXIS)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec)))
    compiled = f.lower(params, state, x, y).compile()  # run once, and its HLO read
    kinds = [c.kind for c in accounting.hlo_collectives(compiled)]
    params, _ = compiled(params, state, x, y)
    flat = distributed.gather(params)
    out = np.concatenate([np.asarray(v).reshape(n, -1) for v in jax.tree.leaves(flat)], axis=1)
    return out, ",".join(sorted(set(kinds)))


def main(out: str) -> None:
    info = distributed.initialize()
    mesh = distributed.global_mesh(AXIS)
    runs = {name: run(name, tx, mesh) for name, tx in transforms().items()}
    results = {name: r[0] for name, r in runs.items()}
    kinds = {f"{name}_kinds": np.asarray(r[1]) for name, r in runs.items()}
    if info.process_id == 0:
        np.savez(out, processes=info.num_processes, **results, **kinds)


if __name__ == "__main__":
    main(sys.argv[1])
