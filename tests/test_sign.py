"""1-bit SGD, EF-SignSGD, majority vote and 2-bit against plain-NumPy references, on 8 workers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm.compressors import sign
from tests import helpers as H

PARAMS = {"w": jnp.zeros((48, 40)), "v": jnp.zeros((1500,)), "b": jnp.zeros((7,))}
MIN_SIZE = 100  # "b" goes dense
# The all-gather exchange, which the NumPy references below model (exchange="auto",
# the default, goes two-phase on 8 workers: tests/test_two_phase.py).
G = "gather"


# --- references: one worker's (sent vector, residual) for flat p ---------------------------


def np_onebit_step(p, bucket=None):
    sent = np.zeros_like(p)
    b = p.size if bucket is None else bucket
    for i in range(0, p.size, b):
        x = p[i : i + b]
        neg = x < 0
        pos_val = x[~neg].mean() if np.any(~neg) else 0.0
        neg_val = x[neg].mean() if np.any(neg) else 0.0
        sent[i : i + b] = np.where(neg, neg_val, pos_val)
    return sent, p - sent


def np_ef_sign_step(p):
    scale = np.abs(p).sum() / p.size  # ‖p‖₁/d
    sent = np.where(p < 0, -scale, scale)  # 1 bit: an exact zero is sent as +
    return sent, p - sent


def np_twobit_step(p, tau):
    sent = np.where(p >= tau, tau, np.where(p <= -tau, -tau, 0.0))
    return sent, p - sent


@pytest.mark.parametrize(
    "make, step, kw",
    [
        (
            lambda: jaxcomm.onebit(axis_name="data", min_size=MIN_SIZE, exchange=G),
            np_onebit_step,
            {},
        ),
        (
            lambda: jaxcomm.onebit(axis_name="data", bucket_size=40, min_size=MIN_SIZE, exchange=G),
            np_onebit_step,
            {"bucket": 40},
        ),
        (
            lambda: jaxcomm.onebit(axis_name="data", bucket_size=7, min_size=MIN_SIZE, exchange=G),
            np_onebit_step,
            {"bucket": 7},
        ),
        (
            lambda: jaxcomm.ef_sign(axis_name="data", min_size=MIN_SIZE, exchange=G),
            np_ef_sign_step,
            {},
        ),
        (
            lambda: jaxcomm.twobit(0.5, axis_name="data", min_size=MIN_SIZE, exchange=G),
            np_twobit_step,
            {"tau": 0.5},
        ),
        (
            lambda: jaxcomm.twobit(0.3, axis_name="data", min_size=MIN_SIZE, exchange=G),
            np_twobit_step,
            {"tau": np.float64(np.float32(0.3))},
        ),
    ],
    ids=["onebit", "onebit-rows", "onebit-b7", "ef_sign", "twobit", "twobit-0.3"],
)
def test_matches_numpy_over_steps(make, step, kw):
    tx = make()
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(4)]
    state = H.stack(tx.init(PARAMS))
    ref_outs, ref_res = H.ef_reference(step, grads_seq, PARAMS, MIN_SIZE, **kw)
    for g, ref in zip(grads_seq, ref_outs):
        out, state = H.shard_map_update(tx, g, state)
        for k in PARAMS:
            assert out[k].dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(out[k]), ref[k], rtol=1e-5, atol=1e-5)
    for k in ("w", "v"):
        got = np.asarray(state.residual[k]).reshape(H.N, -1)
        np.testing.assert_allclose(got, ref_res[k], rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(state.residual["b"]))


def test_onebit_reconstruction_values_minimise_squared_error():
    """The two means are the best pair for the given signs: any other pair does worse."""
    p = np.random.default_rng(0).normal(size=500) + 0.2
    comp = sign.OneBit(None)
    (_, recon), _ = comp.encode(jnp.asarray(p, jnp.float32), None)
    sent = np.where(p < 0, recon[0, 1], recon[0, 0])
    err = np.sum((p - sent) ** 2)
    for dp, dn in [(0.01, 0), (-0.01, 0), (0, 0.01), (0, -0.01)]:
        other = np.where(p < 0, recon[0, 1] + dn, recon[0, 0] + dp)
        assert np.sum((p - other) ** 2) > err
    np.testing.assert_allclose(recon[0], [p[p >= 0].mean(), p[p < 0].mean()], rtol=1e-5)


def np_majority(g):
    """sign(Σ_w sign(g_w)) with sign(0) = 0: a tie gives 0."""
    return np.sign(np.sign(g).sum(0))


def test_majority_vote_matches_numpy_including_ties_and_zeros():
    g = H.per_worker_grads(PARAMS, seed=3)
    v = np.array(g["v"])
    v[:4, :100] = np.abs(v[:4, :100])  # 4 for, 4 against: a tie
    v[4:, :100] = -np.abs(v[4:, :100])
    v[:, 100:110] = 0.0  # nobody votes
    v[:3, 110:120] = 0.0  # 3 abstain, 5 vote
    g = {**g, "v": jnp.asarray(v)}
    tx = jaxcomm.sign_majority(axis_name="data", min_size=MIN_SIZE)
    out, state = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    for k in ("w", "v"):
        np.testing.assert_array_equal(np.asarray(out[k]), np_majority(np.asarray(g[k])))
    assert not np.any(np.asarray(out["v"][:110]))
    np.testing.assert_allclose(out["b"], np.asarray(g["b"]).mean(0), rtol=1e-6)
    assert state.residual is None  # no error feedback


@pytest.mark.parametrize("n", [127, 128, 300])
def test_majority_vote_psum_fields_cannot_overflow(n):
    """Unanimous votes (the largest field sum, 2n) and close votes, beyond int8's range."""
    d = 64
    rng = np.random.default_rng(n)
    g = rng.normal(size=(n, d))
    g[:, :8] = np.abs(g[:, :8])  # unanimous +
    g[:, 8:16] = -np.abs(g[:, 8:16])  # unanimous -
    g[: n // 2 + 1, 16:24] = np.abs(g[: n // 2 + 1, 16:24])  # a majority of one
    g[n // 2 + 1 :, 16:24] = -np.abs(g[n // 2 + 1 :, 16:24])
    tx = jaxcomm.sign_majority(axis_name="data", min_size=0)
    state = H.stack(tx.init({"v": jnp.zeros(d)}), n)
    out, _ = H.vmap_update(tx, {"v": jnp.asarray(g, jnp.float32)}, state)
    np.testing.assert_array_equal(np.asarray(out["v"][0]), np_majority(g))
    assert sign.vote_field_bits(n) == (2 * n).bit_length()


def test_majority_vote_local_is_plain_sign():
    tx = jaxcomm.sign_majority(min_size=0)
    g = jnp.asarray([-2.0, 0.0, 3.0, -0.1])
    out, _ = tx.update({"v": g}, tx.init({"v": g}))
    np.testing.assert_array_equal(out["v"], [-1.0, 0.0, 1.0, -1.0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.ef_sign(axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.onebit(axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.onebit(axis_name="data", bucket_size=50, min_size=0, exchange=G),
        lambda: jaxcomm.twobit(0.5, axis_name="data", min_size=0, exchange=G),
    ],
    ids=["ef_sign", "onebit", "onebit-rows", "twobit"],
)
def test_error_feedback_telescopes(make):
    """Σ_t outputs + mean residual_T == Σ_t mean_w g_t (nothing lost, nothing invented)."""
    H.assert_ef_telescopes(make(), held_back=1e-2)


def test_twobit_residual_invariant():
    """r += g; q = ±τ where |r| >= τ; r -= q. With |g| <= τ the residual stays in (−τ, τ)."""
    tau = 0.25
    tx = jaxcomm.twobit(tau, axis_name="data", min_size=0, exchange=G)
    params = {"v": jnp.zeros((1000,))}
    state = H.stack(tx.init(params))
    rng = np.random.default_rng(0)
    r = np.zeros((H.N, 1000), np.float32)
    for _ in range(20):
        g = rng.uniform(-tau, tau, size=(H.N, 1000)).astype(np.float32)
        out, state = H.shard_map_update(tx, {"v": jnp.asarray(g)}, state)
        p = r + g  # float32, as the transform computes it
        new_r = np.asarray(state.residual["v"])
        sent = p - new_r  # what each worker sent
        assert np.all(np.isin(np.round(sent / tau, 5), [-1.0, 0.0, 1.0]))
        np.testing.assert_array_equal(sent == 0, np.abs(p) < tau)  # send iff |r| >= τ
        assert np.all(np.abs(new_r) < tau)
        np.testing.assert_allclose(np.asarray(out["v"]), sent.mean(0), atol=1e-6)
        r = new_r


@pytest.mark.parametrize(
    "comp, expected_1000",
    [
        (sign.OneBit(None), 4 * 32 + 8),
        (sign.OneBit(100), 4 * 32 + 8 * 10),
        (sign.ScaledSign(), 4 * 32 + 4),
        (sign.MajorityVote("x"), 4 * math.ceil(1000 / 6)),  # n=8: 5-bit fields, 6 a word
        (sign.TwoBit(0.5), 4 * math.ceil(1000 / 16)),
        (sign.TwoBitServer(), 4 * math.ceil(1000 / 16) + 4),  # + the float32 scale
    ],
    ids=["onebit", "onebit-b100", "ef_sign", "majority", "twobit", "twobit_server"],
)
def test_wire_size_formula_equals_traced_bytes(comp, expected_1000):
    params = {"a": jnp.zeros((1000,)), "b": jnp.zeros((33, 31)), "c": jnp.zeros((1,))}
    # wire_size is the payload of a whole leaf, what the all-gather carries
    tx = jaxcomm.compress(comp, axis_name="x", error_feedback=False, min_size=0, exchange=G)
    expected = sum(comp.wire_size(int(x.size), x.dtype, n_workers=8) for x in params.values())
    expected += jaxcomm.core.nan_flag_bytes(comp)  # once per step, not per leaf
    assert jaxcomm.wire_bytes(tx, params, 8) == expected
    assert comp.wire_size(1000, jnp.float32, n_workers=8) == expected_1000


def test_sign_payload_is_one_bit_per_entry():
    words, scale = sign.ScaledSign().encode(jnp.ones((1000,)), None)[0]
    assert words.dtype == jnp.uint32 and words.shape == (32,)  # 1000 bits in 32 words
    assert scale.dtype == jnp.float32 and scale.shape == (1,)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="threshold: expected a finite float > 0, got 0.0"):
        jaxcomm.twobit(0.0)
    with pytest.raises(ValueError, match="threshold"):
        jaxcomm.twobit(-0.5)
    with pytest.raises(TypeError, match="threshold"):
        jaxcomm.twobit("0.5")
    with pytest.raises(ValueError, match="bucket_size: expected an int >= 1, got 0"):
        jaxcomm.onebit(bucket_size=0)
    with pytest.raises(TypeError, match="axis_name"):
        jaxcomm.sign_majority(axis_name=3)


def test_bf16_updates_keep_dtype_and_match_f32():
    g = H.per_worker_grads(PARAMS, seed=5)
    g16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), g)
    for make in (
        lambda: jaxcomm.ef_sign(axis_name="data", min_size=MIN_SIZE),
        lambda: jaxcomm.onebit(axis_name="data", min_size=MIN_SIZE),
    ):
        tx = make()
        params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
        out16, st = H.shard_map_update(tx, g16, H.stack(tx.init(params16)))
        # updates in the params' dtype; the residual in float32 (state_dtype=None)
        assert out16["w"].dtype == jnp.bfloat16 and st.residual["w"].dtype == jnp.float32
        ref, _ = H.shard_map_update(
            tx, jax.tree.map(lambda x: x.astype(jnp.float32), g16), H.stack(tx.init(PARAMS))
        )
        np.testing.assert_allclose(
            np.asarray(out16["w"], np.float32), ref["w"], rtol=1e-2, atol=1e-2
        )


@pytest.mark.parametrize("n", [3, 20])  # 20 > quantize.UNROLL: the streamed (scan) decode
def test_all_gather_decode_any_worker_count(n):
    """EF-sign on n simulated workers (vmap) equals the NumPy mean of each worker's rule."""
    from jaxcomm.compressors import quantize

    assert (n > quantize.UNROLL) == (n == 20)
    tx = jaxcomm.ef_sign(axis_name="data", min_size=0, exchange=G)
    params = {"w": jnp.zeros((300,))}
    g = H.per_worker_grads(params, seed=7, n=n)
    state = H.stack(tx.init(params), n)
    out, _ = jax.vmap(lambda g, s: tx.update(g, s), axis_name="data")(g, state)
    sent = np.stack([np_ef_sign_step(np.asarray(g["w"][w], np.float64))[0] for w in range(n)])
    np.testing.assert_allclose(np.asarray(out["w"][0]), sent.mean(0), rtol=1e-5, atol=1e-6)
