"""Property tests over a registry of every public jaxcomm transform.

Every method of :mod:`jaxcomm.methods` (jaxcomm's public factories and those of
the ``jaxcomm.compressors`` modules) has an entry in REGISTRY (key ``name`` or
``name:variant``), or is tested elsewhere (TESTED_ELSEWHERE):
``test_registry_is_complete`` fails otherwise. Each entry builds the
transform for a given axis_name; extra keyword options (``bucket_bytes``)
go to the jaxcomm transform that communicates (tests/test_buckets.py).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import methods
from tests import helpers as H

KEY = jax.random.key(0)

REGISTRY = {
    "allreduce": lambda ax, **kw: jaxcomm.allreduce(axis_name=ax, **kw),
    # "cast" takes the default accumulate: uint16 words on CPU, the psum elsewhere
    "cast": lambda ax, **kw: jaxcomm.cast(jnp.bfloat16, axis_name=ax, **kw, min_size=64),
    "cast:fp16_psum": lambda ax, **kw: jaxcomm.cast(
        jnp.float16, axis_name=ax, **kw, accumulate="psum", min_size=64
    ),
    "topk": lambda ax, **kw: jaxcomm.topk(0.05, axis_name=ax, **kw, min_size=64),
    "topk:global": lambda ax, **kw: jaxcomm.topk(
        0.05, axis_name=ax, **kw, scope="global", min_size=64
    ),
    "randomk": lambda ax, **kw: jaxcomm.randomk(0.05, key=KEY, axis_name=ax, **kw, min_size=64),
    "randomk:per_worker": lambda ax, **kw: jaxcomm.randomk(
        0.05,
        key=KEY,
        axis_name=ax,
        **kw,
        shared_indices=False,
        error_feedback=False,
        sampling="stratified",
        min_size=64,
    ),
    "threshold": lambda ax, **kw: jaxcomm.threshold(0.05, axis_name=ax, **kw, min_size=64),
    "int8": lambda ax, **kw: jaxcomm.int8(
        key=KEY, bucket_size=100, axis_name=ax, **kw, min_size=64
    ),
    "int8:nearest_ef": lambda ax, **kw: jaxcomm.int8(
        stochastic=False, axis_name=ax, **kw, error_feedback=True, min_size=64
    ),
    "qsgd": lambda ax, **kw: jaxcomm.qsgd(
        16, key=KEY, bucket_size=100, axis_name=ax, **kw, min_size=64
    ),
    # the all-gather path (the default, "qsgd" above, goes two-phase on 8 workers)
    "qsgd:s1_ef": lambda ax, **kw: jaxcomm.qsgd(
        1,
        key=KEY,
        bucket_size=100,
        axis_name=ax,
        **kw,
        error_feedback=True,
        min_size=64,
        exchange="gather",
    ),
    "terngrad": lambda ax, **kw: jaxcomm.terngrad(key=KEY, axis_name=ax, **kw, min_size=64),
    "terngrad:gather": lambda ax, **kw: jaxcomm.terngrad(
        key=KEY, axis_name=ax, **kw, clip_sigma=None, share_scale=False, min_size=64
    ),
    "onebit": lambda ax, **kw: jaxcomm.onebit(axis_name=ax, **kw, min_size=64),
    "onebit:bucket": lambda ax, **kw: jaxcomm.onebit(
        axis_name=ax, **kw, bucket_size=20, min_size=64
    ),
    "ef_sign": lambda ax, **kw: jaxcomm.ef_sign(axis_name=ax, **kw, min_size=64),
    "ef_sign:two_phase": lambda ax, **kw: jaxcomm.ef_sign(
        axis_name=ax, **kw, min_size=64, exchange="two_phase"
    ),
    "sign_majority": lambda ax, **kw: jaxcomm.sign_majority(axis_name=ax, **kw, min_size=64),
    "twobit": lambda ax, **kw: jaxcomm.twobit(0.5, axis_name=ax, **kw, min_size=64),
    "dgc": lambda ax, **kw: jaxcomm.dgc(0.05, axis_name=ax, **kw, min_size=64),
    "dgc:warmup_nesterov_clip": lambda ax, **kw: jaxcomm.dgc(
        0.05, axis_name=ax, **kw, min_size=64, warmup_steps=8, nesterov=True, clip_norm=1.0
    ),
    "dgc:no_correction": lambda ax, **kw: jaxcomm.dgc(
        0.05, axis_name=ax, **kw, min_size=64, momentum=0.0, momentum_correction=False
    ),
    "dgc_sgd": lambda ax, **kw: jaxcomm.dgc_sgd(0.1, 0.05, axis_name=ax, **kw, min_size=64),
    "powersgd": lambda ax, **kw: jaxcomm.powersgd(2, key=KEY, axis_name=ax, **kw),
    "powersgd:rank4_batched_start1": lambda ax, **kw: jaxcomm.powersgd(
        4, key=KEY, axis_name=ax, **kw, batch_same_shape=True, start_iter=1, min_compression_rate=1
    ),
    "powersgd:rank1_no_warm_start_no_ef": lambda ax, **kw: jaxcomm.powersgd(
        1, key=KEY, axis_name=ax, **kw, warm_start=False, error_feedback=False
    ),
}
# sync wrappers around an inner optimizer; STEPS: steps until the first exchange's result
# comes out (the tests that look at an update run that many steps)
REGISTRY.update(
    {
        "accumulate": lambda ax, **kw: jaxcomm.accumulate(
            optax.chain(jaxcomm.topk(0.05, axis_name=ax, **kw, min_size=64), optax.sgd(0.1)),
            every=2,
        ),
        # delay >= 1 returns per-worker updates until the mean arrives (out_specs=P() cannot
        # hold them): delay=0 here, delays tested in tests/test_sync.py
        "delayed_averaging": lambda ax, **kw: jaxcomm.delayed_averaging(
            optax.sgd(0.1), delay=0, axis_name=ax, **kw
        ),
        "stale": lambda ax, **kw: jaxcomm.stale(
            jaxcomm.topk(0.05, axis_name=ax, **kw, min_size=64), staleness=1
        ),
        "skip_nonfinite": lambda ax, **kw: jaxcomm.skip_nonfinite(
            jaxcomm.randomk(0.05, key=KEY, axis_name=ax, **kw, min_size=64)
        ),
    }
)
STEPS = {"accumulate": 2, "stale": 2}


def steps(name, update, g, state):
    """``update(g, state)`` ``STEPS[name]`` times (default 1): the last (updates, state)."""
    for _ in range(STEPS.get(name, 1)):
        out, state = update(g, state)
    return out, state


# Transforms whose properties need a setting this file's tests cannot give, and where
# the same properties are tested instead.
TESTED_ELSEWHERE = {
    "local_sgd": "tests/test_sync.py (per-worker params; updates differ between syncs)",
    "diloco": "tests/test_sync.py (per-worker params; updates differ between syncs)",
    "hierarchical": "tests/test_topology.py (needs a 2-D mesh)",
    "muloco": "tests/test_loco.py (per-worker params; updates differ between syncs)",
    "sparseloco": "tests/test_loco.py (per-worker params; updates differ between syncs)",
    "streaming_diloco": "tests/test_streaming.py (per-worker params; NumPy reference)",
    "demo": "tests/test_demo.py (per-worker momentum; with a schedule the identical update "
    "is typed per worker; NumPy reference, HLO bytes, NaN rule)",
    "onebit_adam": "tests/test_optim.py (identical updates typed per worker: the frozen "
    "variance is per-worker state, so shard_map needs out_specs=P('data'))",
    "auto": "tests/test_policy.py (needs a mesh to measure on; returns one of the candidate "
    "transforms, each in this registry, or dense_warmup over one)",
    "zero_one_adam": "tests/test_optim.py (per-worker updates on local steps; NumPy "
    "reference, HLO bytes, NaN rule)",
}
# Off CPU "cast" is the bf16 psum: vmap sums bf16 payloads in bf16, an all-reduce may
# not. On CPU both casts sum in f32 (uint16 words; fp16 widened) and agree exactly.
VMAP_ATOL = {"cast": 2e-2} if jax.default_backend() != "cpu" else {}

PARAMS = {"w": jnp.zeros((24, 20)), "conv": jnp.zeros((3, 3, 4, 8)), "b": jnp.zeros((5,))}


def params_in(dtype):
    return jax.tree.map(lambda x: x.astype(dtype), PARAMS)


def missing_entries(registry: dict) -> set[str]:
    """The methods of :mod:`jaxcomm.methods` with no entry in ``registry`` nor elsewhere."""
    tested = {name.split(":")[0] for name in registry} | set(TESTED_ELSEWHERE)
    return set(methods.names()) - tested


def test_registry_is_complete():
    missing = missing_entries(REGISTRY)
    assert not missing, f"add these methods to tests/test_registry.py's REGISTRY: {missing}"


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_jit_local_state_stable_dtype_preserved(name, dtype):
    tx = REGISTRY[name](None)
    params = params_in(dtype)
    state = tx.init(params)
    g = jax.tree.map(lambda x: x[0], H.per_worker_grads(params, seed=1))
    update = jax.jit(tx.update)
    out, state1 = update(g, state)
    out2, state2 = update(g, state1)
    for s in (state1, state2):
        assert jax.tree.structure(s) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(state)):
            assert a.shape == b.shape and a.dtype == b.dtype
    for o in (out, out2):
        for k in params:
            assert o[k].dtype == dtype and o[k].shape == params[k].shape
            assert np.all(np.isfinite(np.asarray(o[k], np.float32)))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_shard_map_equals_pmap_equals_vmap(name):
    tx = REGISTRY[name]("data")
    g = H.per_worker_grads(PARAMS, seed=2)
    state = H.stack(tx.init(PARAMS))
    out_sm, st_sm = steps(name, lambda g, s: H.shard_map_update(tx, g, s), g, state)
    out_pm, st_pm = steps(name, lambda g, s: H.pmap_update(tx, g, s), g, state)
    out_vm, st_vm = steps(name, lambda g, s: H.vmap_update(tx, g, s), g, state)
    assert any(np.any(np.asarray(out_sm[k]) != 0) for k in PARAMS)
    for k in PARAMS:
        for w in (0, 5):  # every worker gets the same mean
            np.testing.assert_allclose(out_pm[k][w], out_sm[k], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(
                out_vm[k][w], out_sm[k], rtol=1e-6, atol=VMAP_ATOL.get(name, 1e-7)
            )
    for a, b, c in zip(jax.tree.leaves(st_sm), jax.tree.leaves(st_pm), jax.tree.leaves(st_vm)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-6)
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(c, np.float64), atol=1e-6)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_hlo_collective_bytes_equal_wire_bytes(name):
    tx = REGISTRY[name]("data")
    g = H.per_worker_grads(PARAMS, seed=3)
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS)))
    hlo = jaxcomm.accounting.hlo_collectives(compiled)
    wire = jaxcomm.accounting.wire_report(tx, PARAMS, H.N)
    assert wire, "a transform with an axis must communicate"
    hlo_bytes = sum(c.nbytes for c in hlo)
    wire_bytes = jaxcomm.wire_bytes(tx, PARAMS, H.N)
    assert wire_bytes == sum(c.nbytes for c in wire)
    # to the byte, on every backend: the report counts XLA:CPU's f32 bf16 sums
    assert hlo_bytes == wire_bytes
    kinds = {c.kind for c in wire}
    assert kinds <= {c.kind for c in hlo}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_chain_with_sgd_runs_under_shard_map_with_replicated_params(name):
    """The user-facing pattern: params replicated, per-worker opt state, updated params out P()."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tx = optax.chain(REGISTRY[name]("data"), optax.sgd(0.1))
    mesh = H.mesh()
    opt_state = H.stack(tx.init(PARAMS))

    def step(params, opt_state, g):
        opt_state = jax.tree.map(lambda x: x[0], opt_state)
        g = jax.tree.map(lambda x: x[0], g)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), jax.tree.map(lambda x: x[None], opt_state)

    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))
        )
    )
    rep, sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    g = H.per_worker_grads(PARAMS, seed=4)
    new_params, opt_state = jax.device_put(PARAMS, rep), jax.device_put(opt_state, sh)
    for _ in range(STEPS.get(name, 1)):
        new_params, opt_state = fn(new_params, opt_state, jax.device_put(g, sh))
    assert all(np.any(np.asarray(new_params[k]) != 0) for k in PARAMS)


def test_a_transform_refuses_another_transforms_state():
    # Variants of one factory (e.g. topk and topk:global) share a state layout and may
    # exchange states; states of different factories must never pass silently.
    ones = jax.tree.map(jnp.ones_like, PARAMS)
    silent = []
    for a, b in itertools.permutations(sorted(REGISTRY), 2):
        if a.split(":")[0] == b.split(":")[0]:
            continue
        foreign = REGISTRY[b](None).init(PARAMS)
        try:
            REGISTRY[a](None).update(ones, foreign, PARAMS)
        except (TypeError, ValueError) as e:
            assert "state" in str(e), (a, b, str(e))
        else:
            silent.append((a, b))
    assert not silent, silent


def _poisoned_grads(bad: float, worker: int = 3):
    """Normal per-worker grads; one worker's "w" holds ``bad`` at its smallest entry.

    The smallest magnitude is where a selection by magnitude (top-k,
    threshold, DGC) would not look, and a random selection misses it too.
    """
    g = H.per_worker_grads(PARAMS, seed=7)
    w = np.asarray(g["w"]).copy()
    j = np.unravel_index(np.argmin(np.abs(w[worker])), w[worker].shape)
    w[(worker, *j)] = bad
    return {**g, "w": jnp.asarray(w)}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_one_workers_nan_makes_every_workers_update_nonfinite(name):
    """The NaN rule: any worker's non-finite gradient -> a non-finite update on every worker.

    So a skip decided from the update (``jaxcomm.skip_nonfinite``,
    ``optax.apply_if_finite`` after the exchange) is the same everywhere; and
    the state, finite before, stays finite: the next clean step is finite.
    """
    tx = REGISTRY[name]("data")
    state = H.stack(tx.init(PARAMS))
    step = jax.pmap(tx.update, axis_name=H.AXIS)
    clean = H.per_worker_grads(PARAMS, seed=9)
    for bad in (np.nan, -np.inf):
        out, new_state = step(_poisoned_grads(bad), state)
        for _ in range(STEPS.get(name, 1) - 1):  # clean steps until the bad one comes out
            out, new_state = step(clean, new_state)
        if name == "skip_nonfinite":  # the step is skipped on every worker instead
            for k in PARAMS:
                np.testing.assert_array_equal(np.asarray(out[k]), 0.0)
            continue
        for w in range(H.N):
            assert not all(
                np.all(np.isfinite(np.asarray(out[k][w], np.float32))) for k in PARAMS
            ), (name, bad, w)
        for leaf in jax.tree.leaves(new_state):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.all(np.isfinite(np.asarray(leaf, np.float32))), (name, bad)
        out, _ = step(H.per_worker_grads(PARAMS, seed=8), new_state)
        for k in PARAMS:
            assert np.all(np.isfinite(np.asarray(out[k], np.float32))), (name, bad, k)
