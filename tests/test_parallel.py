"""jaxcomm.data_parallel / init_state: equal to the hand-written shard_map step, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.helpers import AXIS, N


def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 64)) / 4, jnp.float32),
        "b1": jnp.zeros(64, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(64, 4)) / 8, jnp.float32),
    }
    # a different batch on every worker: 8 workers x 4 rows
    batches = [
        (rng.normal(size=(4 * N, 16)).astype(np.float32),
         rng.normal(size=(4 * N, 4)).astype(np.float32))
        for _ in range(4)
    ]  # fmt: skip
    return params, batches


def make_mesh(kind):
    return jax.make_mesh((N,), (AXIS,), axis_types=(kind,))


COMPRESSORS = {
    "allreduce": lambda: jaxcomm.allreduce(axis_name=AXIS),
    "topk": lambda: jaxcomm.topk(0.05, axis_name=AXIS, min_size=0),
    "powersgd": lambda: jaxcomm.powersgd(2, axis_name=AXIS, key=jax.random.key(1)),
    "ef_sign": lambda: jaxcomm.ef_sign(axis_name=AXIS, min_size=0),
}


def by_hand(tx, params, batches, mesh):
    """The step written out: only the compressor's state (tx's first) per worker, check_vma on."""

    def step(p, s, b):
        s = (jax.tree.map(lambda a: a[0], s[0]), *s[1:])
        g = jax.grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), (jax.tree.map(lambda a: a[None], s[0]), *s[1:])

    state = tx.init(params)
    rest = tuple(P() for _ in state[1:])
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), (P(AXIS), *rest), P(AXIS)),
                              out_specs=(P(), (P(AXIS), *rest))))  # fmt: skip
    s = (jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), state[0]), *state[1:])
    s = jax.device_put(s, (NamedSharding(mesh, P(AXIS)), *[NamedSharding(mesh, P())] * len(rest)))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    for b in batches:
        p, s = f(p, s, jax.device_put(b, NamedSharding(mesh, P(AXIS))))
        jax.block_until_ready(p)
    return p, s


def with_helper(tx, params, batches, mesh):
    @jaxcomm.data_parallel(mesh)
    def step(p, s, b):
        g = jax.grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, jaxcomm.init_state(tx, params, mesh)
    for b in batches:  # NumPy batches: the helper places them
        p, s = step(p, s, b)
    return p, s


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_helper_equals_the_hand_written_step_bit_for_bit(name, kind):
    params, batches = setup()
    mesh = make_mesh(kind)
    # a stateful optimizer after the compressor: its state is replicated, not per worker
    tx = optax.chain(COMPRESSORS[name](), optax.sgd(0.1, momentum=0.9))
    p1, s1 = with_helper(tx, params, batches, mesh)
    p0, s0 = by_hand(tx, params, batches, mesh)
    assert_trees_equal(p1, p0)
    assert_trees_equal(s1, s0)
    assert not np.allclose(p1["w1"], params["w1"])  # it trained
    assert s1[1][0].trace["w1"].sharding.is_fully_replicated  # momentum replicated
    assert jax.tree.leaves(s1[0])[0].shape[0] == N  # compressor state per worker


def test_the_exchange_is_the_compressors_own_not_a_dense_gradient_sum():
    """Per-worker gradients reach the compressor: top-k sends different entries per worker."""
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.topk(0.05, axis_name=AXIS, min_size=0), optax.sgd(0.1))
    _, s = with_helper(tx, params, batches[:1], mesh)
    res = np.asarray(s[0].residual["w1"])
    # the residuals differ between workers: each kept what its own gradient did not send
    assert not np.allclose(res[0], res[1])
    # and equal the NumPy reference: g_w - topk(g_w) per worker
    x, y = batches[0]
    for w in (0, 5):
        g = jax.grad(loss_fn)(params, (x[4 * w : 4 * w + 4], y[4 * w : 4 * w + 4]))["w1"]
        g = np.asarray(g).ravel()
        keep = np.argsort(-np.abs(g))[: int(np.ceil(0.05 * g.size))]
        expect = g.copy()
        expect[keep] = 0
        np.testing.assert_allclose(res[w].ravel(), expect, rtol=1e-6, atol=1e-7)


def test_mean_outputs_average_the_loss_over_workers():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.allreduce(axis_name=AXIS), optax.sgd(0.1))

    @jaxcomm.data_parallel(mesh, mean_outputs=(-1,))
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    x, y = batches[0]
    _, _, loss = step(params, jaxcomm.init_state(tx, params, mesh), (x, y))
    per_worker = [loss_fn(params, (x[4 * w : 4 * w + 4], y[4 * w : 4 * w + 4])) for w in range(N)]
    np.testing.assert_allclose(float(loss), np.mean(per_worker), rtol=1e-6)
    assert not np.isclose(float(loss), float(per_worker[0]))


def test_linen_train_state():
    """A flax TrainState is a pytree: its opt_state's jaxcomm part is found and kept per worker."""
    from flax.training import train_state

    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.ef_sign(axis_name=AXIS, min_size=0), optax.adam(1e-2))
    state = train_state.TrainState(
        step=0, apply_fn=None, params=params, tx=tx,
        opt_state=jaxcomm.init_state(tx, params, mesh),
    )  # fmt: skip

    @jaxcomm.data_parallel(mesh, mean_outputs=(1,))
    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    for b in batches:
        state, loss = step(state, b)
    p0, s0 = with_helper(tx, params, batches, mesh)
    assert_trees_equal(state.params, p0)
    assert_trees_equal(state.opt_state, s0)
    assert int(state.step) == len(batches)


def test_setup_mistakes_name_the_leaf_and_the_fix():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.topk(0.05, axis_name=AXIS, min_size=0), optax.sgd(0.1))

    def step(p, s, b):
        u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, u), s

    f = jaxcomm.data_parallel(step, mesh)
    # state without the worker axis (tx.init instead of init_state)
    with pytest.raises(ValueError, match=r"^s\[0\]\.count: .*leading worker axis.*init_state"):
        f(params, tx.init(params), batches[0])
    # a batch that does not divide over the workers
    with pytest.raises(ValueError, match=r"^b\[0\]: .*divisible by the 8 workers"):
        f(params, jaxcomm.init_state(tx, params, mesh), (batches[0][0][:12], batches[0][1][:12]))
    # no jaxcomm transform: nothing would exchange the gradients
    plain = optax.sgd(0.1)
    with pytest.raises(ValueError, match="no jaxcomm transform's state"):
        f(params, plain.init(params), batches[0])
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        jaxcomm.init_state(tx, params, mesh, axis_name="model")
    with pytest.raises(ValueError, match="local_sgd, diloco and zero_one_adam keep params per"):
        jaxcomm.init_state(jaxcomm.local_sgd(optax.sgd(0.1), every=2, axis_name=AXIS), params, mesh)


def test_orbax_restore_inside_the_loop_is_bit_exact(tmp_path):
    """Save after 2 steps, restore onto the mesh, go on: equal to the run never interrupted."""
    import orbax.checkpoint as ocp

    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.topk(0.05, axis_name=AXIS, min_size=0), optax.adam(1e-2))

    @jaxcomm.data_parallel(mesh)
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, u), s

    p, s = params, jaxcomm.init_state(tx, params, mesh)
    for b in batches[:2]:
        p, s = step(p, s, b)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ck", {"params": p, "opt_state": s})
    for b in batches[2:]:
        p, s = step(p, s, b)
    # restore into a freshly built target (the abstract tree of init_state: shapes + shardings)
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct,
        {"params": jax.device_put(params, NamedSharding(mesh, P())),
         "opt_state": jaxcomm.init_state(tx, params, mesh)},
    )  # fmt: skip
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ck", target)
    res = np.asarray(restored["opt_state"][0].residual["w1"])
    assert not np.allclose(res[0], res[1])  # per-worker residuals came back per worker
    q, t = restored["params"], restored["opt_state"]
    for b in batches[2:]:
        q, t = step(q, t, b)
    assert_trees_equal(q, p)
    assert_trees_equal(t, s)


def test_a_long_loop_without_blocking_completes():
    """200 steps dispatched back to back on 8 fake CPU devices (no block_until_ready).

    Without the helper's one-step-in-flight rule this loop aborted here: "Termination
    timeout for all gather RendezvousKey ... only 7 of them arrived".
    """
    rng = np.random.default_rng(0)
    d = 256
    params = {f"w{i}": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32)
              for i in range(4)}  # fmt: skip

    def deep_loss(p, b):
        for i in range(4):
            b = jnp.tanh(b @ p[f"w{i}"])
        return jnp.mean(b**2)

    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.topk(0.01, axis_name=AXIS), optax.sgd(0.05, momentum=0.9))

    @jaxcomm.data_parallel(mesh)
    def step(p, s, b):
        u, s = tx.update(jax.grad(deep_loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

    p, s = params, jaxcomm.init_state(tx, params, mesh)
    x = rng.normal(size=(64, d)).astype(np.float32)
    b = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
    for _ in range(200):
        p, s = step(p, s, b)
    assert deep_loss(jax.device_get(p), x) < deep_loss(params, x)


def test_two_processes_helper_equals_hand_written_and_restores_bit_exactly(tmp_path):
    """2 real processes (gloo): the helper's step == the hand-written one, bit for bit."""
    from tests.test_distributed import launch

    run = launch(2, 1, "-m", "tests.mp_parallel", str(tmp_path / "out.npz"), str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    r = np.load(tmp_path / "out.npz")
    assert int(r["processes"]) == 2
    for name in ("allreduce", "topk", "powersgd", "ef_sign"):
        np.testing.assert_array_equal(r[f"{name}_helper"], r[f"{name}_hand"], err_msg=name)
    np.testing.assert_array_equal(r["topk_restored"], r["topk_helper"])
    assert not np.allclose(r["topk_helper"], r["allreduce_helper"], atol=1e-4)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.allreduce(axis_name=AXIS),
        lambda: jaxcomm.topk(0.05, axis_name=AXIS, min_size=0),
        lambda: jaxcomm.local_sgd(optax.sgd(0.1), every=2, axis_name=AXIS),
    ],
    ids=["allreduce", "topk", "local_sgd"],
)
def test_a_worker_axis_left_on_the_state_is_named(make):
    """The hand-written step that forgets to slice the worker axis off gets told so."""
    params, batches = setup()
    tx = make()
    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *jnp.shape(a))), tx.init(params))
    grads = jax.tree.map(lambda p: jnp.ones((N, *p.shape)), params)
    mesh = make_mesh(AxisType.Auto)

    def step(g, s):  # the slicing of the worker axis (a[0]) forgotten
        return tx.update(g, s, params)[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
    with pytest.raises(ValueError, match=r"state.count .* shape \(1,\).*leading worker axis"):
        f(grads, state)
