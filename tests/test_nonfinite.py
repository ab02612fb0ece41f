"""Skipping non-finite steps with one decision on every worker: jaxcomm.skip_nonfinite.

One of 8 workers gets a NaN. Under shard_map and pmap (real collectives)
the step must be skipped on all of them, the state must stay as it was, and
the next clean step must run (no hang, no type error). The NaN rule itself
(every transform makes the update non-finite on every worker) is tested over
the whole registry in tests/test_registry.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from tests import helpers as H

KEY = jax.random.key(0)
PARAMS = {"w": jnp.zeros((24, 20)), "b": jnp.zeros((5,))}
BAD_WORKER = 3

# one compress-based transform that would not send the NaN, and the two with their own
# update (the NaN rule itself is tested over the whole registry)
MAKERS = {
    "randomk": lambda: jaxcomm.randomk(0.05, key=KEY, axis_name=H.AXIS, min_size=64),
    "powersgd": lambda: jaxcomm.powersgd(2, key=KEY, axis_name=H.AXIS),
    "dgc": lambda: jaxcomm.dgc(0.05, axis_name=H.AXIS, min_size=64),
}


def grads(seed, bad=None):
    g = H.per_worker_grads(PARAMS, seed=seed)
    if bad is None:
        return g
    w = np.asarray(g["w"]).copy()
    j = np.unravel_index(np.argmin(np.abs(w[BAD_WORKER])), w[BAD_WORKER].shape)
    w[(BAD_WORKER, *j)] = bad
    return {**g, "w": jnp.asarray(w)}


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("how", ["shard_map", "pmap"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_nan_on_one_of_8_workers_skips_the_step_on_all(name, how):
    tx = jaxcomm.skip_nonfinite(optax.chain(MAKERS[name](), optax.sgd(0.1)))
    state0 = H.stack(tx.init(PARAMS))
    if how == "pmap":
        step = jax.pmap(tx.update, axis_name=H.AXIS)

        def workers(out):
            return [jax.tree.map(lambda x, w=w: x[w], out) for w in range(H.N)]
    else:
        step, sh = H.sharded(tx)
        step = lambda g, s, f=step: f(jax.device_put(g, sh), jax.device_put(s, sh))  # noqa: E731

        def workers(out):  # out_specs=P(): the same on every worker
            return [out]

    out, state1 = step(grads(1, bad=np.nan), state0)
    for upd in workers(out):
        for k in PARAMS:
            np.testing.assert_array_equal(np.asarray(upd[k]), 0.0)
    assert_same_tree(state1.inner_state, state0.inner_state)  # nothing of the step kept
    np.testing.assert_array_equal(np.asarray(state1.total_notfinite), 1)
    np.testing.assert_array_equal(np.asarray(state1.last_finite), False)

    out, state2 = step(grads(2), state1)  # the next clean step runs, on every worker
    for upd in workers(out):
        assert np.any(np.asarray(upd["w"]) != 0)
        assert np.all(np.isfinite(np.asarray(upd["w"])))
    np.testing.assert_array_equal(np.asarray(state2.total_notfinite), 1)
    # and equals the clean step taken from the initial state: the NaN step left no trace
    ref, _ = step(grads(2), state0)
    for a, b in zip(workers(out), workers(ref)):
        assert_same_tree(a, b)


def test_optax_apply_if_finite_around_an_exchange_is_what_fails():
    """Why the wrapper exists: apply_if_finite decides per worker, before the exchange."""
    tx = optax.apply_if_finite(jaxcomm.topk(0.05, axis_name=H.AXIS, min_size=64), 3)
    with pytest.raises(Exception, match="(?i)cond|branch|vma|varying"):
        H.shard_map_update(tx, grads(1, bad=np.nan), H.stack(tx.init(PARAMS)))


def test_local_sgd_skips_on_every_worker_with_axis_name_and_keeps_its_schedule():
    """Between syncs updates are per worker: axis_name agrees the skip; sync counts stay equal."""
    params = H.stack(PARAMS)
    inner = jaxcomm.local_sgd(optax.sgd(0.1), every=2, axis_name=H.AXIS)
    tx = jaxcomm.skip_nonfinite(inner, axis_name=H.AXIS)
    state = H.stack(tx.init(PARAMS))

    def one(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.pmap(one, axis_name=H.AXIS)
    params1, state1 = step(params, state, grads(1, bad=np.nan))  # a local (non-sync) step
    assert_same_tree(params1, params)  # skipped on all 8, not only on the bad worker
    assert_same_tree(state1.inner_state, state.inner_state)
    p, s = params1, state1
    for t in range(2):  # local step, then the sync: every worker reaches it together
        p, s = step(p, s, grads(10 + t))
    np.testing.assert_array_equal(np.asarray(s.inner_state.syncs), 1)
    for w in range(1, H.N):  # replicas agree right after the sync
        np.testing.assert_allclose(np.asarray(p["w"][w]), np.asarray(p["w"][0]), atol=1e-6)


def test_without_axis_name_local_steps_are_decided_per_worker():
    """The documented limit: without axis_name only the bad worker skips a local step."""
    tx = jaxcomm.skip_nonfinite(jaxcomm.local_sgd(optax.sgd(0.1), every=2, axis_name=H.AXIS))
    state = H.stack(tx.init(PARAMS))
    step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=H.AXIS)
    _, state1 = step(grads(1, bad=np.nan), state, H.stack(PARAMS))
    skipped = np.asarray(state1.total_notfinite)
    assert skipped[BAD_WORKER] == 1 and skipped.sum() == 1


def test_max_consecutive_errors_applies_the_update_after_that_many_skips():
    tx = jaxcomm.skip_nonfinite(optax.sgd(1.0), max_consecutive_errors=2)
    state = tx.init(PARAMS)
    bad = {"w": jnp.full((24, 20), jnp.nan), "b": jnp.zeros((5,))}
    applied = []
    for _ in range(4):
        out, state = tx.update(bad, state)
        applied.append(bool(np.isnan(np.asarray(out["w"])).any()))
    assert applied == [False, False, True, True]  # as optax.apply_if_finite counts
    out, state = tx.update(jax.tree.map(jnp.ones_like, PARAMS), state)
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 4


def test_bad_arguments():
    with pytest.raises(TypeError, match="inner"):
        jaxcomm.skip_nonfinite(object())
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        jaxcomm.skip_nonfinite(optax.sgd(0.1), max_consecutive_errors=-1)
    with pytest.raises(TypeError, match="state"):
        jaxcomm.skip_nonfinite(optax.sgd(0.1)).update(PARAMS, optax.sgd(0.1).init(PARAMS))
