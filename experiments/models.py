"""Models for the experiments (flax.linen): an MLP, a small ResNet, a char-level transformer.

Each model is built by name from ``config.model`` (:func:`build`). BatchNorm
statistics live in the ``batch_stats`` collection; the training step averages
them across workers after every step (``lax.pmean``), so every worker
evaluates with the same statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """Flatten, ``depth`` tanh hidden layers of ``hidden`` units, linear head."""

    num_classes: int
    hidden: int = 128
    depth: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        x = x.reshape(x.shape[0], -1)
        for _ in range(self.depth):
            x = jnp.tanh(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


class ResidualBlock(nn.Module):
    """Two 3x3 convs with BatchNorm, projection shortcut when the shape changes."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """CIFAR-style ResNet: a 3x3 stem, ``len(stages)`` stages of ``blocks`` residual blocks.

    ``stages=(16, 32, 64), blocks=1`` is ResNet-8; ``(64, 128, 256, 512), 2``
    is ResNet-18.
    """

    num_classes: int
    stages: tuple[int, ...] = (16, 32, 64)
    blocks: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = nn.Conv(self.stages[0], (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for i, features in enumerate(self.stages):
            for j in range(self.blocks):
                x = ResidualBlock(features, strides=2 if i > 0 and j == 0 else 1)(x, train=train)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm causal self-attention + GELU MLP."""

    dim: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.dim)(h)


class CharTransformer(nn.Module):
    """Decoder-only transformer over byte tokens: (batch, seq) int32 -> (batch, seq, vocab)."""

    vocab_size: int = 256
    dim: int = 128
    depth: int = 2
    heads: int = 4
    max_len: int = 256

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        x = nn.Embed(self.vocab_size, self.dim)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.dim))
        x = x + pos[: tokens.shape[1]]
        for _ in range(self.depth):
            x = DecoderBlock(self.dim, self.heads)(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "resnet": ResNet,
    "char_transformer": CharTransformer,
    "gpt": CharTransformer,  # GPT-style: pre-LN decoder, learned positions, byte vocabulary
}
LM_MODELS = ("char_transformer", "gpt")


def build(name: str, **kwargs: Any) -> nn.Module:
    """The model called ``name`` (one of :data:`MODELS`) with ``kwargs``."""
    if name not in MODELS:
        raise ValueError(f"config.model.name: unknown {name!r}; choose from {sorted(MODELS)}")
    if "stages" in kwargs:
        kwargs["stages"] = tuple(kwargs["stages"])
    try:
        return MODELS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"config.model: bad arguments for {name!r}: {e}") from None
