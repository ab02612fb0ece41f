"""jaxcomm.fsdp: sharded data parallelism on 8 fake devices, through the real collectives.

References: a hand-written shard_map FSDP step (per-leaf shards, lax.all_gather,
lax.psum_scatter, the optimizer on each shard) for the dense case, bit for bit;
NumPy for the int8 weight codes; the compiled HLO for the bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting

N = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


H = 184  # hidden width: 25 H + 8 = 4608 parameters, 18 int8 blocks of 32 per worker


def make_params(seed=0, h=H, dtype=jnp.float32):
    """A small MLP: two matrices and two biases, 25 h + 8 parameters (4,608: no padding at
    N x 32; h = 185 gives 4,633, padded)."""
    k = jax.random.split(jax.random.key(seed), 4)
    p = {
        "w1": jax.random.normal(k[0], (16, h)) / 4,
        "b1": jax.random.normal(k[1], (h,)) / 10,
        "w2": jax.random.normal(k[2], (h, 8)) / np.sqrt(h),
        "b2": jnp.zeros((8,)),
    }
    return jax.tree.map(lambda x: x.astype(dtype), p)


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


TEACHER = jax.random.normal(jax.random.key(99), (16, 8)) / 4


def make_batch(seed=1, per_worker=4):
    """Inputs and a learnable target (a fixed linear teacher)."""
    x = jax.random.normal(jax.random.key(seed), (N * per_worker, 16))
    return x, x @ TEACHER


def test_padded_vector_trains_bit_for_bit_and_loads_onto_three_workers(mesh):
    """25 x 185 + 8 = 4,633 parameters: the flat vector is padded (4,640 on 8 workers) and
    SGD with momentum still equals per-leaf shards bit for bit; loaded onto 3 workers the
    master weights and the momentum carry over exactly (cut to 4,633, padded to 4,635)."""
    params = make_params(h=185)
    tx = optax.sgd(0.1, 0.9)
    batches = [make_batch(s) for s in range(3)]
    want, _ = hand_written_fsdp(params, tx, batches, mesh, per_leaf=True)
    trainer = jaxcomm.fsdp(loss_fn, tx, mesh)
    state = trainer.init(params)
    assert (trainer.length, trainer.chunk) == (4640, 580)
    for b in batches:
        state, _ = trainer.step(state, b)
    got = trainer.params(state)
    for k in params:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    assert not np.any(np.asarray(state.params)[4633:])  # the padding stays zero
    mesh3 = jax.make_mesh((3,), ("data",), devices=jax.devices()[:3])
    three = jaxcomm.fsdp(loss_fn, tx, mesh3)
    three.init(params)
    moved = three.load(jax.tree.map(np.asarray, state))
    assert moved.params.shape == (4635,)
    for k in params:
        np.testing.assert_array_equal(np.asarray(three.params(moved)[k]), np.asarray(got[k]))
    mom8 = np.asarray(jax.tree.leaves(state.opt_state)[0])
    mom3 = np.asarray(jax.tree.leaves(moved.opt_state)[0])
    np.testing.assert_array_equal(mom3[:4633], mom8[:4633])


def test_an_all_bfloat16_model_keeps_its_dtype(mesh):
    params = make_params(dtype=jnp.bfloat16)
    trainer = jaxcomm.fsdp(loss_fn, optax.sgd(0.1), mesh)
    state = trainer.init(params)
    assert state.params.dtype == jnp.float32  # the master weights
    state, loss = trainer.step(state, make_batch())
    assert all(v.dtype == jnp.bfloat16 for v in trainer.params(state).values())
    # the step ran on bfloat16 weights: its loss is the loss at the rounded params
    want = loss_fn(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), make_batch())
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)


def hand_written_fsdp(params, tx, batches, mesh, per_leaf=True):
    """FSDP written out by hand with lax collectives: every leaf flattened and zero-padded to
    a multiple of N (``per_leaf=False``: all leaves in one such vector, as fsdp lays them
    out), worker j's chunk all-gathered for the forward, the gradient psum_scattered and
    divided by N, ``tx`` on the shards."""
    leaves, tree = jax.tree.flatten(params)
    shapes = [x.shape for x in leaves]
    sizes = [x.size for x in leaves]

    def to_flat(xs):
        xs = [x.reshape(-1) for x in xs]
        xs = xs if per_leaf else [jnp.concatenate(xs)]
        return [jnp.pad(x, (0, (-x.size) % N)) for x in xs]

    def from_flat(xs):
        if not per_leaf:
            xs = np.split(xs[0], np.cumsum(sizes)[:-1]) if isinstance(xs[0], np.ndarray) else [
                jax.lax.dynamic_slice(xs[0], (int(o),), (s,))
                for o, s in zip(np.cumsum([0, *sizes[:-1]]), sizes)
            ]  # fmt: skip
        return [x[:s].reshape(sh) for x, s, sh in zip(xs, sizes, shapes)]

    flat = to_flat(leaves)

    def worker(shards, opt_state, batch):
        full = from_flat([jax.lax.all_gather(s, "data", tiled=True) for s in shards])
        loss, g = jax.value_and_grad(loss_fn)(jax.tree.unflatten(tree, full), batch)
        g = [jax.lax.psum_scatter(x, "data", tiled=True) / N for x in to_flat(jax.tree.leaves(g))]
        u, opt_state = tx.update(g, opt_state, shards)
        return optax.apply_updates(shards, u), opt_state, jax.lax.pmean(loss, "data")

    opt_state = tx.init(flat)
    specs = jax.tree.map(lambda x: P("data") if x.ndim else P(), opt_state)
    fn = jax.jit(
        jax.shard_map(
            worker,
            mesh=mesh,
            in_specs=([P("data")] * len(flat), specs, P("data")),
            out_specs=([P("data")] * len(flat), specs, P()),
            check_vma=False,
        )
    )
    put = lambda tree, spec: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, spec
    )
    flat, opt_state = put(flat, [P("data")] * len(flat)), put(opt_state, specs)
    losses = []
    for b in batches:
        flat, opt_state, loss = fn(flat, opt_state, put(b, (P("data"), P("data"))))
        losses.append(loss)
    out = from_flat([np.asarray(x) for x in flat])
    return jax.tree.unflatten(tree, out), losses


@pytest.mark.parametrize(
    "tx,per_leaf",
    [
        (optax.sgd(0.1, 0.9), True),
        (optax.adamw(1e-2, weight_decay=0.1), False),
        (optax.lion(1e-3), False),
    ],
)
def test_dense_fsdp_equals_the_hand_written_step_bit_for_bit(mesh, tx, per_leaf):
    """SGD with momentum against per-leaf shards; AdamW and Lion against the same flat layout
    (XLA:CPU may compile Adam's division and square root for a 101-entry vector and for
    4 short ones to results 1 ulp apart, so per-leaf AdamW is held to 1e-6 below)."""
    params = make_params()
    batches = [make_batch(s) for s in range(3)]
    want, want_losses = hand_written_fsdp(params, tx, batches, mesh, per_leaf)
    trainer = jaxcomm.fsdp(loss_fn, tx, mesh)
    state = trainer.init(params)
    losses = []
    for b in batches:
        state, loss = trainer.step(state, b)
        losses.append(loss)
    got = trainer.params(state)
    for k in params:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    np.testing.assert_array_equal(np.asarray(losses), np.asarray(want_losses))


def test_dense_fsdp_adamw_matches_per_leaf_shards_closely(mesh):
    params = make_params()
    tx = optax.adamw(1e-2, weight_decay=0.1)
    batches = [make_batch(s) for s in range(3)]
    want, _ = hand_written_fsdp(params, tx, batches, mesh, per_leaf=True)
    trainer = jaxcomm.fsdp(loss_fn, tx, mesh)
    state = trainer.init(params)
    for b in batches:
        state, _ = trainer.step(state, b)
    got = trainer.params(state)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=0, atol=1e-6)


def test_memory_per_worker_is_one_nth_of_replicated(mesh):
    params = make_params()
    tx = optax.adamw(1e-2)
    state = jaxcomm.fsdp(loss_fn, tx, mesh).init(params)
    mem = jaxcomm.fsdp(loss_fn, tx, mesh).memory(state)
    d = sum(x.size for x in jax.tree.leaves(params))  # 16 H + H + 8 H + 8 = 4608
    chunk = -(-d // N)  # 576 entries a worker
    assert mem["params"] == 4 * chunk
    # AdamW: mu and nu shards plus one replicated int32 count
    assert mem["opt_state"] == 2 * 4 * chunk + 4
    replicated = 4 * d + sum(
        x.nbytes for x in jax.tree.leaves(tx.init(params))
    )  # 3 copies of d floats + the count
    assert mem["params"] + mem["opt_state"] <= replicated / N + 4 * 3 * N  # + padding


def test_int8_weights_decode_like_numpy_and_bytes_equal_the_hlo(mesh):
    params = make_params()
    tx = optax.sgd(0.0)  # no update: the step's loss is the loss at the decoded weights
    trainer = jaxcomm.fsdp(loss_fn, tx, mesh, weights="int8", block_size=32)
    state = trainer.init(params)
    b = make_batch()
    _, loss = trainer.step(state, b)
    # NumPy: per 32-entry block of the flat padded vector, scale max|w| / 127, codes rounded
    flat = np.concatenate([np.asarray(params[k]).reshape(-1) for k in sorted(params)])
    length = -(-flat.size // (N * 32)) * N * 32
    blocks = np.pad(flat, (0, length - flat.size)).reshape(-1, 32)
    scale = np.abs(blocks).max(1) / np.float32(127)
    codes = np.clip(np.round(blocks / np.where(scale > 0, scale, 1)[:, None]), -127, 127)
    dec = (codes.astype(np.float32) * scale[:, None]).reshape(-1)[: flat.size]
    off, decoded = 0, {}
    for k in sorted(params):
        decoded[k] = dec[off : off + params[k].size].reshape(params[k].shape)
        off += params[k].size
    at_decoded = float(loss_fn(jax.tree.map(jnp.asarray, decoded), b))
    np.testing.assert_allclose(float(loss), at_decoded, rtol=1e-6)
    # the quantisation moved the loss by more than that tolerance: the check can tell
    assert abs(float(loss_fn(params, b)) - at_decoded) > 1e-5 * at_decoded
    # bytes: the ledger's all-gather of codes + scales equals the compiled program's
    report = trainer.wire_report(state, b)
    gathers = [c for c in report if c.kind == "all_gather"]
    chunk = length // N
    assert sum(c.nbytes for c in gathers) == chunk + 4 * (chunk // 32)
    hlo = accounting.hlo_collectives(trainer.lower(state, b).compile())
    assert sum(c.nbytes for c in hlo) == sum(c.nbytes for c in report)


@pytest.mark.parametrize("weights,per_entry", [("float32", 4), ("bfloat16", 2)])
def test_weight_bytes_per_format_equal_the_hlo(mesh, weights, per_entry):
    params = make_params()
    trainer = jaxcomm.fsdp(loss_fn, optax.adam(1e-3), mesh, weights=weights)
    state = trainer.init(params)
    b = make_batch()
    report = trainer.wire_report(state, b)
    chunk = trainer.chunk
    assert [c.nbytes for c in report if c.kind == "all_gather"] == [per_entry * chunk]
    rs = [c.nbytes for c in report if c.kind == "reduce_scatter"]
    assert rs == [4 * N * chunk]  # the dense reduce-scatter's operand: the whole vector
    hlo = accounting.hlo_collectives(trainer.lower(state, b).compile())
    assert sum(c.nbytes for c in hlo) == sum(c.nbytes for c in report)


def test_compressed_reduce_scatter_trains_close_to_dense_with_fewer_bytes(mesh):
    params = make_params()
    tx = optax.adam(1e-2)
    grads = jaxcomm.int8(
        axis_name="data",
        error_feedback=True,
        exchange="reduce_scatter",
        key=jax.random.key(0),
        min_size=0,
    )
    dense = jaxcomm.fsdp(loss_fn, tx, mesh)
    comp = jaxcomm.fsdp(loss_fn, tx, mesh, weights="int8", gradients=grads, block_size=32)
    sd, sc = dense.init(params), comp.init(params)
    assert sc.comm_state is not None
    for s in range(20):
        b = make_batch(s)
        sd, ld = dense.step(sd, b)
        sc, lc = comp.step(sc, b)
    # within the codecs' tolerance of dense after 20 Adam steps, and far from the start
    pd, pc = dense.params(sd), comp.params(sc)
    start = float(loss_fn(params, make_batch(0)))
    assert float(ld) < 0.8 * start
    assert abs(float(lc) - float(ld)) < 0.05 * float(ld)
    for k in params:
        assert float(jnp.max(jnp.abs(pc[k] - pd[k]))) < 0.05, k
    b = make_batch()
    dense_bytes = sum(c.nbytes for c in dense.wire_report(sd, b))
    comp_report = comp.wire_report(sc, b)
    comp_bytes = sum(c.nbytes for c in comp_report)
    assert comp_bytes <= 0.3 * dense_bytes, (comp_bytes, dense_bytes)
    hlo = accounting.hlo_collectives(comp.lower(sc, b).compile())
    assert sum(c.nbytes for c in hlo) == comp_bytes


def test_state_is_sharded_and_residuals_per_worker(mesh):
    grads = jaxcomm.int8(
        axis_name="data",
        error_feedback=True,
        exchange="reduce_scatter",
        key=jax.random.key(0),
        min_size=0,
    )
    trainer = jaxcomm.fsdp(loss_fn, optax.adam(1e-3), mesh, gradients=grads)
    state = trainer.init(make_params())
    assert state.params.sharding == NamedSharding(mesh, P("data"))
    for x in jax.tree.leaves(state.comm_state):
        assert x.shape[0] == N and x.sharding == NamedSharding(mesh, P("data"))
    state, _ = trainer.step(state, make_batch())
    res = [
        x for x in jax.tree.leaves(state.comm_state)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim == 2
    ]  # fmt: skip
    assert res and any(not np.array_equal(r[0], r[1]) for r in map(np.asarray, res))


def test_bad_input_is_refused_with_the_argument_named(mesh):
    with pytest.raises(ValueError, match="clip_by_global_norm|reduce_sum"):
        jaxcomm.fsdp(loss_fn, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), mesh)
    with pytest.raises(ValueError, match="tx: it exchanges over axis_name='data'"):
        jaxcomm.fsdp(
            loss_fn,
            optax.chain(jaxcomm.int8(axis_name="data", stochastic=False), optax.sgd(0.1)),
            mesh,
        )
    with pytest.raises(ValueError, match="tx: it exchanges over axis_name='data'"):
        jaxcomm.fsdp(loss_fn, jaxcomm.diloco(optax.sgd(0.1), every=2, axis_name="data"), mesh)
    masked = jaxcomm.fsdp(
        loss_fn, optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), mesh
    )
    with pytest.raises(ValueError, match="MaskedState"):
        masked.init(make_params())
    with pytest.raises(ValueError, match="weights"):
        jaxcomm.fsdp(loss_fn, optax.adam(1e-3), mesh, weights="fp8")
    with pytest.raises(ValueError, match="block_size"):
        jaxcomm.fsdp(loss_fn, optax.adam(1e-3), mesh, weights="int8", block_size=0)
    with pytest.raises(ValueError, match="axis_name"):
        jaxcomm.fsdp(loss_fn, optax.adam(1e-3), mesh, axis_name="model")
    trainer = jaxcomm.fsdp(loss_fn, optax.adam(1e-3), mesh)
    with pytest.raises(ValueError, match="integer|float leaves"):
        trainer.init({"w": jnp.zeros((8, 8)), "n": jnp.zeros((3,), jnp.int32)})
    state = trainer.init(make_params())
    with pytest.raises(ValueError, match="batch: .* split evenly"):
        trainer.step(state, (jnp.zeros((12, 16)), jnp.zeros((12, 8))))
    gather = jaxcomm.fsdp(
        loss_fn, optax.adam(1e-3), mesh, gradients=jaxcomm.int8(axis_name="data", stochastic=False)
    )
    with pytest.raises(ValueError, match="exchange='reduce_scatter'"):
        gather.step(gather.init(make_params()), make_batch())


def test_orbax_round_trip_is_bit_exact_and_loads_onto_four_workers(mesh, tmp_path):
    import orbax.checkpoint as ocp

    grads = jaxcomm.int8(
        axis_name="data", error_feedback=True, exchange="reduce_scatter",
        key=jax.random.key(0), min_size=0,
    )  # fmt: skip
    trainer = jaxcomm.fsdp(loss_fn, optax.adam(1e-2), mesh, gradients=grads)
    state = trainer.init(make_params())
    for s in range(2):
        state, _ = trainer.step(state, make_batch(s))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "fsdp", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "fsdp", state)

    def raw(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(raw(a)), np.asarray(raw(b)))
    # the restored state steps exactly like the original (residuals and keys included)
    s1, l1 = trainer.step(state, make_batch(5))
    s2, l2 = trainer.step(trainer.load(restored), make_batch(5))
    np.testing.assert_array_equal(np.asarray(s1.params), np.asarray(s2.params))
    assert float(l1) == float(l2)
    # onto 4 workers: params and Adam's moments carry over bit for bit (host arrays),
    # residuals only when asked to start afresh
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    four = jaxcomm.fsdp(loss_fn, optax.adam(1e-2), mesh4, gradients=grads)
    four.init(make_params())
    host = jax.tree.map(np.asarray, state._replace(comm_state=None))
    with pytest.raises(ValueError, match="comm_state: residuals saved for"):
        four.load(jax.tree.map(np.asarray, state))
    moved = four.load(host)
    for k, v in trainer.params(state).items():
        np.testing.assert_array_equal(np.asarray(four.params(moved)[k]), np.asarray(v))
    mu8, mu4 = np.asarray(state.opt_state[0].mu), np.asarray(moved.opt_state[0].mu)
    np.testing.assert_array_equal(mu4[:4608], mu8[:4608])
    assert moved.params.sharding == NamedSharding(mesh4, P("data"))
    four.step(moved, make_batch(6))  # and it trains on


def test_diloco_over_fsdp_inner_steps_on_a_replica_by_data_mesh(mesh):
    """2 replicas x 4 data workers: each replica trains sharded (AdamW inner steps), every
    H = 3 steps DiLoCo's outer Nesterov step on the replicas' mean drift. Reference: two
    independent 4-worker fsdp trainers (one per replica, its half of every batch) and the
    outer rule in NumPy: delta = anchor - mean(params); m = 0.9 m + delta;
    anchor -= 0.7 (delta + 0.9 m); both replicas restart from the anchor."""
    H, steps = 3, 7
    grid = jax.make_mesh((2, 4), ("replica", "data"), devices=jax.devices()[:N])
    tx = jaxcomm.diloco(optax.adamw(1e-2), every=H, axis_name="replica")
    trainer = jaxcomm.fsdp(loss_fn, tx, grid, replica_axis="replica")
    state = trainer.init(make_params())
    assert state.params.sharding == NamedSharding(grid, P("replica", "data"))
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    inner = [jaxcomm.fsdp(loss_fn, optax.adamw(1e-2), mesh4) for _ in range(2)]
    ref = [t.init(make_params()) for t in inner]
    anchor = np.asarray(ref[0].params)
    momentum = np.zeros_like(anchor)
    for s in range(steps):
        x, y = make_batch(s)
        state, _ = trainer.step(state, (x, y))
        half = x.shape[0] // 2
        ref = [t.step(r, (x[i * half : (i + 1) * half], y[i * half : (i + 1) * half]))[0]
               for i, (t, r) in enumerate(zip(inner, ref))]  # fmt: skip
        if (s + 1) % H == 0:
            mean = (np.asarray(ref[0].params) + np.asarray(ref[1].params)) / np.float32(2)
            delta = anchor - mean
            momentum = np.float32(0.9) * momentum + delta
            anchor = anchor - np.float32(0.7) * (delta + np.float32(0.9) * momentum)
            ref = [r._replace(params=jax.device_put(anchor, r.params.sharding)) for r in ref]
    for r in range(2):
        got, want = trainer.params(state, r), inner[r].params(ref[r])
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=2e-6)
    # after step 7 the replicas differ (one inner step past the sync at step 6) ...
    both = np.asarray(state.params)
    assert not np.array_equal(both[0], both[1])
    # ... and the outer exchange moves each worker's shard across replicas only
    report = trainer.wire_report(state, make_batch())
    assert [c.kind for c in report if c.axis == "replica"] == ["all_reduce"]
    assert [c.nbytes for c in report if c.axis == "replica"] == [4 * trainer.chunk]


@pytest.mark.slow
def test_two_processes_equal_two_devices_in_one_process(tmp_path):
    """2 real processes (gloo) x 1 device == 1 process x 2 devices, dense and int8 both ways,
    bit for bit (both launched alike, so XLA compiles both with the same flags)."""
    from tests.test_distributed import launch

    out = {}
    for procs, devs in ((2, 1), (1, 2)):
        path = tmp_path / f"p{procs}.npz"
        run = launch(procs, devs, "-m", "tests.mp_fsdp", str(path))
        assert run.returncode == 0, run.stdout + run.stderr
        out[procs] = np.load(path)
        assert int(out[procs]["processes"]) == procs
    for k in ("dense_params", "dense_losses", "int8_params", "int8_losses"):
        np.testing.assert_array_equal(out[2][k], out[1][k], err_msg=k)
    from tests import mp_fsdp

    init = np.concatenate([v.ravel() for v in jax.tree.leaves(mp_fsdp.init_params())])
    assert np.abs(out[2]["dense_params"][: init.size] - init).max() > 1e-3  # it trained
    assert not np.array_equal(out[2]["int8_params"], out[2]["dense_params"])


@pytest.mark.slow
def test_the_lm_bench_rows_on_two_devices():
    """experiments/bench/fsdp.py's rows on the LM study's GPT (875,520 parameters), 2 fake
    devices, one step each: memory halves, the compressed row moves <= 0.3x fsdp's bytes."""
    from experiments.bench import fsdp as bench
    from experiments.bench import fsdp_report

    mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    params, loss, batch = bench.setup(2)
    rows = {
        v: bench.row(v, mesh2, params, loss, batch, steps=1, warmup=0)
        for v in ("replicated", "fsdp", "fsdp_q8w_q8g")
    }
    d = 875_520
    assert rows["replicated"]["params"] == 4 * d and rows["fsdp"]["params"] == 4 * d // 2
    # AdamW's mu and nu shards + two int32 counts (Adam's and the schedule's)
    assert rows["fsdp"]["opt_state"] == 2 * 4 * d // 2 + 8
    # fsdp dense: weights all-gather (4 d / 2) + reduce-scatter operand (4 d) + the loss (4)
    assert rows["fsdp"]["bytes_per_step"] == 4 * d // 2 + 4 * d + 4
    assert rows["fsdp_q8w_q8g"]["bytes_per_step"] <= 0.3 * rows["fsdp"]["bytes_per_step"]
    # residuals: none for dense; the error-feedback residual covers the whole vector
    assert rows["fsdp"]["comm_state"] == 0 and rows["fsdp_q8w_q8g"]["comm_state"] >= 4 * d
    md = fsdp_report.timing_markdown(
        {"processes": 2, "links": [{"rate": "loopback", "rows": list(rows.values())}]}
    )
    assert "| loopback | fsdp_q8w_q8g |" in md


def test_replicas_draw_their_own_stochastic_rounding_keys():
    """With replica_axis, the gradient transform's keys differ between replicas (worker j of
    every replica would otherwise round alike, and the outer average would not average that
    noise out); within a replica they start alike (the transform folds the worker in)."""
    grid = jax.make_mesh((2, 4), ("replica", "data"), devices=jax.devices()[:N])
    grads = jaxcomm.int8(
        axis_name="data", error_feedback=True, exchange="reduce_scatter", min_size=0,
        key=jax.random.key(0),
    )  # fmt: skip
    tx = jaxcomm.diloco(optax.sgd(0.1), every=2, axis_name="replica")
    trainer = jaxcomm.fsdp(loss_fn, tx, grid, replica_axis="replica", gradients=grads)
    keys = np.asarray(trainer.init(make_params()).comm_state.key)  # (replicas, workers, 2)
    assert keys.shape == (2, 4, 2)
    assert (keys[0] != keys[1]).any() and (keys[0] == keys[0, :1]).all()


@pytest.mark.slow
def test_the_lm_bench_trajectory_follows_the_study_harness(tmp_path):
    """bench.fsdp's trajectories start from the study's init and draw the harness's batches:
    dense FSDP's validation loss after 2 and 4 steps equals the study's own dense run's
    (experiments.train on 2 workers, the same schedule stopped at step 4) within float32
    reduction order; int8 weights and gradients leave it."""
    from experiments import train
    from experiments.bench import fsdp as bench
    from experiments.configs import lm_shakespeare

    config = lm_shakespeare.get_config("dense")
    config.n_workers, config.stop_after, config.eval_every, config.steps_per_call = 2, 4, 2, 2
    config.progress, config.plot = False, False
    study = [r["eval_loss"] for r in train.train_and_evaluate(config, str(tmp_path)).metrics]
    mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    runs = {v: bench.trajectory(v, mesh2, seed=config.seed, steps=4, eval_every=2)
            for v in ("fsdp", "fsdp_q8w_q8g")}  # fmt: skip
    assert [r["step"] for r in runs["fsdp"]["curve"]] == [2, 4]
    got = [r["eval_loss"] for r in runs["fsdp"]["curve"]]
    np.testing.assert_allclose(got, study[-2:], rtol=2e-5)
    assert got[1] < got[0]  # it trained
    q8 = [r["eval_loss"] for r in runs["fsdp_q8w_q8g"]["curve"]]
    assert abs(q8[1] - got[1]) > 10 * abs(got[1] - study[-1])  # beyond the reduction order
