"""experiments/bench_compressors.py: the timed repetitions carry the state along."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import bench_compressors as B


def test_benchmark_repetitions_evolve_the_state():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (B.AXIS,))
    d = 2048
    tx = jaxcomm.topk(0.01, axis_name=B.AXIS)
    params = {"g": jax.ShapeDtypeStruct((d,), jnp.float32)}
    g = np.asarray(jax.random.normal(jax.random.key(0), (n, d), jnp.float32))
    grads = jax.device_put({"g": g}, NamedSharding(mesh, P(B.AXIS)))
    step, state = B._sharded_update(tx, params, mesh)
    fn = B._Evolving(step, grads, state)
    for _ in range(3):
        fn()
    assert np.all(np.asarray(fn.state.count) == 3)
    # error feedback, top-k of 1%: after 3 steps of the same gradient the residual
    # is 3 g minus the 3 sent rounds, the NumPy reference of three steps
    res = np.zeros((n, d), np.float32)
    for _ in range(3):
        p = g + res
        k = int(np.ceil(0.01 * d))
        idx = np.argsort(-np.abs(p), axis=1, kind="stable")[:, :k]
        res = p.copy()
        np.put_along_axis(res, idx, 0.0, axis=1)
    np.testing.assert_allclose(np.asarray(fn.state.residual["g"]), res, rtol=1e-6, atol=1e-6)
