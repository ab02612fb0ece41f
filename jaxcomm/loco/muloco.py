"""MuLoCo: DiLoCo with Muon as the inner optimizer, optionally with a compressed outer gradient.

A preset over :func:`jaxcomm.diloco`: nothing of DiLoCo is re-implemented
here. The inner optimizer is ``optax.contrib.muon`` (Muon on 2-D weights,
Adam on the other leaves, as optax partitions them); the outer optimizer is
Nesterov SGD on the averaged pseudo-gradient; with ``compressor`` each
worker's pseudo-gradient goes through a jaxcomm compressor with error
feedback (``e ← e + delta``; ``c = C(e)``; ``e ← e − c``) before the mean.
"""

from collections.abc import Mapping
from typing import Any

import optax

from jaxcomm import buckets, sync
from jaxcomm.collectives import AxisName

__all__ = ["muloco"]


def muloco(
    learning_rate: optax.ScalarOrSchedule,
    *,
    every: int,
    axis_name: AxisName | None,
    outer: optax.GradientTransformation | None = None,
    compressor: Any = None,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    muon_options: Mapping[str, Any] | None = None,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
) -> optax.GradientTransformation:
    """MuLoCo: ``every`` Muon steps per worker, then DiLoCo's Nesterov outer step.

    Rule: exactly ``jaxcomm.diloco(optax.contrib.muon(learning_rate, beta=momentum,
    weight_decay=weight_decay, **muon_options), every, axis_name, outer, compressor)``.
    Wire: :func:`jaxcomm.diloco`'s, one (compressed) pseudo-gradient mean per round.

    Args:
      learning_rate: Muon's learning rate (a float or an optax schedule).
      every: inner steps per outer step (H), an int >= 1.
      axis_name: mesh axis to average over; ``None``: a single worker.
      outer: the outer optimizer; ``None``: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      compressor: ``None`` (a dense mean), a jaxcomm transform built with the
        same ``axis_name`` or a :class:`jaxcomm.Compressor` (see :func:`jaxcomm.diloco`).
      momentum: Muon's momentum ``beta``. weight_decay: Muon's decoupled weight decay.
      muon_options: further keyword arguments of ``optax.contrib.muon`` (e.g. ``{"ns_steps": 5}``).
      bucket_bytes: tensor fusion of the dense averaging (see :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`jaxcomm.sync.DiLoCoState`; needs ``params``.

    Example:
      >>> tx = jaxcomm.muloco(0.02, every=30, axis_name="data")

    References:
      Thérien, Huang, Rish & Belilovsky, "MuLoCo: Muon is a practical inner
      optimizer for DiLoCo", 2025, arXiv:2505.23725. Jordan et al., "Muon", 2024.
      Douillard et al., "DiLoCo", 2023, arXiv:2311.08105.
    """
    # Notes. The Muon state (its momentum) is per worker and kept across rounds. With ``compressor``
    # (e.g. ``jaxcomm.topk(0.25, axis_name="data")`` or ``jaxcomm.int8(axis_name="data")``, built
    # with the same ``axis_name``) the pseudo-gradient is sent compressed with that compressor's
    # error feedback, and the outer optimizer sees the mean of what was sent. Muon: Jordan et al.,
    # "Muon: An optimizer for hidden layers in neural networks", 2024 (blog post). DiLoCo: Douillard
    # et al., 2023, arXiv:2311.08105.
    options = dict(muon_options or {})
    clash = {"learning_rate", "beta", "weight_decay"} & set(options)
    if clash:
        raise ValueError(
            f"muon_options: {sorted(clash)} are muloco's own arguments (learning_rate, "
            f"momentum, weight_decay); pass them there"
        )
    inner = optax.contrib.muon(learning_rate, beta=momentum, weight_decay=weight_decay, **options)
    kwargs = {} if outer is None else {"outer": outer}
    return sync.diloco(
        inner,
        every=every,
        axis_name=axis_name,
        compressor=compressor,
        bucket_bytes=bucket_bytes,
        **kwargs,
    )
