"""1-bit Adam and 0/1 Adam: NumPy references over every phase, bytes (HLO too), digits."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import digits
from tests import helpers as H

N = H.N
# "w": 1073 entries (two-phase chunks of 135, the last padded); "b": dense (< min_size)
PARAMS = {"w": jnp.zeros((37, 29)), "b": jnp.zeros((3,))}
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 0.01


def np_sign(x):
    """The scaled sign's decoded value: mean|x| * sign(x), zeros counted as +."""
    return np.float32(np.mean(np.abs(x))) * np.where(x < 0, -1, 1).astype(np.float32)


def np_two_phase(x, err, srv):
    """1-bit two-phase mean of the rows of ``x`` (N, d) with worker residuals ``err``
    (N, d) and server residuals ``srv`` (N, N*c; worker j owns chunk j), updated in place."""
    d = x.shape[1]
    c = -(-d // N)
    p = x + err  # (N, d): input + worker error
    pad = np.pad(p, ((0, 0), (0, N * c - d))).reshape(N, N, c)
    sent = np.stack([[np_sign(pad[w, j]) for j in range(N)] for w in range(N)])
    err[:] = p - sent.reshape(N, N * c)[:, :d]
    chunks = []
    for j in range(N):
        s = sent[:, j].mean(0) + srv[j, j * c : (j + 1) * c]
        q = np_sign(s)
        srv[j, j * c : (j + 1) * c] = s - q
        chunks.append(q)
    srv[:, d:] = 0  # the zero padding of the last chunk is not kept in the state
    return np.concatenate(chunks)[:d]


def np_onebit_adam(grads_seq, warmup):
    """Per step, the update every worker applies (8 workers, two-phase exchange)."""
    d = PARAMS["w"].size
    c = -(-d // N)
    m = {k: np.zeros(PARAMS[k].size, np.float32) for k in PARAMS}
    v = {k: np.zeros(PARAMS[k].size, np.float32) for k in PARAMS}
    err = np.zeros((N, d), np.float32)  # worker residuals of the momentum
    srv = np.zeros((N, N * c), np.float32)  # server residuals (worker j uses chunk j)
    outs = []
    for t, g in enumerate(grads_seq):
        g = {k: np.asarray(g[k], np.float32).reshape(N, -1) for k in PARAMS}
        if t < warmup:
            for k in PARAMS:
                gm = g[k].mean(0)
                m[k] = B1 * m[k] + (1 - B1) * gm
                v[k] = B2 * v[k] + (1 - B2) * gm * gm
        else:
            m["b"] = (B1 * m["b"] + (1 - B1) * g["b"]).mean(0)  # dense leaf: plain mean
            m["w"] = np_two_phase(B1 * m["w"] + (1 - B1) * g["w"], err, srv)
        outs.append({k: -LR * m[k] / (np.sqrt(v[k]) + EPS) for k in PARAMS})
    return outs


def test_matches_numpy_over_warmup_and_compressed_steps():
    tx = jaxcomm.onebit_adam(LR, warmup_steps=2, axis_name=H.AXIS, min_size=64)
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(5)]
    ref = np_onebit_adam(grads_seq, warmup=2)
    # pmap: the update is identical on every worker but typed per worker under shard_map
    # (the frozen variance is per-worker state), so shard_map needs out_specs=P("data")
    step = jax.pmap(tx.update, axis_name=H.AXIS)
    state = H.stack(tx.init(PARAMS))
    for t, (g, want) in enumerate(zip(grads_seq, ref)):
        out, state = step(g, state)
        for k in PARAMS:
            for w in (0, N - 1):
                np.testing.assert_allclose(
                    np.asarray(out[k][w]).ravel(), want[k], rtol=2e-4, atol=1e-6, err_msg=f"{k} {t}"
                )
    # the variance froze after warm-up
    np.testing.assert_array_equal(np.asarray(state.count)[0], 5)


def test_after_warmup_moves_under_a_25th_of_dense_adam_bytes():
    params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))}
    dense = optax.chain(jaxcomm.allreduce(axis_name=H.AXIS), optax.adam(1e-3))
    compressed = jaxcomm.onebit_adam(1e-3, warmup_steps=0, axis_name=H.AXIS)
    ratio = jaxcomm.wire_bytes(compressed, params, N) / jaxcomm.wire_bytes(dense, params, N)
    assert ratio <= 1 / 25, ratio
    # and in the compiled program too
    g = H.per_worker_grads(params, seed=0)
    state = H.stack(compressed.init(params))
    compiled = jax.pmap(compressed.update, axis_name=H.AXIS).lower(g, state).compile()
    hlo = jaxcomm.accounting.hlo_collectives(compiled, n_devices=N)
    assert sum(c.nbytes for c in hlo) == jaxcomm.wire_bytes(compressed, params, N)


DIGITS_STEPS, DIGITS_LR = 300, 3e-3


@pytest.fixture(scope="module")
def adam_accuracy(digits_split):
    """Dense Adam's test accuracy on the digits MLP (the bar for both optimizers)."""
    dense = optax.chain(jaxcomm.allreduce(axis_name="data"), optax.adam(DIGITS_LR, eps=1e-8))
    return digits.train(dense, steps=DIGITS_STEPS, model="mlp", split=digits_split).accuracy


def test_reaches_dense_adams_accuracy_on_digits(digits_split, adam_accuracy):
    """Within 1 point of dense Adam (same lr, same steps); warm-up 15% of the steps."""
    steps, lr, ref = DIGITS_STEPS, DIGITS_LR, adam_accuracy
    tx = jaxcomm.onebit_adam(lr, warmup_steps=45, axis_name="data")
    acc = digits.train(tx, steps=steps, model="mlp", split=digits_split).accuracy
    assert acc >= ref - 0.01, (acc, ref)


def test_nan_on_one_worker_keeps_state_on_all():
    tx = jaxcomm.onebit_adam(LR, warmup_steps=1, axis_name=H.AXIS, min_size=64)
    step = jax.pmap(tx.update, axis_name=H.AXIS)
    _, state = step(H.per_worker_grads(PARAMS, seed=0), H.stack(tx.init(PARAMS)))
    for t in range(2):  # a compressed step with a NaN on worker 5, then a clean one
        g = H.per_worker_grads(PARAMS, seed=1 + t)
        if t == 0:
            w = np.asarray(g["w"]).copy()
            w[5, 0, 0] = np.nan
            g = {**g, "w": jnp.asarray(w)}
        out, new = step(g, state)
        if t == 0:
            finite_per_worker = np.isfinite(np.asarray(out["w"])).reshape(N, -1).all(1)
            assert not finite_per_worker.any()  # non-finite on every worker
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)):
                if a.dtype == jnp.float32:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(new.nonfinite), 1)
        else:
            assert np.all(np.isfinite(np.asarray(out["w"])))
        state = new


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_steps"):
        jaxcomm.onebit_adam(1e-3, warmup_steps=-1)
    with pytest.raises(ValueError, match="b2"):
        jaxcomm.onebit_adam(1e-3, b2=1.0)
    with pytest.raises(ValueError, match="eps"):
        jaxcomm.onebit_adam(1e-3, eps=0.0)
    with pytest.raises(ValueError, match="exchange"):
        jaxcomm.onebit_adam(1e-3, exchange="ring")


# ---- 0/1 Adam -------------------------------------------------------------------------
# variance steps 1, 2 (interval 1), 4, 6 (interval 2), 8 (interval 4); 1-bit steps 3, 5,
# 7, 9, 10; frozen from 11: syncs 11, 12 (interval 1), 14, 16 (interval 2), 20 (interval
# 4 = the clipper, reached at 16 and kept), local steps 13, 15, 17, 18, 19
ZO = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
ZO_KINDS = "vvovovovoo" + "ssls" + "lsllls"
WD = 0.01


def zo_lr(count):
    return LR / (1 + 0.1 * count)


def np_zero_one_schedule(steps, var_freeze_step, var_update_scaler, local_step_scaler, clipper):
    """Kind of each step s = 1..steps: v(ariance), o(ne-bit), s(ync), l(ocal); the rules
    of Lu et al. 2022 / DeepSpeed's ZeroOneAdam with its counters."""
    kinds, vi, vc, li, lc = [], 1, 0, 1, 0
    for s in range(1, steps + 1):
        if s <= var_freeze_step:
            kinds.append("v" if s % vi == 0 else "o")
            if s % vi == 0:
                vc += 1
                if vc == var_update_scaler:
                    vc, vi = 0, vi * 2
        else:
            kinds.append("s" if s % li == 0 else "l")
            lc += 1
            if lc == local_step_scaler:
                lc, li = 0, min(clipper, li * 2)
    return "".join(kinds)


def np_zero_one_adam(grads_seq):
    """Every worker's update and state after each step (8 workers, two-phase exchange)."""
    d = PARAMS["w"].size
    c = -(-d // N)
    kinds = np_zero_one_schedule(len(grads_seq), *ZO.values())
    sizes = {k: PARAMS[k].size for k in PARAMS}
    p = {k: np.zeros((N, sizes[k]), np.float32) for k in PARAMS}
    m = {k: np.zeros((N, sizes[k]), np.float32) for k in PARAMS}
    v = {k: np.zeros(sizes[k], np.float32) for k in PARAMS}
    u = {k: np.zeros((N, sizes[k]), np.float32) for k in PARAMS}
    err = np.zeros((N, d), np.float32)  # worker residuals ("w"; "b" is averaged densely)
    srv = np.zeros((N, N * c), np.float32)  # server residuals (worker j uses chunk j)
    lrs, n_comm, trace = 0.0, 0, []

    def mean(k, x):  # the compressed exchange of leaf k (x: (N, size))
        return np_two_phase(x, err, srv) if k == "w" else x.mean(0)

    for t, (g, kind) in enumerate(zip(grads_seq, kinds)):
        g = {k: np.asarray(g[k], np.float32).reshape(N, -1) for k in PARAMS}
        lr = LR / (1 + 0.1 * t)
        D = {k: np.sqrt(v[k]) + EPS for k in PARAMS}
        out = {}
        if kind in "vo":
            for k in PARAMS:
                gm = g[k].mean(0) if kind == "v" else mean(k, g[k])
                m[k] = np.broadcast_to(B1 * m[k] + (1 - B1) * gm, (N, sizes[k])).copy()
                if kind == "v":
                    v[k] = B2 * v[k] + (1 - B2) * gm * gm
                out[k] = -lr * (m[k] / (np.sqrt(v[k]) + EPS) + WD * p[k])
            n_comm += kind == "o"
        else:
            if t == ZO["var_freeze_step"]:  # first frozen step: residuals start from zero
                err[:], srv[:] = 0, 0
            lrs += lr
            for k in PARAMS:
                m[k] = B1 * m[k] + (1 - B1) * g[k]
                delta = -lr * (m[k] / D[k] + WD * p[k])
                if kind == "l":
                    u[k] = u[k] + delta
                    out[k] = delta
                else:
                    ubar = mean(k, (u[k] + delta) * D[k])
                    out[k] = np.broadcast_to(ubar / D[k] - u[k], (N, sizes[k]))
                    m[k] = np.broadcast_to(-ubar / lrs, (N, sizes[k])).copy()
                    u[k] = np.zeros_like(u[k])
            if kind == "s":
                lrs, n_comm = 0.0, n_comm + 1
        p = {k: p[k] + out[k] for k in PARAMS}
        state = dict(m=m, v=v, u=u, err=err, srv=srv, lrs=lrs, n_comm=n_comm)
        trace.append((out, copy.deepcopy(state)))
    return kinds, trace


def test_zero_one_adam_matches_numpy_over_every_phase():
    """Variance steps, 1-bit steps, then local steps and syncs (the interval doubling up to
    the clipper), with a learning-rate schedule and weight decay; updates and state of
    every worker after every step."""
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in range(len(ZO_KINDS))]
    kinds, trace = np_zero_one_adam(grads_seq)
    assert kinds == ZO_KINDS  # the NumPy schedule is the one worked out by hand above
    tx = jaxcomm.zero_one_adam(zo_lr, **ZO, axis_name=H.AXIS, weight_decay=WD, min_size=64)
    # under jax.shard_map (the NaN test uses pmap): params, updates and state per worker
    per_worker = P(H.AXIS)

    def one(g, s, p):
        u, s = tx.update(*jax.tree.map(lambda x: x[0], (g, s, p)))
        return jax.tree.map(lambda x: x[None], (u, s))

    step = jax.jit(jax.shard_map(one, mesh=H.mesh(), in_specs=per_worker, out_specs=per_worker))
    place = lambda t: jax.device_put(t, NamedSharding(H.mesh(), per_worker))  # noqa: E731
    state, params = place(H.stack(tx.init(PARAMS))), place(H.stack(PARAMS))
    d = PARAMS["w"].size
    c = -(-d // N)

    def close(a, b, msg):
        atol = 1e-6 + 2e-5 * np.abs(b).max()
        np.testing.assert_allclose(np.asarray(a).reshape(np.shape(b)), b, 2e-4, atol, err_msg=msg)

    for t, (g, (want, ref)) in enumerate(zip(grads_seq, trace)):
        out, state = step(place(g), state, params)
        params = jax.tree.map(jnp.add, params, out)
        at = f"step {t + 1} ({kinds[t]})"
        for k in PARAMS:
            close(out[k], want[k].reshape(N, -1), f"update {k} {at}")
            close(state.mu[k], ref["m"][k], f"mu {k} {at}")
            close(np.asarray(state.nu[k])[0], ref["v"][k], f"nu {k} {at}")
            close(state.u[k], ref["u"][k], f"u {k} {at}")
        close(state.comm.residual["w"], ref["err"], f"worker residual {at}")
        server, srv = np.asarray(state.comm.server["w"]).reshape(N, -1), ref["srv"][:, :d]
        for j in range(N):  # worker j keeps the server residual of the chunk it averages
            close(server[j, j * c : (j + 1) * c], srv[j, j * c : (j + 1) * c], f"server {at}")
        close(state.lrs, np.full(N, ref["lrs"], np.float32), f"lrs {at}")
        np.testing.assert_array_equal(np.asarray(state.comm.count), ref["n_comm"], err_msg=at)
    np.testing.assert_array_equal(np.asarray(state.count), len(ZO_KINDS))
    np.testing.assert_array_equal(np.asarray(state.nonfinite), 0)
    # after a sync every worker is back on the same params (the last step is a sync)
    for k in PARAMS:
        np.testing.assert_allclose(
            np.asarray(params[k]), np.asarray(params[k])[:1].repeat(N, 0), atol=1e-6
        )


def test_zero_one_adam_moves_under_a_25th_of_dense_adam_bytes():
    """Per communicating step after freezing (a sync), also in the compiled program."""
    params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))}
    dense = jaxcomm.wire_bytes(
        optax.chain(jaxcomm.allreduce(axis_name=H.AXIS), optax.adam(1e-3)), params, N
    )
    frozen = jaxcomm.zero_one_adam(1e-3, var_freeze_step=0, axis_name=H.AXIS)
    full = jaxcomm.zero_one_adam(1e-3, var_freeze_step=10, axis_name=H.AXIS)
    sync = jaxcomm.wire_bytes(frozen, params, N)
    assert sync <= dense / 25, (sync, dense)
    # the whole program: the variance steps' dense all-reduce plus two 1-bit exchanges
    # (gradients before freezing, accumulated updates after)
    pmean = jaxcomm.wire_bytes(jaxcomm.allreduce(axis_name=H.AXIS), params, N)
    assert jaxcomm.wire_bytes(full, params, N) == pmean + 2 * sync
    # and the compiled program (all three exchanges) moves exactly that
    g = H.per_worker_grads(params, seed=0)
    step = jax.pmap(full.update, axis_name=H.AXIS)
    compiled = step.lower(g, H.stack(full.init(params))).compile()
    hlo = jaxcomm.accounting.hlo_collectives(compiled, n_devices=N)
    assert sum(c.nbytes for c in hlo) == pmean + 2 * sync


def test_zero_one_adam_nan_on_one_worker():
    """A NaN on worker 5 on a variance step, a 1-bit step and a sync: every worker keeps
    its state and gets a non-finite update; on a local step only worker 5 does."""
    zo = dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2)
    kinds = np_zero_one_schedule(6, *zo.values())
    assert kinds == "vvosls"  # step 4 (the first frozen one) also clears the residuals
    tx = jaxcomm.zero_one_adam(LR, **zo, axis_name=H.AXIS, min_size=64)
    step = jax.pmap(tx.update, axis_name=H.AXIS)
    state = H.stack(tx.init(PARAMS))
    kept = lambda s: jax.tree.leaves((s.mu, s.nu, s.u, s.comm.residual, s.comm.server))  # noqa: E731
    for t, kind in enumerate(kinds):
        g = H.per_worker_grads(PARAMS, seed=t)
        if t > 0 and t != 3:
            w = np.asarray(g["w"]).copy()
            w[5, 0, 0] = np.nan
            out, new = step({**g, "w": jnp.asarray(w)}, state)
            finite = np.isfinite(np.asarray(out["w"])).reshape(N, -1).all(1)
            bad = [5] if kind == "l" else list(range(N))
            np.testing.assert_array_equal(~finite, np.isin(np.arange(N), bad), err_msg=kind)
            np.testing.assert_array_equal(np.asarray(new.nonfinite), ~finite)
            for a, b in zip(kept(new), kept(state)):
                np.testing.assert_array_equal(np.asarray(a)[bad], np.asarray(b)[bad], err_msg=kind)
            if kind == "l":  # the others stepped; Λ (a sum of the schedule) advances everywhere
                assert not np.allclose(np.asarray(new.mu["w"])[0], np.asarray(state.mu["w"])[0])
                np.testing.assert_allclose(np.asarray(new.lrs), np.asarray(state.lrs) + LR)
            else:
                np.testing.assert_array_equal(np.asarray(new.lrs), np.asarray(state.lrs))
            np.testing.assert_array_equal(np.asarray(new.count), t + 1)
        out, state = step(g, state)  # the clean step, to go on
        assert np.all(np.isfinite(np.asarray(out["w"])))


def test_zero_one_adam_bad_arguments():
    for name, bad in [
        ("var_freeze_step", -1),
        ("var_update_scaler", 0),
        ("local_step_scaler", 0),
        ("local_step_clipper", 0),
    ]:
        with pytest.raises(ValueError, match=name):
            jaxcomm.zero_one_adam(1e-3, **{name: bad})
    with pytest.raises(TypeError, match="local_step_clipper"):
        jaxcomm.zero_one_adam(1e-3, local_step_clipper=2.5)
    with pytest.raises(ValueError, match="b1"):
        jaxcomm.zero_one_adam(1e-3, b1=-0.1)
    with pytest.raises(ValueError, match="eps"):
        jaxcomm.zero_one_adam(1e-3, eps=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        jaxcomm.zero_one_adam(1e-3, weight_decay=-1.0)
    with pytest.raises(ValueError, match="exchange"):
        jaxcomm.zero_one_adam(1e-3, exchange="ring")
    tx = jaxcomm.zero_one_adam(1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="params"):
        tx.update(PARAMS, tx.init(PARAMS))
    with pytest.raises(TypeError, match="ZeroOneAdamState"):
        tx.update(PARAMS, optax.adam(1e-3).init(PARAMS), PARAMS)


def test_zero_one_adam_reaches_dense_adams_accuracy_on_digits(digits_split, adam_accuracy):
    """Within 1 point of dense Adam (same lr, same steps): variance frozen after 15% of the
    steps, the local interval doubling every 10% of them up to 16."""
    zo = dict(var_freeze_step=45, var_update_scaler=16, local_step_scaler=30, local_step_clipper=16)
    tx = jaxcomm.zero_one_adam(DIGITS_LR, **zo, axis_name="data")
    res = digits.train(tx, steps=DIGITS_STEPS, model="mlp", split=digits_split)
    assert res.accuracy >= adam_accuracy - 0.01, (res.accuracy, adam_accuracy)
    # the run followed the schedule: one compressed exchange per 1-bit step and per sync
    kinds = np_zero_one_schedule(DIGITS_STEPS, *zo.values())
    want = kinds.count("o") + kinds.count("s")
    np.testing.assert_array_equal(np.asarray(res.opt_state.comm.count), want)
