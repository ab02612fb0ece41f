"""What both sides of the peers bench share: the models by name, each rank's batch and
gradients, PowerSGD's settings, and how step times are summarised.

Split from :mod:`experiments.bench.torch_peers` so that the jaxcomm side
(:mod:`experiments.bench.peers_jax`) builds the same models and batches without
torch; :mod:`experiments.bench.torch_peers` builds its twins from the same
:data:`MODELS`. NumPy only.
"""

from __future__ import annotations

import numpy as np

# name -> (flax kwargs for experiments.models.build, input shape NHWC or (features,))
MODELS = {
    "mlp": (dict(name="mlp", num_classes=10, hidden=1024, depth=2), (64,)),
    # the digits MLP (experiments/digits.py's shape): 64-256-10, tanh, 19,210 params
    "digits": (dict(name="mlp", num_classes=10, hidden=256, depth=1), (64,)),
    "resnet18": (
        dict(name="resnet", num_classes=10, stages=(64, 128, 256, 512), blocks=2),
        (8, 8, 3),
    ),
}
POWERSGD = dict(rank=2, start_iter=2, min_compression_rate=2.0)  # both frameworks


def batch(name: str, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of rank ``rank`` (NHWC / flat features, int labels): same in both frameworks."""
    shape = MODELS[name][1]
    rng = np.random.default_rng(1000 + rank)
    x = rng.normal(size=(size,) + shape).astype(np.float32)
    y = rng.integers(0, MODELS[name][0]["num_classes"], size=(size,)).astype(np.int32)
    return x, y


def spread(times: list[float]) -> dict:
    """Median, min, max and interquartile range of step times (seconds)."""
    a = np.asarray(times)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return dict(
        median=float(med), min=float(a.min()), max=float(a.max()), iqr=float(q3 - q1), n=len(a)
    )


def worker_grads(shapes, step: int, worker: int, seed: int = 0) -> list[np.ndarray]:
    """Worker ``worker``'s gradients at ``step`` (torch layout): the same in every process."""
    rng = np.random.default_rng([seed, step, worker])
    return [rng.normal(size=s).astype(np.float32) for s in shapes]
