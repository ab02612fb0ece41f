"""jaxcomm.divergence: which values of a traced step may differ between workers."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import divergence
from tests.helpers import AXIS, N, mesh


def walk(step, n_out):
    """Trace ``step(p, x)`` (p replicated, x the batch) and walk it: (varying outputs, findings)."""
    m = mesh()
    p = jax.device_put(jnp.ones((3,)), NamedSharding(m, P()))
    x = jax.device_put(jnp.ones((N, 3)), NamedSharding(m, P(AXIS)))
    f = jax.shard_map(step, mesh=m, in_specs=(P(), P(AXIS)), out_specs=(P(),) * n_out,
                      check_vma=False)  # fmt: skip
    return divergence.check(jax.jit(f).trace(p, x).jaxpr, [False, True], AXIS)


def test_agreeing_collectives_end_the_variation_and_the_others_do_not():
    def step(p, x):
        g = x[0] * p
        return (
            p * 2,  # replicated in, replicated out
            g,  # the batch
            jax.lax.psum(g, AXIS),
            jax.lax.pmax(g, AXIS),
            jax.lax.all_gather(g, AXIS),
            jax.lax.ppermute(g, AXIS, [(i, (i + 1) % N) for i in range(N)]),
            jax.lax.psum_scatter(jnp.tile(g, N), AXIS, tiled=True),
            p * jax.lax.axis_index(AXIS),  # the worker index differs
            jax.lax.psum(g, AXIS) + g,  # exchanged, then the batch added back
        )

    varies, findings = walk(step, 9)
    assert varies == [False, True, False, False, False, True, True, True, True]
    assert findings == []


def test_a_collective_under_a_batch_dependent_branch_is_found():
    def step(p, x):
        exchanged = lambda v: jax.lax.psum(v, AXIS)  # noqa: E731
        return (
            jax.lax.cond(x.sum() > 0, exchanged, lambda v: v, p),  # per-worker predicate
            jax.lax.cond(p.sum() > 0, exchanged, lambda v: v, p),  # replicated predicate
            jax.lax.cond(jax.lax.psum(x.sum(), AXIS) > 0, exchanged, lambda v: v, p),
        )

    varies, findings = walk(step, 3)
    assert findings == [divergence.Finding("cond", "psum")]
    assert varies == [True, False, False]


def test_a_loop_whose_trip_count_differs_between_workers_is_found():
    def step(p, x):
        def body(c):
            i, v = c
            return i + 1, jax.lax.psum(v, AXIS)

        trips = x.sum().astype(jnp.int32)
        _, v = jax.lax.while_loop(lambda c: c[0] < trips, body, (0, p))
        _, w = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, p))  # the same everywhere
        return v, w

    varies, findings = walk(step, 2)
    assert findings == [divergence.Finding("while", "psum")]
    assert varies == [True, False]


def test_a_scan_carry_takes_the_variation_of_its_inputs():
    def step(p, x):
        def body(c, xs):
            return c + xs * x[0], jax.lax.psum(c, AXIS)

        carry, ys = jax.lax.scan(body, p, jnp.ones((4, 3)))
        replicated, _ = jax.lax.scan(lambda c, xs: (c * xs, None), p, jnp.ones((4, 3)))
        return carry, ys, replicated

    varies, findings = walk(step, 3)
    assert varies == [True, False, False]
    assert findings == []


def test_constants_hoisted_by_the_trace_are_replicated():
    table = np.arange(32, dtype=np.uint32)  # captured: becomes a leading shard_map input

    def step(p, x):
        return p + jnp.asarray(table)[:3].astype(jnp.float32), x[0] + p

    varies, _ = walk(step, 2)
    assert varies == [False, True]
