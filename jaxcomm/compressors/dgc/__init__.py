"""Deep Gradient Compression (Lin et al., ICLR 2018), all four parts switchable.

Per worker and step (``m`` the momentum, ``n`` workers)::

    g   ← g · min(1, (clip_norm/√n) / ‖g‖)       # local gradient clipping
    u   ← m·u + g                                # momentum correction
    v   ← v + u                                  # accumulate velocity
    thr ← sampled top-ρ threshold of |v|          # ρ: density of the step
    send the first ρ·d entries with |v| ≥ thr     # values + int32 indices
    v, u ← 0 where sent                          # momentum factor masking
    return mean over workers of what was sent    # apply with PLAIN SGD

Momentum lives inside DGC, so the transform that follows must be plain SGD
(``optax.sgd(lr)`` without momentum): see :func:`dgc_sgd` and
:func:`check_followed_by_plain_sgd`.

DGC has two state buffers (u and v) and a threshold rule of its own, so it
is its own optax transform rather than a :class:`jaxcomm.core.Compressor`;
it follows the conventions of :func:`jaxcomm.compress`.
"""

from jaxcomm.compressors.dgc.chain import check_followed_by_plain_sgd, dgc_sgd
from jaxcomm.compressors.dgc.schedule import dgc_density_schedule
from jaxcomm.compressors.dgc.transform import DGCState, dgc

__all__ = [
    "DGCState",
    "check_followed_by_plain_sgd",
    "dgc",
    "dgc_density_schedule",
    "dgc_sgd",
]
