"""DGC's warm-up schedule of densities and the checks of its options."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxcomm import checks

# --- validation ---------------------------------------------------------------------


def check_momentum(value: Any) -> float:
    return checks.check_float(value, "momentum", low=0, strict=False, high=1)


def check_clip(value: Any) -> float | None:
    return None if value is None else checks.check_positive(value, "clip_norm")


# --- warm-up schedule ---------------------------------------------------------------


def densities(
    ratio: float, warmup_epochs: int, warmup_ratios: Sequence[float] | None
) -> tuple[float, ...]:
    """Density of each warm-up epoch, then ``ratio``."""
    if warmup_ratios is None:
        # The paper's 75%, 93.75%, 98.4375%, 99.6% sparsity: each epoch keeps a quarter of
        # the previous one's entries, never fewer than the final ratio.
        warm = [max(ratio, 0.25 ** (e + 1)) for e in range(warmup_epochs)]
    else:
        warm = [checks.check_ratio(r, "warmup_ratios") for r in warmup_ratios]
    return (*warm, ratio)


def boundaries(warmup_steps: int, warmup_epochs: int) -> list[int]:
    """First step of warm-up epochs 1..E (epoch E = after warm-up): ceil(e·W/E)."""
    return [-(-e * warmup_steps // warmup_epochs) for e in range(1, warmup_epochs + 1)]


def dgc_density_schedule(
    ratio: float = 0.001,
    *,
    warmup_steps: int = 0,
    warmup_epochs: int = 4,
    warmup_ratios: Sequence[float] | None = None,
) -> Callable[[Any], Any]:
    """The fraction of entries DGC sends at a step (1 − sparsity), as a schedule.

    The first ``warmup_steps`` steps are split into ``warmup_epochs`` equal
    "epochs" (step s is in epoch ``floor(s·E/W)``); epoch e sends
    ``warmup_ratios[e]``, by default ``max(ratio, 4^-(e+1))``: the paper's
    exponential warm-up 75%, 93.75%, 98.4375%, 99.6% sparsity over four
    epochs. From step ``warmup_steps`` on: ``ratio`` (99.9% sparsity by
    default).

    Args:
      ratio: density after warm-up, in (0, 1].
      warmup_steps: steps of warm-up, >= 0 (0: none).
      warmup_epochs: warm-up epochs, >= 1.
      warmup_ratios: densities of the warm-up epochs (``warmup_epochs`` of
        them, each in (0, 1]); ``None`` for the paper's.

    Returns:
      ``step -> density``; works on Python ints and on jnp int arrays.

    Example:
      >>> f = dgc_density_schedule(0.001, warmup_steps=400)
      >>> [f(s) for s in (0, 100, 200, 300, 400)]
      [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    """
    ratio, warmup_steps, warmup_epochs, warmup_ratios = check_schedule(
        ratio, warmup_steps, warmup_epochs, warmup_ratios
    )
    dens = densities(ratio, warmup_epochs, warmup_ratios) if warmup_steps else (ratio,)
    bounds = boundaries(warmup_steps, warmup_epochs) if warmup_steps else []

    def schedule(step):
        if isinstance(step, (int, np.integer)):
            return dens[sum(step >= b for b in bounds)]
        phase = sum((jnp.asarray(step) >= b).astype(jnp.int32) for b in bounds)
        return jnp.asarray(dens, jnp.float32)[phase]

    return schedule


def check_schedule(ratio, warmup_steps, warmup_epochs, warmup_ratios):
    ratio = checks.check_ratio(ratio)
    warmup_steps = checks.check_int(warmup_steps, "warmup_steps", 0)
    warmup_epochs = checks.check_int(warmup_epochs, "warmup_epochs", 1)
    if warmup_ratios is not None:
        warmup_ratios = tuple(warmup_ratios)
        if len(warmup_ratios) != warmup_epochs:
            raise ValueError(
                f"warmup_ratios: expected {warmup_epochs} densities (one per warm-up epoch), "
                f"got {len(warmup_ratios)}"
            )
    return ratio, warmup_steps, warmup_epochs, warmup_ratios
