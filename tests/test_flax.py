"""jaxcomm.flax: an nnx.Optimizer step made data-parallel equals the pure-optax helper's step."""

from functools import partial

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


# --- the official Flax nnx MNIST example's model and step (flax examples/mnist), on 8x8 inputs --


class CNN(nnx.Module):
    """The official example's CNN (BatchNorm, Dropout), sized for 8x8x1 images."""

    seen: list = []  # the image batch shapes the traced steps saw (trace time)

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.25)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(64, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.25)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        CNN.seen.append(x.shape)
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def cnn_loss_fn(model, batch, rngs):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


def official_train_step(model, optimizer, metrics, batch, rngs):
    """Train for a single step (the official example's, unchanged)."""
    grad_fn = nnx.value_and_grad(cnn_loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def images(steps=3, per_worker=4):
    rng = np.random.default_rng(1)
    return [
        {"image": rng.random((per_worker * N, 8, 8, 1), np.float32),
         "label": rng.integers(0, 10, per_worker * N).astype(np.int32)}
        for _ in range(steps)
    ]  # fmt: skip


def official_setup(mesh, seed=0, **options):
    model = CNN(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    jaxcomm.flax.init_optimizer(optimizer, mesh)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    step = jaxcomm.flax.data_parallel(official_train_step, mesh, **options)
    return model, optimizer, metrics, nnx.Rngs(seed), step


def copies(x):
    return [np.asarray(s.data) for s in x.addressable_shards]


def test_the_official_step_splits_the_batch_and_keeps_batch_norm_equal_on_every_worker():
    mesh = jax.make_mesh((N,), (AXIS,))  # Explicit axes, as jax.make_mesh makes them
    model, optimizer, metrics, rngs, step = official_setup(mesh, check_replicas=True)
    model.train()
    CNN.seen.clear()
    with jax.set_mesh(mesh):
        for b in images():
            step(model, optimizer, metrics, b, rngs)
        # the traced step saw one worker's 4 images of the 32, not the global batch
        assert CNN.seen[-1] == (4, 8, 8, 1), CNN.seen
        # Accuracy counts the images of every worker once: the global batch, 3 steps
        assert int(metrics.accuracy.count[...]) == 3 * 4 * N
        assert int(rngs.default.count[...]) == 2 * 3  # each Dropout draws once a step
        for name in ("batch_norm1", "batch_norm2"):
            for stat in ("mean", "var"):
                first, *rest = copies(getattr(model, name).__dict__[stat][...])
                assert not np.allclose(first, 0 if stat == "mean" else 1)  # it moved
                for other in rest:
                    np.testing.assert_array_equal(other, first)
        metrics.reset()  # eager code after the step runs under the mesh


def test_batch_stats_per_worker_average_to_the_mean_mode():
    """One step: the averaged statistics are the mean of the per-worker ones (the same masks)."""
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    b = images(1)[0]
    got = {}
    for mode in ("mean", "per_worker"):
        model, optimizer, metrics, rngs, step = official_setup(mesh, batch_stats=mode)
        if mode == "per_worker":
            jaxcomm.flax.init_per_worker(model, mesh)
        step(model, optimizer, metrics, b, rngs)
        got[mode] = np.asarray(model.batch_norm1.mean[...])
    assert got["per_worker"].shape == (N, 8)
    assert not np.allclose(got["per_worker"][0], got["per_worker"][1])
    np.testing.assert_allclose(got["mean"], got["per_worker"].mean(0), rtol=1e-5, atol=1e-7)


def test_dropout_masks_differ_between_workers_and_repeat_for_a_seed():
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    jaxcomm.flax.init_optimizer(optimizer, mesh)

    @jaxcomm.flax.data_parallel(mesh)
    def step(model, optimizer, batch, rngs):
        grads = nnx.grad(lambda m: loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)
        mask = nnx.Dropout(0.5)(jnp.ones(64), rngs=rngs) > 0
        return jax.lax.all_gather(mask, AXIS)  # every worker's mask

    b = batches(1)[0]
    masks = np.asarray(step(model, optimizer, b, nnx.Rngs(0)))
    assert len({m.tobytes() for m in masks}) == N
    for a in range(N):  # independent: about half of the 64 entries agree (shared: all)
        for c in range(a):
            assert 0.2 < np.mean(masks[a] == masks[c]) < 0.8, (a, c)
    for w in range(N):  # worker w: its stream key folded with w, then nnx's own draw
        rngs = nnx.Rngs(0)
        rngs.default.key[...] = jax.random.fold_in(rngs.default.key[...], w)
        expect = nnx.Dropout(0.5)(jnp.ones(64), rngs=rngs) > 0
        np.testing.assert_array_equal(masks[w], np.asarray(expect))
    rngs = nnx.Rngs(0)
    again = np.asarray(step(model, optimizer, b, rngs))
    np.testing.assert_array_equal(again, masks)
    # the key comes back as it was (replicated), the counter advanced
    np.testing.assert_array_equal(jax.random.key_data(rngs.default.key[...]),
                                  jax.random.key_data(nnx.Rngs(0).default.key[...]))  # fmt: skip
    assert int(rngs.default.count[...]) == 1
    other = np.asarray(step(model, optimizer, b, nnx.Rngs(1)))
    assert not np.array_equal(other, masks)


def test_setup_mistakes_with_nnx_name_the_argument_and_the_fix():
    explicit = jax.make_mesh((N,), (AXIS,))
    model, optimizer, metrics, rngs, step = official_setup(explicit)
    with pytest.raises(ValueError, match=r"Explicit axes \('data',\).*jax\.set_mesh\(mesh\)"):
        step(model, optimizer, metrics, images(1)[0], rngs)
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    model, optimizer, metrics, rngs, _ = official_setup(mesh)
    step = jaxcomm.flax.data_parallel(official_train_step, mesh, batch_argnums=(-1,))
    with pytest.raises(ValueError, match=r"batch_argnums: 'rngs' is an nnx\.Rngs, which is state"):
        step(model, optimizer, metrics, images(1)[0], rngs)
    step = jaxcomm.flax.data_parallel(official_train_step, mesh, batch_stats="per_worker")
    # batch_norm1's statistics have 8 channels, as many as workers: not mistaken as laid out
    with pytest.raises(ValueError, match=r"model\.batch_norm1\.mean: per-worker state.*"
                       r"jaxcomm\.flax\.init_per_worker\(model, mesh\)"):  # fmt: skip
        step(model, optimizer, metrics, images(1)[0], rngs)


def test_a_leaf_left_out_of_the_compressor_is_named_by_its_nnx_path():
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    model = MLP(nnx.Rngs(0))
    only_kernels = lambda p: jax.tree.map_with_path(  # noqa: E731
        lambda path, _: any(getattr(k, "key", None) == "kernel" for k in path), p
    )
    tx = optax.chain(optax.masked(jaxcomm.topk(0.1, axis_name=AXIS, min_size=0), only_kernels),
                     optax.sgd(0.1))  # fmt: skip
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    jaxcomm.flax.init_optimizer(optimizer, mesh)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    step = jaxcomm.flax.data_parallel(train_step, mesh)
    with pytest.raises(ValueError, match=r"model\['l1'\]\['bias'\] is returned as replicated.*"
                       r"jaxcomm\.allreduce"):  # fmt: skip
        step(model, optimizer, metrics, batches(1)[0])


def _fsdp_reference(params, grad_fn, steps, lr=0.1):
    """Plain SGD on the whole batch, one device (the mean gradient fsdp's workers share)."""
    out = []
    for b in batches(steps):
        g = grad_fn(params, b)
        params = jax.tree.map(lambda p, d: p - lr * d, params, g)
        out.append(params)
    return out[-1]


def test_fsdp_of_an_nnx_model_trains_as_sgd_on_the_whole_batch_and_updates_the_model():
    # the sharded step (each worker its slice, gradients reduce-scattered, the shard updated)
    # equals SGD on the whole batch, and fsdp_update writes the gathered params into the model
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    model = MLP(nnx.Rngs(0))
    start = jax.tree.map(jnp.array, nnx.split(model, nnx.Param, ...)[1])  # copies
    trainer, state = jaxcomm.flax.fsdp(model, loss_fn, optax.sgd(0.1), mesh, has_aux=True)
    for b in batches(3):
        state, _ = trainer.step(state, b)
    for m, s in zip(jax.tree.leaves(nnx.split(model, nnx.Param, ...)[1]), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(m), np.asarray(s))  # untouched until update
    graphdef, _, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)

    def grad_fn(p, b):
        return jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), b)[0])(p)

    want = _fsdp_reference(start, grad_fn, 3)
    jaxcomm.flax.fsdp_update(model, trainer, state)
    got = nnx.split(model, nnx.Param, ...)[1]
    moved = [np.abs(np.asarray(g) - np.asarray(s)).max() for g, s in
             zip(jax.tree.leaves(got), jax.tree.leaves(start))]  # fmt: skip
    assert min(moved) > 1e-4, moved  # every leaf trained (and was written back)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_fsdp_of_a_linen_train_state_is_four_lines():
    # a linen TrainState needs no adapter: the loss calls apply_fn, init takes state.params,
    # and replace(params=...) gives the TrainState back; equal to TrainState.apply_gradients
    # on the whole batch
    from flax import linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(jnp.tanh(nn.Dense(32)(x)))

    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.sgd(0.1))

    def loss(p, b):
        logits = state.apply_fn({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    trainer = jaxcomm.fsdp(loss, state.tx, mesh)  # the four lines
    sharded = trainer.init(state.params)
    for b in batches(3):
        sharded, _ = trainer.step(sharded, b)
    done = state.replace(params=trainer.params(sharded))
    ref = state
    for b in batches(3):
        ref = ref.apply_gradients(grads=jax.grad(loss)(ref.params, b))
    for g, w in zip(jax.tree.leaves(done.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


class Scaled(nnx.Module):  # a constant buffer beside the trained layers, used read-only
    def __init__(self, rngs):
        self.scale = nnx.Variable(jnp.full((32,), 0.5))

    def __call__(self, h):
        return h * self.scale[...]


class HalvesKernel(nnx.Module):  # writes a trained variable in the forward pass
    def __init__(self, rngs):
        self.inner = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, h):
        self.inner.kernel[...] = self.inner.kernel[...] * 0.5
        return self.inner(h)


class Sows(nnx.Module):  # an intermediate sown for inspection: an output, not state
    def __call__(self, h):
        self.sow(nnx.Intermediate, "h", h)
        return h


@pytest.mark.parametrize(
    "layer, written",
    [
        (lambda rngs: nnx.BatchNorm(32, rngs=rngs), r"\['extra'\]\['mean'\]"),
        (lambda rngs: nnx.Dropout(0.5, rngs=rngs), r"\['extra'\]\['rngs'\]\['count'\]"),
        (HalvesKernel, r"\['extra'\]\['inner'\]\['kernel'\]"),
        (Scaled, None),
        (lambda rngs: nnx.BatchNorm(32, use_running_average=True, rngs=rngs), None),
        (lambda rngs: Sows(), None),
    ],
    ids=["batch_norm", "dropout", "writes_a_param", "constant", "batch_norm_eval", "sow"],
)
def test_fsdp_refuses_a_model_whose_step_writes_a_variable(layer, written):
    # BatchNorm's running statistics, a dropout stream's counter or a trained kernel written
    # in the forward pass would be dropped after every step: refused, the variable named;
    # state only read (a constant buffer, BatchNorm in eval mode) and sown intermediates train
    class WithExtra(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.extra = nnx.Linear(16, 32, rngs=rngs), layer(rngs)
            self.l2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.extra(jnp.tanh(self.l1(x))))

    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    trainer, state = jaxcomm.flax.fsdp(WithExtra(nnx.Rngs(0)), loss_fn, optax.sgd(0.1), mesh,
                                       has_aux=True)  # fmt: skip
    batch = next(iter(batches(1)))
    if written is None:
        assert np.isfinite(float(trainer.step(state, batch)[1]))
        return
    with pytest.raises(ValueError, match=rf"model: the step writes {written}"):
        trainer.step(state, batch)
