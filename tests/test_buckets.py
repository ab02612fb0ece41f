"""Tensor fusion (jaxcomm.buckets): one collective per bucket, bit-identical results."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import accounting, buckets, netsim, strategies
from jaxcomm.ledger import Collective
from tests import helpers as H
from tests.test_registry import REGISTRY

# Odd leaf sizes, fp32 + bf16, leaves below min_size (64 in the registry): 5 and 3.
TREE = {
    "a_w": jnp.zeros((24, 20)),
    "b_conv": jnp.zeros((3, 3, 4, 8), jnp.bfloat16),
    "c_odd": jnp.zeros((7, 13)),
    "d_b": jnp.zeros((5,)),
    "e_b16": jnp.zeros((3,), jnp.bfloat16),
    "f_w16": jnp.zeros((9, 11), jnp.bfloat16),
}
SMALL = 300  # bytes: several buckets, some payloads larger than a bucket


def _run(tx, steps=2):
    g_seq = [H.per_worker_grads(TREE, seed=10 + s) for s in range(steps)]
    state = H.stack(tx.init(TREE))
    fn, sh = H.sharded(tx)
    outs = []
    for g in g_seq:
        out, state = fn(jax.device_put(g, sh), jax.device_put(state, sh))
        outs.append(out)
    return outs, state


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_bucketed_updates_bit_identical_to_per_leaf(name):
    per_leaf = REGISTRY[name]("data", bucket_bytes=None)
    outs0, state0 = _run(per_leaf)
    for size in (buckets.DEFAULT_BUCKET_BYTES, SMALL):
        tx = REGISTRY[name]("data", bucket_bytes=size)
        outs, state = _run(tx)
        assert _bits(outs) == _bits(outs0), f"updates differ with bucket_bytes={size}"
        assert jax.tree.structure(state) == jax.tree.structure(state0)
        assert _bits(state) == _bits(state0), f"state differs with bucket_bytes={size}"
    # and bucketing did fuse something
    fused = accounting.wire_count(REGISTRY[name]("data"), TREE, H.N)
    assert fused < accounting.wire_count(per_leaf, TREE, H.N)


# --- a many-leaf tree: the count of collectives in compiled HLO ----------------------

MANY = {f"l{i:02d}": jnp.zeros((64 + 37 * i,)) for i in range(12)}
MANY.update({f"m{i}": jnp.zeros((40, 30 + i)) for i in range(4)})
MANY.update({"bias": jnp.zeros((10,)), "ln": jnp.zeros((7,))})
KEY = jax.random.key(1)
# transform -> collectives per step with the default bucket size
EXPECTED = {
    "allreduce": (lambda **kw: jaxcomm.allreduce(axis_name="data", **kw), 1),
    # one all-gather of every leaf's values + indices, the 2 small leaves riding in it
    "topk": (lambda **kw: jaxcomm.topk(0.05, axis_name="data", min_size=64, **kw), 1),
    "int8_gather": (
        lambda **kw: jaxcomm.int8(key=KEY, axis_name="data", min_size=64, exchange="gather", **kw),
        1,
    ),
    # the default on 8 workers is two-phase: all-to-all of chunks, all-gather of the chunk
    # means (+ the NaN flag), the small leaves riding in both
    "int8": (lambda **kw: jaxcomm.int8(key=KEY, axis_name="data", min_size=64, **kw), 2),
    # scales agreed in one pmax; codes + the small leaves (uint32 / f32: two dtypes)
    "terngrad": (lambda **kw: jaxcomm.terngrad(key=KEY, axis_name="data", min_size=64, **kw), 3),
    # key agreement + values and small leaves (all f32)
    "randomk": (lambda **kw: jaxcomm.randomk(0.1, key=KEY, axis_name="data", min_size=64, **kw), 2),
    # P's with the dense leaves, then Q's
    "powersgd": (lambda **kw: jaxcomm.powersgd(2, key=KEY, axis_name="data", **kw), 2),
    "dgc": (lambda **kw: jaxcomm.dgc(0.05, axis_name="data", min_size=64, **kw), 1),
    "delayed_averaging": (
        lambda **kw: jaxcomm.delayed_averaging(optax.sgd(0.1), delay=0, axis_name="data", **kw),
        1,
    ),
}


def _compiled(tx):
    g = H.per_worker_grads(MANY, seed=3)
    return H.shard_map_compiled(tx, g, H.stack(tx.init(MANY)))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hlo_collective_count_equals_wire_count(name):
    make, expected = EXPECTED[name]
    tx = make()
    hlo = accounting.hlo_collectives(_compiled(tx))
    assert accounting.wire_count(tx, MANY, H.N) == expected
    assert len(hlo) == expected, [(c.kind, c.shape, c.operands) for c in hlo]
    # one operand per bucket; XLA:CPU's all-to-all has one per destination worker
    assert all(c.operands == (H.N if c.kind == "all_to_all" else 1) for c in hlo)
    assert sum(c.nbytes for c in hlo) == jaxcomm.wire_bytes(tx, MANY, H.N)


# every codec whose payloads are all-gathered; on 8 workers "auto" picks two-phase for
# the quantisers and the uint16 cast, the all-gather for the others
GATHER_PATH = [
    "cast",  # uint16 words on CPU
    "topk",
    "topk:global",
    "threshold",
    "randomk:per_worker",
    "int8",
    "int8:nearest_ef",
    "qsgd",
    "qsgd:s1_ef",
    "terngrad:gather",
    "onebit",
    "onebit:bucket",
    "ef_sign",
    "ef_sign:two_phase",
    "twobit",
    "dgc",
    "dgc:no_correction",
    "dgc_sgd",
]
# on 2 workers "auto" is the all-gather; ef_sign:two_phase forces two-phase
ON_TWO = ["cast", "int8", "ef_sign:two_phase"]


@pytest.mark.parametrize("name, word", [("cast", "u16"), ("topk", "u8"), ("int8", "u8")])
def test_a_codecs_step_moves_its_payloads_widest_word(name, word):
    # a cast's words move as uint16 (it carries no NaN flag); int8 codes, and top-k's
    # values and indices beside the NaN flag's byte, as bytes (2 workers: the all-gather)
    tx = REGISTRY[name]("data")
    m = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    g = H.per_worker_grads(MANY, seed=3, n=2)
    text = H.shard_map_compiled(tx, g, H.stack(tx.init(MANY), 2), m=m).as_text()
    moved = re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather\(", text)
    assert moved == [word], moved


@pytest.mark.parametrize(
    "name, n", [(name, H.N) for name in GATHER_PATH] + [(name, 2) for name in ON_TWO]
)
def test_a_gather_path_step_is_one_collective_small_leaves_included(name, n):
    # MANY has 2 leaves below min_size=64 (the registry's); they ride in the payload's
    # collective as raw words instead of an all-reduce of their own
    tx = REGISTRY[name]("data")
    m = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    g = H.per_worker_grads(MANY, seed=3, n=n)
    state = H.stack(tx.init(MANY), n)
    hlo = accounting.hlo_collectives(H.shard_map_compiled(tx, g, state, m=m), n_devices=n)
    kinds = sorted(c.kind for c in hlo)
    # one all-gather (one bucket), or the two-phase exchange's two collectives: no
    # all-reduce of the small leaves beside them
    assert kinds in (["all_gather"], ["all_gather", "all_to_all"]), kinds
    assert sum(c.nbytes for c in hlo) == jaxcomm.wire_bytes(tx, MANY, n)


def test_small_leaves_riding_in_two_phase_are_the_mean():
    g = H.per_worker_grads(MANY, seed=4)
    tx = REGISTRY["int8"]("data")  # two-phase on 8 workers
    kinds = sorted(c.kind for c in accounting.wire_report(tx, MANY, H.N))
    assert kinds == ["all_gather", "all_to_all"], kinds
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(MANY)))
    for k in ("bias", "ln"):  # chunks summed in the all-to-all, gathered: the exact mean
        np.testing.assert_allclose(np.asarray(out[k]), np.asarray(g[k]).mean(0), rtol=1e-6)


@pytest.mark.parametrize("name", ["topk", "qsgd:s1_ef", "dgc"])
def test_small_leaves_riding_equal_their_all_reduce(name, monkeypatch):
    # the mean of a riding small leaf is added worker by worker as XLA:CPU's all-reduce
    # adds: the same bits as the separate all-reduce (forced here by the rule)
    g = H.per_worker_grads(MANY, seed=4)
    tx = REGISTRY[name]("data")
    ride, _ = H.shard_map_update(tx, g, H.stack(tx.init(MANY)))
    monkeypatch.setattr(strategies, "dense_rides", lambda n, nbytes: False)
    tx = REGISTRY[name]("data")
    fn, sh = H.sharded(tx)
    apart, _ = fn(jax.device_put(g, sh), jax.device_put(H.stack(tx.init(MANY)), sh))
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(MANY)))
    kinds = [c.kind for c in accounting.hlo_collectives(compiled)]
    assert "all_reduce" in kinds  # the rule was followed: the small leaves went apart
    for k in ("bias", "ln"):
        np.testing.assert_array_equal(np.asarray(ride[k]), np.asarray(apart[k]))
        np.testing.assert_allclose(np.asarray(ride[k]), np.asarray(g[k]).mean(0), rtol=1e-6)


def test_the_ride_rule_weighs_added_bytes_against_a_collective():
    assert strategies.dense_rides(2, 10**9)  # on 2 workers gathering adds no bytes
    bound = strategies.DENSE_RIDE_BYTES
    # on n workers gathering s receives (n-1)(n-2)/n * s more than a ring all-reduce
    s8 = bound * 8 // (7 * 6)
    assert strategies.dense_rides(8, s8) and not strategies.dense_rides(8, s8 + 1)
    for small, want in ((s8 // 4, ["all_gather"]), (s8 // 4 + 1, ["all_gather", "all_reduce"])):
        tree = {"small": jnp.zeros((small,)), "big": jnp.zeros((small + 1,))}
        tx = jaxcomm.topk(0.05, axis_name="data", min_size=small + 1)
        kinds = sorted(c.kind for c in accounting.wire_report(tx, tree, H.N))
        assert kinds == want, (small, kinds)


def test_per_leaf_exchange_counts_every_operand():
    tx = jaxcomm.allreduce(axis_name="data", bucket_bytes=None)
    compiled = _compiled(tx)
    assert accounting.wire_count(tx, MANY, H.N) == len(MANY)
    # XLA may combine the per-leaf all-reduces into one multi-operand instruction
    assert accounting.collective_count(compiled, operands=True) == len(MANY)
    assert accounting.collective_count(compiled) <= len(MANY)


def test_small_buckets_split_the_exchange():
    leaf = 4 * (64 + 37 * 11)  # the largest l-leaf, bytes
    tx = jaxcomm.allreduce(axis_name="data", bucket_bytes=leaf)
    report = accounting.wire_report(tx, MANY, H.N)
    assert all(c.nbytes <= max(leaf, 4 * 40 * 33) for c in report)
    assert 1 < len(report) < len(MANY)
    assert sum(c.nbytes for c in report) == sum(4 * x.size for x in MANY.values())
    # a payload larger than a bucket goes as it is: XLA may combine such collectives
    # into one multi-operand instruction, so count operands
    assert accounting.collective_count(_compiled(tx), operands=True) == len(report)


def test_sync_wrappers_average_in_buckets():
    params = {"w": jnp.ones((6, 5)), "b": jnp.ones((5,)), "h": jnp.ones((3,), jnp.bfloat16)}
    for make in (
        lambda **kw: jaxcomm.local_sgd(optax.sgd(0.1), every=1, axis_name="data", **kw),
        lambda **kw: jaxcomm.diloco(optax.sgd(0.1), every=1, axis_name="data", **kw),
    ):
        assert accounting.wire_count(make(), params, H.N) == 2  # one bucket per dtype
        assert accounting.wire_count(make(bucket_bytes=None), params, H.N) == 3


# --- what a bucket costs: the compiled program moves words, never floats --------------


def _resnet_hlo(tx) -> str:
    from experiments.bench import compressors  # ResNet-18's 62 parameter shapes

    tree = {k: jnp.zeros(s) for k, s in compressors.resnet18_shapes().items()}
    g = H.per_worker_grads(tree, seed=0)
    return H.shard_map_compiled(tx, g, H.stack(tx.init(tree))).as_text()


def _writes(text: str) -> list[tuple[str, str, int]]:
    """``(element type, op, entries)`` of every concatenate / dynamic-update-slice."""
    found = re.findall(r"= (\w+)\[([\d,]*)\]\S* (concatenate|dynamic-update-slice)\(", text)
    return [(t, op, math.prod(int(x) for x in dims.split(",") if x)) for t, dims, op in found]


@pytest.mark.parametrize(
    "make",
    [
        lambda b: jaxcomm.allreduce(axis_name="data", bucket_bytes=b),
        lambda b: jaxcomm.cast(jnp.bfloat16, axis_name="data", accumulate="psum", bucket_bytes=b),
    ],
    ids=["allreduce", "cast_bf16"],
)
def test_buckets_are_written_as_words_in_place(make):
    # The bucketed dense exchange once ran 15-25x its per-leaf time on ResNet-18:
    # XLA:CPU compiled jnp.concatenate into a slow loop, and a chain of bf16
    # dynamic-update-slices was ~10x slower than the same chain on uint16 bits.
    writes = _writes(_resnet_hlo(make(25 * 2**20)))
    assert writes, "no bucket was packed"
    assert not [w for w in writes if w[1] == "concatenate"], writes
    assert {t for t, _, _ in writes} <= {"u8", "u16", "u32"}, writes


def test_a_payload_larger_than_a_bucket_is_not_copied_into_one():
    bucket = buckets.default_bucket_bytes()
    assert bucket == buckets.CPU_BUCKET_BYTES == 2**20  # the suite runs on CPU
    writes = _writes(_resnet_hlo(jaxcomm.allreduce(axis_name="data")))
    assert writes  # the small leaves are packed
    assert max(n * 4 for _, _, n in writes) <= bucket, writes


# --- small sums: all-gather and add, bit for bit psum's -------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m", [1, 7, 3000])
def test_small_sum_is_a_gather_and_equals_psum_bit_for_bit(dtype, m):
    spread = jnp.exp(3 * jax.random.normal(jax.random.key(1), (H.N, m)))
    x = (jax.random.normal(jax.random.key(m), (H.N, m)) * spread).astype(dtype)

    def f(v):
        return jax.lax.psum(v[0], "data")[None], buckets.sum_over(v[0], "data", gather=True)[None]

    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=H.P(H.AXIS), out_specs=H.P(H.AXIS)))
    x = jax.device_put(x, H.NamedSharding(H.mesh(), H.P(H.AXIS)))
    ref, got = fn(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(ref).view(np.uint8))
    kinds = [c.kind for c in accounting.hlo_collectives(fn.lower(x).compile().as_text())]
    assert kinds.count("all_gather") == 1 and kinds.count("all_reduce") == 1  # ref's psum


def test_sums_gather_only_small_operands_across_cpu_processes(monkeypatch):
    assert not buckets.gathers_sum(4, H.N)  # one process: fake devices keep the all-reduce
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    bound = buckets.GATHER_SUM_BYTES
    assert buckets.gathers_sum(bound // 2, 2) and not buckets.gathers_sum(bound // 2 + 1, 2)
    assert buckets.gathers_sum(bound // 8, 8) and not buckets.gathers_sum(bound // 8 + 1, 8)


def test_a_sum_that_does_not_gather_is_an_all_reduce():
    m = 3

    def f(v):
        return buckets.sum_over(v[0], "data")[None]

    x = jax.device_put(jnp.ones((H.N, m)), H.NamedSharding(H.mesh(), H.P(H.AXIS)))
    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=H.P(H.AXIS), out_specs=H.P(H.AXIS)))
    kinds = [c.kind for c in accounting.hlo_collectives(fn.lower(x).compile().as_text())]
    assert kinds == ["all_reduce"]
    np.testing.assert_array_equal(np.asarray(fn(x)), np.full((H.N, m), H.N, np.float32))


# --- the planner and the option ------------------------------------------------------


def test_plan_fills_from_the_last_item_and_keeps_dtypes_apart():
    assert buckets.plan([4, 4, 4], ["f"] * 3, 8) == [[2, 1], [0]]
    assert buckets.plan([4, 4, 4], ["f", "g", "f"], 100) == [[2, 0], [1]]
    assert buckets.plan([4, 20, 4], ["f"] * 3, 8) == [[2], [1], [0]]  # too large: alone
    assert buckets.plan([1, 2, 3], ["f"] * 3, None) == [[2], [1], [0]]
    mib = 2**20  # "auto": the backend's size (1 MiB on CPU)
    assert buckets.plan([mib // 2, mib // 2, 1], ["f"] * 3, "auto") == [[2, 1], [0]]
    assert buckets.default_bucket_bytes("gpu") == 25 * mib
    assert buckets.default_bucket_bytes("tpu") == buckets.ACCELERATOR_BUCKET_BYTES
    # on CPU the sums' buckets are small, the gathers' large
    assert buckets.default_bucket_bytes("cpu", "reduce_scatter") == mib
    assert buckets.default_bucket_bytes("cpu", "all_gather") == 25 * mib
    assert buckets.default_bucket_bytes("cpu", "all_to_all") == 25 * mib


def test_all_gather_bucket_round_trips_mixed_dtypes():
    base = [
        jnp.arange(5, dtype=jnp.float32) - 2.5,
        jnp.arange(3, dtype=jnp.int32) - 7,
        jnp.asarray([1.5, -2.25], jnp.bfloat16),
        jnp.asarray([-3, 4, 5], jnp.int8),
        jnp.asarray([2**32 - 1, 7], jnp.uint32),
    ]

    def mine(w):  # worker w's payloads: different on every worker
        return [(x + w.astype(x.dtype) * 3).astype(x.dtype) for x in base]

    def f(w):
        return tuple(buckets.bucketed_all_gather(mine(w), "data", 1 << 20))

    workers = jnp.arange(4)
    out = jax.vmap(f, axis_name="data")(workers)  # (receiver, sender, ...)
    for j, o in enumerate(out):
        assert o.dtype == base[j].dtype and o.shape == (4, 4) + base[j].shape
        for w in range(4):
            np.testing.assert_array_equal(np.asarray(o[1, w]), np.asarray(mine(workers[w])[j]))


def test_auto_buckets_sums_small_and_gathers_large_on_cpu():
    three = [jnp.full((150_000,), i) for i in range(3)]  # 600 kB each: 1.8 MB in all
    x = jax.device_put(jnp.zeros((H.N, 1)), H.NamedSharding(H.mesh(), H.P(H.AXIS)))

    def kinds(exchange):
        def f(v):
            out = exchange([t + v[0, 0] for t in three], "data", "auto")
            return sum(jnp.sum(o) for o in out)[None]

        fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=H.P(H.AXIS), out_specs=H.P(H.AXIS)))
        found = accounting.hlo_collectives(fn.lower(x).compile().as_text())
        return [(c.kind, c.operands) for c in found]

    # sums: 1 MiB buckets, one payload each (XLA may combine them into one instruction);
    # gathers: one 25 MiB bucket
    assert sum(k == "all_reduce" and m for k, m in kinds(buckets.bucketed_psum)) == 3, kinds(
        buckets.bucketed_psum
    )
    assert kinds(buckets.bucketed_all_gather) == [("all_gather", 1)]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "25MB", "Auto"])
def test_bucket_bytes_is_validated(bad):
    with pytest.raises((TypeError, ValueError), match="bucket_bytes"):
        jaxcomm.topk(0.1, axis_name="data", bucket_bytes=bad)
    with pytest.raises((TypeError, ValueError), match="bucket_bytes"):
        jaxcomm.powersgd(key=KEY, bucket_bytes=bad)


# --- the cost model charges latency per collective -------------------------------------


def test_exchange_time_charges_latency_per_collective_and_operand():
    link = netsim.Link(8e9, latency_s=1e-3)
    one = Collective("all_reduce", "data", 4000, "float32", (1000,))
    split = [Collective("all_reduce", "data", 1000, "float32", (250,))] * 4
    combined = Collective("all_reduce", "data", 4000, "float32", (250,), operands=4)
    t_one = netsim.exchange_time([one], 8, link)
    t_split = netsim.exchange_time(split, 8, link)
    assert t_split == pytest.approx(t_one + 3 * 2 * 7 * 1e-3)  # 3 more rings of 2(n-1) alphas
    assert netsim.exchange_time([combined], 8, link) == pytest.approx(t_split)


def test_hlo_operand_count_parsed():
    text = (
        "%ar = (f32[10]{0}, f32[20]{0}) all-reduce(f32[10]{0} %a, f32[20]{0} %b), "
        "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add\n"
        "%ag = u8[8,12]{1,0} all-gather(u8[12]{0} %c), replica_groups={{0,1,2,3,4,5,6,7}}, "
        "dimensions={0}\n"
    )
    found = accounting.hlo_collectives(text)
    assert [(c.kind, c.operands, c.nbytes) for c in found] == [
        ("all_reduce", 2, 120),
        ("all_gather", 1, 12),
    ]
    assert accounting.collective_count(text) == 2
    assert accounting.collective_count(text, operands=True) == 3


@pytest.mark.parametrize("kind", ["psum_scatter", "all_to_all"])
def test_two_phase_collectives_send_a_payload_larger_than_a_bucket_as_it_is(kind):
    # as psum and all_gather do: packing it would only copy it
    big, small = (H.N, 4000), (H.N, 3)
    arrays = [jnp.arange(math.prod(s), dtype=jnp.float32).reshape(s) + i for i, s in
              enumerate([big, small, small])]  # fmt: skip
    spec = H.P(H.AXIS)
    sharding = H.NamedSharding(H.mesh(), spec)
    xs = [jax.device_put(jnp.broadcast_to(a[None], (H.N,) + a.shape), sharding) for a in arrays]

    def program(bucket_bytes):
        def f(*xs):
            xs = [x[0] if kind == "all_to_all" else x[0].reshape(-1) for x in xs]
            return [g[None] for g in getattr(buckets, f"bucketed_{kind}")(xs, "data", bucket_bytes)]

        return jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=spec, out_specs=spec))

    bucketed, per_leaf = program(1024), program(None)
    for g, r in zip(bucketed(*xs), per_leaf(*xs)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))

    def large(fn):  # writes of the big payload's size (XLA:CPU's all-to-all concatenates its
        # result per leaf too)
        writes = _writes(fn.lower(*xs).compile().as_text())
        return writes, sorted(w for w in writes if w[2] * _word(w[0]) >= 4 * math.prod(big))

    writes, got = large(bucketed)
    assert [w for w in writes if w[0] in ("u8", "u16", "u32")], "the small ones are not packed"
    assert got == large(per_leaf)[1], got


def _word(t: str) -> int:
    return {"u8": 1, "u16": 2}.get(t, 4)


@pytest.mark.parametrize(
    "dtypes, word",
    [
        (["bfloat16", "bfloat16"], "u16"),  # a cast's bucket: its words as they are
        (["bfloat16", "float32", "int32"], "u16"),  # a 4-byte payload as two words
        (["float32", "int32", "uint32"], "u32"),  # top-k's values and indices
        (["int8", "float32", "bool"], "u8"),  # codes and scales: bytes
        (["float32", "int32", "uint8"], "u8"),  # a NaN flag's byte beside them: bytes
        (["float16", "int16", "float32"], "u16"),  # empty payloads too (the last one)
    ],
)
@pytest.mark.parametrize("kind", ["all_gather", "all_to_all"])
def test_row_buckets_move_the_widest_common_word(kind, dtypes, word):
    # the bucket moves the widest unsigned word every payload splits into, so that a payload
    # of that width is bit-cast, not reassembled byte by byte; every worker gets every
    # sender's payload back exactly, equal to the per-payload exchange
    shapes = [(H.N, 96), (H.N, 3), (H.N, 5 if dtypes[-1] != "float32" else 0)][: len(dtypes)]
    spec = H.P(H.AXIS)
    sharding = H.NamedSharding(H.mesh(), spec)

    def payload(i, dtype, shape):
        x = jnp.arange(H.N * math.prod(shape)).reshape((H.N,) + shape) * 37 + 11 * i - 50
        return x > 0 if dtype == "bool" else (x * 0.75 if "float" in dtype else x).astype(dtype)

    pairs = enumerate(zip(dtypes, shapes))
    xs = [jax.device_put(payload(i, d, s), sharding) for i, (d, s) in pairs]

    def program(bucket_bytes):
        def f(*xs):
            xs = [x[0] if kind == "all_to_all" else x[0].reshape(-1) for x in xs]
            return [g[None] for g in getattr(buckets, f"bucketed_{kind}")(xs, "data", bucket_bytes)]

        return jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=spec, out_specs=spec))

    bucketed, per_leaf = program(1 << 20), program(None)
    for x, g, r in zip(xs, bucketed(*xs), per_leaf(*xs)):
        assert g.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    text = bucketed.lower(*xs).compile().as_text()
    op = kind.replace("_", "-")  # XLA:CPU's all-to-all is a tuple of n row operands
    lines = [line.split(" = ", 1)[1] for line in text.splitlines() if f" {op}(" in line]
    moved = [set(re.findall(r"(\w+)\[", line.split(f" {op}(")[0])) for line in lines]
    assert moved == [{word}], moved
