"""jaxcomm.data_parallel across processes: the helper, the hand-written step, orbax mid-loop.

Run under ``experiments.launch`` (e.g. 2 processes x 1 device) or as one
process with fake devices; process 0 writes the final params of each run to
``OUT`` (.npz). ``tests/test_parallel.py`` compares them.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import distributed

AXIS = "data"
STEPS = 4


def transforms() -> dict[str, optax.GradientTransformation]:
    """Each compressor followed by a stateful optimizer (replicated momentum)."""
    compressors = {
        "allreduce": jaxcomm.allreduce(axis_name=AXIS),
        "topk": jaxcomm.topk(0.05, axis_name=AXIS, min_size=0),
        "powersgd": jaxcomm.powersgd(rank=2, axis_name=AXIS, key=jax.random.key(3)),
        "ef_sign": jaxcomm.ef_sign(axis_name=AXIS, min_size=0),
    }
    return {k: optax.chain(c, optax.sgd(0.1, momentum=0.9)) for k, c in compressors.items()}


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


def with_helper(tx, mesh, ckpt_dir=None):
    @jaxcomm.data_parallel(mesh)
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, u), s

    params = init_params()
    p, s = params, jaxcomm.init_state(tx, params, mesh)
    for t, b in enumerate(batches(mesh.size)):
        if ckpt_dir is not None and t == STEPS // 2:  # save, restore into a fresh target, go on
            import orbax.checkpoint as ocp

            with ocp.StandardCheckpointer() as ck:
                ck.save(ckpt_dir, {"p": p, "s": s})
            fresh = {"p": jax.device_put(params, NamedSharding(mesh, P())),
                     "s": jaxcomm.init_state(tx, params, mesh)}  # fmt: skip
            target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
            with ocp.StandardCheckpointer() as ck:
                restored = ck.restore(ckpt_dir, target)
            p, s = restored["p"], restored["s"]
        p, s = step(p, s, b)
    return p


def by_hand(tx, mesh):
    n = mesh.size

    def step(p, s, b):
        s = (jax.tree.map(lambda a: a[0], s[0]), *s[1:])
        g = jax.grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), (jax.tree.map(lambda a: a[None], s[0]), *s[1:])

    params = init_params()
    state = tx.init(params)
    rest = tuple(P() for _ in state[1:])
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), (P(AXIS), *rest), P(AXIS)),
                              out_specs=(P(), (P(AXIS), *rest))))  # fmt: skip
    s = (jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *a.shape)), state[0]),
         *state[1:])  # fmt: skip
    s = jax.device_put(s, (NamedSharding(mesh, P(AXIS)), *[NamedSharding(mesh, P())] * len(rest)))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    for b in batches(n):
        p, s = f(p, s, jax.device_put(b, NamedSharding(mesh, P(AXIS))))
    return p


def flat(p) -> np.ndarray:
    p = distributed.gather(p)
    return np.concatenate([np.asarray(v).ravel() for v in jax.tree.leaves(p)])


def main(out: str, ckpt_root: str) -> None:
    info = distributed.initialize()
    mesh = distributed.global_mesh(AXIS)
    results = {}
    for name, tx in transforms().items():
        results[f"{name}_helper"] = flat(with_helper(tx, mesh))
        results[f"{name}_hand"] = flat(by_hand(tx, mesh))
    results["topk_restored"] = flat(with_helper(transforms()["topk"], mesh, f"{ckpt_root}/ck"))
    if info.process_id == 0:
        np.savez(out, processes=info.num_processes, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
