"""jaxcomm.data_parallel's guesses, checked: the batch, PRNG keys, BatchNorm statistics, and
replicated outputs that would differ between workers (errors before anything runs)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomm
from tests.helpers import AXIS, N
from tests.test_parallel import loss_fn, make_mesh, setup
from tests.test_registry import REGISTRY


def copies(x):
    """Every device's copy of a replicated array."""
    return [np.asarray(s.data) for s in x.addressable_shards]


def assert_replicated(tree):
    for leaf in jax.tree.leaves(tree):
        first, *rest = copies(leaf)
        for other in rest:
            np.testing.assert_array_equal(other, first)


def topk_tx():
    return optax.chain(jaxcomm.topk(0.05, axis_name=AXIS, min_size=0), optax.sgd(0.1))


# --- the batch ------------------------------------------------------------------------------


def test_the_batch_is_found_before_a_trailing_key():
    """The old default (the last argument) would have split the key; the batch is found."""
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()

    def step(params, opt_state, batch, key):
        g = jax.grad(loss_fn)(params, batch)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, jnp.asarray(batch[0].shape[0])

    found = jaxcomm.data_parallel(step, mesh)
    named = jaxcomm.data_parallel(step, mesh, batch_argnums=("batch",))
    state = jaxcomm.init_state(tx, params, mesh)
    p1, s1, rows = found(params, state, batches[0], jax.random.key(0))
    p2, s2, _ = named(params, state, batches[0], jax.random.key(0))
    assert int(rows) == 4 * N // N  # each worker saw its 4 of the 32 rows
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_batch_it_cannot_tell_is_refused_naming_the_arguments():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()
    state = jaxcomm.init_state(tx, params, mesh)

    def step(params, opt_state, batch, weights):  # weights: 16 rows, not returned
        g = jax.grad(loss_fn)(params, batch)
        u, opt_state = tx.update(jax.tree.map(lambda x: x * weights.sum(), g), opt_state, params)
        return optax.apply_updates(params, u), opt_state

    with pytest.raises(
        ValueError,
        match=r"cannot tell which argument is the batch: 'batch' \(leading size 32\), "
        r"'weights' \(leading size 16\).*batch_argnums",
    ):
        jaxcomm.data_parallel(step, mesh)(params, state, batches[0], np.ones(16, np.float32))

    def no_batch(params, opt_state):
        u, opt_state = tx.update(params, opt_state, params)
        return optax.apply_updates(params, u), opt_state

    with pytest.raises(
        ValueError,
        match=r"no argument of the step looks like the batch.*'params' is returned by the step"
        r".*'opt_state' holds per-worker state",
    ):
        jaxcomm.data_parallel(no_batch, mesh)(params, state)
    with pytest.raises(ValueError, match=r"'opt_state' holds per-worker state.*not the batch"):
        jaxcomm.data_parallel(step, mesh, batch_argnums=("opt_state",))(
            params, state, batches[0], np.ones(16, np.float32)
        )
    with pytest.raises(ValueError, match=r"'data' is not a parameter of the step \(params, "):
        jaxcomm.data_parallel(step, mesh, batch_argnums=("data",))(
            params, state, batches[0], np.ones(16, np.float32)
        )
    with pytest.raises(ValueError, match=r"batch_argnums is empty"):
        jaxcomm.data_parallel(step, mesh, batch_argnums=())(
            params, state, batches[0], np.ones(16, np.float32)
        )


def test_an_axis_name_that_is_not_the_meshs_names_the_mesh_axes():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(jaxcomm.topk(0.05, axis_name="batch", min_size=0), optax.sgd(0.1))

    def step(params, opt_state, batch):
        u, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, u), opt_state

    with pytest.raises(ValueError, match=r"'batch' is not bound here(.|\n)*mesh axes \('data',\) "
                       r"(.|\n)*build the transform with axis_name='data'"):  # fmt: skip
        jaxcomm.data_parallel(step, mesh)(params, jaxcomm.init_state(tx, params, mesh), batches[0])


# --- replicated outputs that would differ, and collectives some workers skip -----------------


def test_a_leaf_left_out_of_the_compressor_is_an_error_naming_it_and_the_fix():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    mask = {"w1": True, "b1": False, "w2": True}
    tx = optax.chain(optax.masked(jaxcomm.topk(0.1, axis_name=AXIS, min_size=0), mask),
                     optax.sgd(0.1))  # fmt: skip

    def step(params, opt_state, batch):
        u, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, u), opt_state

    with pytest.raises(
        ValueError,
        match=r"params\['b1'\] is returned as replicated .* without an exchange.*"
        r"optax\.masked\(jaxcomm\.allreduce\(axis_name='data'\)",
    ):
        jaxcomm.data_parallel(step, mesh)(params, jaxcomm.init_state(tx, params, mesh), batches[0])

    # the fix: the leaves left out get a dense mean; every copy of b1 then agrees, and equals
    # b1 - 0.1 * (the mean of the workers' gradients)
    rest = {k: not v for k, v in mask.items()}
    tx = optax.chain(
        optax.masked(jaxcomm.topk(0.1, axis_name=AXIS, min_size=0), mask),
        optax.masked(jaxcomm.allreduce(axis_name=AXIS), rest),
        optax.sgd(0.1),
    )
    p, _ = jaxcomm.data_parallel(step, mesh)(params, jaxcomm.init_state(tx, params, mesh),
                                            batches[0])  # fmt: skip
    assert_replicated(p)
    x, y = batches[0]
    grads = [jax.grad(loss_fn)(params, (x[4 * w : 4 * w + 4], y[4 * w : 4 * w + 4]))["b1"]
             for w in range(N)]  # fmt: skip
    expect = np.asarray(params["b1"]) - 0.1 * np.mean(np.asarray(grads), axis=0)
    np.testing.assert_allclose(np.asarray(p["b1"]), expect, rtol=1e-5, atol=1e-7)


def test_apply_if_finite_around_a_compressor_is_an_error_naming_skip_nonfinite():
    """Refused before it runs (finite data here: without the check it would run, wrongly)."""
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)

    def make_step(tx):
        def step(params, opt_state, batch):
            u, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
            return optax.apply_updates(params, u), opt_state

        return jaxcomm.data_parallel(step, mesh)

    inner = optax.chain(jaxcomm.topk(0.1, axis_name=AXIS, min_size=0), optax.sgd(0.1))
    wrapped = optax.apply_if_finite(inner, 3)
    with pytest.raises(ValueError, match=r"collective \(all_gather\w* over 'data'\) runs inside a "
                       r"lax\.cond .*jaxcomm\.skip_nonfinite"):  # fmt: skip
        make_step(wrapped)(params, jaxcomm.init_state(wrapped, params, mesh), batches[0])
    fixed = jaxcomm.skip_nonfinite(inner)
    p, _ = make_step(fixed)(params, jaxcomm.init_state(fixed, params, mesh), batches[0])
    assert_replicated(p)


def test_optax_multisteps_is_an_error_naming_jaxcomm_accumulate():
    """MultiSteps keeps each worker's own gradient sum in its (replicated) state."""
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    inner = optax.chain(jaxcomm.topk(0.05, axis_name=AXIS, min_size=0), optax.sgd(0.1))

    def make_step(tx):
        def step(params, opt_state, batch):
            u, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
            return optax.apply_updates(params, u), opt_state

        return jaxcomm.data_parallel(step, mesh)

    tx = optax.MultiSteps(inner, 2)
    with pytest.raises(ValueError, match=r"opt_state\.acc_grads\['\w+'\] is returned as "
                       r"replicated.*jaxcomm\.accumulate\(tx, every=k\)"):  # fmt: skip
        make_step(tx)(params, jaxcomm.init_state(tx, params, mesh), batches[0])
    tx = jaxcomm.accumulate(inner, every=2)
    p, s = params, jaxcomm.init_state(tx, params, mesh)
    for b in batches:
        p, s = make_step(tx)(p, s, b)
    assert_replicated(p)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_no_false_alarm_on_any_registered_transform(name):
    """The static check passes every jaxcomm transform, and the debug mode finds every
    replicated copy equal after 2 steps (params, momentum)."""
    params, batches = setup()
    params = {"w1": jnp.tile(params["w1"], (1, 4)), "b1": jnp.zeros(256, jnp.float32),
              "w2": jnp.tile(params["w2"], (4, 1))}  # fmt: skip  # above the min_size of 64
    mesh = make_mesh(AxisType.Explicit)
    tx = optax.chain(REGISTRY[name](AXIS), optax.sgd(0.1, momentum=0.9))

    def step(params, opt_state, batch):
        u, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, u), opt_state

    f = jaxcomm.data_parallel(step, mesh, check_replicas=True)
    p, s = params, jaxcomm.init_state(tx, params, mesh)
    for b in batches[:2]:
        p, s = f(p, s, b)
    assert_replicated((p, s[1]))


def test_a_per_worker_loss_returned_without_mean_outputs_is_an_error():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    state = jaxcomm.init_state(tx, params, mesh)
    with pytest.raises(ValueError, match=r"output 2 is returned as replicated.*mean_outputs"):
        jaxcomm.data_parallel(step, mesh)(params, state, batches[0])
    jaxcomm.data_parallel(step, mesh, mean_outputs=(2,))(params, state, batches[0])


# --- PRNG keys --------------------------------------------------------------------------------


def dropout_step(tx):
    """A step that returns every worker's dropout mask (all-gathered: the same everywhere)."""

    def step(params, opt_state, batch, key):
        mask = jax.random.bernoulli(key, 0.5, (64,))
        g = jax.grad(loss_fn)(params, batch)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, jax.lax.all_gather(mask, AXIS), key

    return step


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_dropout_masks_differ_between_workers_and_repeat_for_a_seed(kind):
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()
    state = jaxcomm.init_state(tx, params, mesh)
    make = jax.random.key if kind == "typed" else jax.random.PRNGKey
    step = jaxcomm.data_parallel(dropout_step(tx), mesh)
    _, _, masks, key_back = step(params, state, batches[0], make(7))
    masks = np.asarray(masks)
    # worker w draws with fold_in(key, w): the closed form, and 8 different masks
    for w in range(N):
        key = make(7) if kind == "typed" else jax.random.wrap_key_data(make(7))
        expect = jax.random.bernoulli(jax.random.fold_in(key, w), 0.5, (64,))
        np.testing.assert_array_equal(masks[w], np.asarray(expect))
    assert len({m.tobytes() for m in masks}) == N
    # independent masks agree on about half of the 64 entries (shared ones on all):
    # binomial(64, 0.5) lies in (0.2, 0.8) * 64 but with probability ~1e-6
    for a in range(N):
        for b in range(a):
            assert 0.2 < np.mean(masks[a] == masks[b]) < 0.8, (a, b)
    # the key returned unchanged comes back as it was handed in (not folded)
    data = jax.random.key_data if kind == "typed" else np.asarray
    np.testing.assert_array_equal(data(key_back), data(make(7)))
    again = np.asarray(step(params, state, batches[0], make(7))[2])
    np.testing.assert_array_equal(again, masks)
    other = np.asarray(step(params, state, batches[0], make(8))[2])
    assert not np.array_equal(other, masks)
    # fold_keys=False: every worker draws the same mask
    same = jaxcomm.data_parallel(dropout_step(tx), mesh, fold_keys=False)
    shared = np.asarray(same(params, state, batches[0], make(7))[2])
    assert len({m.tobytes() for m in shared}) == 1


def test_a_key_derived_from_the_folded_key_and_returned_is_an_error():
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()

    def step(params, opt_state, batch, key):
        key, sub = jax.random.split(key)
        g = jax.grad(loss_fn)(params, batch)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, key

    with pytest.raises(ValueError, match=r"key is returned as replicated.*PRNG key.*split keys "
                       r"outside the step"):  # fmt: skip
        jaxcomm.data_parallel(step, mesh)(
            params, jaxcomm.init_state(tx, params, mesh), batches[0], jax.random.key(0)
        )


# --- linen BatchNorm statistics ----------------------------------------------------------------


def linen_setup(batch_stats):
    from flax import linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Dense(6)(x)  # 6 features: not mistaken for 8 workers
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            return nn.Dense(4)(jnp.tanh(x))

    class State(train_state.TrainState):
        batch_stats: dict

    mesh = make_mesh(AxisType.Explicit)
    net = Net()
    variables = net.init(jax.random.key(0), jnp.ones((2, 16)), train=False)
    tx = optax.chain(jaxcomm.allreduce(axis_name=AXIS), optax.sgd(0.1))
    stats = variables["batch_stats"]
    if batch_stats == "per_worker":
        stats = jaxcomm.parallel.per_worker(stats, mesh)
    state = State(step=0, apply_fn=net.apply, params=variables["params"], tx=tx,
                  opt_state=jaxcomm.init_state(tx, variables["params"], mesh),
                  batch_stats=stats)  # fmt: skip

    @jaxcomm.data_parallel(mesh, mean_outputs=(1,), batch_stats=batch_stats)
    def step(state, batch):
        x, y = batch

        def loss(params):
            out, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                          x, train=True, mutable=["batch_stats"])  # fmt: skip
            return jnp.mean((out - y) ** 2), updates

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        return state.replace(batch_stats=updates["batch_stats"]), value

    return net, variables, state, step


def test_linen_batch_stats_are_averaged_over_workers():
    _, batches = setup()
    net, variables, state, step = linen_setup("mean")
    x = batches[0][0]
    state, _ = step(state, batches[0])
    # one step from mean 0 / var 1: 0.9 * init + 0.1 * the workers' mean of their batch's
    # statistics of the first Dense's output
    h = [np.asarray(x[4 * w : 4 * w + 4] @ variables["params"]["Dense_0"]["kernel"]
                    + variables["params"]["Dense_0"]["bias"]) for w in range(N)]  # fmt: skip
    mean = 0.1 * np.mean([hw.mean(0) for hw in h], axis=0)
    var = 0.9 + 0.1 * np.mean([hw.var(0) for hw in h], axis=0)
    got = state.batch_stats["BatchNorm_0"]
    np.testing.assert_allclose(np.asarray(got["mean"]), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["var"]), var, rtol=1e-5, atol=1e-6)
    for b in batches[1:]:
        state, _ = step(state, b)
    assert_replicated(state.batch_stats)
    assert_replicated(state.params)


def test_linen_batch_stats_kept_per_worker_on_request():
    _, batches = setup()
    net, variables, state, step = linen_setup("per_worker")
    x = batches[0][0]
    state, _ = step(state, batches[0])
    got = np.asarray(state.batch_stats["BatchNorm_0"]["mean"])
    assert got.shape == (N, 6)
    for w in range(N):
        hw = np.asarray(x[4 * w : 4 * w + 4] @ variables["params"]["Dense_0"]["kernel"]
                        + variables["params"]["Dense_0"]["bias"])  # fmt: skip
        np.testing.assert_allclose(got[w], 0.1 * hw.mean(0), rtol=1e-5, atol=1e-6)
    # not laid out per worker: told how
    _, _, fresh, step = linen_setup("per_worker")
    fresh = fresh.replace(batch_stats=variables["batch_stats"])
    with pytest.raises(ValueError, match=r"state\.batch_stats\['BatchNorm_0'\]\['mean'\]: "
                       r"per-worker state.*jaxcomm\.parallel\.per_worker"):  # fmt: skip
        step(fresh, batches[0])


def test_check_replicas_finds_copies_that_differ_at_run_time():
    """A value computed from per-worker state (trusted by the static check) and returned as
    replicated: the debug mode compares the device copies after the step and names it."""
    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()

    def step(params, opt_state, batch):
        leaked = jnp.sum(opt_state[0].residual["w1"])  # this worker's residual
        u, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, u), opt_state, leaked

    checked = jaxcomm.data_parallel(step, mesh, check_replicas=True)
    p, s, _ = checked(params, jaxcomm.init_state(tx, params, mesh), batches[0])  # zeros: equal
    with pytest.raises(ValueError, match=r"check_replicas: output 2 is declared replicated but "
                       r"its copies differ between devices \(7 of 7"):  # fmt: skip
        checked(p, s, batches[1])
    jaxcomm.data_parallel(step, mesh)(p, s, batches[1])  # unchecked: no error


def test_linen_batch_stats_restore_from_orbax_bit_exactly(tmp_path):
    """Save after 2 steps, restore into a fresh state, go on: every leaf (BatchNorm statistics
    and the compressor's per-worker state included) equals the uninterrupted run, bit for bit."""
    import orbax.checkpoint as ocp

    _, batches = setup()
    _, _, state, step = linen_setup("mean")
    fields = ("step", "params", "opt_state", "batch_stats")

    def tree(s):
        return {k: getattr(s, k) for k in fields}

    for b in batches[:2]:
        state, _ = step(state, b)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ck", tree(state))
    for b in batches[2:]:
        state, _ = step(state, b)

    _, _, fresh, _ = linen_setup("mean")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree(fresh))
    with ocp.StandardCheckpointer() as ckpt:
        restored = fresh.replace(**ckpt.restore(tmp_path / "ck", target))
    for b in batches[2:]:
        restored, _ = step(restored, b)
    want = jax.tree_util.tree_leaves_with_path(tree(state))
    assert len(want) == len(jax.tree.leaves(tree(restored)))
    for (path, x), y in zip(want, jax.tree.leaves(tree(restored))):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x),
                                      err_msg=jax.tree_util.keystr(path))  # fmt: skip
    assert_replicated(restored.batch_stats)


def test_a_linen_train_state_without_init_state_is_told_the_linen_fix():
    from flax.training import train_state

    params, batches = setup()
    mesh = make_mesh(AxisType.Explicit)
    tx = topk_tx()
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)  # tx.init

    @jaxcomm.data_parallel(mesh)
    def step(state, batch):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, batch))

    with pytest.raises(
        ValueError,
        match=r"^state\.opt_state\[0\]\.count: .*leading worker axis.*"
        r"state\.replace\(opt_state=jaxcomm\.init_state\(tx, params, mesh\)\)",
    ):
        step(state, batches[0])
