"""The DiLoCo family in jaxcomm.loco: SparseLoCo and MuLoCo against NumPy references.

Workers solve per-worker quadratics (worker i: gradient ``A_i * w - B_i``)
with params kept per worker, under ``jax.shard_map`` on 8 fake CPU devices
(or one worker, ``axis_name=None``), for several synchronisations; the
references are written from the papers' rules, not from the code.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.loco import SparseLoCoState, muloco, sparseloco, sparseloco_sync_bytes
from tests import helpers as H

N, AX = H.N, H.AXIS
# "w": 2000 entries = 8 chunks of 256 (the last zero-padded); "b": 100 < 256, one chunk
SHAPES = {"b": (100,), "w": (50, 40)}
CHUNK, TOPK = 256, 8
LR = 0.3


def problem(n=N, seed=0):
    rng = np.random.default_rng(seed)
    w0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    a = {k: rng.uniform(0.5, 1.5, size=(n,) + s).astype(np.float32) for k, s in SHAPES.items()}
    b = {k: rng.normal(size=(n,) + s).astype(np.float32) for k, s in SHAPES.items()}
    return w0, a, b


def step_fn(tx):
    def step(p, s, a, b):
        g = jax.tree.map(lambda p, a, b: a * p - b, p, a, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step


def run(tx, steps, *, n=N, seed=0):
    """Per-step params (numpy, leading worker axis) and states of ``steps`` steps on n workers."""
    w0, a, b = problem(n, seed)
    p, s = H.stack(w0, n), H.stack(tx.init(w0), n)
    if n == 1:  # axis_name=None: one worker, no mesh
        step = jax.jit(step_fn(tx))
        p, s = jax.tree.map(lambda x: x[0], (p, s))
        a, b = jax.tree.map(lambda x: x[0], (a, b))

        def fn(p, s, a, b):
            return step(p, s, a, b)
    else:
        one = jax.tree.map

        def f(p, s, a, b):
            out = step_fn(tx)(*one(lambda x: x[0], (p, s, a, b)))
            return one(lambda x: x[None], out)

        fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX)))
        p, s, a, b = jax.device_put((p, s, a, b), NamedSharding(H.mesh(), P(AX)))
    params, states = [], []
    for _ in range(steps):
        p, s = fn(p, s, a, b)
        leading = (lambda x: np.asarray(x)[None]) if n == 1 else np.asarray
        params.append(jax.tree.map(leading, p))
        states.append(jax.tree.map(leading, s))
    return params, states


# --- the NumPy reference of SparseLoCo ----------------------------------------------------


def np_compress(e, *, chunk, topk, bits, scale=True):
    """Q(TopK(e)) of one leaf: chunks, top-k by magnitude, uniform 2^bits levels on [-s, s]."""
    d = e.size
    c = min(chunk, d)
    k = topk if c == chunk else max(1, math.ceil(topk * c / chunk))
    nc = math.ceil(d / c)
    x = np.zeros(nc * c, np.float32)
    x[:d] = e.ravel()
    x = x.reshape(nc, c)
    idx = np.argsort(-np.abs(x), axis=1, kind="stable")[:, :k]
    v = np.take_along_axis(x, idx, axis=1)
    s = np.abs(v).max(axis=1) if scale else np.ones(nc, np.float32)
    levels = 2**bits - 1
    safe = np.where(s == 0, np.float32(1), s)[:, None]
    code = np.clip(np.round((v / safe + 1) * np.float32(levels / 2)), 0, levels)
    deq = s[:, None] * ((2 * code - levels) / levels).astype(np.float32)
    out = np.zeros_like(x)
    np.put_along_axis(out, idx, deq.astype(np.float32), axis=1)
    return out.reshape(-1)[:d].reshape(e.shape)


def np_sparseloco(steps, *, n, every, alpha, beta, bits, seed=0, scale=True, residual=True):
    """Params of every worker after each step (inner: SGD), by the paper's rule."""
    w0, a, b = problem(n, seed)
    p = {k: np.repeat(v[None], n, 0) for k, v in w0.items()}
    anchor = {k: v.copy() for k, v in w0.items()}
    err = {k: np.zeros_like(p[k]) for k in SHAPES}
    out = []
    for t in range(steps):
        p = {k: p[k] - np.float32(LR) * (a[k] * p[k] - b[k]) for k in SHAPES}
        if (t + 1) % every == 0:
            for k in SHAPES:
                sent = np.zeros_like(p[k])
                for i in range(n):
                    err[k][i] = np.float32(beta) * err[k][i] + (anchor[k] - p[k][i])
                    c = np_compress(err[k][i], chunk=CHUNK, topk=TOPK, bits=bits, scale=scale)
                    err[k][i] = err[k][i] - c if residual else np.zeros_like(c)
                    sent[i] = c
                anchor[k] = anchor[k] - np.float32(alpha) * sent.mean(0)
                p[k] = np.repeat(anchor[k][None], n, 0)
        out.append({k: v.copy() for k, v in p.items()})
    return out


def make(**kw):
    opts = dict(every=3, outer_learning_rate=1.0, error_decay=0.95, bits=2)
    opts.update(kw)
    return sparseloco(optax.sgd(LR), chunk=CHUNK, topk=TOPK, **opts)


def assert_close(got, want, rtol=2e-5, atol=2e-6):
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


CASES = [  # every, alpha, beta, bits
    (3, 1.0, 0.95, 2),
    (2, 0.7, 0.5, 3),
]


@pytest.mark.parametrize("every,alpha,beta,bits", CASES)
def test_sparseloco_matches_numpy_on_8_workers(every, alpha, beta, bits):
    steps = 3 * every  # three synchronisations: the residual and its decay matter
    tx = sparseloco(
        optax.sgd(LR),
        every=every,
        axis_name=AX,
        outer_learning_rate=alpha,
        error_decay=beta,
        chunk=CHUNK,
        topk=TOPK,
        bits=bits,
    )
    got, states = run(tx, steps)
    ref = np_sparseloco(steps, n=N, every=every, alpha=alpha, beta=beta, bits=bits)
    for t in range(steps):
        assert_close(got[t], ref[t])
    assert all(np.all(s.syncs == (t + 1) // every) for t, s in enumerate(states))


def test_sparseloco_matches_numpy_on_one_worker_without_axis():
    got, _ = run(make(axis_name=None), 9, n=1)
    ref = np_sparseloco(9, n=1, every=3, alpha=1.0, beta=0.95, bits=2)
    for t in range(9):
        assert_close(got[t], ref[t])


def test_each_term_of_the_rule_matters_in_this_problem():
    """The reference would not notice a dropped term if the problem made it a no-op."""
    full = np_sparseloco(9, n=N, every=3, alpha=1.0, beta=0.95, bits=2)[-1]
    for kw in ({"scale": False}, {"residual": False}, {"beta": 0.0}, {"every": 1}):
        opts = dict(every=3, alpha=1.0, beta=0.95, bits=2) | kw
        dropped = np_sparseloco(9, n=N, **opts)[-1]
        assert not np.allclose(full["w"], dropped["w"], rtol=1e-3, atol=1e-4), kw


def test_sparseloco_schedule_workers_drift_between_syncs_and_agree_after():
    got, states = run(make(axis_name=AX), 6)
    for t in range(6):
        same = all(np.allclose(got[t][k], got[t][k][:1], atol=1e-6) for k in SHAPES)
        assert same == ((t + 1) % 3 == 0), t
    err = [s.error["w"] for s in states]
    assert np.array_equal(err[0], np.zeros_like(err[0])) and np.array_equal(err[0], err[1])
    assert not np.array_equal(err[2], err[1]) and np.array_equal(err[3], err[2])
    # the error buffer differs by worker (its own pseudo-gradient), the anchor does not
    assert not np.allclose(err[2][0], err[2][1])
    assert np.array_equal(states[2].anchor["w"], np.repeat(states[2].anchor["w"][:1], N, 0))


def test_sparseloco_keeps_dtypes_and_state_is_float32_for_bf16():
    params = {"w": jnp.ones((64, 8), jnp.bfloat16)}
    tx = sparseloco(optax.sgd(0.1), every=1, axis_name=None, chunk=128, topk=4)
    s = tx.init(params)
    assert s.error["w"].dtype == jnp.float32 and s.anchor["w"].dtype == jnp.bfloat16
    u, s = jax.jit(tx.update)(params, s, params)
    assert u["w"].dtype == jnp.bfloat16 and s.error["w"].dtype == jnp.float32
    assert isinstance(s, SparseLoCoState) and int(s.syncs) == 1


def test_sparseloco_wire_bytes_equal_hlo_bytes_and_the_formula():
    tx = make(axis_name=AX)
    w0, a, b = problem()

    def f(p, s, a, b):
        one = jax.tree.map(lambda x: x[0], (p, s, a, b))
        return jax.tree.map(lambda x: x[None], step_fn(tx)(*one))

    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX)))
    args = jax.device_put((H.stack(w0), H.stack(tx.init(w0)), a, b), NamedSharding(H.mesh(), P(AX)))
    hlo = jaxcomm.accounting.hlo_collectives(fn.lower(*args).compile())
    wire = jaxcomm.wire_bytes(tx, w0, N)
    # w: 8 chunks x 8 kept: 64 8-bit indices (16 words), 64 2-bit codes (4 words), 8 scales;
    # b: 1 chunk x 4 kept: 4 7-bit indices (1 word), 4 codes (1 word), 1 scale
    assert (
        wire
        == 4 * ((16 + 4 + 8) + (1 + 1 + 1))
        == sparseloco_sync_bytes(w0, chunk=CHUNK, topk=TOPK)
    )
    assert [c.kind for c in hlo] == ["all_gather"] and sum(c.nbytes for c in hlo) == wire
    assert jaxcomm.wire_bytes(make(axis_name=None), w0, N) == 0


def test_sparseloco_nonfinite_reaches_every_worker():
    tx = make(axis_name=AX, every=1)
    w0, a, b = problem()
    b["w"][3, 7, 5] = np.nan  # one worker's gradient
    p = jax.device_put(H.stack(w0), NamedSharding(H.mesh(), P(AX)))

    def f(p, s, a, b):
        one = jax.tree.map(lambda x: x[0], (p, s, a, b))
        return jax.tree.map(lambda x: x[None], step_fn(tx)(*one))

    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX)))
    s, a, b = jax.device_put((H.stack(tx.init(w0)), a, b), NamedSharding(H.mesh(), P(AX)))
    p, _ = fn(p, s, a, b)
    assert all(not np.all(np.isfinite(np.asarray(p["w"])[i])) for i in range(N))


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"every": 0}, "every"),
        ({"outer_learning_rate": 0.0}, "outer_learning_rate"),
        ({"error_decay": 1.5}, "error_decay"),
        ({"error_decay": -0.1}, "error_decay"),
        ({"chunk": 0}, "chunk"),
        ({"topk": 0}, "topk"),
        ({"topk": CHUNK + 1}, "topk"),
        ({"bits": 0}, "bits"),
        ({"bits": 17}, "bits"),
        ({"axis_name": 3}, "axis_name"),
    ],
)
def test_sparseloco_bad_arguments_name_the_argument(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make(**({"axis_name": AX} | kw))


def test_sparseloco_needs_params_and_its_own_state():
    tx = make(axis_name=None)
    w0, _, _ = problem(1)
    with pytest.raises(ValueError, match="params"):
        tx.update(w0, tx.init(w0))
    with pytest.raises(TypeError, match="state"):
        tx.update(w0, jaxcomm.diloco(optax.sgd(0.1), every=2, axis_name=None).init(w0), w0)
    with pytest.raises(TypeError, match="inner"):
        sparseloco("sgd", every=2, axis_name=None)


# --- MuLoCo ---------------------------------------------------------------------------------

MU_SHAPES = {"b": (6,), "w": (12, 8)}


def mu_problem(seed=1):
    rng = np.random.default_rng(seed)
    w0 = {k: rng.normal(size=s).astype(np.float32) for k, s in MU_SHAPES.items()}
    a = {k: rng.uniform(0.5, 1.5, size=(N,) + s).astype(np.float32) for k, s in MU_SHAPES.items()}
    b = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in MU_SHAPES.items()}
    return w0, a, b


def np_muloco(steps, every, *, lr, ratio, outer_lr=0.7, mom=0.9):
    """MuLoCo's rule: per-worker Muon (optax, no collectives), then in NumPy the EF top-k
    pseudo-gradient (``p = delta + e``, send the top-k of p, ``e = p - sent``), the mean
    over workers and DiLoCo's Nesterov outer step (``m = mom·m + g``;
    ``anchor -= outer_lr·(g + mom·m)``)."""
    w0, a, b = mu_problem()
    muon = optax.contrib.muon(lr)
    upd = jax.jit(muon.update)
    p = [{k: v.copy() for k, v in w0.items()} for _ in range(N)]
    ms = [muon.init(w0) for _ in range(N)]
    anchor = {k: v.astype(np.float64) for k, v in w0.items()}
    m = {k: np.zeros_like(v) for k, v in anchor.items()}
    e = [{k: np.zeros(s) for k, s in MU_SHAPES.items()} for _ in range(N)]
    out = []
    for t in range(steps):
        for i in range(N):
            g = {k: a[k][i] * p[i][k] - b[k][i] for k in MU_SHAPES}
            u, ms[i] = upd(g, ms[i], p[i])
            p[i] = {k: p[i][k] + np.asarray(u[k]) for k in MU_SHAPES}
        if (t + 1) % every == 0:
            for k in MU_SHAPES:
                sent = []
                for i in range(N):
                    q = anchor[k] - p[i][k] + e[i][k]
                    keep = max(1, math.ceil(ratio * q.size))
                    mask = np.zeros(q.size, bool)
                    mask[np.argsort(-np.abs(q.ravel()), kind="stable")[:keep]] = True
                    s = np.where(mask.reshape(q.shape), q, 0.0)
                    e[i][k] = q - s
                    sent.append(s)
                g = np.mean(sent, 0)
                m[k] = mom * m[k] + g
                anchor[k] = anchor[k] - outer_lr * (g + mom * m[k])
            p = [{k: anchor[k].astype(np.float32) for k in MU_SHAPES} for _ in range(N)]
        out.append([{k: v.copy() for k, v in pi.items()} for pi in p])
    return out


def test_muloco_outer_step_matches_numpy_nesterov_with_ef_topk():
    tx = muloco(
        0.05, every=3, axis_name=AX, compressor=jaxcomm.topk(0.25, axis_name=AX, min_size=0)
    )
    w0, a, b = mu_problem()

    def f(p, s, a, b):
        one = jax.tree.map(lambda x: x[0], (p, s, a, b))
        return jax.tree.map(lambda x: x[None], step_fn(tx)(*one))

    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=P(AX), out_specs=P(AX)))
    sh = NamedSharding(H.mesh(), P(AX))
    p, s, a_, b_ = jax.device_put((H.stack(w0), H.stack(tx.init(w0)), a, b), sh)
    ref = np_muloco(7, 3, lr=0.05, ratio=0.25)
    for t in range(7):
        p, s = fn(p, s, a_, b_)
        for i in (0, 5):
            for k in MU_SHAPES:
                np.testing.assert_allclose(np.asarray(p[k])[i], ref[t][i][k], rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(s.syncs) == 2)


def test_muloco_is_diloco_with_muon_inner():
    s = muloco(0.05, every=2, axis_name=None).init({"w": jnp.zeros((4, 4))})
    assert isinstance(s, jaxcomm.sync.DiLoCoState)
    assert isinstance(s.inner_state, type(optax.contrib.muon(0.05).init({"w": jnp.zeros((4, 4))})))


def test_muloco_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="every"):
        muloco(0.05, every=0, axis_name=AX)
    with pytest.raises(ValueError, match="muon_options"):
        muloco(0.05, every=2, axis_name=AX, muon_options={"beta": 0.9})
    with pytest.raises(ValueError, match="compressor"):
        muloco(0.05, every=2, axis_name=AX, compressor=jaxcomm.topk(0.25)).init(
            {"w": jnp.zeros((4, 4))}
        )
