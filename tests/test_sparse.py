"""top-k, random-k and threshold against plain-NumPy references, on 8 workers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm.compressors.sparse import _periods
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


def np_prime_at_most(n):
    return next((c for c in range(n, 1, -1) if all(c % f for f in range(2, math.isqrt(c) + 1))), 1)


def np_threshold_periods(k):
    """The default slot periods: the largest prime <= ceil(0.6 k), then the largest
    other prime <= k - m1 (0 if k - m1 < 2). Their sum is the number of slots."""
    m1 = np_prime_at_most(max(1, math.ceil(0.6 * k)))
    m2 = np_prime_at_most(k - m1) if k - m1 >= 2 else 0
    if m2 == m1:
        m2 = np_prime_at_most(m1 - 1) if m1 > 2 else 0
    return m1, m2


def np_band_sent(d, c, k, pair, seed=0):
    """Of the round(k/R) adjacent columns of a (R = d/c, c) matrix whose entries outrank
    all others (random order among themselves), how many the two passes send, over
    min(k, band): the plain selection, class by class (an independent check of the
    library's vectorised scoring)."""
    m1, m2 = pair
    r = d // c
    w = max(1, min(c, round(k / r)))
    idx = (np.arange(r)[:, None] * c + np.arange(w)).reshape(-1)
    mag = np.random.default_rng(seed).random(idx.size)
    order = idx[np.argsort(-mag)]  # best first
    taken, seen1 = set(), set()
    for i in order:  # pass 1: the best heavy entry of each class mod m1
        if i % m1 not in seen1:
            seen1.add(i % m1)
            taken.add(i)
    sent = len(taken)
    members = {}
    for i in order:  # pass 2: per class mod m2, its best if free, else its runner-up if free
        members.setdefault(i % m2, []).append(i)
    for top in members.values():
        sent += any(i not in taken for i in top[:2])
    return sent / min(k, idx.size)


def np_worst_band(d, k, pair):
    """The worst band of adjacent columns over the factorisations d = R*c, 2 <= c <= d/2,
    whose columns are shorter than the slots."""
    slots = sum(np_threshold_periods(k))
    cs = [c for c in range(2, d // 2 + 1) if d % c == 0 and d // c < slots]
    return min(np_band_sent(d, c, k, pair) for c in cs)


def np_classes(a, m):
    """(rows, m) ranking keys of float32 ``a >= 0``, class j (entries j, j+m, ...) in column j.

    As documented for the threshold: the magnitude with its low R mantissa bits
    (R = bits of the row count) replaced by ``2^R - 1 - row``, so ties, and values
    equal in all but those bits, rank by row. Padding ranks last (0).
    """
    rows = -(-a.size // m)
    low = (1 << max(1, rows.bit_length())) - 1
    row = np.arange(a.size, dtype=np.uint32) // m
    keys = np.zeros(rows * m, np.uint32)
    keys[: a.size] = (a.astype(np.float32).view(np.uint32) & ~np.uint32(low)) | (low - row)
    return keys.reshape(rows, m).astype(np.int64)


def np_threshold_step(p, ratio, sample_ratio):
    """One worker: two-pass strided-block top-k with a prime-stride sample threshold.

    Pass 1: the largest |p| of each class mod m1. Pass 2: per class mod m2, the
    largest entry pass 1 did not take, among the class's two largest (ties: first).
    """
    d = p.size
    k = max(1, math.ceil(ratio * d))
    m1, m2 = _periods(k, d)  # the pair is a search (tested below); the selection is not
    assert m1 + m2 == sum(np_threshold_periods(k))
    a = np.abs(p)
    thr = -np.inf
    if sample_ratio is not None:
        # the smallest prime >= 1/sample_ratio, and the largest prime <= k // 32 (>= 32
        # sample entries reach the threshold), both skipping primes that divide d
        primes = [c for c in range(2, max(k // 32, round(1 / sample_ratio)) * 2 + 3)]
        primes = [c for c in primes if all(c % f for f in range(2, math.isqrt(c) + 1))]
        ok = [c for c in primes if d % c]
        s = (
            1
            if round(1 / sample_ratio) <= 1
            else min(c for c in ok if c >= round(1 / sample_ratio))
        )
        s = min(s, max([c for c in ok if c <= k // 32], default=1))
        sample = a[::s]
        ks = max(1, math.ceil(ratio * sample.size))
        thr = np.sort(sample)[::-1][ks - 1]
    chosen = list(np.argmax(np_classes(a, m1), axis=0) * m1 + np.arange(m1))
    taken = np.zeros(d, bool)
    taken[chosen] = True
    if m2:
        order = np.argsort(-np_classes(a, m2), axis=0)[:2] * m2 + np.arange(m2)
        for j in range(m2):
            free = [i for i in order[:, j] if i < d and not taken[i]]
            chosen += free[:1]
    sent = np.zeros_like(p)
    for i in chosen:
        if a[i] >= thr:
            sent[i] = p[i]
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
        # exact fp32 accumulation; a psum in fp16 also rounds the sum, outside EF's reach.
        # The all-gather: two-phase adds a server residual (telescoped in test_two_phase.py)
        lambda: jaxcomm.cast(
            jnp.float16,
            axis_name="data",
            accumulate="all_gather",
            exchange="gather",
            error_feedback=True,
            min_size=0,
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


@pytest.mark.parametrize(
    "d, m", [(1, 1), (7, 2), (45, 4), (1000, 1000), (10007, 97), (50000, 49), (50000, 53)]
)
def test_strided_best_finds_first_maximum_and_runner_up_of_each_residue_class(d, m):
    from jaxcomm.compressors.sparse import _strided_best

    def np_ref(a):
        """Per class j: its first maximum, and the next entry by (magnitude desc, position)."""
        best, runner, has = [], [], []
        for j in range(m):
            order = np.argsort(-a[j::m], kind="stable")
            best.append(j + m * int(order[0]))
            has.append(order.size > 1)
            runner.append(j + m * int(order[1]) if order.size > 1 else -1)
        return np.array(best), np.array(runner), np.array(has)

    rng = np.random.default_rng(d + m)
    a = np.abs(rng.normal(size=d)).astype(np.float32)
    last = m * ((d - 1) // m)  # a class's maximum at its last entry (in the tail when d % m)
    a[last] = a.max() * 2
    if d >= 2 * m:
        a[1 % m + m] = a[1 % m] = 10.0 * a.max()  # exact tie: the first of the two, then the other
    if d >= 3 * m + 4:
        a[4 + 2 * m] = 5.0 * a.max()  # a class's runner-up in the middle of its rows
        a[4 + 3 * m] = 6.0 * a.max()
    best, runner, has = np_ref(a)
    np.testing.assert_array_equal(_strided_best(jnp.asarray(a), m), best)
    got_best, got_runner, got_has = (
        np.asarray(x) for x in _strided_best(jnp.asarray(a), m, second=True)
    )
    np.testing.assert_array_equal(got_best, best)
    np.testing.assert_array_equal(got_has, has)
    np.testing.assert_array_equal(got_runner[has], runner[has])
    if m < 3 or d < 2 * m:
        return
    a[2::m] = 0.0  # an all-zero class may report any of its entries
    a[m] = np.nan  # NaN wins its class
    a[1] = np.inf  # so does Inf
    got = np.asarray(_strided_best(jnp.asarray(a), m))
    assert got[2] % m == 2 and 0 <= got[2] < d
    assert got[0] == m and got[1] == 1


def _structured(kind, seed):
    """(1000, 1000) gradient: small noise, heavy mass in 10 rows / columns (random or adjacent)."""
    rng = np.random.default_rng(seed)
    if kind == "iid":
        return rng.normal(size=(1000, 1000)).astype(np.float32)
    g = 0.01 * rng.normal(size=(1000, 1000))
    lines = (
        rng.choice(1000, 10, replace=False) if kind in ("rows", "columns") else 500 + np.arange(10)
    )
    if kind.startswith("rows"):
        g[lines, :] += rng.normal(size=(10, 1000))
    else:
        g[:, lines] += rng.normal(size=(1000, 10))
    return g.astype(np.float32)


@pytest.mark.parametrize("sample_ratio", [0.01, None])
@pytest.mark.parametrize("kind", ["rows", "columns", "rows_adjacent", "columns_adjacent", "iid"])
def test_threshold_fills_half_its_slots_with_true_topk_on_structured_gradients(kind, sample_ratio):
    """Item 5 of issue 12: >= k/2 of the sent entries are among the true top-k.

    Measured here (with the 1% sample threshold; without it): 7,008 (7,008)
    of 10,000 for rows, 6,371 (6,371) columns, 8,238 (8,243) adjacent rows,
    7,923 (7,937) adjacent columns, 6,837 (7,101) i.i.d. (With the default
    periods (5987, 4013) before they were chosen for d: 7,745, 7,826, 8,270,
    7,379, 6,883; over 30 draws of the random rows and columns the two pairs
    send the same on average, 72-74% of k, so the first two are this draw's
    luck.) The one-pass layout
    (m = 9973 slots of one period) filled 4,394 with 10 adjacent columns (the
    row length 1000 against 9973 makes a lattice), contiguous blocks of 1/ratio
    entries 384 with rows.
    """
    ratio = 0.01
    g = _structured(kind, seed=3)
    p = g.reshape(-1)
    k = math.ceil(ratio * p.size)
    tx = jaxcomm.threshold(ratio, sample_ratio=sample_ratio)
    out, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": jnp.zeros_like(g)}))
    sent = np.flatnonzero(np.asarray(out["w"]).reshape(-1))
    true_topk = np.argsort(-np.abs(p), kind="stable")[:k]
    hits = np.intersect1d(sent, true_topk).size
    assert hits >= k / 2, (hits, k)
    # the NumPy reference of the same selection agrees entry for entry
    ref, _ = np_threshold_step(p, ratio, sample_ratio)
    np.testing.assert_array_equal(np.asarray(out["w"]).reshape(-1), ref)
    # and the usage report counts exactly the slots sent, against the static cap
    usage = jaxcomm.compressors.sparse.threshold_usage(
        {"w": jnp.asarray(g)}, None, ratio=ratio, sample_ratio=sample_ratio
    )
    used, slots = usage["['w']"]
    assert int(used) == sent.size and slots == sum(np_threshold_periods(k))


@pytest.mark.parametrize("shape, band", [((3072, 768), 8), ((256, 4000), 40)])
def test_threshold_fills_half_its_slots_on_adjacent_columns_of_other_shapes(shape, band):
    """Layouts where the default pair of periods crowds a band of adjacent columns.

    The heavy columns hold about k entries. With the default periods (the largest
    primes near 0.6k and 0.4k) 38-41% (8 columns of (3072, 768)) and 41-46% (40 of
    (256, 4000)) of k were sent; the periods chosen for d send 76-77% here.
    """
    ratio = 0.01
    rng = np.random.default_rng(5)
    g = 0.01 * rng.normal(size=shape)
    cols = shape[1] // 3 + np.arange(band)
    g[:, cols] += rng.normal(size=(shape[0], band))
    g = g.astype(np.float32)
    p = g.reshape(-1)
    k = math.ceil(ratio * p.size)
    tx = jaxcomm.threshold(ratio)
    out, _ = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": jnp.zeros_like(g)}))
    sent = np.flatnonzero(np.asarray(out["w"]).reshape(-1))
    true_topk = np.argsort(-np.abs(p), kind="stable")[:k]
    assert np.intersect1d(sent, true_topk).size >= k / 2, (sent.size, k)
    ref, _ = np_threshold_step(p, ratio, 0.01)
    np.testing.assert_array_equal(np.asarray(out["w"]).reshape(-1), ref)


def test_threshold_sample_keeps_enough_entries_on_small_leaves():
    """A 1% sample of a (3, 3, 32, 32) kernel (k = 93 at ratio 0.01) held 92 entries, so
    the threshold was the sample's maximum: over 40 i.i.d. normal draws, 19 sent fewer
    than half of the true top-k (one sent 2 of 93; a real ResNet gradient's kernel sent 5).
    The stride now keeps >= 32 sample entries at the threshold (stride 1 here, as 2
    divides d): all 40 draws send >= half, and the selection matches the NumPy
    reference."""
    shape, ratio = (3, 3, 32, 32), 0.01
    d, k = math.prod(shape), math.ceil(ratio * math.prod(shape))
    tx = jaxcomm.threshold(ratio)
    g = np.random.default_rng(0).standard_normal((40, *shape)).astype(np.float32)
    state = tx.init({"w": jnp.zeros(shape)})
    out, _ = jax.jit(jax.vmap(tx.update, in_axes=(0, None)))({"w": jnp.asarray(g)}, state)
    out = np.asarray(out["w"]).reshape(40, d)
    fills = []
    for p, o in zip(g.reshape(40, d), out):
        top = np.argsort(-np.abs(p), kind="stable")[:k]
        fills.append(np.intersect1d(np.flatnonzero(o), top).size / k)
    assert min(fills) >= 0.5, sorted(fills)[:5]
    np.testing.assert_array_equal(out[0], np_threshold_step(g[0].reshape(-1), ratio, 0.01)[0])


def test_threshold_sample_stride_is_coprime_with_d():
    """Heavy mass in two even columns of a (288, 32) leaf (k = 93): a sample stride of 2
    (the largest prime <= k // 32) would sample only even columns, see all the heavy
    entries at twice their share, set the threshold too high and send 44 of 93 (47%).
    2 divides d, so the stride is 1: 70 of 93 (75%)."""
    rng = np.random.default_rng(0)
    g = 0.01 * rng.standard_normal((288, 32))
    g[:, [4, 10]] += rng.standard_normal((288, 2))
    g = g.astype(np.float32)
    p, k = g.reshape(-1), 93
    tx = jaxcomm.threshold(0.01)
    out, _ = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": jnp.zeros_like(g)}))
    sent = np.flatnonzero(np.asarray(out["w"]).reshape(-1))
    top = np.argsort(-np.abs(p), kind="stable")[:k]
    assert np.intersect1d(sent, top).size >= 0.6 * k
    np.testing.assert_array_equal(
        np.asarray(out["w"]).reshape(-1), np_threshold_step(p, 0.01, 0.01)[0]
    )


@pytest.mark.parametrize("d, ratio", [(3072 * 768, 0.01), (256 * 4000, 0.01), (10**6, 0.01)])
def test_threshold_periods_are_chosen_for_every_factorisation_of_d(d, ratio):
    """The pair of periods: distinct primes, the default's sum (the wire size does not
    change), and by an independent class-by-class count, every band of adjacent
    columns of every (d/c, c) view sends >= 60% of min(k, band) (the default pair:
    13-57% on these d)."""
    k = math.ceil(ratio * d)
    m1, m2 = _periods(k, d)
    default = np_threshold_periods(k)
    assert m1 != m2 and m1 + m2 == sum(default)
    assert all(m > 2 and all(m % f for f in range(2, math.isqrt(m) + 1)) for m in (m1, m2))
    assert d % m1 and d % m2
    worst, worst_default = np_worst_band(d, k, (m1, m2)), np_worst_band(d, k, default)
    assert worst >= 0.6 and worst >= worst_default, (worst, worst_default)
    assert _periods(k, None) == default  # no d (e.g. the accounting): the default pair


def test_threshold_usage_adds_the_residual_and_skips_dense_leaves():
    rng = np.random.default_rng(0)
    g = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32), "b": jnp.ones((10,))}
    tx = jaxcomm.threshold(0.05, min_size=100)
    state = tx.init(g)
    _, state = tx.update(g, state)
    usage = jaxcomm.compressors.sparse.threshold_usage(g, state.residual, ratio=0.05, min_size=100)
    assert list(usage) == ["['w']"]
    p = (np.asarray(g["w"]) + np.asarray(state.residual["w"])).reshape(-1)
    ref, _ = np_threshold_step(p, 0.05, 0.01)
    assert int(usage["['w']"][0]) == np.count_nonzero(ref)
    with pytest.raises(ValueError, match="sample_ratio"):
        jaxcomm.compressors.sparse.threshold_usage(g, ratio=0.05, sample_ratio=0.0)
    with pytest.raises(ValueError, match="min_size"):
        jaxcomm.compressors.sparse.threshold_usage(g, ratio=0.05, min_size=-1)


@pytest.mark.parametrize("n, k", [(1, 1), (10, 3), (40000, 40), (999, 999)])
def test_kth_largest_is_exact(n, k):
    from jaxcomm.compressors.sparse import kth_largest

    rng = np.random.default_rng(n)
    a = np.abs(rng.standard_t(2, size=n)).astype(np.float32)
    a[: n // 3] = a[n // 2]  # many ties
    assert float(kth_largest(jnp.asarray(a), k)) == np.sort(a)[::-1][k - 1]
    a[0] = np.inf
    assert float(kth_largest(jnp.asarray(a), 1)) == np.inf
