"""Ring all-reduce by ppermute and the two-level (hierarchical) exchange on a 2x4 mesh."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import exchange, ledger
from tests import helpers as H


@pytest.mark.parametrize("shape", [(13, 3), (8,), (1,), (100, 7)])
def test_ring_allreduce_equals_psum_and_moves_2_n_minus_1_chunks(shape):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(H.N,) + shape), jnp.float32)
    mesh = H.mesh()
    f = jax.jit(
        jax.shard_map(
            lambda x: exchange.ring_allreduce(x[0], "data")[None],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    expected = np.asarray(x, np.float64).sum(0)
    for w in range(H.N):
        np.testing.assert_allclose(np.asarray(f(xs))[w], expected, rtol=1e-5, atol=1e-5)
    pm = jax.pmap(lambda x: exchange.ring_allreduce(x, "data"), axis_name="data")(x)
    np.testing.assert_allclose(np.asarray(pm)[3], expected, rtol=1e-5, atol=1e-5)
    hlo = jaxcomm.accounting.hlo_collectives(f.lower(xs).compile())
    chunk = math.ceil(math.prod(shape) / H.N) * 4
    assert [c.kind for c in hlo] == ["collective_permute"] * (2 * (H.N - 1))
    assert sum(c.nbytes for c in hlo) == 2 * (H.N - 1) * chunk
    # the traced accounting agrees, and per worker it is 2(n-1)/n of the (padded) payload
    with ledger.recording(H.N) as book:
        jax.make_jaxpr(lambda v: exchange.ring_allreduce(v, "data"))(x[0])
    assert sum(c.nbytes for c in book.collectives) == 2 * (H.N - 1) * chunk


MESH2 = ("node", "local")
PARAMS = {"w": jnp.zeros((30, 20)), "b": jnp.zeros((10,))}


def mesh_2d():
    return jax.make_mesh((2, 4), MESH2)


def run_2d(tx, grads, state):
    return H.shard_map_update(tx, grads, state, m=mesh_2d())


def np_topk_sent(p, ratio):
    k = max(1, math.ceil(ratio * p.size))
    idx = np.argsort(-np.abs(p), kind="stable")[:k]
    sent = np.zeros_like(p)
    sent[idx] = p[idx]
    return sent


def test_hierarchical_sharded_topk_matches_numpy():
    ratio = 0.05
    tx = jaxcomm.hierarchical(
        jaxcomm.topk(ratio, axis_name="node", min_size=0), inner_axis="local", inner_size=4
    )
    state = H.stack(tx.init(PARAMS))
    residual = {k: np.zeros((2, 4, math.ceil(PARAMS[k].size / 4))) for k in PARAMS}
    for seed in range(3):
        g = H.per_worker_grads(PARAMS, seed=seed)
        out, state = run_2d(tx, g, state)
        for k, shape in ((k, PARAMS[k].shape) for k in PARAMS):
            d = PARAMS[k].size
            c = math.ceil(d / 4)
            flat = np.asarray(g[k], np.float64).reshape(2, 4, d)
            node_mean = np.pad(flat.mean(1), ((0, 0), (0, 4 * c - d))).reshape(2, 4, c)
            sent = np.zeros_like(node_mean)
            for node in range(2):
                for j in range(4):  # local rank j owns shard j
                    p = node_mean[node, j] + residual[k][node, j]
                    sent[node, j] = np_topk_sent(p, ratio)
                    residual[k][node, j] = p - sent[node, j]
            expected = sent.mean(0).reshape(-1)[:d].reshape(shape)
            np.testing.assert_allclose(np.asarray(out[k]), expected, rtol=1e-5, atol=1e-6)


def test_hierarchical_dense_equals_global_mean_both_forms():
    g = H.per_worker_grads(PARAMS, seed=5)
    for inner_size in (4, None):
        tx = jaxcomm.hierarchical(
            jaxcomm.allreduce(axis_name="node"), inner_axis="local", inner_size=inner_size
        )
        out, _ = run_2d(tx, g, H.stack(tx.init(PARAMS)))
        for k in PARAMS:
            np.testing.assert_allclose(
                np.asarray(out[k]), np.asarray(g[k], np.float64).mean(0), rtol=1e-5, atol=1e-6
            )


def test_hierarchical_bytes_slow_axis_separately_and_in_hlo():
    tx = jaxcomm.hierarchical(
        jaxcomm.topk(0.05, axis_name="node", min_size=0), inner_axis="local", inner_size=4
    )
    sizes = {"node": 2, "local": 4}
    shard = {k: math.ceil(PARAMS[k].size / 4) for k in PARAMS}
    slow = jaxcomm.wire_bytes(tx, PARAMS, sizes, axis="node")
    # + the NaN rule's 1-byte flag
    assert slow == sum(8 * max(1, math.ceil(0.05 * c)) for c in shard.values()) + 1
    fast = jaxcomm.wire_bytes(tx, PARAMS, sizes, axis="local")
    # reduce-scatter contributes the padded leaf, the all-gather one shard
    assert fast == sum(4 * (4 * c) + 4 * c for c in shard.values())
    # a flat top-k over all 8 workers would send the whole leaf's k per worker
    flat = jaxcomm.wire_bytes(jaxcomm.topk(0.05, axis_name=MESH2, min_size=0), PARAMS, 8)
    assert slow < flat
    compiled = H.shard_map_compiled(
        tx, H.per_worker_grads(PARAMS), H.stack(tx.init(PARAMS)), m=mesh_2d()
    )
    assert jaxcomm.accounting.collective_bytes(compiled) == slow + fast


def test_hierarchical_rejects_wrong_inner_size_and_state():
    tx = jaxcomm.hierarchical(jaxcomm.allreduce(axis_name="node"), inner_axis="local", inner_size=8)
    with pytest.raises(ValueError, match="inner_size: the transform was built for 8"):
        run_2d(tx, H.per_worker_grads(PARAMS), H.stack(tx.init(PARAMS)))
    with pytest.raises(ValueError, match="inner_size"):
        jaxcomm.hierarchical(jaxcomm.allreduce(axis_name="node"), inner_axis="local", inner_size=0)
    with pytest.raises(TypeError, match="state: expected the HierarchicalState"):
        tx.update(PARAMS, optax.sgd(0.1).init(PARAMS))


# Odd sizes (not multiples of the 4 local workers), fp32 + bf16, a leaf smaller than 4.
TREE_H = {
    "a": jnp.zeros((7, 13)),
    "b": jnp.zeros((3,)),
    "c": jnp.zeros((5, 9), jnp.bfloat16),
    "d": jnp.zeros((33,)),
}


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("inner_size", [4, None])
def test_hierarchical_buckets_are_bit_identical_to_per_leaf(inner_size):
    def make(**kw):
        # the replicated form's output is typed varying over "local" when tx has per-worker
        # state (a residual): shard_map's P() out_specs then refuse it, so dense there
        if inner_size is None:
            inner = jaxcomm.allreduce(axis_name="node")
        else:
            inner = jaxcomm.topk(0.2, axis_name="node", min_size=0)
        return jaxcomm.hierarchical(inner, inner_axis="local", inner_size=inner_size, **kw)

    results = {}
    for size in (None, 25 * 2**20, 64):
        tx = make(bucket_bytes=size)
        state = H.stack(tx.init(TREE_H))
        outs = []
        for seed in range(2):
            out, state = run_2d(tx, H.per_worker_grads(TREE_H, seed=seed), state)
            outs.append(out)
        results[size] = (_bits(outs), _bits(state))
    assert results[25 * 2**20] == results[None]
    assert results[64] == results[None]


def test_hierarchical_inner_exchange_is_one_collective_per_bucket():
    inner = jaxcomm.topk(0.2, axis_name="node", min_size=0)
    g = H.per_worker_grads(TREE_H)
    # one reduce-scatter per dtype (f32, bf16), one all-gather of every shard's bytes, and
    # the slow axis's one bucketed all-gather (node axis: 2 workers)
    bucketed = jaxcomm.hierarchical(inner, inner_axis="local", inner_size=4)
    hlo = jaxcomm.accounting.hlo_collectives(
        H.shard_map_compiled(bucketed, g, H.stack(bucketed.init(TREE_H)), m=mesh_2d())
    )
    kinds = sorted((c.kind, c.axis, c.operands) for c in hlo)
    assert kinds == [("all_gather", 2, 1), ("all_gather", 4, 1)] + [("reduce_scatter", 4, 1)] * 2
    per_leaf = jaxcomm.hierarchical(inner, inner_axis="local", inner_size=4, bucket_bytes=None)
    hlo = jaxcomm.accounting.hlo_collectives(
        H.shard_map_compiled(per_leaf, g, H.stack(per_leaf.init(TREE_H)), m=mesh_2d())
    )
    inner_ops = [c for c in hlo if c.axis == 4]
    assert sum(c.operands for c in inner_ops) == 2 * len(TREE_H)  # a scatter + a gather per leaf
