"""PowerSGD against a NumPy reference and closed forms (exact low-rank cases)."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from experiments import digits
from jaxcomm.compressors.powersgd import PowerSGDState, leaf_plan, orthogonalize
from tests import helpers as H

KEY = jax.random.key(0)


def run4(tx, grads, state):
    """``tx.update`` under shard_map on a 4-device mesh (leading worker axis of 4)."""
    m = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    return H.shard_map_update(tx, grads, state, m=m)


def np_gram_schmidt(p):
    """Orthonormal basis of p's columns: QR with a positive diagonal of R (= Gram-Schmidt)."""
    q, r = np.linalg.qr(p)
    return q * np.sign(np.diag(r))


def np_powersgd_step(ms, q):
    """Per-worker matrices ms (n, a, b), shared q (b, r) -> (output, residuals, mean Q)."""
    p_hat = np_gram_schmidt(np.einsum("wab,br->ar", ms, q))
    q_w = np.einsum("wab,ar->wbr", ms, p_hat)
    q_mean = q_w.mean(0)
    residuals = ms - np.einsum("ar,wbr->wab", p_hat, q_w)
    return p_hat @ q_mean.T, residuals, q_mean


@pytest.mark.parametrize("view", ["first", "last"])
def test_two_steps_match_numpy_on_4_devices(view):
    params = {"w": jnp.zeros((12, 10)), "c": jnp.zeros((6, 2, 5)), "b": jnp.zeros((7,))}
    tx = jaxcomm.powersgd(2, key=KEY, axis_name="data", min_compression_rate=1.0, matrix_view=view)
    state = H.stack(tx.init(params), 4)
    # w (12x10) and c (6x10 "first", torch's view; 12x5 "last") are compressed, b is dense
    assert len(state.q) == 2
    q = {k: np.asarray(x[0], np.float64) for k, x in zip(("c", "w"), state.q)}  # flatten order
    res = {k: np.zeros((4,) + params[k].shape) for k in ("c", "w")}
    for step in range(2):
        g = H.per_worker_grads(params, seed=10 + step, n=4)
        out, state = run4(tx, g, state)
        for k in ("c", "w"):
            gk = np.asarray(g[k], np.float64)
            shape = params[k].shape
            a, b = (shape[0], -1) if view == "first" else (-1, shape[-1])
            ms = (gk + res[k]).reshape(4, a, b)
            ref, r, q[k] = np_powersgd_step(ms, q[k])
            res[k] = r.reshape(res[k].shape)
            np.testing.assert_allclose(out[k], ref.reshape(params[k].shape), atol=2e-5)
            np.testing.assert_allclose(state.residual[k], res[k], atol=2e-5)
        np.testing.assert_allclose(out["b"], np.asarray(g["b"]).mean(0), rtol=1e-6)
        # warm start: the state holds the worker mean of Q_w, the same on every worker
        for got, k in zip(state.q, ("c", "w")):
            np.testing.assert_allclose(got, np.broadcast_to(q[k], got.shape), atol=2e-5)
    assert not np.any(np.asarray(state.residual["b"]))


@pytest.mark.parametrize("shape, rank", [((6, 40), 6), ((6, 40), 9), ((30, 2), 2), ((2, 50), 3)])
def test_rank_at_least_min_dim_reconstructs_exactly(shape, rank):
    params = {"w": jnp.zeros(shape)}
    tx = jaxcomm.powersgd(rank, key=KEY, axis_name="data", min_compression_rate=0.05)
    state = H.stack(tx.init(params))
    assert state.q[0].shape[-1] == min(shape)  # rank is capped at min(a, b)
    g = H.per_worker_grads(params, seed=1)
    out, state = H.shard_map_update(tx, g, state)
    np.testing.assert_allclose(out["w"], np.asarray(g["w"]).mean(0), atol=1e-5)
    res = np.asarray(state.residual["w"])
    np.testing.assert_allclose(res.mean(0), 0, atol=1e-5)
    if rank >= shape[0]:  # P̂ spans R^a: every worker's own error is zero too
        np.testing.assert_allclose(res, 0, atol=1e-5)
    else:  # P̂ spans the mean's columns only; the workers' errors cancel
        assert np.abs(res).max() > 0.1


def test_rank1_matrix_at_rank1_reconstructs_exactly():
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(40, 1)), rng.normal(size=(H.N, 1, 30))
    g = {"w": jnp.asarray(u[None] * v, jnp.float32)}  # worker w: u v_wᵀ; mean is rank 1
    tx = jaxcomm.powersgd(1, key=KEY, axis_name="data")
    out, state = H.shard_map_update(tx, g, H.stack(tx.init({"w": g["w"][0]})))
    np.testing.assert_allclose(out["w"], u * v.mean(0), atol=1e-5)
    np.testing.assert_allclose(state.residual["w"], 0, atol=1e-5)


def test_warm_start_power_iteration_converges_to_best_rank_r():
    """Same gradient every step, no EF: warm-started Q converges to the top-r subspace."""
    rng = np.random.default_rng(2)
    s = np.diag([10.0, 6.0, 3.0, 1.0])
    m = np.linalg.qr(rng.normal(size=(40, 4)))[0] @ s @ np.linalg.qr(rng.normal(size=(30, 4)))[0].T
    u_, s_, vt_ = np.linalg.svd(m)
    best = u_[:, :2] * s_[:2] @ vt_[:2]
    g = {"w": jnp.asarray(m, jnp.float32)}
    errors = {}
    for warm in (True, False):
        tx = jaxcomm.powersgd(2, key=KEY, error_feedback=False, warm_start=warm)
        state = tx.init(g)
        update = jax.jit(tx.update)
        for _ in range(30):
            out, state = update(g, state)
        errors[warm] = np.linalg.norm(np.asarray(out["w"]) - best) / np.linalg.norm(best)
        if warm:
            np.testing.assert_allclose(
                state.q[0], m.T @ np_gram_schmidt(m @ state.q[0]), rtol=1e-3, atol=1e-4
            )
        else:
            assert state.q is None and state.key is not None
    assert errors[True] < 1e-4, errors
    assert errors[False] > 1e-2, errors  # a single power step per fresh Q does not get there


def test_error_feedback_telescopes():
    """Σ_t outputs + mean residual_T == Σ_t mean_w g_t."""
    params = {"w": jnp.zeros((30, 50)), "b": jnp.zeros((50,))}
    tx = jaxcomm.powersgd(1, key=KEY, axis_name="data")
    state = H.stack(tx.init(params))
    tot_out, tot_in = np.zeros((30, 50)), np.zeros((30, 50))
    for s in range(8):
        g = H.per_worker_grads(params, seed=100 + s)
        out, state = H.shard_map_update(tx, g, state)
        tot_out += np.asarray(out["w"], np.float64)
        tot_in += np.asarray(g["w"], np.float64).mean(0)
    mean_res = np.asarray(state.residual["w"], np.float64).mean(0)
    np.testing.assert_allclose(tot_out + mean_res, tot_in, atol=1e-4)
    assert np.abs(mean_res).max() > 0.1  # rank 1 of 30x50 holds most of it back


@pytest.mark.parametrize("rank", [2, 4], ids=["gram_schmidt", "qr"])
def test_zero_and_rank_deficient_gradients_give_no_nan(rank):
    params = {"w": jnp.zeros((20, 16))}
    tx = jaxcomm.powersgd(rank, key=KEY, axis_name="data")
    state = H.stack(tx.init(params))
    q0 = np.asarray(state.q[0])
    out, state = H.shard_map_update(tx, {"w": jnp.zeros((H.N, 20, 16))}, state)
    assert np.all(np.asarray(out["w"]) == 0)
    # Q̄ = Mᵀ P̂ is 0 here; warm start keeps the old Q rather than a Q that stays 0 for ever
    np.testing.assert_array_equal(state.q[0], q0)
    assert not np.any(np.asarray(state.residual["w"]))
    # rank 1 < rank: P is rank-deficient; the rank-1 mean is still reconstructed exactly
    rng = np.random.default_rng(3)
    g = jnp.asarray(
        np.outer(rng.normal(size=20), rng.normal(size=16))[None] * rng.normal(size=(H.N, 1, 1)),
        jnp.float32,
    )
    out, state = H.shard_map_update(tx, {"w": g}, state)
    np.testing.assert_allclose(out["w"], np.asarray(g).mean(0), atol=1e-5)
    assert np.all(np.isfinite(state.q[0]))


def test_orthogonalize_guards_zero_and_dependent_columns():
    p = jnp.asarray(np.stack([np.arange(5.0), 2 * np.arange(5.0)], 1), jnp.float32)[None]
    q = np.asarray(orthogonalize(p))
    np.testing.assert_allclose(
        q[0, :, 0], np.arange(5.0) / np.linalg.norm(np.arange(5.0)), rtol=1e-6
    )
    assert np.all(q[0, :, 1] == 0)  # dependent column -> 0, not noise or NaN
    assert np.all(np.asarray(orthogonalize(jnp.zeros((2, 7, 2)))) == 0)
    x = np.asarray(
        orthogonalize(jnp.asarray(np.random.default_rng(0).normal(size=(3, 9, 2)), jnp.float32))
    )
    np.testing.assert_allclose(
        np.einsum("kar,kas->krs", x, x), np.broadcast_to(np.eye(2), (3, 2, 2)), atol=1e-6
    )


def test_nonfinite_gradient_skips_state_everywhere_and_reaches_output():
    params = {"w": jnp.zeros((20, 16)), "b": jnp.zeros((16,))}
    tx = jaxcomm.powersgd(2, key=KEY, axis_name="data")
    state = H.stack(tx.init(params))
    _, state = H.shard_map_update(tx, H.per_worker_grads(params, seed=0), state)
    g = H.per_worker_grads(params, seed=1)
    g["w"] = g["w"].at[3, 2, 5].set(jnp.nan)
    out, new = H.shard_map_update(tx, g, state)
    assert np.all(np.isnan(np.asarray(out["w"])))
    assert np.all(np.isfinite(np.asarray(out["b"])))
    np.testing.assert_array_equal(new.q[0], state.q[0])
    np.testing.assert_array_equal(new.residual["w"], state.residual["w"])
    np.testing.assert_array_equal(new.nonfinite, np.ones(H.N))
    out, _ = H.shard_map_update(tx, H.per_worker_grads(params, seed=2), new)
    assert np.all(np.isfinite(np.asarray(out["w"])))


def test_batched_equals_unbatched():
    params = {f"l{i}": jnp.zeros((16, 12)) for i in range(3)}
    params.update(x=jnp.zeros((16, 20)), y=jnp.zeros((10, 20)), z=jnp.zeros((10, 20)))
    g = H.per_worker_grads(params, seed=4)
    results = []
    for batched in (False, True):
        tx = jaxcomm.powersgd(3, key=KEY, axis_name="data", batch_same_shape=batched)
        state = H.stack(tx.init(params))
        for _ in range(2):
            out, state = H.shard_map_update(tx, g, state)
        results.append((out, state))
    (o1, s1), (o2, s2) = results
    for a, b in zip(jax.tree.leaves((o1, s1)), jax.tree.leaves((o2, s2))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_wire_bytes_and_hlo_match_the_formula():
    params = {
        "w": jnp.zeros((64, 32)),
        "conv": jnp.zeros((3, 3, 8, 16)),  # Flax HWIO: viewed (72, 16)
        "b": jnp.zeros((32,)),
        "tiny": jnp.zeros((4, 4)),
    }
    r = 2
    compressed = [(64, 32), (72, 16)]  # tiny: (4+4)·2·2 >= 16 goes dense
    expected = sum((a + b) * r * 4 for a, b in compressed) + (32 + 16) * 4
    tx = jaxcomm.powersgd(r, key=KEY, axis_name="data")
    assert jaxcomm.wire_bytes(tx, params, H.N) == expected
    report = jaxcomm.accounting.wire_report(tx, params, H.N)
    # one bucket: one all-reduce of all P's with the dense leaves, one of all Q's
    assert [c.nbytes for c in report] == [(64 + 72) * r * 4 + 32 * 4 + 16 * 4, (32 + 16) * r * 4]
    per_leaf = jaxcomm.powersgd(r, key=KEY, axis_name="data", bucket_bytes=None)
    assert sorted(
        c.nbytes for c in jaxcomm.accounting.wire_report(per_leaf, params, H.N)
    ) == sorted([64 * r * 4, 16 * r * 4, 32 * r * 4, 72 * r * 4, 32 * 4, 16 * 4])
    g = H.per_worker_grads(params, seed=0)
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(params)))
    assert jaxcomm.accounting.collective_bytes(compiled) == expected
    # P and Q are separate single-operand all-reduces in the program (Q depends on P)
    hlo = jaxcomm.accounting.hlo_collectives(compiled)
    assert [(c.nbytes, c.operands) for c in hlo] == [(c.nbytes, 1) for c in report]
    dense_fp32 = sum(x.size for x in params.values()) * 4
    assert expected < dense_fp32 / 4


def test_start_iter_averages_densely_first():
    params = {"w": jnp.zeros((20, 16))}
    tx = jaxcomm.powersgd(1, key=KEY, axis_name="data", start_iter=2)
    state = H.stack(tx.init(params))
    q0 = np.asarray(state.q[0])
    for step in range(3):
        g = H.per_worker_grads(params, seed=step)
        out, state = H.shard_map_update(tx, g, state)
        exact = np.allclose(out["w"], np.asarray(g["w"]).mean(0), atol=1e-6)
        assert exact == (step < 2)
        assert np.array_equal(state.q[0], q0) == (step < 2)
        assert (not np.any(np.asarray(state.residual["w"]))) == (step < 2)
    # the plain-mean branch and the PowerSGD branch are both in the program, plus the
    # 4-byte agreement on the step count
    assert jaxcomm.wire_bytes(tx, params, H.N) == 20 * 16 * 4 + (20 + 16) * 4 + 4


def test_matrix_view_last_suits_flax_conv_kernels():
    params = {"conv": jnp.zeros((3, 3, 16, 32))}  # Flax (kh, kw, in, out)
    first = jaxcomm.powersgd(2, key=KEY, axis_name="data", matrix_view="first")
    last = jaxcomm.powersgd(2, key=KEY, axis_name="data")  # the default
    # "first": a 3 x 4608 matrix, (3 + 4608)·2·2 > 13824: dense; "last": 144 x 32
    assert first.init(params).q == ()
    assert last.init(params).q[0].shape == (32, 2)
    assert jaxcomm.wire_bytes(last, params, H.N) == (144 + 32) * 2 * 4
    g = H.per_worker_grads(params, seed=0)
    out, state = H.shard_map_update(last, g, H.stack(last.init(params)))
    # one PowerSGD step on the (144, 32) view, in NumPy: P = Σ_w M_w Q0, P̂ = orth(P),
    # Q̄ = mean_w M_wᵀ P̂, update P̂ Q̄ᵀ (a wrong view or transpose gives another matrix)
    m = np.asarray(g["conv"], np.float64).reshape(H.N, 144, 32)
    q0 = np.asarray(last.init(params).q[0], np.float64)
    p_hat = np_gram_schmidt((m @ q0).sum(0))
    q_bar = (np.swapaxes(m, 1, 2) @ p_hat).mean(0)
    np.testing.assert_allclose(
        np.asarray(out["conv"]).reshape(144, 32), p_hat @ q_bar.T, rtol=1e-4, atol=1e-5
    )


def test_local_without_axis_and_dtypes():
    params = {"w": jnp.zeros((24, 20), jnp.bfloat16), "b": jnp.zeros((20,), jnp.bfloat16)}
    tx = jaxcomm.powersgd(2, key=KEY)
    state = tx.init(params)
    # bf16 params: a float32 residual (state_dtype=None), Q float32; updates stay bf16
    assert state.residual["w"].dtype == jnp.float32 and state.q[0].dtype == jnp.float32
    g = jax.tree.map(lambda x: x[0], H.per_worker_grads(params, seed=0))
    out, state = jax.jit(tx.update)(g, state)
    assert out["w"].dtype == jnp.bfloat16 and state.residual["w"].dtype == jnp.float32
    assert jaxcomm.wire_bytes(tx, params, H.N) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        jaxcomm.powersgd(0, key=KEY)
    with pytest.raises(TypeError, match="rank"):
        jaxcomm.powersgd(2.0, key=KEY)
    with pytest.raises(ValueError, match="start_iter"):
        jaxcomm.powersgd(key=KEY, start_iter=-1)
    with pytest.raises(ValueError, match="min_compression_rate"):
        jaxcomm.powersgd(key=KEY, min_compression_rate=0)
    with pytest.raises(ValueError, match="orthogonalization_epsilon"):
        jaxcomm.powersgd(key=KEY, orthogonalization_epsilon=-1.0)
    with pytest.raises(ValueError, match="matrix_view"):
        jaxcomm.powersgd(key=KEY, matrix_view="rows")
    with pytest.raises(TypeError, match="key"):
        jaxcomm.powersgd(2, key=None)
    with pytest.raises(TypeError, match="key"):
        jaxcomm.powersgd(2)  # key is required
    tx = jaxcomm.powersgd(key=KEY)
    with pytest.raises(TypeError, match=r"\['step'\]"):
        tx.init({"w": jnp.zeros((4, 4)), "step": jnp.zeros((), jnp.int32)})
    params = {"w": jnp.zeros((8, 8))}
    with pytest.raises(TypeError, match="state"):
        tx.update(params, optax.sgd(0.1).init(params))
    with pytest.raises(ValueError, match="state"):
        tx.update(
            {"w": jnp.zeros((8, 8))}, jaxcomm.powersgd(key=KEY, error_feedback=False).init(params)
        )


def test_convergence_on_digits_within_one_point_of_sgd():
    split = digits.load(8)
    lr, steps = 0.1, 300

    def train(first):
        tx = optax.chain(first, optax.sgd(lr, momentum=0.9))
        return digits.train(tx, steps=steps, model="mlp", split=split)

    dense = train(jaxcomm.allreduce(axis_name="data"))
    low_rank = train(jaxcomm.powersgd(2, key=KEY, axis_name="data"))
    print(f"dense {dense.accuracy:.4f}  powersgd-2 {low_rank.accuracy:.4f}")
    assert dense.accuracy > 0.95
    assert low_rank.accuracy >= dense.accuracy - 0.01, (low_rank.accuracy, dense.accuracy)
    assert isinstance(
        jax.tree.leaves(low_rank.opt_state, is_leaf=lambda x: isinstance(x, PowerSGDState))[0],
        PowerSGDState,
    )
    params = digits.init_params("mlp", KEY)
    ratio = jaxcomm.wire_bytes(jaxcomm.powersgd(2, key=KEY, axis_name="data"), params, 8) / (
        4 * sum(math.prod(x.shape) for x in params.values())
    )
    assert ratio < 0.15, ratio


def _resnet18_params():
    from experiments import models

    model = models.ResNet(num_classes=10, stages=(64, 128, 256, 512), blocks=2)
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]


def test_flax_resnet18_every_kernel_compressed_and_bytes_match_torchs_rule():
    params = _resnet18_params()
    plan = leaf_plan(params, 2)
    kernels = [d for d in plan if len(d["shape"]) >= 2]
    assert len(kernels) >= 21 and all(d["compressed"] for d in kernels), [
        (d["path"], d["reason"]) for d in kernels if not d["compressed"]
    ]
    assert all(d["reason"] == "1-D or empty" for d in plan if not d["compressed"])
    # torch's hook on the same network (OIHW weights viewed (out, in·kh·kw), rank 2, rate 2):
    # each weight with (n + m)·r·2 < n·m sends (n + m)·r floats, everything else dense
    torch_floats = 0
    for leaf in jax.tree.leaves(params):
        shape = leaf.shape
        if len(shape) < 2:
            torch_floats += math.prod(shape)
            continue
        n, m = shape[-1], math.prod(shape[:-1])  # out, in·kh·kw of the OIHW twin
        r = min(2, n, m)
        torch_floats += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    ours = jaxcomm.wire_bytes(jaxcomm.powersgd(2, key=KEY, axis_name="data"), params, H.N)
    # ours also agrees the step count (4 bytes): within 2% of torch's figure
    assert abs(ours - 4 * torch_floats) <= 0.02 * 4 * torch_floats, (ours, 4 * torch_floats)
    # torch's view on the Flax layout leaves most of the network dense (the old default)
    first = jaxcomm.powersgd(2, key=KEY, axis_name="data", matrix_view="first")
    assert jaxcomm.wire_bytes(first, params, H.N) > 50 * ours


def test_bf16_params_keep_a_float32_residual_so_small_gradients_are_not_lost():
    """Small full-rank noise beside a large rank-1 part, 300 steps, bf16 params.

    Error feedback telescopes: Σ sent + residual = Σ g. With the default
    float32 residual it holds to the outputs' bf16 rounding; a bf16 residual
    (state_dtype=bf16, what bf16 params used to get) rounds ``M = g + e``
    and gets the small entries' mass wrong by ~300x more.
    """
    steps = 300
    g = 1e-3 * np.sign(np.random.default_rng(0).normal(size=(64, 64)))
    g[::9, :] = 1.0
    grads = {"w": jnp.asarray(g, jnp.bfloat16)}
    total = steps * np.asarray(grads["w"], np.float64)
    small = np.abs(g) < 0.5

    def error(state_dtype):
        tx = jaxcomm.powersgd(1, key=KEY, min_compression_rate=1, state_dtype=state_dtype)
        state = tx.init({"w": jnp.zeros((64, 64), jnp.bfloat16)})
        assert state.residual["w"].dtype == (state_dtype or jnp.float32)
        step, sent = jax.jit(tx.update), np.zeros((64, 64))
        for _ in range(steps):
            out, state = step(grads, state)
            assert out["w"].dtype == jnp.bfloat16
            sent += np.asarray(out["w"], np.float64)
        left = np.asarray(state.residual["w"], np.float64)
        return np.abs(total - sent - left)[small].sum() / np.abs(total[small]).sum()

    assert error(None) < 0.002  # measured 1.2e-4: the bf16 rounding of the outputs
    assert error(jnp.bfloat16) > 0.01  # measured 3.9e-2


@pytest.mark.parametrize("batch", [False, True])
def test_every_matmul_asks_for_full_float32(batch):
    # JAX's default precision is TF32 on recent NVIDIA GPUs: there PowerSGD's update differed
    # from the CPU's by 4e-4 (tests/test_accelerator.py). On CPU the precision changes no
    # number, so the request itself is what this checks.
    tx = jaxcomm.powersgd(2, key=jax.random.key(0), batch_same_shape=batch)
    params = {"a": jnp.ones((16, 12)), "b": jnp.ones((16, 12)), "c": jnp.ones((3, 3, 4, 8))}
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params))

    def dots(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from dots(sub)

    found = list(dots(jaxpr.jaxpr))
    assert len(found) >= 4
    highest = jax.lax.Precision.HIGHEST
    assert all(e.params["precision"] == (highest, highest) for e in found), [
        e.params["precision"] for e in found
    ]


def test_powersgd_refuses_an_option_it_does_not_take_and_keeps_its_defaults():
    from jaxcomm.compressors import powersgd as module
    from jaxcomm.options import take

    with pytest.raises(TypeError, match=r"jaxcomm\.powersgd: unexpected argument\(s\) 'min_size'"):
        jaxcomm.powersgd(2, key=KEY, min_size=16)
    with pytest.raises(TypeError, match=r"jaxcomm\.powersgd: .*'scope'"):
        jaxcomm.powersgd(2, key=KEY, scope="global")
    resolved = take("powersgd", {}, module.OPTIONS)
    assert resolved == {
        "key": None,  # required: key_bits refuses None
        "axis_name": None,
        "error_feedback": True,
        "bucket_bytes": "auto",
        "state_dtype": None,
    }
