r"""The LM study's GPT in PyTorch: a twin of ``experiments.models.CharTransformer`` (``"gpt"``).

For running the study's workload (:mod:`experiments.configs.lm_shakespeare`)
with what a PyTorch user would pick instead of jaxcomm (DDP with comm hooks,
torchft's DiLoCo). Everything here mirrors the JAX harness: the model, its
initialisation, the loss, AdamW and the learning-rate schedule, and the byte
windows each worker draws at each step.

Model (:class:`GPT`), layer by layer against the Flax one (Flax defaults in
brackets; ``fan_in`` is the layer's input width):

- token embedding ``nn.Embedding(vocab, dim)`` [``nn.Embed``: normal,
  stddev ``1/sqrt(dim)``: ``variance_scaling(1, "fan_in", "normal",
  out_axis=0)`` on a ``(vocab, dim)`` table has ``fan_in = dim``];
- learned positions ``pos`` ``(max_len, dim)``, added [normal, stddev 0.02];
- ``depth`` pre-LayerNorm blocks: ``x + attn(ln1(x))``, then
  ``x + proj(gelu(fc(ln2(x))))``;
  attention [``nn.MultiHeadDotProductAttention(heads)``]: separate ``q``,
  ``k``, ``v`` and ``out`` projections ``dim -> dim`` with biases, heads
  split head-major (Flax's ``(dim, heads, head_dim)`` kernels), scores scaled
  by ``1/sqrt(head_dim)``, causal, softmax in float32, no dropout; the MLP
  ``fc`` ``dim -> 4 dim``, tanh-approximated GELU [``nn.gelu``'s default],
  ``proj`` ``4 dim -> dim``;
- a final LayerNorm and an untied head ``dim -> vocab`` with bias.

Every LayerNorm has epsilon 1e-6 [Flax's; torch's default is 1e-5], scale 1,
bias 0. Every projection's weight is LeCun normal [Flax's
``default_kernel_init``]: a normal truncated at 2 standard deviations, scaled
so that its variance is ``1/fan_in`` (Flax initialises the attention's
``(dim, heads, head_dim)`` and ``(heads, head_dim, dim)`` kernels flattened to
``(dim, dim)``, so ``fan_in = dim`` there too); every bias 0. The study's sizes
(dim 128, depth 4, heads 4, max_len 128) give 875,520 parameters in 70 tensors
on both sides, one torch tensor per Flax leaf (:func:`param_pairs`).

Loss: the mean over batch and positions of the next-byte cross-entropy
(:func:`lm_loss`, ``optax.softmax_cross_entropy_with_integer_labels(...).mean()``
in ``experiments.train``); a window of ``seq_len + 1`` bytes is split into
input ``w[:, :-1]`` and target ``w[:, 1:]``.

Optimizer (:func:`adamw`): ``optax.adamw`` decays every leaf (the study passes
no mask), so torch's AdamW gets all parameters in one group; eps 1e-8 (optax's
default); the decay is decoupled and scaled by the learning rate in both. The
schedule (:func:`learning_rate`) is ``experiments.optimizers.learning_rate``'s:
linear from 0 to the peak over ``warmup_steps``, cosine to ``end_factor`` x peak
at ``num_train_steps``. Optax applies ``lr(k)`` at the k-th update (counting
from 0, so the first update is a no-op); ``LambdaLR`` does the same when
``scheduler.step()`` follows each ``optimizer.step()``.

Batches (:func:`batch_starts`, :func:`windows`): the harness draws them inside
its compiled step with ``experiments.data.sample_batch``: worker ``w`` at step
``s`` takes ``batch_size`` windows of ``seq_len + 1`` bytes from its own stream
``data.shakespeare(n_workers, seq_len=...).x_train[w]`` (the training text
dealt in contiguous pieces), at starts
``jax.random.randint(fold_in(fold_in(key(seed + 1), w), s), (batch_size,), 0,
len(stream) - seq_len - 1)``. That is jax.random (threefry), so the starts are
computed here with jax, the same function; the windows are then sliced in
NumPy.

What is not bit for bit: torch's LayerNorm computes the variance in two passes
(Flax: ``E[x^2] - E[x]^2``), and the attention and matmuls accumulate in
another order; with the same weights the logits agree to a few 1e-6 and the
loss to ~1e-7 relative (``tests/test_torch_lm.py``). Each framework's own
initialisation draws from the same distributions but from its own random
stream, so the two start from different weights of the same law.

Example::

    from experiments import data
    from experiments.configs import lm_shakespeare
    config = lm_shakespeare.get_config("dense")
    torch.manual_seed(config.seed)
    model = from_config(config)
    opt, sched = adamw(model, config)
    stream = data.shakespeare(2, seq_len=128).x_train[rank]
    starts = batch_starts(config.seed, rank, range(config.num_train_steps), len(stream), 8, 128)
    for s in starts:
        x, y = windows(stream, s, 128)
        loss = lm_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()

References: Radford et al., Language Models are Unsupervised Multitask
Learners (GPT-2, pre-LayerNorm decoder), 2019; Loshchilov & Hutter, Decoupled
Weight Decay Regularization, 2019, arXiv:1711.05101.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import ml_collections
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from experiments import data as data_lib

EPS = 1e-6  # flax.linen.LayerNorm's epsilon
TRUNC_STD = 0.87962566103423978  # stddev of a unit normal truncated to [-2, 2] (as jax's)


def _lecun_normal_(w: torch.Tensor) -> None:
    """Flax's default kernel init on a torch ``(out, in)`` weight: truncated normal, var 1/in."""
    std = math.sqrt(1.0 / w.shape[1]) / TRUNC_STD
    nn.init.trunc_normal_(w, 0.0, std, -2 * std, 2 * std)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    lin = nn.Linear(n_in, n_out)
    _lecun_normal_(lin.weight)
    nn.init.zeros_(lin.bias)
    return lin


class CausalSelfAttention(nn.Module):
    """``nn.MultiHeadDotProductAttention(heads)`` with a causal mask: q, k, v, out projections."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.heads = heads
        self.q, self.k, self.v = _linear(dim, dim), _linear(dim, dim), _linear(dim, dim)
        self.out = _linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        # scale 1/sqrt(head_dim) (SDPA's default, Flax's query scaling)
        y = F.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """``models.DecoderBlock``: pre-LayerNorm causal self-attention + tanh-GELU MLP (4x)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim, eps=EPS)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim, eps=EPS)
        self.fc, self.proj = _linear(dim, 4 * dim), _linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """``models.CharTransformer``: (batch, seq) int64 bytes -> (batch, seq, vocab) logits.

    Initialised as Flax initialises the twin (module docstring), from torch's
    global random stream: call ``torch.manual_seed`` first.
    """

    def __init__(self, dim: int, depth: int, heads: int, max_len: int, vocab: int = 256):
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, dim)
        nn.init.normal_(self.tok.weight, 0.0, 1.0 / math.sqrt(dim))
        self.pos = nn.Parameter(torch.empty(max_len, dim))
        nn.init.normal_(self.pos, 0.0, 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim, eps=EPS)
        self.head = _linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} tokens is longer than max_len={self.max_len}")
        x = self.tok(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def from_config(config: ml_collections.ConfigDict) -> GPT:
    """The twin of ``config.model`` (a ``"gpt"`` / ``"char_transformer"`` config)."""
    if config.model.name not in ("gpt", "char_transformer"):
        raise ValueError(f"config.model.name: {config.model.name!r} has no torch twin here")
    kw = dict(config.model.get("kwargs", {}))
    vocab = kw.pop("vocab_size", 256)
    # CharTransformer's own defaults where the config leaves one out
    kw = {"dim": 128, "depth": 2, "heads": 4, "max_len": 256, **kw}
    return GPT(**kw, vocab=vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over batch and positions (the harness's LM loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- Flax params -> torch --------------------------------------------------------------

_same = lambda a: a
_dense = lambda a: a.T  # (in, out) -> (out, in)
_heads_in = lambda a: a.reshape(a.shape[0], -1).T  # (dim, heads, head_dim) -> (dim, dim)^T
_heads_out = lambda a: a.reshape(-1, a.shape[-1]).T  # (heads, head_dim, dim) -> (dim, dim)^T
_flat = lambda a: a.reshape(-1)  # (heads, head_dim) -> (dim,)


def param_pairs(model: GPT) -> list[tuple[str, tuple[str, ...], Callable]]:
    """``(torch name, Flax path, conversion)`` for every parameter, one Flax leaf each.

    ``conversion`` maps the Flax array (NumPy) to the torch parameter's layout.
    """
    pairs = [("tok.weight", ("Embed_0", "embedding"), _same), ("pos", ("pos",), _same)]

    def norm(name, path):
        pairs.extend([(f"{name}.weight", path + ("scale",), _same),
                      (f"{name}.bias", path + ("bias",), _same)])  # fmt: skip

    def linear(name, path, weight=_dense, bias=_same):
        pairs.extend([(f"{name}.weight", path + ("kernel",), weight),
                      (f"{name}.bias", path + ("bias",), bias)])  # fmt: skip

    for i in range(len(model.blocks)):
        t, f = f"blocks.{i}", (f"DecoderBlock_{i}",)
        att = f + ("MultiHeadDotProductAttention_0",)
        norm(f"{t}.ln1", f + ("LayerNorm_0",))
        for name, flax_name in (("q", "query"), ("k", "key"), ("v", "value")):
            linear(f"{t}.attn.{name}", att + (flax_name,), _heads_in, _flat)
        linear(f"{t}.attn.out", att + ("out",), _heads_out)
        norm(f"{t}.ln2", f + ("LayerNorm_1",))
        linear(f"{t}.fc", f + ("Dense_0",))
        linear(f"{t}.proj", f + ("Dense_1",))
    norm("ln_f", ("LayerNorm_0",))
    linear("head", ("Dense_0",))
    return pairs


def load_from_flax(torch_model: GPT, flax_params: Any) -> GPT:
    """Copies the Flax ``CharTransformer``'s ``params`` into ``torch_model``, in place.

    Dense kernels ``(in, out)`` are transposed; the attention's ``(dim, heads,
    head_dim)`` q/k/v kernels and ``(heads, head_dim, dim)`` out kernel are
    flattened to ``(dim, dim)`` and transposed, their ``(heads, head_dim)``
    biases flattened; LayerNorm ``scale`` becomes ``weight``.
    """
    params = dict(torch_model.named_parameters())
    for name, path, convert in param_pairs(torch_model):
        leaf = flax_params
        for key in path:
            leaf = leaf[key]
        value = torch.from_numpy(np.array(convert(np.asarray(leaf, np.float32)), order="C"))
        if value.shape != params[name].shape:
            raise ValueError(f"{'/'.join(path)}: {tuple(value.shape)} for {name} "
                             f"{tuple(params[name].shape)}")  # fmt: skip
        with torch.no_grad():
            params[name].copy_(value)
    return torch_model


# --- optimizer and schedule -------------------------------------------------------------

_ADAMW_KEYS = ("b1", "b2", "eps", "weight_decay")  # what torch.optim.AdamW can mirror


def learning_rate(config: ml_collections.ConfigDict, step: int) -> float:
    """``experiments.optimizers.learning_rate(config)`` at ``step``, in plain Python."""
    o = config.optimizer
    peak = o.learning_rate * o.get("lr_scale", 1.0)
    sched = o.get("schedule") or {"name": "constant"}
    if sched.get("name", "constant") == "constant":
        return peak
    if sched["name"] != "warmup_cosine":
        raise ValueError(f"config.optimizer.schedule.name: unknown {sched['name']!r}")
    warm, total = sched.get("warmup_steps", 0), config.num_train_steps
    if step < warm:  # optax.linear_schedule from 0
        return peak * step / warm
    end = peak * sched.get("end_factor", 0.1)
    t = min(step - warm, total - warm) / (total - warm)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


def adamw(
    model: nn.Module, config: ml_collections.ConfigDict
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """``optax.adamw`` on ``config``'s schedule: (optimizer, scheduler), every parameter decayed.

    The group's base rate is 1 and ``LambdaLR`` sets it to :func:`learning_rate`
    exactly; call ``scheduler.step()`` after each ``optimizer.step()``.
    """
    o = config.optimizer
    if o.name != "adamw":
        raise ValueError(f"config.optimizer.name: {o.name!r}; the torch twin mirrors 'adamw' only")
    kw = dict(o.get("kwargs", {}))
    unknown = sorted(set(kw) - set(_ADAMW_KEYS))
    if unknown:  # mask, nesterov, eps_root, mu_dtype: would silently differ from optax
        raise ValueError(f"config.optimizer.kwargs: {unknown} not mirrored in torch")
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=1.0,
        betas=(kw.get("b1", 0.9), kw.get("b2", 0.999)),
        eps=kw.get("eps", 1e-8),
        weight_decay=kw.get("weight_decay", 1e-4),  # optax's default (torch's is 1e-2)
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(config, s))


# --- batches ------------------------------------------------------------------------------


def batch_starts(
    seed: int, worker: int, steps: Iterable[int], stream_len: int, batch_size: int, seq_len: int
) -> np.ndarray:
    """``(len(steps), batch_size)`` window starts: ``data.sample_batch``'s for ``worker``.

    ``seed`` is ``config.seed`` (the key: :func:`experiments.data.worker_key`);
    ``stream_len`` the length of the worker's stream.
    """
    key = data_lib.worker_key(seed, worker)
    high = stream_len - seq_len - 1
    draw = lambda s: jax.random.randint(jax.random.fold_in(key, s), (batch_size,), 0, high)
    steps = np.asarray(list(steps), np.int32)
    return np.asarray(jax.jit(jax.vmap(draw))(steps), np.int64)


def windows(
    stream: np.ndarray, starts: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) int64 tensors ``(len(starts), seq_len)``: windows shifted by one byte."""
    idx = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len + 1)
    w = torch.from_numpy(np.asarray(stream)[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, test_windows: np.ndarray, batch_size: int = 128) -> dict:
    """The harness's evaluation over ``test_windows`` ``(t, seq_len + 1)`` (``data.shakespeare``'s
    ``x_test``): the mean next-byte loss over windows with its standard error, and accuracy."""
    losses, correct, count = [], 0, 0
    for i in range(0, len(test_windows), batch_size):
        w = torch.from_numpy(np.asarray(test_windows[i : i + batch_size], np.int64))
        logits = model(w[:, :-1])
        per = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="none"
        )
        losses.extend(per.reshape(len(w), -1).mean(1).tolist())
        correct += int((logits.argmax(-1) == w[:, 1:]).sum())
        count += w[:, 1:].numel()
    losses = np.asarray(losses)
    return {
        "eval_loss": float(losses.mean()),
        "eval_loss_se": float(losses.std(ddof=1) / np.sqrt(len(losses))),
        "accuracy": correct / count,
    }
