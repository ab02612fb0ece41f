"""DGC against a NumPy reference of its four parts, over several steps on 8 workers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from experiments import digits
from jaxcomm.compressors.dgc import check_followed_by_plain_sgd, dgc_density_schedule
from tests import helpers as H

# "w": strided sample (3000 > 2/ratio); "v": strided, d not a multiple of the stride;
# "s": d <= 2/ratio, exact threshold over all of |v|; "b": dense (< min_size)
PARAMS = {
    "w": jnp.zeros((60, 50)),
    "v": jnp.zeros((1500,)),
    "s": jnp.zeros((150,)),
    "b": jnp.zeros((7,)),
}
RATIO, MIN_SIZE = 0.01, 100
F32 = np.float32


def runner(tx):
    """A jitted ``tx.update`` under shard_map, compiled once for several steps."""
    fn, sh = H.sharded(tx)
    return lambda g, s: fn(jax.device_put(g, sh), jax.device_put(s, sh))


def kept(ratio, d):
    return min(d, max(1, math.ceil(ratio * d - 1e-9)))


def np_select(v, ratio, step, sample_ratio=0.01):
    """Indices DGC sends for one worker's flat float32 velocity v (the official rule)."""
    d = v.size
    a = np.abs(v).astype(F32)
    cap = kept(ratio, d)
    target = max(math.ceil(sample_ratio * d), math.ceil(2 / ratio))
    stride = 1 if target >= d else d // target
    ns = d // stride
    sample = a[: ns * stride].reshape(ns, stride)[:, step % stride]
    tiny = np.finfo(F32).tiny
    thr = max(F32(np.sort(sample)[::-1][kept(ratio, ns) - 1]), tiny)
    count = int(np.sum(a >= thr))
    below, above = F32(0), F32(np.inf)  # thresholds known to select too many / too few
    if stride > 1:
        for _ in range(10):
            if count > math.floor(1.3 * cap):
                below, thr = thr, F32(thr * F32(1.3))
            elif count < math.ceil(0.8 * cap):
                above, thr = thr, F32(thr * F32(0.8))
            else:
                break
            if below > 0 and np.isfinite(above):
                thr = F32((below + above) * F32(0.5))
            thr = max(thr, tiny)
            count = int(np.sum(a >= thr))
        if count < math.ceil(0.8 * cap) and below > 0:  # ties: back to a too-many threshold
            thr = below
    sel = np.flatnonzero(a >= thr)
    window = min(d, max(cap, math.ceil(1.3 * cap)))
    if sel.size > window:  # a window of consecutive selected entries from a rotating start
        start = int(((step + 1) * 2654435761) % 2**32) % sel.size
        sel = sel[(start + np.arange(window)) % sel.size]
    # of those, the cap largest (ties: the earlier in the window)
    return sel[np.argsort(-a[sel], kind="stable")[:cap]]


def np_dgc(grads_seq, *, m, nesterov, correction, masking, clip):
    """The four DGC equations per worker, then the mean of what was sent."""
    n = H.N
    names = sorted(PARAMS)
    u = {k: np.zeros((n, PARAMS[k].size), F32) for k in names}
    v = {k: np.zeros((n, PARAMS[k].size), F32) for k in names}
    outs = []
    for step, g in enumerate(grads_seq):
        g = {k: np.asarray(g[k], F32).reshape(n, -1) for k in names}
        if clip is not None:
            norms = np.sqrt(sum((g[k].astype(np.float64) ** 2).sum(1) for k in names))
            scale = np.minimum(1.0, clip / math.sqrt(n) / (norms + 1e-6)).astype(F32)
            g = {k: g[k] * scale[:, None] for k in names}
        out = {}
        for k in names:
            if correction:
                if nesterov:
                    u[k] = F32(m) * (u[k] + g[k])
                    acc = u[k] + g[k]
                else:
                    u[k] = F32(m) * u[k] + g[k]
                    acc = u[k]
            else:
                acc = g[k]
            if PARAMS[k].size < MIN_SIZE:
                out[k] = acc.astype(np.float64).mean(0)
                continue
            v[k] = v[k] + acc
            sent = np.zeros_like(v[k])
            for w in range(n):
                idx = np_select(v[k][w], RATIO, step)
                sent[w, idx] = v[k][w, idx]
                v[k][w, idx] = 0
                if correction and masking:
                    u[k][w, idx] = 0
            out[k] = sent.astype(np.float64).mean(0)
        outs.append(out)
    return outs, u, v


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            momentum=0.9,
            nesterov=False,
            momentum_correction=True,
            momentum_masking=True,
            clip_norm=None,
        ),
        dict(
            momentum=0.9,
            nesterov=True,
            momentum_correction=True,
            momentum_masking=True,
            clip_norm=20.0,
        ),
        dict(
            momentum=0.5,
            nesterov=False,
            momentum_correction=True,
            momentum_masking=False,
            clip_norm=None,
        ),
        dict(
            momentum=0.0,
            nesterov=False,
            momentum_correction=False,
            momentum_masking=True,
            clip_norm=None,
        ),
    ],
    ids=["momentum", "nesterov-clip", "no-masking", "no-correction"],
)
def test_matches_numpy_reference_over_steps(kw):
    tx = jaxcomm.dgc(RATIO, axis_name="data", min_size=MIN_SIZE, **kw)
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(4)]
    ref_outs, ref_u, ref_v = np_dgc(
        grads_seq,
        m=kw["momentum"],
        nesterov=kw["nesterov"],
        correction=kw["momentum_correction"],
        masking=kw["momentum_masking"],
        clip=kw["clip_norm"],
    )
    if kw["clip_norm"] is not None:  # the clip is active on every worker
        norms = np.sqrt(
            sum(np.asarray(grads_seq[0][k]).reshape(H.N, -1).__pow__(2).sum(1) for k in PARAMS)
        )
        assert np.all(norms > kw["clip_norm"] / math.sqrt(H.N))
    state = H.stack(tx.init(PARAMS))
    step = runner(tx)
    for g, ref in zip(grads_seq, ref_outs):
        out, state = step(g, state)
        for k in PARAMS:
            np.testing.assert_allclose(
                out[k], ref[k].reshape(PARAMS[k].shape), rtol=1e-5, atol=1e-6, err_msg=k
            )
    for k in PARAMS:
        got_v = np.asarray(state.velocity[k]).reshape(H.N, -1)
        if PARAMS[k].size >= MIN_SIZE:
            np.testing.assert_allclose(got_v, ref_v[k], rtol=1e-5, atol=1e-6, err_msg=k)
            # the same entries were sent (v is exactly zero there) ...
            np.testing.assert_array_equal(got_v == 0, ref_v[k] == 0, err_msg=k)
        else:
            assert not np.any(got_v)  # dense leaves keep no velocity
        if kw["momentum_correction"]:
            np.testing.assert_allclose(
                np.asarray(state.momentum[k]).reshape(H.N, -1),
                ref_u[k],
                rtol=1e-5,
                atol=1e-6,
                err_msg=k,
            )
        else:
            assert state.momentum is None


def test_masking_zeroes_u_and_v_at_sent_positions():
    g = H.per_worker_grads(PARAMS, seed=7)
    for masking in (True, False):
        tx = jaxcomm.dgc(RATIO, axis_name="data", min_size=MIN_SIZE, momentum_masking=masking)
        _, st = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
        for k in ("w", "v", "s"):
            gk = np.asarray(g[k]).reshape(H.N, -1)
            u = np.asarray(st.momentum[k]).reshape(H.N, -1)
            v = np.asarray(st.velocity[k]).reshape(H.N, -1)
            sent = v == 0  # first step: u = v = g, nonzero everywhere
            d = gk.shape[1]
            cap = kept(RATIO, d)
            assert np.all(sent.sum(1) <= cap) and np.all(sent.sum(1) >= math.ceil(0.8 * cap))
            np.testing.assert_array_equal(v[~sent], gk[~sent])
            if masking:
                assert np.all(u[sent] == 0)
            else:
                np.testing.assert_array_equal(u[sent], gk[sent])
            np.testing.assert_array_equal(u[~sent], gk[~sent])


@pytest.mark.parametrize(
    "d, p, cap", [(3000, 0.01, 40), (64, 1.0, 64), (33, 1.0, 40), (1000, 0.0, 5), (5000, 0.002, 7)]
)
def test_first_set_bits_is_exact(d, p, cap):
    from jaxcomm.compressors.dgc.selection import first_set, pack_bits

    sel = np.random.default_rng(d).random(d) < p
    got = np.asarray(first_set(pack_bits(jnp.asarray(sel)), cap, d))
    ref = np.flatnonzero(sel)[:cap]
    np.testing.assert_array_equal(got, np.concatenate([ref, np.full(cap - ref.size, d)]))


def _sent_positions(tx, g, steps):
    state, out = tx.init(g), []
    for _ in range(steps):
        upd, state = tx.update(g, state)
        out.append(np.flatnonzero(np.asarray(upd["w"], np.float32)))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("values", [(1.0,), (0.25, 0.5, 1.0)], ids=["all_equal", "three_values"])
def test_tied_magnitudes_still_fill_the_payload_and_rotate(values, dtype):
    """Ties (bf16 buffers) jump the threshold from too many to none: k must still be sent."""
    d, ratio = 10_000, 0.01
    cap = kept(ratio, d)
    w = np.random.default_rng(0).choice(values, size=d).astype(np.float32)
    g = {"w": jnp.asarray(w, dtype)}
    tx = jaxcomm.dgc(ratio, momentum=0.0, momentum_correction=False, min_size=0)
    sent = _sent_positions(tx, g, 3)
    for pos in sent:
        assert pos.size == cap  # was 0 of k, for ever
    # the first step sends only the largest value; and not the first positions holding it
    assert np.all(w[sent[0]] == max(values))
    assert sent[0].min() > np.flatnonzero(w == max(values))[cap]


def test_when_more_pass_than_fit_the_largest_are_kept():
    """Exact threshold (sample_ratio=1) with ties at it: 120 reach it, 100 fit."""
    d, ratio = 4000, 0.025
    cap = kept(ratio, d)
    w = np.full(d, 0.01, np.float32)
    w[:30] = 1.0  # early, small: the threshold's ties
    w[-90:] = 5.0  # late, large: all must go
    assert cap == 100 and np.sum(w >= np.sort(w)[::-1][cap - 1]) == 120
    tx = jaxcomm.dgc(ratio, momentum=0.0, momentum_correction=False, min_size=0, sample_ratio=1.0)
    (pos,) = _sent_positions(tx, {"w": jnp.asarray(w)}, 1)
    assert pos.size == cap
    assert set(np.flatnonzero(w == 5.0)) <= set(pos)  # first-by-position dropped 20 of them


def test_warmup_schedule_values():
    f = dgc_density_schedule(0.001, warmup_steps=400)
    expected = {
        0: 0.25,
        99: 0.25,
        100: 0.0625,
        199: 0.0625,
        200: 0.015625,
        299: 0.015625,
        300: 0.00390625,
        399: 0.00390625,
        400: 0.001,
        10**6: 0.001,
    }
    for step, dens in expected.items():
        assert f(step) == dens, step
        assert float(f(jnp.int32(step))) == np.float32(dens)
    # 75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity (the paper's)
    assert [round(100 * (1 - f(s)), 2) for s in (0, 100, 200, 300, 400)] == [
        75.0,
        93.75,
        98.44,
        99.61,
        99.9,
    ]
    g = dgc_density_schedule(0.01, warmup_steps=10, warmup_epochs=2, warmup_ratios=(0.5, 0.1))
    assert [g(s) for s in (0, 4, 5, 9, 10)] == [0.5, 0.5, 0.1, 0.1, 0.01]
    assert dgc_density_schedule(0.01)(0) == 0.01  # no warm-up
    # floors at ratio: a ratio above the paper's late densities shortens the ramp
    assert dgc_density_schedule(0.05, warmup_steps=4)(2) == 0.05


def test_warmup_sends_the_scheduled_number_of_entries():
    d = 4000
    params = {"x": jnp.zeros((d,))}
    tx = jaxcomm.dgc(0.001, warmup_steps=8, momentum=0.0, min_size=0)
    f = dgc_density_schedule(0.001, warmup_steps=8)
    state = tx.init(params)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for step in range(10):
        out, state = update({"x": jnp.asarray(rng.normal(size=d), jnp.float32)}, state)
        cap = kept(f(step), d)
        sent = np.count_nonzero(np.asarray(out["x"]))
        assert math.ceil(0.8 * cap) <= sent <= cap, (step, sent, cap)


def test_wire_bytes_equal_hlo_and_formula():
    g = H.per_worker_grads(PARAMS, seed=3)
    sparse = [3000, 1500, 150]
    dense = 7 * 4
    tx = jaxcomm.dgc(RATIO, axis_name="data", min_size=MIN_SIZE)
    expected = sum(kept(RATIO, d) * (4 + 4) for d in sparse) + dense
    assert jaxcomm.wire_bytes(tx, PARAMS, H.N) == expected
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS)))
    assert jaxcomm.accounting.collective_bytes(compiled) == expected
    # one collective: the dense leaves ride in the values' all-gather
    assert [c.kind for c in jaxcomm.accounting.hlo_collectives(compiled)] == ["all_gather"]
    # warm-up: every distinct density is a branch holding its own all-gather (the dense
    # leaves riding in each), plus the 4-byte agreement on the step count
    params = {"w": PARAMS["w"], "b": PARAMS["b"]}
    g = {"w": g["w"], "b": g["b"]}
    sched = dict(warmup_steps=40, warmup_epochs=2, warmup_ratios=(0.1, 0.05))
    tx = jaxcomm.dgc(RATIO, axis_name="data", min_size=MIN_SIZE, **sched)
    dens = {dgc_density_schedule(RATIO, **sched)(s) for s in range(41)}
    assert dens == {0.1, 0.05, RATIO}
    expected = sum(kept(r, 3000) * 8 + dense for r in dens) + 4
    assert jaxcomm.wire_bytes(tx, params, H.N) == expected
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(params)))
    assert jaxcomm.accounting.collective_bytes(compiled) == expected


def test_nonfinite_gradient_leaves_that_workers_state_and_reaches_output():
    tx = jaxcomm.dgc(RATIO, axis_name="data", min_size=MIN_SIZE)
    step = runner(tx)
    state = H.stack(tx.init(PARAMS))
    _, state = step(H.per_worker_grads(PARAMS, seed=0), state)
    g = H.per_worker_grads(PARAMS, seed=1)
    g["w"] = g["w"].at[2, 5, 5].set(jnp.inf)
    out, new = step(g, state)
    assert np.any(np.isnan(np.asarray(out["w"])))
    np.testing.assert_array_equal(new.nonfinite, [0, 0, 1, 0, 0, 0, 0, 0])
    for buf_new, buf_old in ((new.velocity, state.velocity), (new.momentum, state.momentum)):
        for k in PARAMS:
            a, b = np.asarray(buf_new[k]), np.asarray(buf_old[k])
            np.testing.assert_array_equal(a[2], b[2])  # worker 2 skipped its update
            assert np.all(np.isfinite(a))
            if k != "b":
                assert not np.array_equal(a[0], b[0])  # the others did not


def test_plain_sgd_check_and_dgc_sgd():
    params = {"w": jnp.zeros((40, 40))}
    with pytest.raises(ValueError, match="TraceState"):
        check_followed_by_plain_sgd(
            optax.chain(jaxcomm.dgc(), optax.sgd(0.1, momentum=0.9)).init(params)
        )
    with pytest.raises(ValueError, match="ScaleByAdamState"):
        check_followed_by_plain_sgd(optax.chain(jaxcomm.dgc(), optax.adam(1e-3)).init(params))
    check_followed_by_plain_sgd(optax.chain(jaxcomm.dgc(), optax.sgd(0.1)).init(params))
    check_followed_by_plain_sgd(jaxcomm.dgc_sgd(0.1).init(params))
    # without momentum correction the momentum belongs after DGC
    tx = jaxcomm.dgc_sgd(0.1, momentum=0.9, momentum_correction=False)
    check_followed_by_plain_sgd(tx.init(params))


def test_dgc_sgd_steps_match_numpy_momentum_sgd_over_three_steps():
    """dgc_sgd = DGC's momentum-corrected, masked top-k, then -lr: the NumPy reference."""
    lr = 0.1
    tx = jaxcomm.dgc_sgd(lr, RATIO, momentum=0.9, axis_name="data", min_size=MIN_SIZE)
    grads_seq = [H.per_worker_grads(PARAMS, seed=20 + s) for s in range(3)]
    ref, _, _ = np_dgc(grads_seq, m=0.9, nesterov=False, correction=True, masking=True, clip=None)
    update, state = runner(tx), H.stack(tx.init(PARAMS))
    for g, want in zip(grads_seq, ref):
        out, state = update(g, state)
        for k in PARAMS:
            np.testing.assert_allclose(
                np.asarray(out[k]).ravel(), -lr * want[k].ravel(), rtol=1e-5, atol=1e-6
            )


def test_bad_arguments():
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="ratio"):
            jaxcomm.dgc(bad)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="momentum"):
            jaxcomm.dgc(momentum=bad)
    with pytest.raises(ValueError, match="clip_norm"):
        jaxcomm.dgc(clip_norm=0.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        jaxcomm.dgc(warmup_steps=-1)
    with pytest.raises(ValueError, match="warmup_ratios"):
        jaxcomm.dgc(warmup_steps=10, warmup_ratios=(0.5,))
    with pytest.raises(ValueError, match="sample_ratio"):
        jaxcomm.dgc(sample_ratio=0.0)
    with pytest.raises(ValueError, match="momentum"):
        jaxcomm.dgc(momentum_correction=False)  # momentum 0.9 would be silently dropped
    tx = jaxcomm.dgc()
    with pytest.raises(TypeError, match=r"\['n'\]"):
        tx.init({"w": jnp.zeros((40, 40)), "n": jnp.zeros((), jnp.int32)})
    params = {"w": jnp.zeros((40, 40))}
    with pytest.raises(TypeError, match="state"):
        tx.update(params, optax.sgd(0.1).init(params))
    with pytest.raises(ValueError, match="state"):
        tx.update(params, jaxcomm.dgc(momentum=0, momentum_correction=False).init(params))


def test_convergence_on_digits_at_999_sparsity_within_one_point_of_momentum_sgd():
    """MLP (64-128-10), 600 full-batch steps on 8 workers; warm-up over the first quarter."""
    split = digits.load(8)
    lr, steps = 0.1, 600

    def train(tx):
        return digits.train(tx, steps=steps, model="mlp", hidden=128, split=split)

    dense = train(optax.chain(jaxcomm.allreduce(axis_name="data"), optax.sgd(lr, momentum=0.9)))
    sparse = train(jaxcomm.dgc_sgd(lr, 0.001, axis_name="data", warmup_steps=steps // 4))
    print(f"momentum SGD {dense.accuracy:.4f}  DGC 99.9% {sparse.accuracy:.4f}")
    assert dense.accuracy > 0.95
    assert sparse.accuracy >= dense.accuracy - 0.01, (sparse.accuracy, dense.accuracy)
    # the big layers really were sent at 0.1% after warm-up
    params = digits.init_params("mlp", jax.random.key(0), hidden=128)
    tx = jaxcomm.dgc(0.001, axis_name="data")
    assert jaxcomm.wire_bytes(tx, params, 8) == (9 + 2) * 8 + (128 + 10) * 4


def test_bf16_params_keep_float32_momentum_and_velocity():
    """40 large entries every step beside 4056 of 1e-3, 300 steps, bf16 params.

    DGC's velocity is its error feedback: Σ sent + v = Σ g. Float32 u/v (the
    default for bf16 params) keep it exactly; bf16 ones (state_dtype=bf16,
    what bf16 params used to get) lose more than 10% of the small gradients.
    """

    def tx(state_dtype):
        return jaxcomm.dgc(
            0.01, momentum=0.0, momentum_correction=False, min_size=0, state_dtype=state_dtype
        )

    memory = lambda state: state.velocity["w"]  # noqa: E731
    assert tx(None).init({"w": jnp.zeros(8, jnp.bfloat16)}).velocity["w"].dtype == jnp.float32
    assert H.bf16_telescoping_error(tx(None), memory) < 1e-3
    assert H.bf16_telescoping_error(tx(jnp.bfloat16), memory) > 0.1
    d = 4096
    momentum = jaxcomm.dgc(0.01, min_size=0).init({"w": jnp.zeros(d, jnp.bfloat16)}).momentum
    assert momentum["w"].dtype == jnp.float32


def test_dgc_refuses_an_option_it_does_not_take_and_keeps_its_defaults():
    from jaxcomm.compressors.dgc import transform
    from jaxcomm.options import take

    with pytest.raises(TypeError, match=r"jaxcomm\.dgc: unexpected argument\(s\) 'error_feedback'"):
        jaxcomm.dgc(0.01, error_feedback=False)
    with pytest.raises(TypeError, match=r"jaxcomm\.dgc: .*'key'"):
        jaxcomm.dgc(0.01, key=jax.random.key(0))
    assert take("dgc", {}, transform.OPTIONS) == {
        "axis_name": None,
        "min_size": 1024,
        "bucket_bytes": "auto",
        "state_dtype": None,
    }
