"""The generic path: validation, non-finite gradients, state checks, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm
from tests import helpers as H

PARAMS = {"w": jnp.zeros((32, 40)), "b": jnp.zeros((8,))}


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan")])
@pytest.mark.parametrize("factory", ["topk", "threshold", "randomk"])
def test_ratio_outside_unit_interval_raises(factory, ratio):
    kw = {"key": jax.random.key(0)} if factory == "randomk" else {}
    with pytest.raises(ValueError, match=r"ratio: must be in \(0, 1\]"):
        getattr(jaxcomm, factory)(ratio, **kw)


def test_other_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="ratio"):
        jaxcomm.topk("0.1")
    with pytest.raises(ValueError, match="sample_ratio"):
        jaxcomm.threshold(0.01, sample_ratio=2.0)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        jaxcomm.cast(jnp.int8)
    with pytest.raises(TypeError, match="dtype"):
        jaxcomm.cast("float8")
    with pytest.raises(ValueError, match="accumulate"):
        jaxcomm.cast(accumulate="tree")
    with pytest.raises(TypeError, match="key: a PRNG key is required"):
        jaxcomm.randomk(0.1, key=None)
    with pytest.raises(TypeError, match="key"):
        jaxcomm.randomk(0.1, key=jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="sampling"):
        jaxcomm.randomk(0.1, key=jax.random.key(0), sampling="sorted")
    with pytest.raises(ValueError, match="scope"):
        jaxcomm.topk(0.1, scope="layer")
    with pytest.raises(ValueError, match="min_size"):
        jaxcomm.topk(0.1, min_size=-1)
    with pytest.raises(TypeError, match="axis_name"):
        jaxcomm.topk(0.1, axis_name=3)


def test_cast_accepts_dtype_names():
    tx = jaxcomm.cast("float16", min_size=0)
    out, _ = tx.update({"w": jnp.full((4,), 1 / 3)}, tx.init({"w": jnp.zeros((4,))}))
    np.testing.assert_array_equal(out["w"], np.float32(np.float16(1 / 3)))


def test_unbound_axis_raises_clear_error():
    tx = jaxcomm.topk(0.1, axis_name="data")
    g = {k: v[0] for k, v in H.per_worker_grads(PARAMS).items()}
    with pytest.raises(ValueError, match="axis_name='data' is not bound.*shard_map"):
        jax.jit(tx.update)(g, tx.init(PARAMS))


def test_unknown_axis_under_shard_map_raises_clear_error():
    tx = jaxcomm.allreduce(axis_name="model")
    g = H.per_worker_grads(PARAMS)
    with pytest.raises(ValueError, match="axis_name='model' is not bound"):
        H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))


def test_gradients_of_replicated_params_are_rejected_under_shard_map():
    """jax.grad of P() params inside shard_map is already psum'd: compressing it is a bug."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tx = jaxcomm.topk(0.1, axis_name="data", min_size=0)
    mesh = H.mesh()
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    params = {"w": jnp.ones((4,))}
    state = jax.device_put(H.stack(tx.init(params)), NamedSharding(mesh, P("data")))

    def step(params, state, x, per_worker):
        state = jax.tree.map(lambda a: a[0], state)
        p = jax.lax.pcast(params, "data", to="varying") if per_worker else params
        grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(p)
        u, _ = tx.update(grads, state)
        return u

    for per_worker in (False, True):
        fn = jax.jit(
            jax.shard_map(
                lambda p, s, x, pw=per_worker: step(p, s, x, pw),
                mesh=mesh,
                in_specs=(P(), P("data"), P("data")),
                out_specs=P(),
            )
        )
        if not per_worker:
            with pytest.raises(ValueError, match=r"updates: leaf \['w'\].*already summed"):
                fn(params, state, x)
        else:
            u = fn(params, state, x)
            # mean over workers of d/dw sum(x_i @ w) = column sums of x_i = 1 each; top-k 1
            np.testing.assert_allclose(np.sort(np.asarray(u["w"])), [0, 0, 0, 1.0])


def test_integer_leaves_raise_type_error_naming_the_leaf():
    tx = jaxcomm.topk(0.1)
    params = {"w": jnp.zeros((16,)), "step": jnp.zeros((), jnp.int32)}
    with pytest.raises(TypeError, match=r"\['step'\].*int32"):
        tx.init(params)
    state = tx.init({"w": jnp.zeros((16,)), "step": jnp.zeros(())})
    with pytest.raises(TypeError, match=r"updates: leaf \['step'\]"):
        tx.update({"w": jnp.zeros((16,)), "step": jnp.zeros((), jnp.int32)}, state)


def test_state_from_another_transform_raises():
    g = {k: v[0] for k, v in H.per_worker_grads(PARAMS).items()}
    tx = jaxcomm.topk(0.1)
    with pytest.raises(TypeError, match="state: expected the TopKState"):
        tx.update(g, optax.sgd(0.1).init(PARAMS))
    no_ef = jaxcomm.topk(0.1, error_feedback=False).init(PARAMS)
    with pytest.raises(ValueError, match="error_feedback=False"):
        tx.update(g, no_ef)
    with pytest.raises(TypeError, match="expected the RandomKState .* got TopKState"):
        jaxcomm.randomk(0.1, key=jax.random.key(0)).update(g, tx.init(PARAMS))
    other = tx.init({"w": jnp.zeros((32, 40))})
    with pytest.raises(ValueError, match="state.residual: its tree structure"):
        tx.update(g, other)
    wrong_shape = tx.init({"w": jnp.zeros((40, 32)), "b": jnp.zeros((8,))})
    with pytest.raises(ValueError, match="state.residual: leaf shape"):
        tx.update(g, wrong_shape)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradient_never_enters_the_residual(bad):
    tx = jaxcomm.topk(0.05, axis_name="data", min_size=0)
    state = H.stack(tx.init(PARAMS))
    _, state = H.shard_map_update(tx, H.per_worker_grads(PARAMS, seed=0), state)
    before = jax.tree.map(np.asarray, state.residual)
    g = H.per_worker_grads(PARAMS, seed=1)
    g["w"] = g["w"].at[3, 0, 0].set(bad)  # worker 3 only
    out, state = H.shard_map_update(tx, g, state)
    after = jax.tree.map(np.asarray, state.residual)
    for k in PARAMS:
        # the step is void on every worker (the NaN rule): all kept their old residual
        np.testing.assert_array_equal(after[k], before[k])
        assert np.all(np.isfinite(after[k]))
    assert list(np.asarray(state.nonfinite)) == [1] * 8
    # the bad value is not hidden: the compressed update is NaN on every worker
    assert np.all(np.isnan(np.asarray(out["w"])))
    # a clean step moves every worker's residual again
    _, state = H.shard_map_update(tx, H.per_worker_grads(PARAMS, seed=2), state)
    for k in PARAMS:
        for w in range(8):
            assert not np.array_equal(np.asarray(state.residual[k])[w], before[k][w])
    # single worker (no axis): optax.apply_if_finite can skip the step
    wrapped = optax.apply_if_finite(optax.chain(jaxcomm.topk(0.05, min_size=0), optax.sgd(1.0)), 3)
    ws = wrapped.init(PARAMS)
    upd, ws = wrapped.update({k: v[3] for k, v in g.items()}, ws, PARAMS)
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(upd))
    assert int(ws.notfinite_count) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.topk(0.05, axis_name="data", min_size=0),
        lambda: jaxcomm.threshold(0.05, axis_name="data", min_size=0),
        lambda: jaxcomm.topk(0.05, axis_name="data", min_size=0, scope="global"),
        lambda: jaxcomm.randomk(0.05, axis_name="data", key=jax.random.key(0), min_size=0),
    ],
    ids=["topk", "threshold", "topk_global", "randomk"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_void_step_keeps_the_residual_bit_for_bit(make, dtype):
    """On a void step the residual keeps every bit, signed zeros and all: the sparse
    codecs form it as ``e + where(ok, g, -0.0)`` (a +0.0 there turns -0.0 into +0.0)."""
    params = {k: v.astype(dtype) for k, v in PARAMS.items()}
    tx = make()
    state = H.stack(tx.init(params))
    _, state = H.shard_map_update(tx, H.per_worker_grads(params, seed=0), state)
    # signed zeros, subnormals and ordinary values in every worker's residual
    res = {}
    for k, r in state.residual.items():
        r = np.array(r)
        flat = r.reshape(r.shape[0], -1)
        flat[:, ::3] = -0.0
        flat[:, 1::7] = np.float32(1e-40)
        res[k] = jnp.asarray(flat.reshape(r.shape), r.dtype)
    state = state._replace(residual=res)
    bits = {k: np.asarray(v).view(np.uint32) for k, v in res.items()}
    g = H.per_worker_grads(params, seed=1)
    g["w"] = g["w"].at[5, 1, 2].set(np.nan)
    out, state = H.shard_map_update(tx, g, state)
    assert np.all(np.isnan(np.asarray(out["w"], np.float32)))
    for k in params:
        np.testing.assert_array_equal(np.asarray(state.residual[k]).view(np.uint32), bits[k])


def test_updates_keep_their_dtype_and_residual_is_float32_for_bf16_params():
    params = {"w": jnp.zeros((64, 32), jnp.bfloat16)}
    tx = jaxcomm.topk(0.1, min_size=0)
    state = tx.init(params)
    assert state.residual["w"].dtype == jnp.float32
    out, state = tx.update({"w": jnp.ones((64, 32), jnp.bfloat16)}, state)
    assert out["w"].dtype == jnp.bfloat16 and state.residual["w"].dtype == jnp.float32
    # the payload is still encoded in bf16: same bytes as before
    assert jaxcomm.wire_bytes(jaxcomm.topk(0.1, min_size=0, axis_name="data"), params, 8) == (
        205 * (2 + 4) + 1  # + the NaN rule's 1-byte flag
    )
    # state_dtype= keeps it in bf16 for users who must save the memory
    low = jaxcomm.core.compress(
        jaxcomm.compressors.sparse.TopK(0.1), min_size=0, state_dtype=jnp.bfloat16
    )
    assert low.init(params).residual["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="state_dtype"):
        jaxcomm.core.compress(jaxcomm.compressors.sparse.TopK(0.1), state_dtype=jnp.int32)


def test_bf16_small_gradients_beside_large_ones_are_all_sent_eventually():
    def tx(state_dtype):
        return jaxcomm.core.compress(
            jaxcomm.compressors.sparse.TopK(0.01), min_size=0, state_dtype=state_dtype
        )

    memory = lambda state: state.residual["w"]  # noqa: E731
    # the default: a float32 residual; Σ sent + residual = Σ g up to float32 rounding
    assert H.bf16_telescoping_error(tx(None), memory) < 1e-3
    # what bf16 params used to get: e + g rounds to bf16
    assert H.bf16_telescoping_error(tx(jnp.bfloat16), memory) > 0.1


def test_typed_and_raw_keys_give_the_same_stream():
    g = {"v": jnp.arange(2000.0)}
    a = jaxcomm.randomk(0.01, key=jax.random.key(5), min_size=0)
    b = jaxcomm.randomk(0.01, key=jax.random.PRNGKey(5), min_size=0)
    oa, sa = a.update(g, a.init(g))
    ob, sb = b.update(g, b.init(g))
    np.testing.assert_array_equal(oa["v"], ob["v"])
    np.testing.assert_array_equal(sa.key, sb.key)


def test_checkpoint_restores_bit_exactly(tmp_path):
    """orbax round trip of a chain's state: residuals, keys and counters, bit for bit."""
    tx = optax.chain(
        jaxcomm.randomk(0.1, key=jax.random.key(1), min_size=0),
        optax.sgd(0.1, momentum=0.9),
    )
    params = {"w": jnp.zeros((32, 40), jnp.bfloat16), "b": jnp.zeros((8,))}
    state = tx.init(params)
    g = jax.tree.map(lambda x: x[0], H.per_worker_grads(params, seed=9))
    for _ in range(3):
        _, state = tx.update(g, state, params)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state", jax.tree.map(jnp.zeros_like, state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the restored state continues exactly like the original
    u1, _ = tx.update(g, state, params)
    u2, _ = tx.update(g, restored, params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
