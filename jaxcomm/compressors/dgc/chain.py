"""DGC followed by plain SGD, and the check that nothing after DGC adds momentum."""

from __future__ import annotations

from typing import Any

import optax

from jaxcomm.compressors.dgc.schedule import check_momentum
from jaxcomm.compressors.dgc.transform import DGCState, dgc

# --- the chain ----------------------------------------------------------------------


def dgc_sgd(
    learning_rate: optax.ScalarOrSchedule,
    ratio: float = 0.001,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_correction: bool = True,
    **dgc_options: Any,
) -> optax.GradientTransformation:
    """DGC followed by the SGD it needs: momentum in DGC, plain SGD after.

    Rule: ``optax.chain(jaxcomm.dgc(ratio, momentum=momentum, ...), optax.sgd(lr))``;
    with ``momentum_correction=False`` the momentum moves to the SGD instead.
    Wire: :func:`dgc`'s.

    Args:
      learning_rate: SGD learning rate (float or optax schedule).
      ratio: DGC density after warm-up, in (0, 1].
      momentum: momentum in [0, 1). nesterov: Nesterov momentum.
      momentum_correction: see :func:`dgc`.
      **dgc_options: any other keyword argument of :func:`dgc` (``axis_name``, ...).

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = jaxcomm.dgc_sgd(0.1, 0.001, axis_name="data", warmup_steps=2000)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, arXiv:1712.01887.
    """
    # Notes. With ``momentum_correction=False``: ``optax.chain(jaxcomm.dgc(ratio, momentum=0,
    # momentum_correction=False, ...), optax.sgd(lr, momentum=momentum, nesterov=nesterov))``.
    # ``dgc_options`` e.g. ``axis_name``, ``clip_norm``, ``warmup_steps``.
    if momentum_correction:
        return optax.chain(
            dgc(ratio, momentum=momentum, nesterov=nesterov, **dgc_options),
            optax.sgd(learning_rate),
        )
    m = check_momentum(momentum)
    return optax.chain(
        dgc(ratio, momentum=0.0, momentum_correction=False, **dgc_options),
        optax.sgd(learning_rate, momentum=m or None, nesterov=nesterov),
    )


_MOMENTUM_FIELDS = ("trace", "mu", "momentum", "momentum_buffer")


def check_followed_by_plain_sgd(opt_state: Any) -> None:
    """Raise if a DGC with momentum is followed by a transform that keeps momentum.

    Walks an optimizer state (e.g. ``tx.init(params)`` of an ``optax.chain``)
    in chain order. After a :class:`DGCState` holding momentum, any state with
    a momentum-like field (``trace``: ``optax.sgd(momentum=...)``,
    ``optax.trace``; ``mu``: Adam, AdamW, Lion, ...) means momentum is applied
    twice.

    Args:
      opt_state: the state of the whole optimizer.

    Raises:
      ValueError: naming the offending state.

    Example:
      >>> tx = optax.chain(jaxcomm.dgc(axis_name="data"), optax.sgd(0.1, momentum=0.9))
      >>> check_followed_by_plain_sgd(tx.init(params))  # ValueError
    """

    def is_state(x):
        return isinstance(x, tuple) and hasattr(x, "_fields")

    def walk(node):  # states in chain order, wrappers before what they wrap
        if is_state(node):
            yield node
            if isinstance(node, DGCState):
                return
        if isinstance(node, (tuple, list)):
            for child in node:
                yield from walk(child)
        elif isinstance(node, dict):
            for child in node.values():
                yield from walk(child)

    seen_dgc = False
    for node in walk(opt_state):
        if isinstance(node, DGCState):
            if seen_dgc and node.momentum is not None:
                raise ValueError("opt_state: two DGC transforms with momentum in one chain")
            seen_dgc = seen_dgc or node.momentum is not None
            continue
        if seen_dgc:
            found = [f for f in _MOMENTUM_FIELDS if f in node._fields]
            if found:
                raise ValueError(
                    f"opt_state: {type(node).__name__} (field {found[0]!r}) follows a DGC that "
                    f"already applies momentum; use plain SGD after DGC, e.g. optax.chain("
                    f"jaxcomm.dgc(...), optax.sgd(lr)) or jaxcomm.dgc_sgd(lr, ...)"
                )
