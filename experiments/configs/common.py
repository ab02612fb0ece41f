"""Defaults shared by every config; each config file overrides what it needs."""

from __future__ import annotations

import ml_collections


def base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.n_workers = 0  # 0: every device (8 fake CPU devices here)
    c.model = ml_collections.ConfigDict({"name": "mlp", "kwargs": {}})
    c.data = ml_collections.ConfigDict(
        {"name": "digits", "batch_size": 32, "seq_len": 0, "dir": "", "max_chars": 2**21}
    )
    c.compressor = ml_collections.ConfigDict({"name": "allreduce", "kwargs": {}})
    c.policy = "none"  # "matrices": compressor on >=2-D leaves, dense all-reduce on the rest
    c.optimizer = ml_collections.ConfigDict({"name": "sgd", "learning_rate": 0.1, "kwargs": {}})
    c.wrapper = ml_collections.ConfigDict({"name": "none", "every": 1, "warmup_steps": 0})
    c.num_train_steps = 400
    c.steps_per_call = 50  # micro-steps per compiled call (lax.scan)
    c.eval_every = 50
    c.checkpoint_every = 200
    c.eval_batch_size = 1024
    c.netsim = ml_collections.ConfigDict({"gbps": 10.0, "latency_us": 10.0, "compute_s": 0.0})
    c.progress = True
    c.plot = True
    return c


def apply_variant(c: ml_collections.ConfigDict, variant: dict) -> None:
    """Set a config's compressor, policy and wrapper from a ``VARIANTS`` entry.

    ``variant``: ``{"compressor": (name, kwargs), "policy"?: str, "wrapper"?: (name, every)}``.
    """
    name, kwargs = variant["compressor"]
    c.compressor.name, c.compressor.kwargs = name, dict(kwargs)
    c.policy = variant.get("policy", "none")
    if "wrapper" in variant:
        c.wrapper.name, c.wrapper.every = variant["wrapper"]
