"""DeMo: a NumPy reference of the whole rule, locally and on 8 workers; bytes (HLO); NaN rule."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import helpers as H

M = importlib.import_module("jaxcomm.optim.demo")  # the module (jaxcomm.optim.demo is the function)
N = H.N
TOPK, CHUNK, DECAY, LR, WD = 16, 32, 0.9, 0.01, 0.1
# every leaf is cut into several chunks with k < chunk entries:
# "w": 12 chunks of 32×32 (uint16 indices); "odd": 100 = 4·25 rows, 72 = 3·24 cols (no
# dimension divisible by 32); "b": 1-D, 3 chunks of 32; "conv": 3-D, seen as 12×40 (chunks
# 12×20)
PARAMS = {
    "w": jnp.zeros((128, 96)),
    "odd": jnp.zeros((100, 72)),
    "b": jnp.zeros((96,)),
    "conv": jnp.zeros((3, 4, 40)),
}


def lr_at(count):
    return LR / (1 + 0.5 * count)


# ---- the NumPy reference ---------------------------------------------------------------


def np_dct(n):
    """Orthonormal DCT-II from its closed form: C[k, j] = s_k cos(π(2j+1)k / 2n)."""
    k, j = np.arange(n)[:, None], np.arange(n)[None, :]
    c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j + 1) * k / (2 * n))
    c[0] /= np.sqrt(2.0)
    return c


def np_divisor(n, target):
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= target)


def np_view(shape):
    if len(shape) <= 1:
        return 1, int(np.prod(shape))
    return int(np.prod(shape[:-1])), shape[-1]


class NpDeMo:
    """DeMo on n workers in float64: per-worker momenta ``delta[leaf]`` of shape (n, *shape)."""

    def __init__(self, params, n, *, topk=TOPK, chunk=CHUNK, decay=DECAY, wd=0.0, agg="mean"):
        self.shapes = {k: tuple(v.shape) for k, v in params.items()}
        self.delta = {k: np.zeros((n,) + s) for k, s in self.shapes.items()}
        self.n, self.topk, self.chunk, self.decay = n, topk, chunk, decay
        self.wd, self.agg = wd, agg

    def leaf(self, name, g, lr):
        shape = self.shapes[name]
        R, C = np_view(shape)
        h, w = np_divisor(R, self.chunk), np_divisor(C, self.chunk)
        k = min(self.topk, h * w)
        Ch, Cw = np_dct(h), np_dct(w)
        to_chunks = lambda x: x.reshape(R // h, h, C // w, w).transpose(0, 2, 1, 3)  # noqa: E731
        back = lambda c: c.transpose(0, 2, 1, 3).reshape(shape)  # noqa: E731
        total, senders = 0.0, 0.0
        for wk in range(self.n):
            d = self.decay * self.delta[name][wk] + lr * np.asarray(g[wk], np.float64)
            coeff = (Ch @ to_chunks(d.reshape(R, C)) @ Cw.T).reshape(R // h, C // w, h * w)
            idx = np.argsort(-np.abs(coeff), axis=-1, kind="stable")[..., :k]
            kept = np.zeros_like(coeff)
            np.put_along_axis(kept, idx, np.take_along_axis(coeff, idx, -1), -1)
            mask = np.zeros_like(coeff)
            np.put_along_axis(mask, idx, 1.0, -1)
            q = back(Ch.T @ kept.reshape(R // h, C // w, h, w) @ Cw)
            self.delta[name][wk] = d - q
            total, senders = total + kept, senders + mask
        mean = total / np.maximum(senders, 1) if self.agg == "mean" else total / self.n
        return back(Ch.T @ mean.reshape(R // h, C // w, h, w) @ Cw)

    def step(self, grads, lr, params=None):
        """The update every worker applies; ``grads[leaf]``: (n, *shape)."""
        out = {}
        for name in self.shapes:
            t = self.leaf(name, grads[name], lr)
            p = 0.0 if params is None else np.asarray(params[name], np.float64)
            out[name] = -lr * (np.sign(t) + self.wd * p)
        return out


def close_delta(got, want, msg):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-7, err_msg=msg)


def assert_signs(got, want, lr, msg):
    """Updates are ±lr (or 0): equal up to float32 rounding of lr."""
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-9, err_msg=msg)


# ---- the rule ---------------------------------------------------------------------------


def test_dct_is_the_orthonormal_closed_form_and_chunks_round_trip():
    for n in (1, 5, 24, 32):
        np.testing.assert_allclose(M.dct_matrix(n), np_dct(n), atol=1e-12)
        np.testing.assert_allclose(M.dct_matrix(n) @ M.dct_matrix(n).T, np.eye(n), atol=1e-12)
    for n, target in [(96, 32), (100, 32), (72, 32), (97, 32), (12, 32), (1, 64), (4096, 64)]:
        assert M.chunk_size(n, target) == np_divisor(n, target), (n, target)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(100, 72)), jnp.float32)
    lay = M.layout((100, 72), CHUNK, TOPK)
    assert (lay.h, lay.w, lay.k, lay.chunks) == (25, 24, 16, 12)
    np.testing.assert_allclose(M.decode(M.encode(x, lay), lay, x.shape), x, atol=1e-5)


def test_all_coefficients_send_the_momentum_exactly():
    """topk = every entry of a chunk: q = Δ, so the residual is 0, and the transmitted
    gradient is Δ itself (locally lr·g: the update is -lr·sign(g))."""
    params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((40,))}  # chunks 8×8 and 8
    tx = jaxcomm.demo(LR, compression_topk=64, compression_chunk=8, compression_decay=DECAY)
    g = jax.tree.map(lambda x: x[0], H.per_worker_grads(params, seed=4))
    out, state = jax.jit(tx.update)(g, tx.init(params))
    for k in params:
        np.testing.assert_allclose(np.asarray(state.delta[k]), 0.0, atol=1e-8)
        assert_signs(out[k], -LR * np.sign(np.asarray(g[k])), LR, k)


def test_matches_numpy_locally_with_a_schedule():
    """The factory's default decay (0.999), one worker (no axis)."""
    tx = jaxcomm.demo(lr_at, compression_topk=TOPK, compression_chunk=CHUNK)
    ref = NpDeMo(PARAMS, 1, decay=0.999)
    state, step = tx.init(PARAMS), jax.jit(tx.update)
    for t in range(3):
        g = H.per_worker_grads(PARAMS, seed=10 + t, n=1)
        out, state = step(jax.tree.map(lambda x: x[0], g), state)
        want = ref.step(g, lr_at(t))
        for k in PARAMS:
            assert_signs(out[k], want[k], lr_at(t), f"update {k} step {t}")
            close_delta(state.delta[k], ref.delta[k][0], f"delta {k} step {t}")
    assert int(state.count) == 3 and int(state.nonfinite) == 0


def per_worker_step(tx):
    """``tx.update`` under jax.shard_map, everything per worker (``P("data")``).

    With a schedule the update is identical on every worker but typed per worker (the
    step count lives in per-worker state), so it cannot leave with ``out_specs=P()``.
    """
    spec = P(H.AXIS)

    def f(g, s, p):
        u, s = tx.update(*jax.tree.map(lambda x: x[0], (g, s, p)))
        return jax.tree.map(lambda x: x[None], (u, s))

    fn = jax.jit(jax.shard_map(f, mesh=H.mesh(), in_specs=spec, out_specs=spec))
    place = lambda t: jax.device_put(t, NamedSharding(H.mesh(), spec))  # noqa: E731
    return lambda g, s, p=None: fn(place(g), place(s), place(p))


def same_on_every_worker(out):
    """The update of worker 0, after checking every worker has it."""
    for x in jax.tree.leaves(out):
        np.testing.assert_array_equal(np.asarray(x), np.broadcast_to(np.asarray(x)[:1], x.shape))
    return jax.tree.map(lambda x: np.asarray(x)[0], out)


def demo_8(**kw):
    return jaxcomm.demo(
        lr_at, compression_topk=TOPK, compression_chunk=CHUNK, compression_decay=DECAY,
        axis_name=H.AXIS, **kw,
    )  # fmt: skip


def test_matches_numpy_on_8_workers_under_shard_map():
    """Different gradients per worker; the update (out_specs=P()) is the same on every
    worker, each worker's momentum its own. Each coefficient is the mean over the workers
    that sent it: summing over workers and dividing by n gives other signs here."""
    tx = demo_8()
    ref, by_sum = NpDeMo(PARAMS, N), NpDeMo(PARAMS, N, agg="sum")
    state, step = H.stack(tx.init(PARAMS)), per_worker_step(tx)
    differs = False
    for t in range(3):
        g = H.per_worker_grads(PARAMS, seed=20 + t)
        out, state = step(g, state)
        out = same_on_every_worker(out)
        want, other = ref.step(g, lr_at(t)), by_sum.step(g, lr_at(t))
        for k in PARAMS:
            assert_signs(out[k], want[k], lr_at(t), f"update {k} step {t}")
            close_delta(state.delta[k], ref.delta[k], f"delta {k} step {t}")
            differs |= not np.allclose(want[k], other[k])
    assert differs  # the data tells the two aggregations apart
    np.testing.assert_array_equal(np.asarray(state.count), 3)


def test_coefficients_are_averaged_over_the_workers_that_sent_them():
    """Worker 0 sends coefficient 3 (value 1), workers 1-7 coefficient 9 (value 0.5 each):
    the mean is 1·b₃ + 0.5·b₉ (the reference's scatter mean), not (b₃ + 3.5·b₉)/8."""
    params = {"b": jnp.zeros((64,))}
    C = np_dct(64)
    g = np.stack([C[3]] + [0.5 * C[9]] * (N - 1))  # rows of C: the DCT basis vectors
    tx = jaxcomm.demo(1.0, compression_topk=1, compression_chunk=64, axis_name=H.AXIS)
    out, _ = H.shard_map_update(tx, {"b": jnp.asarray(g, jnp.float32)}, H.stack(tx.init(params)))
    want = -np.sign(C[3] + 0.5 * C[9])
    assert not np.array_equal(want, -np.sign(C[3] + 3.5 * C[9]))
    np.testing.assert_array_equal(np.asarray(out["b"]), want)


def test_residual_stays_in_the_momentum():
    """Step 1 sends the top-k part of lr·g₁ and keeps the rest; with g₂ = 0, step 2 sends
    the top-k of β·(what was kept), which a dropped residual (or no subtraction) misses."""
    tx = jaxcomm.demo(LR, compression_topk=TOPK, compression_chunk=CHUNK, compression_decay=0.9)
    ref = NpDeMo(PARAMS, 1, decay=0.9)
    g1 = jax.tree.map(lambda x: x[0], H.per_worker_grads(PARAMS, seed=30, n=1))
    zero = jax.tree.map(jnp.zeros_like, g1)
    step = jax.jit(tx.update)
    _, state = step(g1, tx.init(PARAMS))
    ref.step(jax.tree.map(lambda x: np.asarray(x)[None], g1), LR)
    for k in PARAMS:
        lrg = LR * np.asarray(g1[k], np.float64)
        kept = np.asarray(state.delta[k], np.float64)
        assert 0.1 < np.linalg.norm(kept) / np.linalg.norm(lrg) < 0.99  # part sent, part kept
    out, state = step(zero, state)
    want = ref.step(jax.tree.map(lambda x: np.asarray(x)[None], zero), LR)
    for k in PARAMS:
        assert np.count_nonzero(np.asarray(out[k])) > 0
        assert_signs(out[k], want[k], LR, k)
        close_delta(state.delta[k], ref.delta[k][0], k)


def test_weight_decay_on_8_workers():
    """-lr·(sign(t) + wd·p), the same update on every worker."""
    tx = demo_8(weight_decay=WD)
    rng = np.random.default_rng(40)
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)
    ref = NpDeMo(PARAMS, N, wd=WD)
    state, step = H.stack(tx.init(params)), per_worker_step(tx)
    for t in range(2):
        g = H.per_worker_grads(PARAMS, seed=41 + t)
        out, state = step(g, state, H.stack(params))
        out = same_on_every_worker(out)
        want = ref.step(g, lr_at(t), params)
        for k in PARAMS:
            np.testing.assert_allclose(out[k], want[k], rtol=1e-5, atol=1e-8)
        params = jax.tree.map(jnp.add, params, out)
    with pytest.raises(ValueError, match="params"):
        jaxcomm.demo(LR, weight_decay=WD).update(g, jaxcomm.demo(LR).init(PARAMS))


# ---- bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_wire_bytes_are_k_values_and_indices_per_chunk_and_equal_hlo(dtype):
    """Defaults (chunk 64, top 32): "w" 8 chunks of 64×64 (uint16 indices), "b" 2 chunks
    of 64 (uint8), "c" 3-D seen as 60×96: chunks 60×48 (uint16)."""
    params = {
        "w": jnp.zeros((256, 128), dtype),
        "b": jnp.zeros((128,), dtype),
        "c": jnp.zeros((3, 20, 96), dtype),
    }
    tx = jaxcomm.demo(1e-3, axis_name=H.AXIS)
    v = jnp.dtype(dtype).itemsize
    want = 8 * 32 * (v + 2) + 2 * 32 * (v + 1) + 2 * 32 * (v + 2)
    assert jaxcomm.wire_bytes(tx, params, N) == want
    assert jaxcomm.wire_bytes(jaxcomm.demo(1e-3), params, N) == 0
    assert want < 4 * (256 * 128 + 128 + 3 * 20 * 96) / 50  # vs a dense f32 all-reduce
    g = H.per_worker_grads(params, seed=50)
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(params)))
    assert jaxcomm.accounting.collective_bytes(compiled) == want
    kinds = {c.kind for c in jaxcomm.accounting.hlo_collectives(compiled)}
    assert kinds == {"all_gather"}


# ---- dtypes, jit, NaN rule, errors ----------------------------------------------------


def test_bf16_params_keep_float32_momentum_and_bf16_updates():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    tx = jaxcomm.demo(LR, compression_topk=TOPK, compression_chunk=CHUNK)
    state = tx.init(params)
    assert all(d.dtype == jnp.float32 for d in jax.tree.leaves(state.delta))
    g = jax.tree.map(lambda x: x[0], H.per_worker_grads(params, seed=60))
    step = jax.jit(tx.update)
    out, s1 = step(g, state)
    out2, s2 = step(g, s1)
    for s in (s1, s2):
        assert jax.tree.structure(s) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(state)):
            assert a.shape == b.shape and a.dtype == b.dtype
    for o in (out, out2):
        for k in params:
            assert o[k].dtype == jnp.bfloat16 and o[k].shape == params[k].shape
            assert np.all(np.abs(np.asarray(o[k], np.float32)) > 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_nonfinite_on_one_worker_makes_every_update_nan_and_keeps_state(bad):
    tx = demo_8()
    step = jax.pmap(tx.update, axis_name=H.AXIS)
    _, state = step(H.per_worker_grads(PARAMS, seed=70), H.stack(tx.init(PARAMS)))
    g = H.per_worker_grads(PARAMS, seed=71)
    w = np.asarray(g["w"]).copy()
    w[5, 3, 7] = bad
    out, new = step({**g, "w": jnp.asarray(w)}, state)
    for k in PARAMS:  # every leaf of every worker: a skip decided on any leaf agrees
        assert not np.isfinite(np.asarray(out[k])).reshape(N, -1).any(axis=1).any(), k
    for a, b in zip(jax.tree.leaves(new.delta), jax.tree.leaves(state.delta)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new.nonfinite), 1)
    np.testing.assert_array_equal(np.asarray(new.count), 2)
    out, new = step(g, new)  # a clean step goes on from the kept state
    assert all(np.isfinite(np.asarray(o)).all() for o in jax.tree.leaves(out))
    np.testing.assert_array_equal(np.asarray(new.nonfinite), 1)


def test_bad_arguments():
    for kw, err, name in [
        (dict(compression_topk=0), ValueError, "compression_topk"),
        (dict(compression_topk=65, compression_chunk=8), ValueError, "compression_topk"),
        (dict(compression_topk=2.0), TypeError, "compression_topk"),
        (dict(compression_chunk=0), ValueError, "compression_chunk"),
        (dict(compression_decay=1.0), ValueError, "compression_decay"),
        (dict(compression_decay=-0.1), ValueError, "compression_decay"),
        (dict(compression_decay="0.9"), TypeError, "compression_decay"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay"),
        (dict(axis_name=3), TypeError, "axis_name"),
    ]:
        with pytest.raises(err, match=name):
            jaxcomm.demo(LR, **kw)
    jaxcomm.demo(LR, compression_topk=64, compression_chunk=8)  # a full 8×8 chunk is allowed
    tx = jaxcomm.demo(LR, axis_name=H.AXIS)
    g = jax.tree.map(lambda x: x[0], H.per_worker_grads(PARAMS, seed=80))
    with pytest.raises(ValueError, match="not bound"):
        tx.update(g, tx.init(PARAMS))
    with pytest.raises(TypeError, match="int32"):
        tx.init({"w": jnp.zeros((64, 64)), "step": jnp.zeros((), jnp.int32)})
    with pytest.raises(TypeError, match="DeMoState"):
        jaxcomm.demo(LR).update(g, optax.sgd(LR).init(PARAMS))
