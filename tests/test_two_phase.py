"""The two-phase compressed all-reduce (jaxcomm.exchange.two_phase), on 8 workers.

Against a NumPy reference of the algorithm: chunk, quantise each chunk,
worker j averages every worker's chunk j, adds its server residual,
re-quantises, and everyone decodes the gathered chunk means; error feedback
on both sides. Odd sizes and a leaf smaller than the number of workers.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm.compressors import dense
from tests import helpers as H

N = H.N
BUCKET = 16
# "w": 1073 entries (chunks of 135, the last padded); "t": 5 < 8 workers; "b": dense
PARAMS = {"w": jnp.zeros((37, 29)), "t": jnp.zeros((5,)), "b": jnp.zeros((3,))}
MIN_SIZE = 4


def np_int8(x):
    """Round-to-nearest int8 with one max-abs scale per BUCKET entries: x's decoded value."""
    nb = math.ceil(x.size / BUCKET)
    b = np.pad(x.astype(np.float32), (0, nb * BUCKET - x.size)).reshape(nb, BUCKET)
    scale = np.abs(b).max(1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(b / safe[:, None]), -127, 127)
    return (q * scale[:, None]).reshape(-1)[: x.size].astype(np.float32)


TAU = np.float32(0.5)  # twobit's threshold in these tests


def np_twobit(x, tau=TAU):
    """The workers' 2-bit rule: +τ where x >= τ, −τ where x <= −τ, else 0."""
    return np.where(x >= tau, tau, np.where(x <= -tau, -tau, np.float32(0))).astype(np.float32)


def np_twobit_server(s):
    """twobit's server rule on a chunk: a = mean|s| (padding counted), the nearest of {±a, 0}."""
    a = np.mean(np.abs(s.astype(np.float32)), dtype=np.float32)
    return np.where(s >= a / 2, a, np.where(s <= -a / 2, -a, np.float32(0))).astype(np.float32)


def np_two_phase(grads_seq, names, worker=np_int8, server=None):
    """Per step: the mean every worker gets; final worker and server residuals.

    ``worker(chunk)``: what a worker's chunk decodes to; ``server(chunk mean +
    server residual)``: what the owner sends (default: the worker's rule).
    """
    server = server or worker
    res = {k: np.zeros((N, PARAMS[k].size), np.float32) for k in names}
    srv = {k: np.zeros((N, PARAMS[k].size), np.float32) for k in names}
    outs = []
    for g in grads_seq:
        out = {}
        for k in names:
            d = PARAMS[k].size
            c = -(-d // N)
            p = np.asarray(g[k], np.float32).reshape(N, d) + res[k]
            pad = np.pad(p, ((0, 0), (0, N * c - d))).reshape(N, N, c)  # worker, chunk, c
            sent = np.stack([[worker(pad[w, j]) for j in range(N)] for w in range(N)])
            res[k] = p - sent.reshape(N, N * c)[:, :d]
            means = []
            for j in range(N):  # worker j averages chunk j, adds its server residual
                s_pad = np.pad(srv[k][j], (0, N * c - d))
                s = sent[:, j].sum(0) / np.float32(N) + s_pad[j * c : (j + 1) * c]
                m = server(s)
                s_pad[j * c : (j + 1) * c] = s - m
                srv[k][j] = s_pad[:d]
                means.append(m)
            out[k] = np.concatenate(means)[:d]
        out["b"] = np.asarray(g["b"], np.float32).mean(0)
        outs.append(out)
    return outs, res, srv


def assert_close_to_a_quantum(got, want):
    """Equal up to float rounding, except where summation order moved a rounding tie: at
    most 0.5% of the entries, by at most one int8 quantum (max|x|/127 <= 0.04 here)."""
    diff = np.abs(np.asarray(got, np.float64).ravel() - np.asarray(want, np.float64).ravel())
    assert np.mean(diff > 1e-5) <= 0.005, np.sum(diff > 1e-5)
    assert diff.max() < 0.04, diff.max()


def tx_int8(mode="two_phase", **kw):
    return jaxcomm.int8(
        stochastic=False,
        bucket_size=BUCKET,
        axis_name=H.AXIS,
        error_feedback=True,
        min_size=MIN_SIZE,
        exchange=mode,
        **kw,
    )


@pytest.mark.parametrize("bucket_bytes", [None, 1 << 20], ids=["per_array", "bucketed"])
def test_int8_two_phase_matches_numpy_over_steps(bucket_bytes):
    tx = tx_int8(bucket_bytes=bucket_bytes)
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(3)]
    ref, res, srv = np_two_phase(grads_seq, ["w", "t"])
    fn, sh = H.sharded(tx)
    state = jax.device_put(H.stack(tx.init(PARAMS)), sh)
    for g, want in zip(grads_seq, ref):
        out, state = fn(jax.device_put(g, sh), state)
        for k in PARAMS:
            assert_close_to_a_quantum(out[k], want[k])
    for k in ("w", "t"):
        assert_close_to_a_quantum(state.residual[k], res[k])
        assert_close_to_a_quantum(state.server[k], srv[k])
    assert np.abs(srv["w"]).max() > 1e-4  # the server residual is used


def test_bytes_are_the_ring_bound_at_the_compressed_size_and_match_hlo():
    tx, gather = tx_int8(), tx_int8("gather")
    c = -(-1073 // N)
    chunk = c + 4 * math.ceil(c / BUCKET)  # int8 codes + one f32 scale per bucket
    tiny = 1 + 4  # "t": chunks of 1 entry
    # all-to-all operand: n chunks; all-gather operand: one chunk (+ the 1-byte NaN flag);
    # "b" (3 fp32, below min_size) rides in both: n chunks of 1 entry, then its chunk sum
    want = N * (chunk + tiny) + (chunk + tiny + 1) + (N + 1) * 4
    assert jaxcomm.wire_bytes(tx, PARAMS, N) == want
    g = H.per_worker_grads(PARAMS, seed=1)
    hlo = jaxcomm.accounting.hlo_collectives(H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS))))
    assert sum(c.nbytes for c in hlo) == want
    assert sorted(c.kind for c in hlo) == ["all_gather", "all_to_all"]  # nothing beside
    # traffic per worker: 2(n-1)/n of a payload against (n-1) payloads received
    report = jaxcomm.accounting.wire_report(tx, PARAMS, N)
    two = jaxcomm.accounting.traffic_bytes(report, N)
    one = jaxcomm.accounting.traffic_bytes(jaxcomm.accounting.wire_report(gather, PARAMS, N), N)
    assert two < 0.3 * one


def test_auto_gathers_on_two_workers_and_goes_two_phase_on_more():
    tx = tx_int8("auto")
    kinds = lambda n: {c.kind for c in jaxcomm.accounting.wire_report(tx, PARAMS, n)}  # noqa: E731
    assert "all_to_all" not in kinds(2)
    assert "all_to_all" in kinds(4) and "all_to_all" in kinds(8)


# --- twobit: the server re-quantises chunk means with a scale of its own -----------------


def tx_twobit(mode="two_phase", **kw):
    return jaxcomm.twobit(float(TAU), axis_name=H.AXIS, min_size=MIN_SIZE, exchange=mode, **kw)


def assert_twobit_close(got, want):
    """Equal up to float rounding, except where a summation order moved a chunk's scale
    a by an ulp across an entry at exactly ±a/2: at most 0.5% of the entries."""
    diff = np.abs(np.asarray(got, np.float64).ravel() - np.asarray(want, np.float64).ravel())
    assert np.mean(diff > 1e-5) <= 0.005, np.sum(diff > 1e-5)


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_twobit_two_phase_matches_numpy_over_steps():
    """Workers: ±τ codes with their residual; chunk owner: mean + server residual,
    a = mean|s| over the chunk, the nearest of {−a, 0, a}, server residual s − q."""
    tx = tx_twobit()
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(3)]
    ref, res, srv = np_two_phase(grads_seq, ["w", "t"], np_twobit, np_twobit_server)
    fn, sh = H.sharded(tx)
    state = jax.device_put(H.stack(tx.init(PARAMS)), sh)
    for g, want in zip(grads_seq, ref):
        out, state = fn(jax.device_put(g, sh), state)
        for k in PARAMS:
            assert_twobit_close(out[k], want[k])
    for k in ("w", "t"):
        assert_twobit_close(state.residual[k], res[k])
        assert_twobit_close(state.server[k], srv[k])
    # chunk j's update takes the values {-a_j, 0, a_j}, a_j its own scale (not tau = 0.5)
    w = np.asarray(out["w"]).ravel()
    c = -(-w.size // N)
    scales = [np.abs(w[j * c : (j + 1) * c]).max() for j in range(N)]
    for j, a in enumerate(scales):
        np.testing.assert_allclose(np.unique(np.abs(w[j * c : (j + 1) * c])), [0, a], rtol=1e-6)
    assert 0 < min(scales) and max(scales) < 0.5 and len(set(scales)) == N


def test_twobit_one_step_points_along_the_worker_mean():
    """N(0, 1) gradients, tau = 0.5: a chunk mean is a multiple of tau/8; re-quantised with
    tau (the old server rule, in NumPy) it moves only where all 8 workers agreed."""
    params = {"w": jnp.zeros((128, 256))}  # chunks of 4096
    g = H.per_worker_grads(params, seed=0)
    gw = np.asarray(g["w"], np.float32).reshape(N, -1)
    mean = gw.mean(0)
    s = np_twobit(gw).sum(0) / np.float32(N)  # chunk means (no residuals on the first step)
    old = np_twobit(s)  # the server re-quantising with the workers' tau
    c = s.size // N
    new_np = np.concatenate([np_twobit_server(s[j * c : (j + 1) * c]) for j in range(N)])
    tx = tx_twobit("auto")
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(params)))
    new = np.asarray(out["w"]).ravel()
    assert np.count_nonzero(old) > 0  # the old rule moved a few entries: a real cosine
    assert cosine(old, mean) < 0.1
    assert cosine(new, mean) >= 0.3
    assert_twobit_close(new, new_np)  # and the transform's is the rule's


def test_twobit_server_residual_carries_what_was_not_sent():
    """Step 1: owner j keeps s_1 - q_1 on chunk j (zeros elsewhere). Step 2 quantises the
    new chunk mean plus that residual; two steps telescope on both sides."""
    params = {"w": jnp.zeros((30, 50))}  # 1500 entries: chunks of 188, the last padded
    d, c = 1500, 188
    tx = tx_twobit()
    fn, sh = H.sharded(tx)
    state = jax.device_put(H.stack(tx.init(params)), sh)
    g1, g2 = (H.per_worker_grads(params, seed=s) for s in (60, 61))
    gw1, gw2 = (np.asarray(g["w"], np.float32).reshape(N, d) for g in (g1, g2))

    def server(s):  # the owners' rule on the whole (padded) vector
        pad = np.pad(s, (0, N * c - d))
        return np.concatenate([np_twobit_server(pad[j * c : (j + 1) * c]) for j in range(N)])[:d]

    out1, state = fn(jax.device_put(g1, sh), state)
    out1 = np.asarray(out1["w"]).ravel()
    s1 = np_twobit(gw1).sum(0) / np.float32(N)
    assert_twobit_close(out1, server(s1))
    srv1 = np.asarray(state.server["w"]).reshape(N, d)
    for j in range(N):  # each owner holds only its own chunk's remainder
        mine = np.zeros(d, bool)
        mine[j * c : (j + 1) * c] = True
        assert not np.any(srv1[j][~mine])
    np.testing.assert_allclose(srv1.sum(0), s1 - out1, atol=1e-6)  # what was not sent
    assert np.abs(srv1).max() > 0.01

    e1 = gw1 - np_twobit(gw1)
    out2, state = fn(jax.device_put(g2, sh), state)
    out2 = np.asarray(out2["w"]).ravel()
    s2 = np_twobit(gw2 + e1).sum(0) / np.float32(N)
    assert_twobit_close(out2, server(s2 + srv1.sum(0)))
    assert np.mean(out2 != server(s2)) > 0.05  # without the residual: another update
    left = np.asarray(state.residual["w"], np.float64).reshape(N, d).mean(0)
    srv2 = np.asarray(state.server["w"], np.float64).reshape(N, d).sum(0)
    total_in = gw1.astype(np.float64).mean(0) + gw2.astype(np.float64).mean(0)
    np.testing.assert_allclose(out1 + out2 + left + srv2, total_in, atol=1e-5)


def test_twobit_two_phase_bytes_analytic_equal_hlo():
    """Phase one: 2-bit codes; phase two: 2-bit codes + one float32 scale per chunk."""
    tx = tx_twobit("auto")

    def codes(x):
        return 4 * math.ceil(x / 16)

    chunks = [-(-d // N) for d in SIZES]
    two = sum(N * codes(c) + codes(c) + 4 for c in chunks) + TWO_PHASE_DENSE_AND_FLAG
    assert jaxcomm.wire_bytes(tx, PARAMS, N) == two
    g = H.per_worker_grads(PARAMS, seed=1)
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS)))
    assert jaxcomm.accounting.collective_bytes(compiled) == two
    assert "all_to_all" in {c.kind for c in jaxcomm.accounting.hlo_collectives(compiled)}
    comp = jaxcomm.compressors.sign.TwoBit(0.5)
    traffic = jaxcomm.strategies.exchange_traffic(comp, [(d, jnp.float32) for d in SIZES], N)
    assert traffic["two_phase"] == (N - 1) * sum(2 * codes(c) + 4 for c in chunks)


# --- exchange="auto", the default: the exchange that moves fewer bytes ------------------


def int8_bytes(x):  # int8 codes + one float32 scale per BUCKET entries
    return x + 4 * math.ceil(x / BUCKET)


def sign_bytes(x):  # one bit per entry in uint32 words + one float32 scale
    return 4 * math.ceil(x / 32) + 4


def qsgd16_bytes(x):  # sign + 5 level bits per entry in uint32 words + a norm per bucket
    return 4 * math.ceil(6 * x / 32) + 4 * math.ceil(x / BUCKET)


# Default transforms (no exchange=), with the payload bytes s(x) of x entries in closed form.
DEFAULTS = {
    "int8": (
        lambda: jaxcomm.int8(
            stochastic=False,
            bucket_size=BUCKET,
            axis_name=H.AXIS,
            error_feedback=True,
            min_size=MIN_SIZE,
        ),
        int8_bytes,
    ),
    "ef_sign": (lambda: jaxcomm.ef_sign(axis_name=H.AXIS, min_size=MIN_SIZE), sign_bytes),
    "qsgd": (
        lambda: jaxcomm.qsgd(
            16,
            key=jax.random.key(0),
            bucket_size=BUCKET,
            axis_name=H.AXIS,
            error_feedback=True,
            min_size=MIN_SIZE,
        ),
        qsgd16_bytes,
    ),
}
SIZES = (PARAMS["w"].size, PARAMS["t"].size)  # compressed leaves; "b" (3 entries) is dense
DENSE_AND_FLAG = 3 * 4 + 1  # "b" in float32 + the NaN rule's 1-byte flag
# two-phase: "b" rides in both phases, n chunks of ceil(3/n) fp32 out, one chunk sum back
TWO_PHASE_DENSE_AND_FLAG = (N + 1) * 4 * math.ceil(3 / N) + 1


def mesh_of(n):
    return jax.make_mesh((n,), (H.AXIS,), devices=jax.devices()[:n])


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_default_moves_the_two_phase_bytes_on_8_workers_analytic_equals_hlo(name):
    make, s = DEFAULTS[name]
    tx = make()
    chunks = [-(-d // N) for d in SIZES]
    # all-to-all of the n chunk payloads + all-gather of one chunk mean, per leaf
    two = sum(N * s(c) + s(c) for c in chunks) + TWO_PHASE_DENSE_AND_FLAG
    gather = sum(s(d) for d in SIZES) + DENSE_AND_FLAG
    # what a worker sends: 2(n-1)·s(c) against the (n-1)·s(d) it receives by all-gather
    assert 2 * sum(s(c) for c in chunks) < sum(s(d) for d in SIZES)
    assert jaxcomm.wire_bytes(tx, PARAMS, N) == two != gather
    state = tx.init(PARAMS)  # outside the axis: n unknown, the server residual is there
    assert state.server is not None
    compiled = H.shard_map_compiled(tx, H.per_worker_grads(PARAMS, seed=1), H.stack(state))
    assert jaxcomm.accounting.collective_bytes(compiled) == two
    assert "all_to_all" in {c.kind for c in jaxcomm.accounting.hlo_collectives(compiled)}


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_default_gathers_on_two_workers(name):
    make, s = DEFAULTS[name]
    tx = make()
    gather = sum(s(d) for d in SIZES) + DENSE_AND_FLAG
    assert jaxcomm.wire_bytes(tx, PARAMS, 2) == gather
    g = H.per_worker_grads(PARAMS, seed=1, n=2)
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS), 2), m=mesh_of(2))
    assert jaxcomm.accounting.collective_bytes(compiled) == gather
    assert "all_to_all" not in {c.kind for c in jaxcomm.accounting.hlo_collectives(compiled)}
    # init under the axis knows n: no server residual where two-phase does not run
    state = jax.vmap(lambda p: tx.init(p), axis_name=H.AXIS)(H.stack(PARAMS, 2))
    assert state.server is None
    state8 = jax.vmap(lambda p: tx.init(p), axis_name=H.AXIS)(H.stack(PARAMS, N))
    assert state8.server is not None


def test_a_tie_is_the_gather():
    """uint16 cast on even sizes and 2 workers: 2·s(d/2) = s(d), both exchanges move the same."""
    tx = jaxcomm.cast(
        jnp.bfloat16, axis_name=H.AXIS, accumulate="all_gather", min_size=4, error_feedback=True
    )
    params = {"w": jnp.zeros((32, 32)), "v": jnp.zeros((6,))}
    comp = dense.Cast(jnp.bfloat16, "all_gather")
    traffic = jaxcomm.strategies.exchange_traffic(comp, [(1024, jnp.float32), (6, jnp.float32)], 2)
    assert traffic["gather"] == traffic["two_phase"] == 2 * (1024 + 6)
    assert jaxcomm.wire_bytes(tx, params, 2) == 2 * (1024 + 6)  # no NaN flag: NaN rides along
    kinds = lambda n: {c.kind for c in jaxcomm.accounting.wire_report(tx, params, n)}  # noqa: E731
    assert "all_to_all" not in kinds(2) and "all_to_all" in kinds(3)


@pytest.mark.parametrize("d", [64, 96, 128, 1000])
def test_auto_follows_the_bytes_not_the_worker_count(d):
    """EF-sign: each chunk pays a float32 scale and a whole uint32 word, so on small leaves
    two-phase moves more than the all-gather even on many workers (64 entries: never)."""
    tx = jaxcomm.ef_sign(axis_name=H.AXIS, min_size=0)
    params = {"w": jnp.zeros((d,))}
    for n in (2, 3, 4, 8, 64):
        fewer = 2 * sign_bytes(-(-d // n)) < sign_bytes(d)
        report = jaxcomm.accounting.wire_report(tx, params, n)
        assert ("all_to_all" in {c.kind for c in report}) == fewer, (d, n)
        both = [
            jaxcomm.accounting.traffic_bytes(
                jaxcomm.accounting.wire_report(
                    jaxcomm.ef_sign(axis_name=H.AXIS, min_size=0, exchange=m), params, n
                ),
                n,
            )
            for m in ("gather", "two_phase")
        ]
        assert jaxcomm.accounting.traffic_bytes(report, n) == min(both)
    # init outside the axis: no server residual where two-phase is never fewer bytes
    assert (tx.init(params).server is None) == (2 * sign_bytes(1) >= sign_bytes(d))


def test_where_two_phase_is_never_fewer_bytes_the_default_gathers_on_8_workers():
    """EF-sign on a 64-entry leaf: two-phase 2·s(8) = 16 B > s(64) = 12 B (and 2·s(1) > s(64))."""
    tx = jaxcomm.ef_sign(axis_name=H.AXIS, min_size=0)
    params = {"w": jnp.zeros((64,))}
    assert 2 * sign_bytes(1) > sign_bytes(64)
    state = tx.init(params)
    assert state.server is None  # never two-phase for this tree: no server residual
    want = sign_bytes(64) + 1  # the all-gather (+ the NaN flag)
    assert jaxcomm.wire_bytes(tx, params, N) == want
    compiled = H.shard_map_compiled(tx, H.per_worker_grads(params, seed=3), H.stack(state))
    assert jaxcomm.accounting.collective_bytes(compiled) == want
    assert {c.kind for c in jaxcomm.accounting.hlo_collectives(compiled)} == {"all_gather"}


def test_a_state_without_the_server_residual_is_refused_where_two_phase_runs():
    tx = tx_int8("auto")
    g = H.per_worker_grads(PARAMS, seed=4)
    for state in (
        H.stack(tx_int8("gather").init(PARAMS)),  # e.g. a checkpoint of exchange="gather"
        H.stack(  # made by init under a 2-worker axis, used on 8
            jax.tree.map(
                lambda x: x[0], jax.vmap(lambda p: tx.init(p), axis_name=H.AXIS)(H.stack(PARAMS, 2))
            )
        ),
    ):
        assert state.server is None
        with pytest.raises(ValueError, match="state.server is None, but exchange='auto' runs"):
            H.shard_map_update(tx, g, state)


def test_auto_is_the_one_all_reduce_for_summed_payloads():
    """cast's psum (fp16 widened to float32 on XLA:CPU) stays the path under "auto"."""
    for dtype in (jnp.float16, jnp.bfloat16):
        kw = dict(axis_name=H.AXIS, min_size=4, error_feedback=True, accumulate="psum")
        auto = jaxcomm.cast(dtype, **kw)
        gather = jaxcomm.cast(dtype, **kw, exchange="gather")
        assert auto.init(PARAMS).server is None
        assert jaxcomm.accounting.wire_report(auto, PARAMS, N) == (
            jaxcomm.accounting.wire_report(gather, PARAMS, N)
        )
        assert {c.kind for c in jaxcomm.accounting.wire_report(auto, PARAMS, N)} == {"all_reduce"}


def test_nan_on_one_worker_reaches_every_worker_and_state_stays():
    tx = jaxcomm.twobit(0.5, axis_name=H.AXIS, min_size=MIN_SIZE, exchange="two_phase")
    state = H.stack(tx.init(PARAMS))
    g = H.per_worker_grads(PARAMS, seed=2)
    w = np.asarray(g["w"]).copy()
    w[3, 0, 0] = np.nan
    out, new = jax.pmap(tx.update, axis_name=H.AXIS)({**g, "w": jnp.asarray(w)}, state)
    assert np.all(np.isnan(np.asarray(out["w"])))
    for a, b in zip(jax.tree.leaves(new.residual), jax.tree.leaves(state.residual)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(new.server), jax.tree.leaves(state.server)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "make",
    [
        lambda m: jaxcomm.ef_sign(axis_name=H.AXIS, min_size=MIN_SIZE, exchange=m),
        lambda m: jaxcomm.onebit(axis_name=H.AXIS, min_size=MIN_SIZE, exchange=m),
        lambda m: jaxcomm.qsgd(
            16,
            key=jax.random.key(0),
            axis_name=H.AXIS,
            min_size=MIN_SIZE,
            exchange=m,
            error_feedback=True,
        ),
        lambda m: jaxcomm.cast(
            jnp.bfloat16,
            axis_name=H.AXIS,
            accumulate="all_gather",
            min_size=MIN_SIZE,
            exchange=m,
            error_feedback=True,
        ),
        lambda m: jaxcomm.twobit(0.5, axis_name=H.AXIS, min_size=MIN_SIZE, exchange=m),
    ],
    ids=["ef_sign", "onebit", "qsgd", "cast_bf16", "twobit"],
)
def test_error_feedback_on_both_sides_telescopes(make):
    """Σ outputs + mean worker residual + server residuals = Σ mean gradients.

    Worker j's server residual holds what chunk j's *mean* did not send, so
    Σ_t out_t + mean_w e_w + Σ_j srv_j (each on its chunk) = Σ_t mean_w g_t.
    """
    tx = make("two_phase")
    params = {"w": jnp.zeros((30, 50))}
    state = H.stack(tx.init(params))
    fn, sh = H.sharded(tx)
    tot_out, tot_in = np.zeros(1500), np.zeros(1500)
    for s in range(6):
        g = H.per_worker_grads(params, seed=40 + s)
        out, state = fn(jax.device_put(g, sh), jax.device_put(state, sh))
        tot_out += np.asarray(out["w"], np.float64).reshape(-1)
        tot_in += np.asarray(g["w"], np.float64).reshape(N, -1).mean(0)
    left = np.asarray(state.residual["w"], np.float64).reshape(N, -1).mean(0)
    server = np.asarray(state.server["w"], np.float64).reshape(N, -1).sum(0)
    np.testing.assert_allclose(tot_out + left + server, tot_in, atol=2e-4)
    assert np.abs(server).max() > 1e-4  # the server side holds something back


def test_bad_exchange_option():
    with pytest.raises(ValueError, match="exchange: expected one of"):
        jaxcomm.int8(stochastic=False, exchange="ring")
    with pytest.raises(ValueError, match="exchange: 'two_phase' is for compressors"):
        jaxcomm.cast(jnp.bfloat16, exchange="two_phase")  # psum: already one all-reduce


# --- compressed reduce-scatter (sharded training) ---------------------------------------

SHARDED = {"w": jnp.zeros((64, 24)), "b": jnp.zeros((8,))}  # first dims: multiples of 8


def test_reduce_scatter_equals_psum_scatter_within_the_codecs_rounding():
    """bf16 chunks summed in fp32: lax.psum_scatter's shard, to bf16 rounding; "b" dense."""
    from jax import lax
    from jax.sharding import PartitionSpec as P

    tx = jaxcomm.cast(
        jnp.bfloat16, axis_name=H.AXIS, accumulate="all_gather", min_size=16,
        exchange="reduce_scatter",
    )  # fmt: skip
    g = H.per_worker_grads(SHARDED, seed=5)

    def f(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        u, _ = tx.update(g, jax.tree.map(lambda x: x[0], s))
        want = jax.tree.map(lambda x: lax.psum_scatter(x, H.AXIS, tiled=True) / N, g)
        return u, want

    mesh = H.mesh()
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(H.AXIS), out_specs=P(H.AXIS)))
    sh = jax.sharding.NamedSharding(mesh, P(H.AXIS))
    got, want = fn(jax.device_put(g, sh), jax.device_put(H.stack(tx.init(SHARDED)), sh))
    assert got["w"].shape == (64, 24)  # 8 shards of (8, 24), one per worker
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(got["b"]), np.asarray(want["b"]), rtol=1e-6)
    assert np.abs(np.asarray(got["w"]) - np.asarray(want["w"])).max() > 0  # it was compressed
    # a worker sends (n-1)/n of its compressed gradient: one all-to-all (+ the dense leaf)
    report = jaxcomm.accounting.wire_report(tx, SHARDED, N)
    assert {c.kind for c in report} == {"all_to_all", "reduce_scatter"}
    assert sum(c.nbytes for c in report if c.kind == "all_to_all") == 2 * 64 * 24 + N


def test_sharded_training_with_compressed_reduce_scatter_learns_like_dense():
    """Linear regression, W (64, 24) sharded by rows over 8 workers, per-worker data.

    Each step all-gathers W, takes the local gradient, and reduce-scatters it:
    int8 with error feedback vs the dense lax.psum_scatter.
    """
    from jax import lax
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(N, 32, 64)), jnp.float32)
    y = x @ jnp.asarray(rng.normal(size=(64, 24)), jnp.float32)

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def train(exchange_fn):
        def run(x, y):
            x, y = x[0], y[0]
            shard = lax.pcast(jnp.zeros((64 // N, 24)), H.AXIS, to="varying")  # a shard

            def body(carry, _):
                shard, state = carry
                w = lax.all_gather(shard, H.AXIS, tiled=True)  # varying: local gradients
                g = jax.grad(loss)(w, x, y)
                upd, state = exchange_fn(g, state)
                return (shard - 3.0 * upd, state), None

            state = init_state()
            (shard, _), _ = lax.scan(body, (shard, state), None, length=150)
            w = lax.all_gather(shard, H.AXIS, tiled=True)
            return lax.pmean(loss(w, x, y), H.AXIS)[None]

        mesh = H.mesh()
        fn = jax.shard_map(run, mesh=mesh, in_specs=P(H.AXIS), out_specs=P(H.AXIS))
        sh = jax.sharding.NamedSharding(mesh, P(H.AXIS))
        return float(np.asarray(jax.jit(fn)(jax.device_put(x, sh), jax.device_put(y, sh)))[0])

    tx = jaxcomm.int8(
        stochastic=False, axis_name=H.AXIS, error_feedback=True, min_size=16,
        exchange="reduce_scatter",
    )  # fmt: skip

    def init_state():
        s = tx.init({"w": jnp.zeros((64, 24))})
        return jax.tree.map(lambda a: lax.pcast(a, H.AXIS, to="varying"), s)

    compressed = train(lambda g, s: (tx.update({"w": g}, s)[0]["w"], tx.update({"w": g}, s)[1]))
    dense = train(lambda g, s: (lax.psum_scatter(g, H.AXIS, tiled=True) / N, s))
    first = float(jnp.mean(y**2))
    assert dense < 0.01 * first
    assert compressed < 2 * dense + 1e-3 * first, (compressed, dense, first)


def test_reduce_scatter_refuses_leaves_that_do_not_shard():
    tx = jaxcomm.int8(stochastic=False, axis_name=H.AXIS, exchange="reduce_scatter")
    params = {"w": jnp.zeros((30, 50))}  # 30 rows on 8 workers
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(30, 50\); its first dimension"):
        H.shard_map_update(tx, H.per_worker_grads(params), H.stack(tx.init(params)))


# a 63-leaf tree: 42 matrices and 21 vectors, the shapes of a small transformer's leaves
TREE63 = {f"l{i}": jnp.zeros((64 + i, 33)) if i % 3 else jnp.zeros((40 + i,)) for i in range(63)}


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.int8(
            axis_name=H.AXIS, key=jax.random.key(0), error_feedback=True, exchange="two_phase"
        ),  # fmt: skip
        lambda: jaxcomm.ef_sign(axis_name=H.AXIS, exchange="two_phase"),
        lambda: jaxcomm.cast(axis_name=H.AXIS, exchange="two_phase", accumulate="all_gather"),
        lambda: jaxcomm.twobit(axis_name=H.AXIS, exchange="two_phase"),
    ],
    ids=["int8", "ef_sign", "cast", "twobit"],
)
def test_two_phase_emits_one_operand_per_collective_for_a_63_leaf_tree(make):
    """The program jaxcomm lowers: one all-to-all (phase 1) and one all-gather (phase 2 +
    the NaN flag), the small dense leaves riding in both, each with one operand.

    (XLA:CPU then compiles the all-to-all into its tuple form, one operand per
    destination: 8 here; that split is the backend's, not the program's.)
    """
    import re

    tx = make()
    g, state = H.per_worker_grads(TREE63), H.stack(tx.init(TREE63))
    fn, sh = H.sharded(tx)
    text = fn.lower(jax.device_put(g, sh), jax.device_put(state, sh)).as_text()
    ops = re.findall(r'"stablehlo\.(all_reduce|all_to_all|all_gather)"\(([^)]*)\)', text)
    assert sorted(kind for kind, _ in ops) == ["all_gather", "all_to_all"]
    assert [len(args.split(",")) for _, args in ops] == [1, 1]
