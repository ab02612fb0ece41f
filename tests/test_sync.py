"""Less frequent communication: accumulation, local SGD, DiLoCo, delayed averaging, staleness.

Most tests run a per-worker quadratic problem (worker i has loss
``sum(A_i * w**2 / 2 - B_i * w)``, gradient ``A_i * w - B_i``) for a few steps
under ``jax.shard_map`` with params kept per worker, and compare with a
float64 NumPy reference of the algorithm. Collectives are counted as they
execute: ``collectives.psum``/``all_gather`` are wrapped with a host callback.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import digits
from jaxcomm import collectives
from jaxcomm.compressors.dense import Dense
from jaxcomm.compressors.sparse import RandomK
from jaxcomm.sync import accumulate, delayed_averaging, diloco, local_sgd, stale
from tests import helpers as H

N, AX = H.N, H.AXIS
SHAPES = {"w": (6, 4), "b": (5,)}
PARAMS = {k: jnp.zeros(s) for k, s in SHAPES.items()}
LR = 0.3


def problem(seed=0):
    """Initial params (same on every worker) and per-worker data A, B."""
    rng = np.random.default_rng(seed)
    w0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    a = {k: rng.uniform(0.5, 1.5, size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}
    b = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}
    return w0, a, b


def grad(p, a, b):
    return jax.tree.map(lambda p, a, b: a * p - b, p, a, b)


def _first(t):
    return jax.tree.map(lambda x: x[0], t)


def _lead(t):
    return jax.tree.map(lambda x: x[None], t)


def make_step(tx, *, fixed_grads=False):
    """One training step of one worker: (params, state, a, b) -> (params, state, updates).

    ``fixed_grads``: the gradient is ``b`` itself (does not depend on params).
    """

    def step(p, s, a, b):
        g = b if fixed_grads else grad(p, a, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    return step


def shard_map_step(tx, **kw):
    step = make_step(tx, **kw)

    def f(p, s, a, b):
        return _lead(step(_first(p), _first(s), _first(a), _first(b)))

    return jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX)))


def place(tree):
    return jax.device_put(tree, NamedSharding(H.mesh(), P(AX)))


def run(tx, steps, *, seed=0, a=None, b=None, how="shard_map", on_step=None, fixed_grads=False):
    """``steps`` steps on N workers. Returns per-step history (numpy) and the final state.

    ``b`` may be a list of per-step trees (a gradient sequence, with ``fixed_grads``).
    """
    w0, a0, b0 = problem(seed)
    a = a0 if a is None else a
    p, s = H.stack(w0), H.stack(tx.init(w0))
    if how == "shard_map":
        fn = shard_map_step(tx, fixed_grads=fixed_grads)
        p, s, a = place(p), place(s), place(a)
    elif how == "pmap":
        fn = jax.pmap(make_step(tx, fixed_grads=fixed_grads), axis_name=AX)
    else:
        fn = jax.jit(jax.vmap(make_step(tx, fixed_grads=fixed_grads), axis_name=AX))
    hist = {"params": [H.np_tree(p)], "updates": [], "states": []}
    for t in range(steps):
        bt = b[t] if isinstance(b, list) else (b0 if b is None else b)
        if on_step is not None:
            on_step(t)
        p, s, u = jax.block_until_ready(fn(p, s, a, place(bt) if how == "shard_map" else bt))
        jax.effects_barrier()
        hist["params"].append(H.np_tree(p))
        hist["updates"].append(H.np_tree(u))
        hist["states"].append(jax.tree.map(np.asarray, s))
    return hist, s


@pytest.fixture
def exchanges(monkeypatch):
    """Steps at which a collective executed: collectives.psum/all_gather report to the host."""
    log, current = [], [None]

    def wrap(fn):
        def counted(tree, axis_name):
            out = fn(tree, axis_name)
            leaf = jax.tree.leaves(out)[0]
            jax.debug.callback(lambda _: log.append(current[0]), leaf.reshape(-1)[0])
            return out

        return counted

    monkeypatch.setattr(collectives, "psum", wrap(collectives.psum))
    monkeypatch.setattr(collectives, "all_gather", wrap(collectives.all_gather))

    class Counter:
        def on_step(self, t):
            current[0] = t

        def steps(self):
            return sorted(set(log))

        def calls(self):
            return len(log)

    return Counter()


def sync_steps(steps, every, warmup=0):
    return [t for t in range(steps) if t < warmup or (t - warmup + 1) % every == 0]


# --- NumPy references -------------------------------------------------------------------


def np_problem(seed=0):
    w0, a, b = problem(seed)
    f64 = lambda t: {k: np.asarray(v, np.float64) for k, v in t.items()}
    return f64(w0), f64(a), f64(b)


def np_local_sgd(steps, every, warmup=0, lr=LR, momentum=0.0, seed=0):
    w0, a, b = np_problem(seed)
    w = {k: np.broadcast_to(v, (N,) + v.shape).copy() for k, v in w0.items()}
    tr = {k: np.zeros_like(v) for k, v in w.items()}
    out = []
    for t in range(steps):
        for k in w:
            tr[k] = a[k] * w[k] - b[k] + momentum * tr[k]
            w[k] = w[k] - lr * tr[k]
        if t < warmup or (t - warmup + 1) % every == 0:
            w = {k: np.broadcast_to(v.mean(0), v.shape).copy() for k, v in w.items()}
        out.append({k: v.copy() for k, v in w.items()})
    return out


def np_topk_mean(x, ratio):
    """Per-worker top-k of each row of x (n, d): the kept vectors."""
    k = min(x.shape[1], max(1, math.ceil(ratio * x.shape[1] - 1e-9)))
    kept = np.zeros_like(x)
    for i in range(x.shape[0]):
        idx = np.argsort(-np.abs(x[i]), kind="stable")[:k]
        kept[i, idx] = x[i, idx]
    return kept


def np_diloco(steps, every, lr=LR, outer_lr=0.7, mu=0.9, topk=None, seed=0):
    """DiLoCo with inner SGD and outer Nesterov SGD; optional top-k + EF on the drift."""
    w0, a, b = np_problem(seed)
    w = {k: np.broadcast_to(v, (N,) + v.shape).copy() for k, v in w0.items()}
    anchor = {k: v.copy() for k, v in w0.items()}
    mom = {k: np.zeros_like(v) for k, v in w0.items()}
    res = {k: np.zeros_like(v) for k, v in w.items()}
    out = []
    for t in range(steps):
        for k in w:
            w[k] = w[k] - lr * (a[k] * w[k] - b[k])
        if (t + 1) % every == 0:
            for k in w:
                if topk is None:
                    delta = anchor[k] - w[k].mean(0)
                else:
                    p = (anchor[k][None] - w[k]).reshape(N, -1) + res[k].reshape(N, -1)
                    kept = np_topk_mean(p, topk)
                    res[k] = (p - kept).reshape(res[k].shape)
                    delta = kept.mean(0).reshape(anchor[k].shape)
                mom[k] = delta + mu * mom[k]
                anchor[k] = anchor[k] - outer_lr * (delta + mu * mom[k])  # nesterov
                w[k] = np.broadcast_to(anchor[k], w[k].shape).copy()
        out.append({k: v.copy() for k, v in w.items()})
    return out


def assert_close(got, want, rtol=1e-5, atol=1e-5):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


# --- argument checks ----------------------------------------------------------------


def test_bad_arguments_raise_value_errors_naming_the_argument():
    sgd = optax.sgd(0.1)
    for bad, err in (
        (0, ValueError),
        (-1, ValueError),
        (2.5, TypeError),
        (True, TypeError),
        (None, TypeError),
    ):
        with pytest.raises(err, match=r"every: expected an int >= 1"):
            local_sgd(sgd, every=bad, axis_name=AX)
        with pytest.raises(err, match=r"every: expected an int >= 1"):
            diloco(sgd, every=bad, axis_name=AX)
        with pytest.raises(err, match=r"every: expected an int >= 1"):
            accumulate(sgd, every=bad)
    with pytest.raises(ValueError, match=r"warmup_steps: expected an int >= 0"):
        local_sgd(sgd, every=2, axis_name=AX, warmup_steps=-1)
    with pytest.raises(ValueError, match=r"delay: expected an int >= 0"):
        delayed_averaging(sgd, delay=-1, axis_name=AX)
    with pytest.raises(ValueError, match=r"staleness: expected an int >= 0"):
        stale(sgd, staleness=-2)
    with pytest.raises(TypeError, match="inner: expected an optax.GradientTransformation"):
        local_sgd(lambda g: g, every=2, axis_name=AX)
    with pytest.raises(TypeError, match="outer"):
        diloco(sgd, every=2, axis_name=AX, outer="sgd")
    with pytest.raises(TypeError, match="axis_name"):
        local_sgd(sgd, every=2, axis_name=3)
    with pytest.raises(TypeError, match="compressor"):
        diloco(sgd, every=2, axis_name=AX, compressor="topk")
    keyed = RandomK(0.1, shared=True, rescale=False, sampling="uniform")
    with pytest.raises(ValueError, match="compressor: this Compressor needs a PRNG key"):
        diloco(sgd, every=2, axis_name=AX, compressor=keyed)


@pytest.mark.parametrize("make", [local_sgd, diloco], ids=["local_sgd", "diloco"])
def test_missing_params_raise_value_error_naming_params(make):
    tx = make(optax.sgd(0.1), every=2, axis_name=None)
    with pytest.raises(ValueError, match=r"params: .*tx.update\(updates, state, params\)"):
        tx.update(PARAMS, tx.init(PARAMS))


def test_state_from_another_transform_raises():
    tx = local_sgd(optax.sgd(0.1), every=2, axis_name=None)
    with pytest.raises(TypeError, match="state: expected the LocalSGDState"):
        tx.update(PARAMS, optax.sgd(0.1).init(PARAMS), PARAMS)


def test_compressor_must_average_over_the_same_axis():
    for comp in (jaxcomm.topk(0.1, min_size=0), jaxcomm.topk(0.1, axis_name="model")):
        tx = diloco(optax.sgd(0.1), every=2, axis_name=AX, compressor=comp)
        with pytest.raises(ValueError, match="compressor: must average over axis_name='data'"):
            tx.init(PARAMS)
    tx = local_sgd(
        optax.sgd(0.1), every=2, axis_name=None, compressor=jaxcomm.allreduce(axis_name=AX)
    )
    with pytest.raises(ValueError, match="compressor: it communicates"):
        tx.init(PARAMS)


# --- gradient accumulation -------------------------------------------------------------


def micro_grads(steps, seed=5):
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]


def test_accumulate_exchanges_once_per_k_and_residual_moves_only_then(exchanges):
    k, steps = 3, 8
    inner = lambda: optax.chain(jaxcomm.topk(0.25, axis_name=AX, min_size=0), optax.sgd(1.0))
    gs = micro_grads(steps)
    hist, state = run(
        accumulate(inner(), every=k), steps, b=gs, fixed_grads=True, on_step=exchanges.on_step
    )
    assert exchanges.steps() == [2, 5]  # counted from execution
    assert np.all(state.syncs == 2) and np.all(state.count == steps)
    # reference: inner alone on the mean of each block of k micro-gradients
    means = [jax.tree.map(lambda *g: np.mean(g, 0), *gs[i : i + k]) for i in (0, 3)]
    ref, _ = run(inner(), 2, b=means, fixed_grads=True)
    residual = lambda s: s.inner_state[0].residual
    for t in range(steps):
        moved = t in (2, 5)
        before = residual(hist["states"][t - 1]) if t else H.np_tree(H.stack(PARAMS))
        after = residual(hist["states"][t])
        for key in SHAPES:
            assert np.array_equal(before[key], after[key]) != moved, (t, key)
            if not moved:
                assert not np.any(hist["updates"][t][key])
    for t, r in ((2, 0), (5, 1)):
        assert_close(hist["updates"][t], ref["updates"][r], rtol=1e-6, atol=1e-6)
        assert_close(residual(hist["states"][t]), ref["states"][r][0].residual, 1e-6, 1e-6)


def test_optax_multisteps_exchanges_on_every_micro_step(exchanges):
    """Why jaxcomm.sync.accumulate exists (optax 0.2.8). If this fails, optax changed."""
    inner = optax.chain(jaxcomm.topk(0.25, axis_name=AX, min_size=0), optax.sgd(1.0))
    tx = optax.MultiSteps(inner, every_k_schedule=3)
    step = make_step(tx, fixed_grads=True)

    def f(p, s, a, b):
        return _lead(step(_first(p), _first(s), _first(a), _first(b)))

    w0, a, _ = problem()
    args = place((H.stack(w0), H.stack(tx.init(w0)), a, micro_grads(1)[0]))
    with pytest.raises(TypeError, match="cond branches"):  # per-worker state, vma checked
        jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX)))(*args)
    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX), check_vma=False))
    for t in range(3):
        exchanges.on_step(t)
        args = (*jax.block_until_ready(fn(*args))[:2], *args[2:])
        jax.effects_barrier()
    assert exchanges.steps() == [0, 1, 2]  # the exchange ran on every micro-step


# --- local SGD --------------------------------------------------------------------------


def test_local_sgd_every_1_equals_synchronous_sgd():
    hist, _ = run(local_sgd(optax.sgd(LR), every=1, axis_name=AX), 10)
    ref, _ = run(optax.chain(jaxcomm.allreduce(axis_name=AX), optax.sgd(LR)), 10)
    for got, want in zip(hist["params"], ref["params"]):
        assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "every,warmup,steps", [(4, 0, 10), (3, 2, 11), (8, 0, 8), (5, 3, 2), (1, 0, 5), (4, 5, 14)]
)
def test_local_sgd_sync_count_counted_from_execution(exchanges, every, warmup, steps):
    tx = local_sgd(optax.sgd(LR), every=every, axis_name=AX, warmup_steps=warmup)
    _, state = run(tx, steps, on_step=exchanges.on_step)
    want = sync_steps(steps, every, warmup)
    assert len(want) == min(steps, warmup) + max(0, steps - warmup) // every
    assert exchanges.steps() == want
    assert exchanges.calls() == N * len(want)  # one all-reduce call per sync, on every device
    assert np.all(np.asarray(state.syncs) == len(want))


def test_local_sgd_replicas_differ_between_syncs_and_agree_right_after():
    every, warmup, steps = 4, 2, 12
    hist, _ = run(local_sgd(optax.sgd(LR), every=every, axis_name=AX, warmup_steps=warmup), steps)
    syncs = sync_steps(steps, every, warmup)
    for t in range(steps):
        p = hist["params"][t + 1]
        spread = max(np.max(np.abs(v - v[:1])) for v in p.values())
        if t in syncs:
            assert spread <= 1e-6, (t, spread)
        else:
            assert spread > 1e-3, (t, spread)


def test_local_sgd_with_momentum_matches_numpy_reference():
    every, warmup, steps = 3, 2, 11
    tx = local_sgd(optax.sgd(LR, momentum=0.5), every=every, axis_name=AX, warmup_steps=warmup)
    hist, _ = run(tx, steps)
    ref = np_local_sgd(steps, every, warmup, momentum=0.5)
    for t in range(steps):
        assert_close(hist["params"][t + 1], ref[t])


def test_local_sgd_with_dense_compressor_equals_plain_local_sgd():
    plain, _ = run(local_sgd(optax.sgd(LR), every=3, axis_name=AX), 9)
    comp = local_sgd(
        optax.sgd(LR), every=3, axis_name=AX, compressor=jaxcomm.allreduce(axis_name=AX)
    )
    hist, state = run(comp, 9)
    for got, want in zip(hist["params"], plain["params"]):
        assert_close(got, want, rtol=1e-6, atol=1e-6)
    # a bare Compressor is wrapped (error feedback, min_size=0): the same result
    obj = local_sgd(optax.sgd(LR), every=3, axis_name=AX, compressor=Dense())
    for got, want in zip(run(obj, 9)[0]["params"], plain["params"]):
        assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the anchor is the last synchronised params
    assert_close(_first(H.np_tree(state.anchor)), _first(hist["params"][9]), 1e-6, 1e-6)


# --- DiLoCo -----------------------------------------------------------------------------


def test_diloco_with_outer_sgd_1_equals_local_sgd():
    hist, _ = run(diloco(optax.sgd(LR), every=4, axis_name=AX, outer=optax.sgd(1.0)), 12)
    ref, _ = run(local_sgd(optax.sgd(LR), every=4, axis_name=AX), 12)
    for got, want in zip(hist["params"], ref["params"]):
        assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_diloco_nesterov_outer_matches_numpy_reference(exchanges):
    hist, state = run(diloco(optax.sgd(LR), every=3, axis_name=AX), 12, on_step=exchanges.on_step)
    ref = np_diloco(12, 3)
    for t in range(12):
        assert_close(hist["params"][t + 1], ref[t])
    assert exchanges.steps() == [2, 5, 8, 11] and np.all(np.asarray(state.syncs) == 4)


def test_diloco_topk_compressed_pseudo_gradient_with_error_feedback_matches_numpy():
    comp = jaxcomm.topk(0.25, axis_name=AX, min_size=0)
    hist, _ = run(diloco(optax.sgd(LR), every=3, axis_name=AX, compressor=comp), 12)
    ref = np_diloco(12, 3, topk=0.25)
    for t in range(12):
        assert_close(hist["params"][t + 1], ref[t])
    # the residual moves only on synchronisations
    res = [s.compressor_state.residual["w"] for s in hist["states"]]
    for t in range(1, 12):
        assert np.array_equal(res[t], res[t - 1]) == (t not in (2, 5, 8, 11))


# --- delayed averaging, staleness --------------------------------------------------------


def test_delayed_averaging_delay_0_equals_synchronous_sgd():
    hist, _ = run(delayed_averaging(optax.sgd(LR), delay=0, axis_name=AX), 10)
    ref, _ = run(optax.chain(jaxcomm.allreduce(axis_name=AX), optax.sgd(LR)), 10)
    for got, want in zip(hist["params"], ref["params"]):
        assert_close(got, want, rtol=0, atol=0)  # bit for bit


def np_delayed(steps, delay, drain, lr=LR, seed=0):
    """Zhu et al.: w -= lr*g_t; when mean_{t-D} arrives, w -= lr*(mean_{t-D} - g_{t-D})."""
    w0, a, b = np_problem(seed)
    w = {k: np.broadcast_to(v, (N,) + v.shape).copy() for k, v in w0.items()}
    sent, out = [], []
    for t in range(steps + drain):
        g = {k: (a[k] * w[k] - b[k]) if t < steps else np.zeros_like(w[k]) for k in w}
        sent.append(g)
        for k in w:
            w[k] = w[k] - lr * g[k]
            if t >= delay:
                old = sent[t - delay][k]
                w[k] = w[k] - lr * (old.mean(0) - old)
        out.append({k: v.copy() for k, v in w.items()})
    return out


@pytest.mark.parametrize("delay", [1, 3])
def test_delayed_averaging_matches_numpy_and_agrees_after_the_queue_drains(delay):
    steps = 9
    w0, a, b = problem()
    zeros_a = jax.tree.map(np.zeros_like, a)  # drain: gradient A*w - B with A = B = 0
    tx = delayed_averaging(optax.sgd(LR), delay=delay, axis_name=AX)
    p, s = place(H.stack(w0)), place(H.stack(tx.init(w0)))
    fn = shard_map_step(tx)
    ref = np_delayed(steps, delay, delay)
    for t in range(steps + delay):
        at, bt = (a, b) if t < steps else (zeros_a, zeros_a)
        p, s, _ = fn(p, s, place(at), place(bt))
        assert_close(H.np_tree(p), ref[t])
    drained = H.np_tree(p)
    for v in drained.values():  # every worker holds the same params once nothing is in flight
        np.testing.assert_allclose(v, np.broadcast_to(v[:1], v.shape), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(s.count) == steps + delay) and s.queue["w"].shape == (N, delay, 6, 4)


def test_delayed_averaging_closed_form_for_fixed_gradients():
    """Gradients that do not depend on params: after draining, w = w0 - lr * sum_t mean_t."""
    delay, steps = 2, 6
    gs = micro_grads(steps, seed=3) + [jax.tree.map(np.zeros_like, micro_grads(1)[0])] * delay
    hist, _ = run(
        delayed_averaging(optax.sgd(LR), delay=delay, axis_name=AX),
        steps + delay,
        b=gs,
        fixed_grads=True,
    )
    w0 = np_problem()[0]
    total = {k: sum(np.asarray(g[k], np.float64).mean(0) for g in gs) for k in SHAPES}
    want = {k: np.broadcast_to(w0[k] - LR * total[k], (N,) + SHAPES[k]) for k in SHAPES}
    assert_close(hist["params"][-1], want, rtol=1e-5, atol=1e-6)


def test_stale_0_is_the_inner_optimizer():
    hist, _ = run(stale(optax.sgd(LR, momentum=0.9), staleness=0), 6)
    ref, _ = run(optax.sgd(LR, momentum=0.9), 6)
    for got, want in zip(hist["params"], ref["params"]):
        assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("staleness", [1, 3])
def test_stale_applies_gradients_late_like_numpy(staleness):
    steps = 10
    tx = stale(optax.chain(jaxcomm.allreduce(axis_name=AX), optax.sgd(LR)), staleness=staleness)
    hist, _ = run(tx, steps)
    w0, a, b = np_problem()
    ws = [{k: np.broadcast_to(v, (N,) + v.shape).copy() for k, v in w0.items()}]
    for t in range(steps):
        w = ws[-1]
        if t >= staleness:
            old = ws[t - staleness]
            w = {k: w[k] - LR * (a[k] * old[k] - b[k]).mean(0) for k in w}
        ws.append(w)
    for t in range(steps + 1):
        assert_close(hist["params"][t], ws[t])


def test_stale_leaves_inner_state_untouched_until_the_first_gradient_arrives():
    _, state = run(stale(optax.adam(0.1), staleness=3), 5)
    assert np.all(np.asarray(state.inner_state[0].count) == 2)


# --- under every mapping; accounting; checkpoints ----------------------------------------

MAPPED = {
    "local_sgd": lambda: local_sgd(
        optax.sgd(LR, momentum=0.5), every=3, axis_name=AX, warmup_steps=1
    ),
    "local_sgd:topk": lambda: local_sgd(
        optax.sgd(LR),
        every=2,
        axis_name=AX,
        compressor=jaxcomm.topk(0.25, axis_name=AX, min_size=0),
    ),
    "diloco": lambda: diloco(optax.adam(0.05), every=3, axis_name=AX),
    "diloco:topk": lambda: diloco(
        optax.sgd(LR),
        every=2,
        axis_name=AX,
        compressor=jaxcomm.topk(0.25, axis_name=AX, min_size=0),
    ),
    "delayed_averaging": lambda: delayed_averaging(
        optax.sgd(LR, momentum=0.5), delay=2, axis_name=AX
    ),
    "stale": lambda: stale(
        optax.chain(jaxcomm.allreduce(axis_name=AX), optax.sgd(LR)), staleness=2
    ),
    "accumulate": lambda: accumulate(
        optax.chain(jaxcomm.topk(0.25, axis_name=AX, min_size=0), optax.sgd(LR)), every=2
    ),
}


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_shard_map_equals_pmap_equals_vmap(name):
    sm, s_sm = run(MAPPED[name](), 5)
    pm, s_pm = run(MAPPED[name](), 5, how="pmap")
    vm, s_vm = run(MAPPED[name](), 5, how="vmap")
    assert_close(sm["params"][-1], pm["params"][-1], rtol=1e-6, atol=1e-6)
    assert_close(sm["params"][-1], vm["params"][-1], rtol=1e-6, atol=1e-6)
    for a, b, c in zip(jax.tree.leaves(s_sm), jax.tree.leaves(s_pm), jax.tree.leaves(s_vm)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-6)
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(c, np.float64), atol=1e-6)


@pytest.mark.parametrize("name", sorted(set(MAPPED) - {"stale"}))
def test_hlo_collective_bytes_equal_wire_bytes(name):
    tx = MAPPED[name]()
    w0, a, b = problem()
    fn = shard_map_step(tx)
    compiled = fn.lower(*place((H.stack(w0), H.stack(tx.init(w0)), a, b))).compile()
    hlo = sum(c.nbytes for c in jaxcomm.accounting.hlo_collectives(compiled))
    wire = jaxcomm.wire_bytes(tx, PARAMS, N)
    assert wire > 0 and hlo == wire
    if name in ("local_sgd", "diloco", "delayed_averaging"):  # one dense model per exchange
        assert wire == 4 * sum(math.prod(s) for s in SHAPES.values())


def test_checkpoint_round_trip_continues_identically(tmp_path):
    tx = MAPPED["diloco:topk"]()
    _, state = run(tx, 3)
    state = jax.device_get(state)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state", jax.tree.map(np.zeros_like, state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w0, a, b = problem()
    fn = shard_map_step(tx)
    p = place(H.stack(w0))
    out1 = fn(p, place(state), place(a), place(b))
    out2 = fn(p, place(restored), place(a), place(b))
    for x, y in zip(jax.tree.leaves(out1), jax.tree.leaves(out2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- convergence on digits ----------------------------------------------------------------

STEPS = 300


def test_local_sgd_and_diloco_every_8_within_two_points_of_synchronous_sgd():
    split = digits.load(8)
    dense = digits.train(
        optax.chain(jaxcomm.allreduce(axis_name=AX), optax.sgd(0.5)), steps=STEPS, split=split
    )
    assert dense.accuracy > 0.93
    results = {}
    for name, tx in {
        "local_sgd": local_sgd(optax.sgd(0.5), every=8, axis_name=AX),
        "diloco": diloco(optax.sgd(0.5), every=8, axis_name=AX),
    }.items():
        r = digits.train(tx, steps=STEPS, split=split)
        syncs = np.asarray(r.opt_state.syncs)
        assert np.all(syncs == STEPS // 8)  # 37 synchronisations instead of 300
        results[name] = (r.accuracy, int(syncs[0]))
        assert r.accuracy >= dense.accuracy - 0.02, (name, r.accuracy, dense.accuracy)
    print(
        f"sync SGD {dense.accuracy:.4f} ({STEPS} syncs); "
        + "; ".join(f"{k} {a:.4f} ({s} syncs)" for k, (a, s) in results.items())
    )
