"""wire_bytes (what the algorithm sends) and HLO parsing (what the program moves)."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxcomm
from jaxcomm.compressors import dense, sparse
from tests import helpers as H

PARAMS = {"w": jnp.zeros((100, 50)), "e": jnp.zeros((3000,)), "b": jnp.zeros((10,))}
DENSE_B = 10 * 4  # "b" is below min_size=1024: dense fp32
# The NaN rule's flag (jaxcomm.stages.flag): one byte in an all-gather, one entry of the
# payload's dtype in a psum.
GATHER_FLAG = 1


def k_of(ratio, d):
    return max(1, math.ceil(ratio * d))


@pytest.mark.parametrize("n", [2, 8, 64])
def test_wire_bytes_closed_forms(n):
    d = {"w": 5000, "e": 3000}
    assert jaxcomm.wire_bytes(jaxcomm.allreduce(axis_name="x"), PARAMS, n) == 4 * 8010
    # casts carry NaN/Inf in the payload itself: no flag. The default on CPU: uint16
    # words, two-phase from 3 workers (an all-to-all of n chunks of c = ceil(d/n)
    # entries per leaf, an all-gather of c, + the two-phase NaN flag byte)
    cast = jaxcomm.wire_bytes(jaxcomm.cast(axis_name="x"), PARAMS, n)
    if jax.default_backend() == "cpu" and n > 2:
        cs = [math.ceil(v / n) for v in d.values()]
        # "b" rides in both phases: n chunks of ceil(10/n) fp32 out, one chunk sum back
        dense = (n + 1) * 4 * math.ceil(10 / n)
        assert cast == sum(2 * n * c + 2 * c for c in cs) + 1 + dense
    else:
        assert cast == 2 * 8000 + DENSE_B
    # the 16-bit psum: XLA:CPU sums bf16 in f32, 4 bytes per entry
    psum = jaxcomm.cast(axis_name="x", accumulate="psum")
    per_entry = 4 if jax.default_backend() == "cpu" else 2
    assert jaxcomm.wire_bytes(psum, PARAMS, n) == per_entry * 8000 + DENSE_B
    topk = jaxcomm.topk(0.01, axis_name="x")
    assert (
        jaxcomm.wire_bytes(topk, PARAMS, n)
        == sum(8 * k_of(0.01, v) for v in d.values()) + DENSE_B + GATHER_FLAG
    )
    glob = jaxcomm.topk(0.01, axis_name="x", scope="global")
    assert jaxcomm.wire_bytes(glob, PARAMS, n) == 8 * k_of(0.01, 8000) + DENSE_B + GATHER_FLAG
    rk = jaxcomm.randomk(0.01, key=jax.random.key(0), axis_name="x")
    # shared indices: a psum of f32 values (+ a 4-byte f32 flag) and the 8-byte key agreement
    assert (
        jaxcomm.wire_bytes(rk, PARAMS, n)
        == sum(4 * k_of(0.01, v) for v in d.values()) + DENSE_B + 4 + 8
    )
    rkw = jaxcomm.randomk(0.01, key=jax.random.key(0), axis_name="x", shared_indices=False)
    assert (
        jaxcomm.wire_bytes(rkw, PARAMS, n)
        == sum(8 * k_of(0.01, v) for v in d.values()) + DENSE_B + GATHER_FLAG
    )
    th = jaxcomm.threshold(0.01, axis_name="x")
    # top-k's k slots per leaf (values + int32 indices), whatever the candidates' period
    assert (
        jaxcomm.wire_bytes(th, PARAMS, n)
        == sum(8 * k_of(0.01, v) for v in d.values()) + DENSE_B + GATHER_FLAG
    )


def test_without_axis_nothing_is_sent():
    assert jaxcomm.wire_bytes(jaxcomm.topk(0.01), PARAMS, 8) == 0
    assert jaxcomm.accounting.wire_report(jaxcomm.allreduce(), PARAMS, 8) == []


@pytest.mark.parametrize(
    "comp",
    [
        dense.Dense(),
        dense.Cast(jnp.bfloat16),
        sparse.TopK(0.01),
        sparse.Threshold(0.003, 0.01),
        sparse.RandomK(0.02, shared=False, rescale=True, sampling="stratified"),
    ],
    ids=lambda c: type(c).__name__,
)
def test_protocol_wire_size_equals_traced_bytes(comp):
    key = jax.random.key(0) if comp.needs_key else None
    tx = jaxcomm.compress(comp, axis_name="x", key=key, error_feedback=False)
    # the NaN flag: none for Dense and Cast (NaN travels in the payload), else a byte
    flag = 0 if getattr(comp, "carries_nonfinite", False) else GATHER_FLAG
    expected = (
        sum(comp.wire_size(int(x.size), x.dtype) for x in jax.tree.leaves(PARAMS) if x.size >= 1024)
        + DENSE_B
        + flag
    )
    assert jaxcomm.wire_bytes(tx, PARAMS, 8) == expected


def test_compositions_are_counted():
    chained = optax.chain(jaxcomm.topk(0.01, axis_name="x"), optax.adam(1e-3))
    assert jaxcomm.wire_bytes(chained, PARAMS, 8) == jaxcomm.wire_bytes(
        jaxcomm.topk(0.01, axis_name="x"), PARAMS, 8
    )
    # per-leaf policy: top-k for the matrix, bf16 for the rest
    part = optax.partition(
        {
            "sparse": jaxcomm.topk(0.01, axis_name="x", min_size=0),
            "cast": jaxcomm.cast(
                axis_name="x", min_size=0, accumulate="all_gather", exchange="gather"
            ),
        },
        {"w": "sparse", "e": "cast", "b": "cast"},
    )
    assert jaxcomm.wire_bytes(part, PARAMS, 8) == 8 * 50 + GATHER_FLAG + 2 * 3010
    every4 = jaxcomm.accumulate(jaxcomm.allreduce(axis_name="x"), every=4)
    assert jaxcomm.wire_bytes(every4, PARAMS, 8) == 4 * 8010  # one exchange, when it happens
    # MultiSteps exchanges on every micro-step (and discards): counted the same per step
    multi = optax.MultiSteps(jaxcomm.allreduce(axis_name="x"), every_k_schedule=4)
    assert jaxcomm.wire_bytes(multi, PARAMS, 8) == 4 * 8010


def test_traffic_bytes_closed_forms():
    dense = jaxcomm.accounting.wire_report(jaxcomm.allreduce(axis_name="x"), PARAMS, 8)
    assert jaxcomm.accounting.traffic_bytes(dense, 8) == pytest.approx(2 * 7 / 8 * 4 * 8010)
    topk = jaxcomm.accounting.wire_report(jaxcomm.topk(0.01, axis_name="x", min_size=0), PARAMS, 8)
    k = k_of(0.01, 5000) + k_of(0.01, 3000) + k_of(0.01, 10)
    assert jaxcomm.accounting.traffic_bytes(topk, 8) == pytest.approx(7 * (8 * k + GATHER_FLAG))
    assert jaxcomm.accounting.traffic_bytes(dense, 1) == 0


def test_axis_sizes_per_axis():
    tx = jaxcomm.allreduce(axis_name=("node", "local"))
    report = jaxcomm.accounting.wire_report(tx, PARAMS, {"node": 2, "local": 4})
    assert {c.axis for c in report} == {("node", "local")}
    with pytest.raises(ValueError, match="n_workers: no size given for mesh axis 'local'"):
        jaxcomm.wire_bytes(tx, PARAMS, {"node": 2})


HLO = """
ENTRY %main {
  %ar = (f32[100]{0}, bf16[10,4]{1,0}) all-reduce(%a, %b), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
  %ag = s32[8,25]{1,0} all-gather(%c), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ag2 = f32[4,6]{1,0} all-gather(%d), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %rs = f32[16]{0} reduce-scatter(%e), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
  %cp = u8[33]{0} collective-permute(%f), channel_id=5, source_target_pairs={{0,1},{1,2}}
  %ags = (f32[10]{0}, f32[80]{0}) all-gather-start(%g), channel_id=6, replica_groups=[1,8]<=[8]
  %agd = f32[80]{0} all-gather-done(%ags)
  %notme = f32[7]{0} add(%all-reduce.1, %x)
}
"""


def test_hlo_parser_on_known_text():
    got = [(c.kind, c.nbytes, c.dtype) for c in jaxcomm.accounting.hlo_collectives(HLO)]
    assert got == [
        ("all_reduce", 400 + 80, "f32"),
        ("all_gather", 25 * 4, "s32"),
        ("all_gather", 6 * 4, "f32"),
        ("reduce_scatter", 16 * 4 * 4, "f32"),
        ("collective_permute", 33, "u8"),
        ("all_gather", 40, "f32"),
    ]
    assert jaxcomm.accounting.collective_bytes(HLO) == 480 + 100 + 24 + 256 + 33 + 40


def test_collective_bytes_accepts_lowered_and_compiled():
    tx = jaxcomm.allreduce(axis_name="data")
    params = {"w": jnp.zeros((64,))}
    compiled = H.shard_map_compiled(tx, H.per_worker_grads(params), H.stack(tx.init(params)))
    assert jaxcomm.accounting.collective_bytes(compiled) == 256
    assert jaxcomm.accounting.collective_bytes(compiled.as_text()) == 256


def test_bf16_collectives_hlo_equals_the_report_on_this_backend():
    """bf16 params: top-k's all-gathered values and two-phase codes travel as uint16 bits
    (2 bytes on every backend), a bf16 psum is counted at what this backend moves."""
    params = {"w": jnp.zeros((64, 64), jnp.bfloat16), "b": jnp.zeros((64,), jnp.bfloat16)}
    cases = {
        "topk": jaxcomm.topk(0.05, axis_name="data", min_size=100),
        "psum": jaxcomm.cast(axis_name="data", min_size=100, accumulate="psum"),
        "words": jaxcomm.cast(axis_name="data", min_size=100, accumulate="all_gather"),
        "ring": jaxcomm.int8(key=jax.random.key(0), axis_name="data", min_size=100),
    }
    g = H.per_worker_grads(params, seed=4)
    cpu = jax.default_backend() == "cpu"
    for name, tx in cases.items():
        compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(params)))
        hlo = jaxcomm.accounting.hlo_collectives(compiled)
        assert jaxcomm.accounting.collective_bytes(compiled) == jaxcomm.wire_bytes(tx, params, 8), (
            name
        )
        if name == "topk":  # the values' all-gather: uint16 words, 2 bytes per value, and
            k = math.ceil(0.05 * 4096)  # the "b" leaf (below min_size) riding as bf16 words
            assert [c.kind for c in hlo] == ["all_gather"]
            assert hlo[0].nbytes == k * (2 + 4) + 64 * 2 + GATHER_FLAG
    # the "b" leaf (below min_size) and the psum are bf16 all-reduces: 4 bytes per entry
    # on XLA:CPU, 2 on GPU/TPU; the report can be made for either
    psum = cases["psum"]
    for backend, per_entry in (("cpu", 4), ("gpu", 2), ("tpu", 2), (None, 4 if cpu else 2)):
        assert jaxcomm.wire_bytes(psum, params, 8, backend=backend) == per_entry * (4096 + 64)
    with pytest.raises(ValueError, match="backend"):
        jaxcomm.wire_bytes(psum, params, 8, backend="metal")


def test_wire_bytes_under_a_global_explicit_mesh():
    """jax.set_mesh with Explicit axes (jax.make_mesh's default) does not change the count.

    It used to raise ShardingTypeError from the bucket packing, typed by the caller's mesh.
    """
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    # "b" is below top-k's min_size: packed into a dense bucket, where the error was raised
    tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))
    outside = jaxcomm.wire_bytes(tx, PARAMS, 8)
    with jax.set_mesh(mesh):
        assert jaxcomm.wire_bytes(tx, PARAMS, 8) == outside > 0
