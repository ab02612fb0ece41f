"""Per-leaf policies: optax.partition of jaxcomm transforms, run and accounted together."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from tests import helpers as H

PARAMS = {
    "embed": jnp.zeros((50, 16)),  # dense: embeddings are sparse-gradient already
    "dense1": jnp.zeros((16, 64)),  # PowerSGD
    "dense2": jnp.zeros((64, 32)),  # PowerSGD
    "bias": jnp.zeros((64,)),  # bf16
    "norm": jnp.zeros((32,)),  # bf16
}
LABELS = {
    "embed": "dense",
    "dense1": "lowrank",
    "dense2": "lowrank",
    "bias": "half",
    "norm": "half",
}
KEY = jax.random.key(0)


def parts(ax):
    return {
        "lowrank": jaxcomm.powersgd(2, key=KEY, axis_name=ax),
        "half": jaxcomm.cast(jnp.bfloat16, axis_name=ax, min_size=0, accumulate="psum"),
        "dense": jaxcomm.allreduce(axis_name=ax),
    }


def policy(ax):
    return optax.partition(parts(ax), LABELS)


def subset(tree, label):
    return {k: v for k, v in tree.items() if LABELS[k] == label}


def test_partition_equals_each_part_alone():
    tx = policy("data")
    g = H.per_worker_grads(PARAMS, seed=0)
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    for label, part in parts("data").items():
        params = subset(PARAMS, label)
        alone, _ = H.shard_map_update(part, subset(g, label), H.stack(part.init(params)))
        for k in params:
            np.testing.assert_allclose(np.asarray(out[k]), np.asarray(alone[k]), rtol=1e-6)
    # and it really compressed: PowerSGD's rank-2 output is not the dense mean
    mean = np.asarray(g["dense2"]).mean(0)
    assert np.abs(np.asarray(out["dense2"]) - mean).max() > 1e-3
    np.testing.assert_allclose(np.asarray(out["embed"]), np.asarray(g["embed"]).mean(0), rtol=1e-6)


def test_wire_bytes_of_the_composition_is_the_sum_of_the_parts_and_matches_hlo():
    total = jaxcomm.wire_bytes(policy("data"), PARAMS, 8)
    by_part = sum(
        jaxcomm.wire_bytes(part, subset(PARAMS, label), 8) for label, part in parts("data").items()
    )
    assert total == by_part
    # closed form: PowerSGD (a+b)*r*4 per matrix, the bf16 psum 2 bytes (4 on XLA:CPU,
    # which sums bf16 in f32), fp32 4 bytes
    bf16 = 4 if jax.default_backend() == "cpu" else 2
    assert total == (16 + 64) * 2 * 4 + (64 + 32) * 2 * 4 + bf16 * (64 + 32) + 4 * 50 * 16
    tx = policy("data")
    compiled = H.shard_map_compiled(tx, H.per_worker_grads(PARAMS), H.stack(tx.init(PARAMS)))
    assert jaxcomm.accounting.collective_bytes(compiled) == total
