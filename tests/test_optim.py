"""1-bit Adam: NumPy reference over warm-up and compressed steps, bytes, convergence on digits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
            p = B1 * m["w"] + (1 - B1) * g["w"] + err  # (N, d): momentum + worker error
            pad = np.pad(p, ((0, 0), (0, N * c - d))).reshape(N, N, c)
            sent = np.stack([[np_sign(pad[w, j]) for j in range(N)] for w in range(N)])
            err = p - sent.reshape(N, N * c)[:, :d]
            chunks = []
            for j in range(N):
                s = sent[:, j].mean(0) + srv[j, j * c : (j + 1) * c]
                q = np_sign(s)
                srv[j, j * c : (j + 1) * c] = s - q
                chunks.append(q)
            srv[:, d:] = 0  # the zero padding of the last chunk is not kept in the state
            m["w"] = np.concatenate(chunks)[:d]
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


def test_reaches_dense_adams_accuracy_on_digits(digits_split):
    """Within 1 point of dense Adam (same lr, same steps); warm-up 15% of the steps."""
    steps, lr = 300, 3e-3
    dense = optax.chain(jaxcomm.allreduce(axis_name="data"), optax.adam(lr, eps=1e-8))
    ref = digits.train(dense, steps=steps, model="mlp", split=digits_split).accuracy
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
