"""The official Flax nnx MNIST example, data-parallel with jaxcomm, on scikit-learn's digits.

The model (a small CNN with BatchNorm and Dropout), ``loss_fn``, ``train_step``
and ``eval_step`` are those of the Flax nnx MNIST example (``examples/mnist``
in the Flax repository: ``train_step(model, optimizer, metrics, batch, rngs)``,
an ``nnx.Rngs`` for dropout, ``model.train()`` / ``model.eval()``), trained with
``optax.adamw`` as in the Flax nnx MNIST tutorial; the digits are 8x8x1 images
instead of 28x28x1, so the first dense layer is smaller. The workers are all
the devices on a mesh axis "data"; each computes the gradient of its slice of
the global batch, and the jaxcomm transform put before AdamW in the chain
exchanges them (compressed). The BatchNorm statistics are averaged over the
workers after each step, and each worker draws its own dropout masks (the
``rngs`` keys folded with the worker index). The six statements that differ
from the single-device example are marked ``# jaxcomm:``.

Run (one worker per device; the global batch must divide by their count)::

    python -m experiments.examples.nnx_digits --compressor=topk

On one CPU, as 8 fake devices in one process::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m experiments.examples.nnx_digits --compressor=topk

The mesh's axis is Auto: with an Explicit one (``jax.make_mesh``'s default)
the loop runs under ``jax.set_mesh(mesh)`` (the step refuses otherwise, as the
eager code after it, ``metrics.reset()``, would fail).
"""

from __future__ import annotations

from functools import partial

import jax
import optax
from absl import app, flags
from flax import nnx

import jaxcomm.flax  # jaxcomm: the library
from experiments import examples

FLAGS = flags.FLAGS  # defined by examples.define_flags() when run as a program


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(256, 256, rngs=rngs)  # 2x2x64 features after two poolings
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, batch, rngs):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch, rngs):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch, None)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.


def build(
    compressor: str, *, learning_rate: float = 0.005, momentum: float = 0.9, seed: int = 0
) -> dict:
    """The mesh, ``model``, ``optimizer``, ``metrics``, ``rngs`` and the data-parallel step."""
    mesh = jax.make_mesh(  # jaxcomm: the workers, one per device (Auto axes: see above)
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    model = CNN(rngs=nnx.Rngs(seed))
    tx = optax.chain(  # jaxcomm: the gradient exchange first, then the optimizer
        examples.compressor(compressor), optax.adamw(learning_rate, momentum)
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # jaxcomm: tx
    jaxcomm.flax.init_optimizer(optimizer, mesh)  # jaxcomm: the compressor's state per worker
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(),
        loss=nnx.metrics.Average("loss"),
    )
    rngs = nnx.Rngs(seed)
    step = jaxcomm.flax.data_parallel(train_step, mesh)  # jaxcomm: was @nnx.jit
    return {"mesh": mesh, "model": model, "optimizer": optimizer, "metrics": metrics,
            "rngs": rngs, "train_step": step}  # fmt: skip


def main_loop(
    compressor: str,
    steps: int,
    *,
    batch_size: int = 128,
    eval_every: int = 50,
    learning_rate: float = 0.005,
    momentum: float = 0.9,
    seed: int = 0,
    log=print,
) -> dict:
    """Train for ``steps`` steps; evaluate every ``eval_every`` steps and at the end.

    Returns the last evaluation's ``train_loss``, ``train_accuracy`` (over the
    steps since the one before), ``test_loss``, ``test_accuracy``, every
    evaluation in ``history`` and the objects of :func:`build` after training.
    """
    train_ds, test_ds = examples.load_digits()
    run = build(compressor, learning_rate=learning_rate, momentum=momentum, seed=seed)
    model, optimizer, metrics, rngs = (run[k] for k in ("model", "optimizer", "metrics", "rngs"))
    history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    model.train()  # Switch to train mode
    for step, batch in enumerate(examples.train_batches(train_ds, batch_size, steps, seed=seed)):
        run["train_step"](model, optimizer, metrics, batch, rngs)

        if step > 0 and (step % eval_every == 0 or step == steps - 1):
            # Log the training metrics.
            for metric, value in metrics.compute().items():  # Compute the metrics.
                history[f"train_{metric}"].append(float(value))  # Record the metrics.
            metrics.reset()  # Reset the metrics for the test set.

            # Compute the metrics on the test set.
            model.eval()  # Switch to eval mode
            eval_step(model, metrics, test_ds)
            model.train()

            # Log the test metrics.
            for metric, value in metrics.compute().items():
                history[f"test_{metric}"].append(float(value))
            metrics.reset()  # Reset the metrics for the next training epoch.

            log(
                f"step {step}: train loss {history['train_loss'][-1]:.4f} "
                f"accuracy {history['train_accuracy'][-1]:.4f}, "
                f"test loss {history['test_loss'][-1]:.4f} "
                f"accuracy {history['test_accuracy'][-1]:.4f}"
            )
    final = {name: values[-1] for name, values in history.items()}
    return {**final, "history": history, **run}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    print(f"{jax.device_count()} workers, compressor {FLAGS.compressor}", flush=True)
    main_loop(
        FLAGS.compressor, FLAGS.steps, batch_size=FLAGS.batch_size, eval_every=FLAGS.eval_every
    )


if __name__ == "__main__":
    examples.define_flags()
    app.run(main)
