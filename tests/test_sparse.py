"""top-k, random-k and threshold against plain-NumPy references, on 8 workers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from tests import helpers as H

PARAMS = {"w": jnp.zeros((48, 40)), "v": jnp.zeros((1500,)), "b": jnp.zeros((7,))}
MIN_SIZE = 100  # "b" goes dense


def np_topk_step(p, ratio):
    """One worker: (sent dense vector, residual) of exact top-k on flat p."""
    d = p.size
    k = max(1, math.ceil(ratio * d))
    idx = np.argsort(-np.abs(p), kind="stable")[:k]
    sent = np.zeros_like(p)
    sent[idx] = p[idx]
    return sent, p - sent


def np_threshold_step(p, ratio, sample_ratio):
    """One worker: blocked top-k with a strided-sample threshold (see jaxcomm.threshold)."""
    d = p.size
    k = max(1, math.ceil(ratio * d))
    b = math.ceil(d / k)
    a = np.abs(p)
    thr = -np.inf
    if sample_ratio is not None:
        sample = a[:: max(1, round(1 / sample_ratio))]
        ks = max(1, math.ceil(ratio * sample.size))
        thr = np.sort(sample)[::-1][ks - 1]
    sent = np.zeros_like(p)
    for start in range(0, d, b):
        blk = a[start : start + b]
        j = start + int(np.argmax(blk))
        if a[j] >= thr:
            sent[j] = p[j]
    return sent, p - sent


@pytest.mark.parametrize(
    "make, step, kw",
    [
        (
            lambda: jaxcomm.topk(0.02, axis_name="data", min_size=MIN_SIZE),
            np_topk_step,
            {"ratio": 0.02},
        ),
        (
            lambda: jaxcomm.threshold(0.02, axis_name="data", min_size=MIN_SIZE),
            np_threshold_step,
            {"ratio": 0.02, "sample_ratio": 0.01},
        ),
        (
            lambda: jaxcomm.threshold(0.05, axis_name="data", sample_ratio=None, min_size=MIN_SIZE),
            np_threshold_step,
            {"ratio": 0.05, "sample_ratio": None},
        ),
    ],
    ids=["topk", "threshold", "threshold-nosample"],
)
def test_sparsifier_matches_numpy_over_steps(make, step, kw):
    tx = make()
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(3)]
    state = H.stack(tx.init(PARAMS))
    ref_outs, ref_res = H.ef_reference(step, grads_seq, PARAMS, MIN_SIZE, **kw)
    for g, ref in zip(grads_seq, ref_outs):
        out, state = H.shard_map_update(tx, g, state)
        for k in PARAMS:
            np.testing.assert_allclose(np.asarray(out[k]), ref[k], rtol=1e-5, atol=1e-6)
    for k in ("w", "v"):
        got = np.asarray(state.residual[k]).reshape(H.N, -1)
        np.testing.assert_allclose(got, ref_res[k], rtol=1e-5, atol=1e-6)
    # dense leaves keep a zero residual
    assert not np.any(np.asarray(state.residual["b"]))


def test_topk_global_scope_keeps_k_largest_of_whole_tree():
    params = {"a": jnp.zeros((300,)), "b": jnp.zeros((700,))}
    tx = jaxcomm.topk(0.01, scope="global", min_size=0)
    rng = np.random.default_rng(1)
    g = {
        "a": jnp.asarray(rng.normal(size=300) * 10, jnp.float32),
        "b": jnp.asarray(rng.normal(size=700), jnp.float32),
    }
    out, state = tx.update(g, tx.init(params))
    flat = np.concatenate([np.asarray(g["a"]), np.asarray(g["b"])])
    sent, res = np_topk_step(flat, 0.01)
    np.testing.assert_array_equal(np.concatenate([out["a"], out["b"]]), sent)
    np.testing.assert_array_equal(np.concatenate([state.residual["a"], state.residual["b"]]), res)
    # the large-magnitude leaf takes most of the budget: more than its 1% share
    assert np.count_nonzero(out["a"]) > 3


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("sampling", ["uniform", "stratified"])
def test_randomk_with_error_feedback(shared, sampling):
    ratio, d = 0.05, 1000
    params = {"v": jnp.zeros((d,))}
    tx = jaxcomm.randomk(
        ratio,
        key=jax.random.key(3),
        axis_name="data",
        shared_indices=shared,
        sampling=sampling,
        min_size=0,
    )
    g = H.per_worker_grads(params, seed=2)
    state = H.stack(tx.init(params))
    out, new = H.shard_map_update(tx, g, state)
    p = np.asarray(g["v"])
    res = np.asarray(new.residual["v"])
    k = math.ceil(ratio * d)
    kept = res != p  # entries each worker sent (residual zeroed there)
    assert np.all(kept.sum(1) == k)
    assert np.all(res[kept] == 0)
    if shared:
        assert np.all(kept == kept[0])  # same indices everywhere
    else:
        assert not np.all(kept == kept[0])
    expected = np.where(kept, p, 0).mean(0)
    np.testing.assert_allclose(np.asarray(out["v"]), expected, rtol=1e-6, atol=1e-7)
    if sampling == "stratified":  # one index per stratum of 20
        assert np.all(kept.reshape(H.N, k, d // k).sum(-1) == 1)


@pytest.mark.parametrize("sampling", ["uniform", "stratified"])
def test_randomk_without_error_feedback_is_unbiased(sampling):
    # d not divisible by k, so stratified strata have unequal sizes.
    d, ratio, steps = 203, 0.1, 3000
    params = {"v": jnp.zeros((d,))}
    tx = jaxcomm.randomk(
        ratio, key=jax.random.key(7), error_feedback=False, sampling=sampling, min_size=0
    )
    g = jnp.asarray(np.random.default_rng(0).normal(size=d) + 0.5, jnp.float32)

    def body(state, _):
        out, state = tx.update({"v": g}, state)
        return state, out["v"]

    _, outs = jax.lax.scan(body, tx.init(params), None, length=steps)
    outs = np.asarray(outs, np.float64)
    gn = np.asarray(g, np.float64)
    mean = outs.mean(0)
    # per-coordinate standard error, from the samples themselves
    se = outs.std(0) / math.sqrt(steps)
    z2 = ((mean - gn) / se) ** 2
    # unbiased: sum of d squared z-scores ~ chi2(d): mean d, sd sqrt(2d)
    assert z2.sum() < d + 5 * math.sqrt(2 * d), z2.sum()
    # and the selection frequency is k/d (uniform) / 1/stratum size (stratified)
    freq = (outs != 0).mean(0)
    k = math.ceil(ratio * d)
    if sampling == "uniform":
        expected = np.full(d, k / d)
    else:
        bounds = (np.arange(k + 1) * d) // k
        expected = np.repeat(1 / np.diff(bounds), np.diff(bounds))
    assert np.abs(freq - expected).max() < 5 * math.sqrt(0.25 / steps)
    # a biased variant (no rescale) must fail the same test: the test can fail
    biased = outs * (k / d) if sampling == "uniform" else None
    if biased is not None:
        zb = ((biased.mean(0) - gn) / (biased.std(0) / math.sqrt(steps))) ** 2
        assert zb.sum() > d + 5 * math.sqrt(2 * d)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.topk(0.01, axis_name="data", min_size=0),
        lambda: jaxcomm.threshold(0.01, axis_name="data", min_size=0),
        lambda: jaxcomm.randomk(0.01, key=jax.random.key(0), axis_name="data", min_size=0),
        # exact fp32 accumulation; a psum in fp16 also rounds the sum, outside EF's reach
        lambda: jaxcomm.cast(
            jnp.float16, axis_name="data", accumulate="all_gather", error_feedback=True, min_size=0
        ),
    ],
    ids=["topk", "threshold", "randomk", "cast-fp16"],
)
def test_error_feedback_telescopes(make):
    """Σ_t outputs + mean residual_T == Σ_t mean_w g_t (nothing lost, nothing invented)."""
    H.assert_ef_telescopes(make(), held_back=1e-4)


def test_k_is_at_least_one_and_at_most_d():
    assert jaxcomm.core.num_kept(1e-9, 10) == 1
    assert jaxcomm.core.num_kept(1.0, 10) == 10
    assert jaxcomm.core.num_kept(0.1, 1000) == 100
    assert jaxcomm.core.num_kept(0.01, 1001) == 11


@pytest.mark.parametrize("b", [1, 2, 7, 1000, 4099])
def test_block_argmax_finds_first_maximum(b):
    from jaxcomm.compressors.sparse import _block_argmax

    rng = np.random.default_rng(b)
    a = np.abs(rng.normal(size=(50, b))).astype(np.float32)
    a[4, -1] = a[4].max() * 2  # maximum at the end
    if b > 1:
        a[5, 1] = a[5, 0] = 10.0  # exact tie: first of the two
    a[7, :] = 1e-30  # tiny but normal: ties, first position
    np.testing.assert_array_equal(_block_argmax(jnp.asarray(a)), np.argmax(a, axis=1))
    a[3, :] = 0.0  # an all-zero block may report any position, inside the block
    a[6, b // 2] = np.nan  # NaN wins its block
    a[8, b - 1] = -np.inf if b > 1 else np.inf  # so does Inf (magnitudes are >= 0 here)
    a[8] = np.abs(a[8])
    got = np.asarray(_block_argmax(jnp.asarray(a)))
    assert 0 <= got[3] < b
    assert got[6] == b // 2 and got[8] == b - 1


@pytest.mark.parametrize("n, k", [(1, 1), (10, 3), (40000, 40), (999, 999)])
def test_kth_largest_is_exact(n, k):
    from jaxcomm.compressors.sparse import _kth_largest

    rng = np.random.default_rng(n)
    a = np.abs(rng.standard_t(2, size=n)).astype(np.float32)
    a[: n // 3] = a[n // 2]  # many ties
    assert float(_kth_largest(jnp.asarray(a), k)) == np.sort(a)[::-1][k - 1]
    a[0] = np.inf
    assert float(_kth_largest(jnp.asarray(a), 1)) == np.inf
