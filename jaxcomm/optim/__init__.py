"""Optimizers whose communication is part of the algorithm: 1-bit Adam, 0/1 Adam and DeMo.

Adam's variance ``v`` cannot be compressed with error feedback (it is not a
linear function of the gradients), but it becomes stable early in training.
1-bit Adam (Tang et al. 2021) runs ordinary Adam with dense all-reduce for a
warm-up, then freezes ``v`` and communicates only the momentum, compressed to
one bit per entry with error feedback on both sides of the two-phase exchange
(:func:`jaxcomm.exchange.two_phase`), the variance acting as a fixed
preconditioner. 0/1 Adam (Lu et al. 2022) refreshes ``v`` only on an
exponentially thinning schedule of steps, compresses every other step, and
after freezing ``v`` takes local steps, synchronising the accumulated update
(1-bit, with error feedback) at doubling intervals.

Both are optax transforms of their own rather than compressors on the
:func:`jaxcomm.compress` pipeline: what they exchange is Adam's momentum or
the accumulated local update, on schedules of their own, not the gradient;
they reuse the pipeline's pieces (the two-phase exchange, buckets, the NaN rule).

DeMo (Peng, Quesnelle, Kingma 2024) never averages the gradient: each worker
keeps its own momentum, sends only the largest DCT coefficients of each chunk
of it (subtracting what it sent, so the momentum is its own error feedback),
and every worker steps by the sign of the decoded mean of what was sent.
"""

from jaxcomm.optim.demo import DeMoState, demo
from jaxcomm.optim.onebit_adam import OnebitAdamState, onebit_adam
from jaxcomm.optim.zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__ = [
    "DeMoState",
    "OnebitAdamState",
    "ZeroOneAdamState",
    "demo",
    "onebit_adam",
    "zero_one_adam",
]
