"""Flax examples made data-parallel with jaxcomm, on scikit-learn's digits (real data, offline).

``nnx_digits`` is the official Flax nnx MNIST example and ``linen_digits`` its
linen ``TrainState`` counterpart, each changed in a handful of lines marked
``# jaxcomm:``. This module holds what they share: the data (the Flax examples
load MNIST with tensorflow_datasets), the command-line flags and the compressors.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import optax
from absl import flags

from jaxcomm import methods

# the examples' choices: name -> (method of jaxcomm.methods, its options)
COMPRESSORS = {
    "allreduce": ("allreduce", {}),
    "topk": ("topk", {"ratio": 0.01}),
    "powersgd": ("powersgd", {"rank": 2}),  # key: jax.random.key(0)
    "ef_sign": ("ef_sign", {}),
}
N_TEST = 300  # the last 300 digits are held out


def define_flags() -> None:
    """The examples' command-line flags; defined only when an example runs as a program, so
    that importing both (tests) does not clash with each other or other experiments' flags."""
    flags.DEFINE_enum("compressor", "topk", list(COMPRESSORS), "jaxcomm gradient exchange")
    flags.DEFINE_integer("steps", 300, "training steps")
    flags.DEFINE_integer("batch_size", 128, "global batch size (split over the devices)")
    flags.DEFINE_integer("eval_every", 50, "steps between evaluations")


def compressor(name: str) -> optax.GradientTransformation:
    """The jaxcomm transform put first in the optimizer chain (workers on mesh axis "data")."""
    if name not in COMPRESSORS:
        raise ValueError(f"compressor: expected one of {list(COMPRESSORS)}, got {name!r}")
    method, kwargs = COMPRESSORS[name]
    return methods.make(method, **kwargs, axis_name="data")


def load_digits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(train, test)``: images (n, 8, 8, 1) float32 in [0, 1], labels (n,) int32."""
    from sklearn import datasets

    x, y = datasets.load_digits(return_X_y=True)
    images = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    labels = y.astype(np.int32)
    train = {"image": images[:-N_TEST], "label": labels[:-N_TEST]}
    test = {"image": images[-N_TEST:], "label": labels[-N_TEST:]}
    return train, test


def train_batches(
    train: dict[str, np.ndarray], batch_size: int, steps: int, *, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """``steps`` shuffled global batches, reshuffled every epoch, remainder dropped."""
    rng = np.random.default_rng(seed)
    n = len(train["label"])
    if batch_size > n:
        raise ValueError(f"batch_size: {batch_size} > {n} training digits")
    order, pos = rng.permutation(n), 0
    for _ in range(steps):
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        yield {k: v[idx] for k, v in train.items()}
