"""int8, QSGD and TernGrad: NumPy references of each rule, unbiasedness, QSGD's variance bound."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm.compressors import quantize
from tests import helpers as H

KEY = jax.random.key(0)
PARAMS = {"w": jnp.zeros((48, 40)), "v": jnp.zeros((1500,)), "b": jnp.zeros((7,))}
MIN_SIZE = 100  # "b" goes dense


# --- references -----------------------------------------------------------------------


def np_buckets(x, b):
    """(d,) -> list of consecutive buckets of b entries (the last may be shorter)."""
    return [x[i : i + b] for i in range(0, x.size, b)]


def np_int8_nearest(p, b):
    """One worker's decoded vector: scale = max|x|/127 per bucket, round half to even."""
    out = []
    for x in np_buckets(np.asarray(p, np.float32), b):
        scale = np.float32(np.abs(x).max()) / np.float32(127)
        q = np.clip(np.round(x / scale), -127, 127) if scale > 0 else np.zeros_like(x)
        out.append(q * scale)
    return np.concatenate(out).astype(np.float64)


def np_qsgd_grid(g, s, b):
    """Per entry: the grid step ‖v‖/s of its bucket, the lower level l and frac = r - l."""
    g = np.asarray(g, np.float64)
    step = np.concatenate([np.full(x.size, np.linalg.norm(x) / s) for x in np_buckets(g, b)])
    r = np.abs(g) / step
    low = np.floor(r)
    return step, low, r - low


def sample_local(tx, g, steps):
    """``steps`` outputs of a local transform on a fixed gradient (fresh noise each step)."""
    params = {"v": jnp.zeros_like(g)}

    def body(state, _):
        out, state = tx.update({"v": g}, state)
        return state, out["v"]

    _, outs = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(tx.init(params))
    return np.asarray(outs, np.float64)


def chi2_of_mean(mean, outs, target, step):
    """Σ z² of ``mean`` against ``target`` with the samples' standard errors (and the dof).

    ``step``: per entry, the gap between the two values a sample can take. An entry whose
    samples never moved (a rare Bernoulli that never fired, or a certain one) gets the
    floor ``step/T`` as its standard error: a bias of less than ~1/T of a step passes.
    """
    steps = outs.shape[0]
    se = np.maximum(outs.std(0, ddof=1) / math.sqrt(steps), step / steps)
    return float(np.sum(((mean - target) / se) ** 2)), int(target.size)


def assert_unbiased(outs, target, biased_mean, step):
    """The sample mean passes a chi² test against ``target``; a biased rule's mean fails it."""
    stat, dof = chi2_of_mean(outs.mean(0), outs, target, step)
    limit = dof + 5 * math.sqrt(2 * dof)  # chi²(dof): mean dof, sd sqrt(2 dof)
    assert stat < limit, (stat, limit)
    # The test can fail: the same noise around a biased rule's mean is rejected.
    stat_b, _ = chi2_of_mean(biased_mean, outs, target, step)
    assert stat_b > limit, (stat_b, limit)


def grads(d, seed=0, loc=0.3):
    return jnp.asarray(np.random.default_rng(seed).normal(size=d) + loc, jnp.float32)


# --- int8 -----------------------------------------------------------------------------


def test_int8_nearest_matches_numpy_on_8_workers():
    b = 100  # does not divide 1500 or 1920
    tx = jaxcomm.int8(
        stochastic=False, bucket_size=b, axis_name="data", min_size=MIN_SIZE, exchange="gather"
    )  # the all-gather's rule; "auto" would go two-phase on 8 workers
    g = H.per_worker_grads(PARAMS, seed=1)
    out, state = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    for k in ("w", "v"):
        gk = np.asarray(g[k], np.float32).reshape(H.N, -1)
        ref = np.mean([np_int8_nearest(gk[w], b) for w in range(H.N)], axis=0)
        np.testing.assert_allclose(np.asarray(out[k]).reshape(-1), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["b"], np.asarray(g["b"]).mean(0), rtol=1e-6)


def test_int8_stochastic_rounds_to_a_neighbour_and_is_unbiased():
    d, b, steps = 700, 256, 3000
    g = grads(d, seed=3)
    tx = jaxcomm.int8(key=jax.random.key(1), bucket_size=b, min_size=0)
    outs = sample_local(tx, g, steps)
    gn = np.asarray(g, np.float64)
    scale = np.concatenate([np.full(x.size, np.abs(x).max() / 127) for x in np_buckets(gn, b)])
    y = outs / scale  # integer codes
    np.testing.assert_allclose(y, np.round(y), atol=1e-3)
    assert np.all(np.abs(y - gn / scale) < 1 + 1e-3)  # floor or ceil of p/scale
    nearest = np_int8_nearest(g, b)  # what stochastic=False computes: biased
    assert_unbiased(outs, gn, biased_mean=nearest, step=scale)


# --- QSGD -----------------------------------------------------------------------------


@pytest.mark.parametrize("s", [1, 4, 16])
def test_qsgd_rule_support_probabilities_and_unbiasedness(s):
    d, b, steps = 600, 256, 4000  # buckets 256, 256, 88
    g = grads(d, seed=s)
    outs = sample_local(jaxcomm.qsgd(s, key=jax.random.key(s), bucket_size=b, min_size=0), g, steps)
    step, low, frac = np_qsgd_grid(g, s, b)
    sign = np.sign(np.asarray(g, np.float64))
    level = outs * sign / step  # ξ, the level each sample took
    np.testing.assert_allclose(level, np.round(level), atol=1e-3)
    up = np.isclose(level, low + 1, atol=1e-3)
    assert np.all(up | np.isclose(level, low, atol=1e-3))  # ξ ∈ {l, l+1}
    # P(ξ = l+1) = s|v|/‖v‖ − l, per entry
    assert np.abs(up.mean(0) - frac).max() < 5 * math.sqrt(0.25 / steps)
    truncated = sign * low * step  # deterministic truncation: biased
    assert_unbiased(outs, np.asarray(g, np.float64), biased_mean=truncated, step=step)


@pytest.mark.parametrize(
    "s, flat", [(1, True), (1, False), (2, True), (16, False)], ids=["s1-flat", "s1", "s2", "s16"]
)
def test_qsgd_variance_within_paper_bound(s, flat):
    """E‖Q(v) − v‖² = Σ step²·f(1−f) exactly, and <= min(b/s², √b/s)·‖v‖² (Lemma 3.1)."""
    b, steps = 512, 3000
    rng = np.random.default_rng(s)
    v = np.where(rng.random(b) < 0.5, -1.0, 1.0) if flat else rng.normal(size=b)
    v = jnp.asarray(v * 0.1, jnp.float32)
    outs = sample_local(jaxcomm.qsgd(s, key=jax.random.key(9), bucket_size=b, min_size=0), v, steps)
    vn = np.asarray(v, np.float64)
    sq_err = ((outs - vn) ** 2).sum(1)
    step, _, frac = np_qsgd_grid(v, s, b)
    exact = np.sum(step**2 * frac * (1 - frac))
    se = sq_err.std(ddof=1) / math.sqrt(steps)
    assert abs(sq_err.mean() - exact) < 5 * se + 1e-9 * exact, (sq_err.mean(), exact, se)
    bound = min(b / s**2, math.sqrt(b) / s) * np.sum(vn**2)
    assert sq_err.mean() + 5 * se <= bound, (sq_err.mean(), bound)
    if flat and s == 1:  # the bound is nearly tight here: ‖v‖(‖v‖₁ − ‖v‖) = (√b − 1)‖v‖²
        assert exact > 0.9 * bound


def test_qsgd_on_8_workers_each_worker_draws_its_own_noise():
    tx = jaxcomm.qsgd(
        4,
        key=KEY,
        bucket_size=128,
        axis_name="data",
        error_feedback=True,
        min_size=MIN_SIZE,
        exchange="gather",  # the mean of the n decoded payloads
    )
    same = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), H.per_worker_grads(PARAMS))
    out, state = H.shard_map_update(tx, same, H.stack(tx.init(PARAMS)))
    for k in ("w", "v"):
        p = np.asarray(same[k], np.float64).reshape(H.N, -1)
        own = p - np.asarray(state.residual[k], np.float64).reshape(H.N, -1)  # decode(own)
        assert not np.allclose(own[0], own[1])  # key folded with the worker index
        np.testing.assert_allclose(np.asarray(out[k]).reshape(-1), own.mean(0), atol=1e-5)
        step, low, _ = np_qsgd_grid(p[0], 4, 128)
        level = np.abs(own) / step
        assert np.all(np.isclose(level, low, atol=1e-3) | np.isclose(level, low + 1, atol=1e-3))


def test_qsgd_payload_is_sign_and_level_bits_plus_a_norm_per_bucket():
    comp = quantize.QSGD(16, 512)
    assert comp.bits == 6  # 1 sign + ceil(log2(17)) = 5 level bits
    (words, norms), _ = comp.encode(jnp.ones((1000,)), KEY)
    assert words.dtype == jnp.uint32 and words.shape == (math.ceil(1000 * 6 / 32),)
    assert norms.dtype == jnp.float32 and norms.shape == (2,)
    levels = (1, 2, 3, 4, 7, 8, 255, 256)
    assert [quantize.QSGD(s, 8).bits for s in levels] == [2, 3, 3, 4, 4, 5, 9, 10]


# --- TernGrad -------------------------------------------------------------------------


def test_terngrad_rule_support_probabilities_and_unbiasedness():
    d, steps = 500, 4000
    g = grads(d, seed=5)
    tx = jaxcomm.terngrad(key=jax.random.key(2), clip_sigma=None, min_size=0)
    outs = sample_local(tx, g, steps)
    gn = np.asarray(g, np.float64)
    s = np.abs(gn).max()
    np.testing.assert_allclose(np.abs(outs)[outs != 0], s, rtol=1e-6)  # ±s or 0
    assert np.all((outs == 0) | (np.sign(outs) == np.sign(gn)))
    freq = (outs != 0).mean(0)
    assert np.abs(freq - np.abs(gn) / s).max() < 5 * math.sqrt(0.25 / steps)  # Bernoulli(|g|/s)
    rounded = s * np.sign(gn) * np.round(np.abs(gn) / s)  # deterministic ternary: biased
    assert_unbiased(outs, gn, biased_mean=rounded, step=np.full(d, s))


def test_terngrad_clipping_is_unbiased_for_the_clipped_gradient():
    d, steps = 500, 3000
    gn = np.random.default_rng(6).normal(size=d)
    gn[:5] = [30.0, -25.0, 12.0, 9.0, -40.0]  # outliers beyond 2.5 sigma
    g = jnp.asarray(gn, jnp.float32)
    outs = sample_local(jaxcomm.terngrad(key=jax.random.key(3), min_size=0), g, steps)
    gn = np.asarray(g, np.float64)
    c = 2.5 * gn.std()
    clipped = np.clip(gn, -c, c)
    np.testing.assert_allclose(np.abs(outs)[outs != 0], c, rtol=1e-5)  # s = max|clip(g)| = c
    # unbiased for clip(g), and a test against the unclipped g fails
    assert_unbiased(outs, clipped, biased_mean=gn, step=np.full(d, c))


@pytest.mark.parametrize("share_scale", [True, False])
def test_terngrad_on_8_workers_scale_is_shared_and_mean_is_exact(share_scale):
    tx = jaxcomm.terngrad(
        key=KEY,
        axis_name="data",
        clip_sigma=None,
        share_scale=share_scale,
        error_feedback=True,
        min_size=MIN_SIZE,
        exchange="gather",  # the mean of the n decoded payloads (psum with share_scale)
    )
    g = H.per_worker_grads(PARAMS, seed=7)
    # one worker with a much larger gradient sets the shared scale
    g = jax.tree.map(lambda x: x.at[3].multiply(4.0), g)
    out, state = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    for k in ("w", "v"):
        p = np.asarray(g[k], np.float64).reshape(H.N, -1)
        own = p - np.asarray(state.residual[k], np.float64).reshape(H.N, -1)
        scales = np.abs(p).max(1)
        expect = np.full(H.N, scales.max()) if share_scale else scales
        for w in range(H.N):
            nz = own[w] != 0
            np.testing.assert_allclose(np.abs(own[w][nz]), expect[w], rtol=1e-6)
            assert np.all(np.sign(own[w][nz]) == np.sign(p[w][nz]))
        np.testing.assert_allclose(
            np.asarray(out[k]).reshape(-1), own.mean(0), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("n", [127, 128, 300])
def test_terngrad_psum_fields_cannot_overflow(n):
    """Every worker at the extreme code (|g| = s: Bernoulli(1)) and n beyond int8's range."""
    d = 64
    sign = np.where(np.arange(d) % 3 == 0, -1.0, 1.0)
    g = np.tile(2.0 * sign, (n, 1))
    g[: n // 3, 1::2] *= -1  # a mix of votes on odd entries
    tx = jaxcomm.terngrad(key=KEY, axis_name="data", clip_sigma=None, min_size=0)
    state = H.stack(tx.init({"v": jnp.zeros(d)}), n)
    out, _ = H.vmap_update(tx, {"v": jnp.asarray(g, jnp.float32)}, state)
    np.testing.assert_allclose(np.asarray(out["v"][0]), g.mean(0), rtol=1e-6, atol=1e-6)
    assert quantize.ternary_field_bits(n) == (2 * n).bit_length()


# --- bytes and arguments ------------------------------------------------------------


@pytest.mark.parametrize(
    "comp, expected_1000",
    [
        (quantize.Int8(512, True), 1000 + 4 * 2),
        (quantize.Int8(100, False), 1000 + 4 * 10),
        (quantize.QSGD(16, 512), 4 * math.ceil(1000 * 6 / 32) + 4 * 2),
        (quantize.QSGD(1, 512), 4 * math.ceil(1000 * 2 / 32) + 4 * 2),
        (quantize.TernGrad(2.5, True, "x"), 4 * math.ceil(1000 / 6) + 4),  # n=8: 5-bit fields
        (quantize.TernGrad(None, False, "x"), 4 * math.ceil(1000 / 16) + 4),
    ],
    ids=["int8", "int8-b100", "qsgd16", "qsgd1", "terngrad", "terngrad-gather"],
)
def test_wire_size_formula_equals_traced_bytes(comp, expected_1000):
    params = {"a": jnp.zeros((1000,)), "b": jnp.zeros((33, 31)), "c": jnp.zeros((1,))}
    key = KEY if comp.needs_key else None
    tx = jaxcomm.compress(
        comp, axis_name="x", key=key, error_feedback=False, min_size=0, exchange="gather"
    )  # wire_size is the payload of a whole leaf, what the all-gather carries
    expected = sum(comp.wire_size(int(x.size), x.dtype, n_workers=8) for x in params.values())
    expected += jaxcomm.core.nan_flag_bytes(comp)  # once per step, not per leaf
    assert jaxcomm.wire_bytes(tx, params, 8) == expected
    assert comp.wire_size(1000, jnp.float32, n_workers=8) == expected_1000


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"levels: expected an int in \[1, 65535\], got 0"):
        jaxcomm.qsgd(0, key=KEY)
    with pytest.raises(ValueError, match="levels"):
        jaxcomm.qsgd(70000, key=KEY)
    with pytest.raises(TypeError, match="levels"):
        jaxcomm.qsgd(2.5, key=KEY)
    with pytest.raises(ValueError, match="bucket_size: expected an int >= 1, got 0"):
        jaxcomm.qsgd(4, bucket_size=0, key=KEY)
    with pytest.raises(ValueError, match="bucket_size"):
        jaxcomm.int8(bucket_size=-3, key=KEY)
    with pytest.raises(TypeError, match="key: a PRNG key is required"):
        jaxcomm.qsgd(4, key=None)
    with pytest.raises(TypeError, match="key: a PRNG key is required when stochastic=True"):
        jaxcomm.int8()
    jaxcomm.int8(stochastic=False)  # no key needed
    with pytest.raises(TypeError, match="key"):
        jaxcomm.terngrad(key=None)
    with pytest.raises(ValueError, match="clip_sigma: expected a finite float > 0"):
        jaxcomm.terngrad(key=KEY, clip_sigma=0.0)
    with pytest.raises(ValueError, match="clip_sigma"):
        jaxcomm.terngrad(key=KEY, clip_sigma=-1)
    with pytest.raises(TypeError, match="axis_name"):
        jaxcomm.terngrad(key=KEY, axis_name=1)


def test_zero_gradient_stays_zero():
    for tx in (
        jaxcomm.int8(key=KEY, min_size=0),
        jaxcomm.qsgd(4, key=KEY, min_size=0),
        jaxcomm.terngrad(key=KEY, min_size=0),
    ):
        out, _ = tx.update({"v": jnp.zeros(300)}, tx.init({"v": jnp.zeros(300)}))
        assert not np.any(np.asarray(out["v"]))
