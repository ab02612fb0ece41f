"""jaxcomm.flax: an nnx.Optimizer step made data-parallel equals the pure-optax helper's step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import jaxcomm
import jaxcomm.flax
from tests.helpers import AXIS, N


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


def train_step(model, optimizer, metrics, batch):  # as in the Flax nnx MNIST example
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)


def batches(steps=3):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(4 * N, 16)).astype(np.float32),
         "y": rng.integers(0, 10, 4 * N).astype(np.int32)}
        for _ in range(steps)
    ]  # fmt: skip


def make_tx():
    return optax.chain(jaxcomm.topk(0.1, axis_name=AXIS, min_size=0), optax.adamw(1e-2))


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_nnx_step_equals_the_optax_helper_bit_for_bit(kind):
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(kind,))
    model = MLP(nnx.Rngs(0))
    graphdef, params0 = nnx.split(nnx.clone(model), nnx.Param)  # a copy: training mutates model
    tx = make_tx()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    jaxcomm.flax.init_optimizer(optimizer, mesh)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    step = jaxcomm.flax.data_parallel(train_step, mesh)
    with jax.set_mesh(mesh):
        for b in batches():
            step(model, optimizer, metrics, b)

    # the reference: the same model as a pure function of its params, plain optax
    def pure_loss(p, b):
        return loss_fn(nnx.merge(graphdef, p), b)[0]

    @jaxcomm.data_parallel(mesh)
    def ref_step(p, s, b):
        u, s = tx.update(jax.grad(pure_loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

    p, s = params0, jaxcomm.init_state(tx, params0, mesh)
    for b in batches():
        p, s = ref_step(p, s, b)
    got = nnx.state(model, nnx.Param)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    residual = np.asarray(optimizer.opt_state[0].residual["l1"]["kernel"][...])
    assert residual.shape == (N, 16, 32) and not np.allclose(residual[0], residual[1])
    assert not np.allclose(np.asarray(got["l1"]["kernel"][...]), params0["l1"]["kernel"][...])


def test_metrics_describe_the_global_batch():
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    jaxcomm.flax.init_optimizer(optimizer, mesh)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    b = batches(1)[0]
    before = nnx.clone(model)
    jaxcomm.flax.data_parallel(train_step, mesh)(model, optimizer, metrics, b)
    per_worker = [
        float(loss_fn(before, {k: v[4 * w : 4 * w + 4] for k, v in b.items()})[0]) for w in range(N)
    ]
    np.testing.assert_allclose(float(metrics.compute()["loss"]), np.mean(per_worker), rtol=1e-5)
    assert not np.isclose(float(metrics.compute()["loss"]), per_worker[0])


def test_an_optimizer_without_init_optimizer_is_told_the_fix():
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    step = jaxcomm.flax.data_parallel(train_step, mesh)
    with pytest.raises(
        ValueError,
        match=r"^optimizer\.opt_state\[0\]\.count: .*leading worker axis.*"
        r"jaxcomm\.flax\.init_optimizer\(optimizer, mesh\)",
    ):
        step(model, optimizer, metrics, batches(1)[0])
