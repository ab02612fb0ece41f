"""Data-parallel training on scikit-learn's digits (real data, ships offline), one program.

A tiny, exact driver of :mod:`experiments.train`'s step for comparing jaxcomm
transforms: the 1,797 8x8 digit images are standardised, split 75/25 into
train/test with a fixed seed, and the training set is dealt evenly to
``n_workers`` (the remainder is dropped: :func:`experiments.data.digits`).
Every step each worker computes the full-batch gradient of its shard, the
optimizer (any ``tx``, e.g. a jaxcomm transform chained with an optax
optimizer) exchanges and applies it. Each chunk of steps is one compiled call
of :func:`experiments.train.make_train_call` (``data.batch_size=0``: the whole
shard every step) on a ``("data",)`` mesh, so it is fast on CPU; what this
module adds is the model (:class:`Net`: logistic regression or a tanh MLP on
plain arrays), evaluation between chunks and the measured time per chunk, with
no workdir, checkpoints or config file.

Params are kept per worker (leading worker axis, sharded over "data"), so
methods that let workers drift apart (local SGD, DiLoCo) run on the same
harness; synchronous methods keep them identical.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import data as data_lib
from experiments import train as harness

AXIS = "data"


class Split(NamedTuple):
    x_train: np.ndarray  # (n_workers, m, 64) float32
    y_train: np.ndarray  # (n_workers, m) int32
    x_test: np.ndarray  # (t, 64)
    y_test: np.ndarray  # (t,)


def load(n_workers: int, *, seed: int = 0, test_fraction: float = 0.25) -> Split:
    """Digits, standardised and split; the train set dealt evenly to workers."""
    ds = data_lib.digits(n_workers, seed=seed, test_fraction=test_fraction)
    return Split(ds.x_train, ds.y_train, ds.x_test, ds.y_test)


def label_skewed(split: Split) -> Split:
    """The same training set dealt to workers sorted by label: each holds one or two digits.

    Heterogeneous shards (as when each worker's data comes from its own
    source): the workers' gradients disagree, which is where a biased
    compressor without error feedback (scaled sign) drifts from the mean
    gradient, and error feedback repairs it (Karimireddy et al. 2019,
    arXiv:1901.09847). The test set is unchanged; dense SGD on the full
    batch is unaffected (the mean gradient is the same).
    """
    x = split.x_train.reshape(-1, split.x_train.shape[-1])
    y = split.y_train.reshape(-1)
    order = np.argsort(y, kind="stable")
    return Split(
        x[order].reshape(split.x_train.shape),
        y[order].reshape(split.y_train.shape),
        split.x_test,
        split.y_test,
    )


def init_params(model: str, key: jax.Array, *, hidden: int = 64) -> dict[str, jax.Array]:
    """``"logreg"``: W (64, 10), b (10,). ``"mlp"``: one tanh hidden layer."""
    if model == "logreg":
        return {"w": jnp.zeros((64, 10)), "b": jnp.zeros((10,))}
    if model == "mlp":
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (64, hidden)) / math.sqrt(64),
            "b1": jnp.zeros((hidden,)),
            "w2": jax.random.normal(k2, (hidden, 10)) / math.sqrt(hidden),
            "b2": jnp.zeros((10,)),
        }
    raise ValueError(f"model: expected 'logreg' or 'mlp', got {model!r}")


def logits(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    if "w" in params:
        return x @ params["w"] + params["b"]
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


class Net:
    """:func:`init_params` / :func:`logits` with a flax module's ``init`` / ``apply`` face.

    What :func:`experiments.train.make_train_call` calls; params stay plain
    dicts (``{"w", "b"}`` or ``{"w1", "b1", "w2", "b2"}``).
    """

    def __init__(self, model: str = "logreg", hidden: int = 64):
        self.model, self.hidden = model, hidden

    def init(self, key: jax.Array, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"params": init_params(self.model, key, hidden=self.hidden)}

    def apply(self, variables: dict[str, Any], x: jax.Array, **kwargs: Any) -> jax.Array:
        return logits(variables["params"], x)


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def accuracy(params: dict[str, jax.Array], x: Any, y: Any) -> float:
    return float(jnp.mean(jnp.argmax(logits(params, jnp.asarray(x)), -1) == jnp.asarray(y)))


class Result(NamedTuple):
    accuracy: float  # test accuracy of worker 0's params
    train_loss: float  # mean over workers of their shard loss, worker 0's params
    params: Any  # per-worker params, leading worker axis
    opt_state: Any  # per-worker optimizer state


def train(
    tx: optax.GradientTransformation,
    *,
    steps: int,
    model: str = "logreg",
    hidden: int = 64,
    n_workers: int = 8,
    seed: int = 0,
    split: Split | None = None,
) -> Result:
    """Train ``model`` on digits over ``n_workers`` devices with optimizer ``tx``.

    ``tx`` must average over axis ``"data"`` itself (e.g. ``optax.chain(
    jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.5))``); its state is
    kept per worker.
    """
    return train_curve(
        tx,
        steps=steps,
        eval_every=steps,
        model=model,
        hidden=hidden,
        n_workers=n_workers,
        seed=seed,
        split=split,
    ).result


class Curve(NamedTuple):
    steps: list[int]  # step after each chunk
    accuracy: list[float]  # test accuracy of worker 0's params at those steps
    result: Result
    # measured seconds of training up to those steps: the compiled chunks only
    # (compile and evaluation excluded), so a time axis can be built on it
    train_s: list[float] = []


def train_curve(
    tx: optax.GradientTransformation,
    *,
    steps: int,
    eval_every: int,
    model: str = "logreg",
    hidden: int = 64,
    n_workers: int = 8,
    seed: int = 0,
    split: Split | None = None,
    on_chunk: Callable[[int, float], None] | None = None,
) -> Curve:
    """As :func:`train`, but evaluated every ``eval_every`` steps (one compiled call per chunk).

    The chunk is :func:`experiments.train.make_train_call`'s scan of
    ``eval_every`` full-shard steps in one jitted ``shard_map``, compiled once
    (ahead of time, outside the timed calls);
    state is carried between calls, so the final state matches
    :func:`train`'s run of the same length. ``Curve.train_s`` is the measured
    wall clock of the chunks alone. ``on_chunk(step, accuracy)`` is called
    after each evaluation (e.g. to advance a progress bar).
    """
    if steps % eval_every:
        raise ValueError(f"steps: {steps} must be a multiple of eval_every={eval_every}")
    if jax.device_count() < n_workers:
        raise ValueError(
            f"n_workers: {n_workers} > {jax.device_count()} devices; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n_workers} before importing jax"
        )
    split = split or load(n_workers, seed=seed)
    mesh = jax.make_mesh((n_workers,), (AXIS,), devices=jax.devices()[:n_workers])
    net = Net(model, hidden)
    params = net.init(jax.random.key(seed))["params"]
    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (n_workers,) + a.shape), t)
    ds = data_lib.Dataset("digits", split.x_train, split.y_train, split.x_test, split.y_test, 10)
    config = ml_collections.ConfigDict(
        {"seed": seed, "data": {"batch_size": 0}, "steps_per_call": eval_every}
    )
    fn = harness.make_train_call(net, tx, mesh, ds, config)
    state = harness.TrainState(
        jnp.zeros((n_workers,), jnp.int32), stack(params), {}, stack(tx.init(params))
    )
    sh = NamedSharding(mesh, P(AXIS))
    state, x, y = jax.device_put((state, split.x_train, split.y_train), sh)
    compiled = fn.lower(state, x, y).compile()
    done, accs, times, elapsed = [], [], [], 0.0
    for i in range(steps // eval_every):
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(compiled(state, x, y))
        elapsed += time.perf_counter() - t0
        p0 = jax.tree.map(lambda a: np.asarray(a)[0], state.params)
        done.append((i + 1) * eval_every)
        accs.append(accuracy(p0, split.x_test, split.y_test))
        times.append(elapsed)
        if on_chunk is not None:
            on_chunk(done[-1], accs[-1])
    params, opt_state = jax.device_get((state.params, state.opt_state))
    p0 = jax.tree.map(lambda a: a[0], params)
    train_loss = float(
        np.mean([loss_fn(p0, split.x_train[w], split.y_train[w]) for w in range(n_workers)])
    )
    res = Result(accs[-1], train_loss, params, opt_state)
    return Curve(done, accs, res, times)
