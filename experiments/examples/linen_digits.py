"""A Flax linen ``TrainState`` loop on scikit-learn's digits, data-parallel with jaxcomm.

The CNN and the step are those of the Flax linen MNIST example (a small CNN,
``flax.training.train_state.TrainState``, ``optax.adamw``; the digits are
8x8x1 images instead of 28x28x1), with the step written as one
``train_step(state, batch) -> (state, metrics)``. The workers are all the
devices on a mesh axis "data"; each computes the gradient of its slice of the
global batch, and the jaxcomm transform put before AdamW in the chain
exchanges them (compressed). A ``TrainState`` is a pytree, so
:func:`jaxcomm.data_parallel` takes it as it is; only its ``opt_state`` is
laid out by :func:`jaxcomm.init_state` (the compressor's state per worker).
The statements that differ from the single-device loop are marked ``# jaxcomm:``.

Run (one worker per device; the global batch must divide by their count)::

    python -m experiments.examples.linen_digits --compressor=topk

On one CPU, as 8 fake devices in one process::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m experiments.examples.linen_digits --compressor=topk

The mesh's axis is Auto: with an Explicit one (``jax.make_mesh``'s default)
the eager code after the step needs ``jax.set_mesh(mesh)`` around the loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import linen as nn
from flax.training import train_state

import jaxcomm  # jaxcomm: the library
from experiments import examples

FLAGS = flags.FLAGS  # defined by examples.define_flags() when run as a program


class CNN(nn.Module):
    """A simple CNN model."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def loss_fn(params, apply_fn, batch):
    logits = apply_fn({"params": params}, batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


def compute_metrics(loss, logits, labels):
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


@jax.jit
def eval_step(state: train_state.TrainState, batch):
    loss, logits = loss_fn(state.params, state.apply_fn, batch)
    return compute_metrics(loss, logits, batch["label"])


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

    Returns the last evaluation's ``train_loss``, ``train_accuracy`` (mean over
    the steps since the one before), ``test_loss``, ``test_accuracy``, every
    evaluation in ``history`` and the trained ``state``.
    """
    train_ds, test_ds = examples.load_digits()
    mesh = jax.make_mesh(  # jaxcomm: the workers, one per device (Auto axes: see above)
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )

    model = CNN()
    params = model.init(jax.random.key(seed), jnp.ones((1, 8, 8, 1)))["params"]
    tx = optax.chain(  # jaxcomm: the gradient exchange first, then the optimizer
        examples.compressor(compressor), optax.adamw(learning_rate, momentum)
    )
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = state.replace(opt_state=jaxcomm.init_state(tx, params, mesh))  # jaxcomm: per worker

    @jaxcomm.data_parallel(mesh, mean_outputs=(1,))  # jaxcomm: was @jax.jit
    def train_step(state: train_state.TrainState, batch):
        """Train for a single step."""
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(state.params, state.apply_fn, batch)
        state = state.apply_gradients(grads=grads)
        return state, compute_metrics(loss, logits, batch["label"])

    history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    seen = []  # the training metrics since the last evaluation
    for step, batch in enumerate(examples.train_batches(train_ds, batch_size, steps, seed=seed)):
        state, metrics = train_step(state, batch)
        seen.append(metrics)

        if step > 0 and (step % eval_every == 0 or step == steps - 1):
            for metric, values in jax.device_get(jax.tree.map(lambda *v: v, *seen)).items():
                history[f"train_{metric}"].append(float(np.mean(values)))
            seen = []
            for metric, value in eval_step(state, test_ds).items():
                history[f"test_{metric}"].append(float(value))
            log(
                f"step {step}: train loss {history['train_loss'][-1]:.4f} "
                f"accuracy {history['train_accuracy'][-1]:.4f}, "
                f"test loss {history['test_loss'][-1]:.4f} "
                f"accuracy {history['test_accuracy'][-1]:.4f}"
            )
    final = {name: values[-1] for name, values in history.items()}
    return {**final, "history": history, "state": state}


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
