"""Defaults shared by every config; each config file overrides what it needs.

Method names resolve in :mod:`jaxcomm.methods` (the library's registry); a
config file's ``VARIANTS`` are the table of its named variants beside it (a
method with the options a study ran). :func:`variant` looks a variant up:
every compressor of the registry is a variant of every config as well, with
its defaults (``--config experiments/configs/digits_mlp.py:fp8`` trains a codec
added under ``jaxcomm/compressors/`` with no edit here). :func:`optimizer`
builds a variant's optimizer, for whatever needs a method by name without a
training run of :mod:`experiments.train` (the comparison study, the notebooks,
tests).
"""

from __future__ import annotations

from types import ModuleType

import ml_collections
import optax

from jaxcomm import methods


def base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.n_workers = 0  # 0: every device (8 fake CPU devices here)
    c.model = ml_collections.ConfigDict({"name": "mlp", "kwargs": {}})
    # batch_size: per worker per step; 0 (classification): the whole shard, in order
    c.data = ml_collections.ConfigDict(
        {"name": "digits", "batch_size": 32, "seq_len": 0, "dir": "", "max_chars": 2**21}
    )
    c.compressor = ml_collections.ConfigDict({"name": "allreduce", "kwargs": {}})
    c.policy = "none"  # "matrices": compressor on >=2-D leaves, dense all-reduce on the rest
    c.optimizer = ml_collections.ConfigDict(
        {"name": "sgd", "learning_rate": 0.1, "lr_scale": 1.0, "kwargs": {}}
    )
    c.wrapper = ml_collections.ConfigDict(
        # fragments, delay, mix: streaming_diloco's (see jaxcomm.streaming_diloco)
        {"name": "none", "every": 1, "warmup_steps": 0, "fragments": 1, "delay": 0, "mix": 0.0}
    )
    c.num_train_steps = 400
    c.steps_per_call = 50  # micro-steps per compiled call (lax.scan)
    c.eval_every = 50
    c.checkpoint_every = 200
    c.eval_batch_size = 1024
    c.netsim = ml_collections.ConfigDict({"gbps": 10.0, "latency_us": 10.0, "compute_s": 0.0})
    # "abort": a NaN/Inf training loss or state stops the run with an error, saving nothing
    # non-finite; "continue": train on (non-finite states are still never checkpointed)
    c.on_nonfinite = "abort"
    c.progress = True
    c.plot = True
    # every process appends to timeline.p<i>.jsonl in the workdir: each call's start and
    # end, process 0's evaluation's end, and when the process was free to go on (time.time()),
    # to check that the processes run in step
    c.timeline = False
    return c


def variant(variants: dict[str, dict], name: str, config: str) -> dict:
    """``variants[name]``, or ``{"compressor": (name, {})}`` where ``name`` is a compressor of
    :func:`jaxcomm.methods.compressors`; a ``ValueError`` naming config ``config`` otherwise."""
    if name in variants:
        return variants[name]
    if name in methods.compressors():
        return {"compressor": (name, {})}
    raise ValueError(
        f"{config} variant: unknown {name!r}; choose from {list(variants)} or a compressor "
        f"of jaxcomm.methods: {methods.compressors()}"
    )


def apply_variant(c: ml_collections.ConfigDict, variant: dict) -> None:
    """Set a config's compressor, policy, wrapper (and learning-rate factor) from a variant.

    ``variant``: ``{"compressor": (name, kwargs), "policy"?: str, "wrapper"?: (name, every)
    or (name, every, {other wrapper keys}), "optimizer"?: (name, kwargs), "lr_scale"?: float}``;
    ``optimizer`` replaces the config's optimizer name and keyword arguments (its learning
    rate and schedule stay); ``lr_scale`` multiplies ``optimizer.learning_rate`` (e.g. 0.1
    for DGC, which keeps momentum 0.9 itself).
    """
    name, kwargs = variant["compressor"]
    c.compressor.name, c.compressor.kwargs = name, dict(kwargs)
    c.policy = variant.get("policy", "none")
    if "wrapper" in variant:
        c.wrapper.name, c.wrapper.every, *more = variant["wrapper"]
        c.wrapper.update(more[0] if more else {})
    if "optimizer" in variant:
        c.optimizer.name, kwargs = variant["optimizer"]
        c.optimizer.kwargs = dict(kwargs)
    if "lr_scale" in variant:
        c.optimizer.lr_scale = float(variant["lr_scale"])


def variant_config(
    config_module: ModuleType, variant: str, *, learning_rate: float | None = None
) -> ml_collections.ConfigDict:
    """``config_module.get_config(variant)``, its learning rate replaced if given."""
    c = config_module.get_config(variant)
    if learning_rate is not None:
        c.optimizer.learning_rate = learning_rate
    return c


def optimizer(
    config_module: ModuleType, variant: str, *, learning_rate: float | None = None
) -> optax.GradientTransformation:
    """The optimizer of ``config_module``'s variant ``variant``, as training builds it.

    E.g. ``optimizer(digits_compare, "EF-sign", learning_rate=0.3)``: its
    collectives over axis ``"data"``, its keys from the config's seed
    (:func:`experiments.optimizers.make_optimizer`).
    """
    from experiments import optimizers  # the harness composes; configs only hold values

    return optimizers.make_optimizer(
        variant_config(config_module, variant, learning_rate=learning_rate)
    )


def comm_every(c: ml_collections.ConfigDict) -> int:
    """Steps per communication of a config's wrapper (1: every step communicates)."""
    return 1 if c.wrapper.name == "none" else int(c.wrapper.every)
