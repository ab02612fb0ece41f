"""branches.typed_cond / typed_switch: lax.cond / lax.switch whose branches may differ in
shard_map's varying type, with the values of the branch taken."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import collectives
from jaxcomm.branches import typed_cond, typed_switch
from tests import helpers as H

X = np.arange(H.N * 3, dtype=np.float32).reshape(H.N, 3) - 5.0


def placed():
    """``X`` with row i on worker i."""
    return jax.device_put(X, NamedSharding(H.mesh(), P(H.AXIS)))


def mean(x):  # invariant over the axis: every worker holds the same
    return collectives.psum(x, H.AXIS) / H.N


def keep(x):  # varying: each worker's own
    return x * 2.0


def run(fn, *args):
    """``fn(x, *args)`` per worker under shard_map (type checks on), stacked over workers."""
    f = jax.shard_map(lambda x: fn(x[0], *args)[None], mesh=H.mesh(), in_specs=P(H.AXIS),
                      out_specs=P(H.AXIS))  # fmt: skip
    return np.asarray(jax.jit(f)(placed()))


def test_plain_lax_cond_refuses_branches_typed_differently():
    # what the helpers exist for: without them the two branches do not type-check
    with pytest.raises(TypeError, match="vma|varying|type"):
        run(lambda x: lax.cond(x[0] > 0, mean, keep, x))


@pytest.mark.parametrize("take_mean", [True, False])
def test_typed_cond_gives_the_values_of_the_branch_taken(take_mean):
    got = run(lambda x: typed_cond(jnp.asarray(take_mean), mean, keep, x))
    want = np.broadcast_to(X.mean(0), X.shape) if take_mean else X * 2.0
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_typed_switch_gives_the_values_of_the_branch_taken(index):
    branches = [mean, keep, lambda x: mean(x) + 1.0]
    got = run(lambda x: typed_switch(jnp.asarray(index), branches, x))
    want = [np.broadcast_to(X.mean(0), X.shape), X * 2.0, np.broadcast_to(X.mean(0) + 1, X.shape)]
    np.testing.assert_allclose(got, want[index], rtol=1e-6)


def test_outputs_typed_alike_in_both_branches_stay_as_they_are():
    # both branches invariant: no cast, the output stays invariant (out_specs P() accepts it)
    f = jax.shard_map(lambda x: typed_cond(x[0, 0] > 0, mean, lambda y: mean(y) * 2, x[0]),
                      mesh=H.mesh(), in_specs=P(H.AXIS), out_specs=P())  # fmt: skip
    np.testing.assert_allclose(np.asarray(jax.jit(f)(placed())), X.mean(0) * 2, rtol=1e-6)


def test_outside_shard_map_they_are_the_plain_ones():
    x = jnp.asarray(X[0])
    for pred in (True, False):
        want = lax.cond(pred, lambda y: y + 1, lambda y: y * 3, x)
        got = typed_cond(jnp.asarray(pred), lambda y: y + 1, lambda y: y * 3, x)
        np.testing.assert_array_equal(got, want)
    for i in range(3):
        fns = [lambda y: y + 1, lambda y: y * 3, lambda y: -y]
        np.testing.assert_array_equal(typed_switch(i, fns, x), lax.switch(i, fns, x))
