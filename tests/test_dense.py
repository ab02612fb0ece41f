"""allreduce and cast against NumPy, on 8 workers."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcomm
from tests import helpers as H

PARAMS = {"w": jnp.zeros((40, 64)), "b": jnp.zeros((10,))}


def test_allreduce_is_the_mean():
    tx = jaxcomm.allreduce(axis_name="data")
    g = H.per_worker_grads(PARAMS, seed=0)
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    for k in PARAMS:
        np.testing.assert_allclose(
            out[k], np.asarray(g[k], np.float64).mean(0), rtol=1e-6, atol=1e-7
        )


def test_allreduce_without_axis_is_identity():
    tx = jaxcomm.allreduce()
    g = {k: v[0] for k, v in H.per_worker_grads(PARAMS).items()}
    out, _ = tx.update(g, tx.init(PARAMS))
    for k in PARAMS:
        np.testing.assert_array_equal(out[k], g[k])


@pytest.mark.parametrize(
    "dtype, np_dtype", [(jnp.bfloat16, ml_dtypes.bfloat16), (jnp.float16, np.float16)]
)
def test_cast_all_gather_rounds_each_worker_then_sums_in_fp32(dtype, np_dtype):
    tx = jaxcomm.cast(
        dtype, axis_name="data", accumulate="all_gather", min_size=100, exchange="gather"
    )  # each worker's rounding summed; "auto" re-rounds the chunk means (two-phase) on 8
    g = H.per_worker_grads(PARAMS, seed=1)
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    w = np.asarray(g["w"])
    expected = w.astype(np_dtype).astype(np.float32).sum(0) / 8
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6, atol=1e-7)
    assert out["w"].dtype == jnp.float32
    # "b" is below min_size: exact fp32 mean
    np.testing.assert_allclose(out["b"], np.asarray(g["b"]).mean(0), rtol=1e-6)


@pytest.mark.parametrize(
    "dtype, np_dtype", [(jnp.bfloat16, ml_dtypes.bfloat16), (jnp.float16, np.float16)]
)
def test_cast_psum_matches_low_precision_sum(dtype, np_dtype):
    tx = jaxcomm.cast(dtype, axis_name="data", min_size=100, accumulate="psum")
    g = H.per_worker_grads(PARAMS, seed=2)
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))
    q = np.asarray(g["w"]).astype(np_dtype).astype(np.float64)
    exact = q.sum(0) / 8
    got = np.asarray(out["w"], np.float64)
    if jax.default_backend() == "cpu" and dtype == jnp.bfloat16:
        # XLA:CPU promotes the bf16 all-reduce: a float32 sum, rounded to bf16 once (a
        # bound of one rounding per addition would hold for any such result)
        once = q.astype(np.float32).sum(0).astype(np_dtype).astype(np.float64) / 8
        np.testing.assert_array_equal(got, once)
    else:
        # the sum is rounded to the 16-bit dtype at most once per addition
        eps = float(ml_dtypes.finfo(np_dtype).eps)
        bound = 8 * eps * np.abs(q).sum(0) / 8 + 1e-7
        assert np.all(np.abs(got - exact) <= bound)
    # and differs from the fp32 mean by the cast error
    assert np.abs(np.asarray(out["w"]) - np.asarray(g["w"]).mean(0)).max() > 0
    # the wire report says what the program moves: 4 bytes per entry on XLA:CPU (bf16
    # promoted by XLA, fp16 widened by us), 2 elsewhere; "b" goes dense in fp32
    per_entry = 4 if jax.default_backend() == "cpu" else 2
    assert jaxcomm.wire_bytes(tx, PARAMS, 8) == per_entry * 40 * 64 + 4 * 10
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS)))
    assert jaxcomm.accounting.collective_bytes(compiled) == jaxcomm.wire_bytes(tx, PARAMS, 8)


def test_cast_keeps_bf16_params_in_bf16():
    params = {"w": jnp.zeros((64, 32), jnp.bfloat16)}
    tx = jaxcomm.cast(jnp.float16, axis_name="data", min_size=0)
    g = H.per_worker_grads(params, seed=3)
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(params)))
    assert out["w"].dtype == jnp.bfloat16


def test_cast_error_feedback_keeps_the_rounding_error():
    params = {"w": jnp.zeros((2048,))}
    tx = jaxcomm.cast(jnp.bfloat16, error_feedback=True)
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=2048), jnp.float32)}
    out, state = tx.update(g, tx.init(params))
    expected = np.asarray(g["w"]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(out["w"], expected)
    np.testing.assert_array_equal(state.residual["w"], np.asarray(g["w"]) - expected)


@pytest.mark.parametrize("n", [4, 8])
def test_cast_fp16_psum_does_not_overflow_at_the_edge_of_the_range(n):
    # |g| in [2e4, 6e4] with one sign: the fp16 sum of n of them is far above 65504
    params = {"w": jnp.zeros((4096,))}
    rng = np.random.default_rng(5)
    g = {"w": jnp.asarray(rng.uniform(2e4, 6e4, size=(n, 4096)), jnp.float32)}
    tx = jaxcomm.cast(jnp.float16, axis_name="data", min_size=0, accumulate="psum")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
    out, _ = H.shard_map_update(tx, g, H.stack(tx.init(params), n), m=mesh)
    exact = np.asarray(g["w"], np.float64).mean(0)
    got = np.asarray(out["w"], np.float64)
    assert np.all(np.isfinite(got))
    # each g/n rounds once to fp16, each of the n-1 additions once: relative error <= n * eps
    np.testing.assert_allclose(got, exact, rtol=n * float(np.finfo(np.float16).eps))
    # 2 bytes per entry on the wire; on XLA:CPU widened to 4 (F16 sums there are slow)
    assert jaxcomm.wire_bytes(tx, params, n) == (4 if jax.default_backend() == "cpu" else 2) * 4096


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [2, 8])
def test_cast_default_moves_two_bytes_per_entry_on_this_backend(dtype, n):
    """The default accumulate="auto": the 16-bit words on CPU, the psum elsewhere."""
    params = {"w": jnp.zeros((4096,))}
    rng = np.random.default_rng(6)
    g = {"w": jnp.asarray(rng.normal(size=(n, 4096)), jnp.float32)}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
    auto = jaxcomm.cast(dtype, axis_name="data", min_size=0)
    cpu = jax.default_backend() == "cpu"
    same = jaxcomm.cast(
        dtype, axis_name="data", min_size=0, accumulate="all_gather" if cpu else "psum"
    )
    out, _ = H.shard_map_update(auto, g, H.stack(auto.init(params), n), m=mesh)
    ref, _ = H.shard_map_update(same, g, H.stack(same.init(params), n), m=mesh)
    np.testing.assert_array_equal(out["w"], ref["w"])
    wire = jaxcomm.wire_bytes(auto, params, n)
    assert wire == jaxcomm.wire_bytes(same, params, n)
    compiled = H.shard_map_compiled(auto, g, H.stack(auto.init(params), n), m=mesh)
    assert jaxcomm.accounting.collective_bytes(compiled) == wire
    if cpu:  # closed form: uint16 all-gather on 2; two-phase on 8 (+1 byte NaN flag)
        c = 4096 // n
        assert wire == (2 * 4096 if n == 2 else 2 * n * c + 2 * c + 1)
        # the psum moves 4 bytes per entry on this backend
        psum = jaxcomm.cast(dtype, axis_name="data", min_size=0, accumulate="psum")
        assert jaxcomm.wire_bytes(psum, params, n) == 4 * 4096


def test_cast_default_does_not_start_jax():
    """Building the default cast must not pick a backend: jax.distributed.initialize
    has to run first in a multi-process job."""
    import subprocess
    import sys

    code = (
        "import jaxcomm, jax.numpy as jnp\n"
        "from jax._src import xla_bridge\n"
        "tx = jaxcomm.cast(jnp.float16, axis_name='data')\n"
        "assert not xla_bridge.backends_are_initialized(), 'cast() started JAX'\n"
        "import jax; tx.init({'w': jnp.zeros(3)})\n"
        "assert xla_bridge.backends_are_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
