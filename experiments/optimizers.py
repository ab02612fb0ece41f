"""Optimizer composition by name: ``make_optimizer(config)``, the transform a run trains with.

``config.compressor.name`` is a :mod:`jaxcomm` factory (called as
``getattr(jaxcomm, name)(**kwargs, axis_name="data")``, a ``key`` added when
the factory takes one), ``config.optimizer.name`` an optax optimizer (Muon from
``optax.contrib``, DeMo from :mod:`jaxcomm`), ``config.policy`` which leaves
are compressed and ``config.wrapper.name`` how they are composed (gradient
accumulation, local SGD, the DiLoCo family). :func:`learning_rate` is the
run's schedule; :func:`comm_steps` counts the steps that communicate.
:mod:`experiments.train` validates the whole config and trains with the result.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import numpy as np
import optax

import jaxcomm
from jaxcomm import methods

AXIS = "data"  # the mesh axis the transforms exchange over (the training mesh's)
# the compressors are jaxcomm.methods.compressors(), read when a config is checked (a codec
# module added under jaxcomm/compressors/ is one), plus jaxcomm.auto (measured on the run's
# mesh when training starts)
AUTO = "auto"
# optax's, optax.contrib's Muon (MuLoCo's inner optimizer under wrapper "diloco") and
# jaxcomm.demo (DeMo communicates itself: compressor "allreduce", wrapper "none")
OPTIMIZERS = ("sgd", "adam", "adamw", "muon", "demo")
# "no_exchange": the optimizer alone, each worker on its own batch and its own copy (a
# compute floor to time a step against; nothing is averaged)
WRAPPERS = (
    "none", "accumulate", "local_sgd", "diloco", "streaming_diloco", "sparseloco", "no_exchange",
)  # fmt: skip
PARAM_AVERAGING = ("local_sgd", "diloco", "streaming_diloco", "sparseloco")  # per-worker params
# wrapper keys passed to jaxcomm.sparseloco (as its keyword arguments)
SPARSELOCO_KEYS = ("outer_learning_rate", "error_decay", "chunk", "topk", "bits")
POLICIES = ("none", "matrices")


def choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, else a ``ValueError`` naming config ``key``."""
    if value not in allowed:
        raise ValueError(f"{key}: unknown {value!r}; choose from {list(allowed)}")
    return value


def positive_int(value: Any, key: str, low: int = 1) -> int:
    """``value`` as an int if it is one >= ``low``, else a ``ValueError`` naming config ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{key}: expected an int >= {low}, got {value!r}")
    return int(value)


def compressor_names() -> tuple[str, ...]:
    """What ``config.compressor.name`` may be: every compressor of :mod:`jaxcomm.methods`
    and ``"auto"``."""
    return (*methods.compressors(), AUTO)


SCHEDULES = ("constant", "warmup_cosine")


def learning_rate(
    config: ml_collections.ConfigDict, peak: float | None = None
) -> float | optax.Schedule:
    """``config.optimizer.learning_rate`` x ``lr_scale``, shaped by ``optimizer.schedule`` if set.

    ``schedule.name="warmup_cosine"``: linear warm-up from 0 over
    ``schedule.warmup_steps``, then cosine decay to ``schedule.end_factor`` x the
    peak at ``config.num_train_steps`` (one schedule for every method of a study).
    ``peak``: another peak on the same schedule (Muon's Adam learning rate).
    """
    lr = config.optimizer.learning_rate if peak is None else peak
    scale = config.optimizer.get("lr_scale", 1.0)
    if scale != 1.0:
        lr = lr * scale
    sched = config.optimizer.get("schedule") or {"name": "constant"}
    name = choice(sched.get("name", "constant"), "config.optimizer.schedule.name", SCHEDULES)
    if name == "constant":
        return lr
    warm = positive_int(sched.get("warmup_steps", 0), "config.optimizer.schedule.warmup_steps", 0)
    total = positive_int(config.num_train_steps, "config.num_train_steps")
    if warm >= total:
        raise ValueError(
            f"config.optimizer.schedule.warmup_steps: {warm} must be < num_train_steps={total}"
        )
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, warm, total, end_value=lr * sched.get("end_factor", 0.1)
    )


def make_optimizer(
    config: ml_collections.ConfigDict,
    params: Any = None,
    mesh: Any = None,
    costs: dict[str, float] | None = None,
    rounds: dict[str, list[float]] | None = None,
) -> optax.GradientTransformation:
    """Compose ``config.compressor`` with ``config.optimizer`` per policy and wrapper.

    ``compressor.name="auto"`` (:func:`jaxcomm.auto`, its keyword arguments from
    ``compressor.kwargs``: margin, max_ratio, warmup_steps, repeats) measures its
    candidates on ``mesh`` with one worker's ``params`` (or decides from ``costs``
    and their ``rounds`` measured before: a resumed run replays its first choice); without them
    (validation, before any data is read) the dense all-reduce stands in.
    """
    comp_name = choice(config.compressor.name, "config.compressor.name", compressor_names())
    opt_name = choice(config.optimizer.name, "config.optimizer.name", OPTIMIZERS)
    wrapper = choice(config.wrapper.name, "config.wrapper.name", WRAPPERS)
    policy = choice(config.get("policy", "none"), "config.policy", POLICIES)
    lr = learning_rate(config)
    opt_kwargs = dict(config.optimizer.get("kwargs", {}))
    comp_kwargs = dict(config.compressor.get("kwargs", {}))
    if opt_name == "demo":
        if comp_name != "allreduce" or wrapper != "none" or policy != "none":
            raise ValueError(
                "config.optimizer.name: 'demo' exchanges its own compressed momentum; use "
                "compressor.name='allreduce', wrapper.name='none', policy='none'"
            )
        try:
            return jaxcomm.demo(lr, axis_name=AXIS, **opt_kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.optimizer: bad value for 'demo': {e}") from None
    if opt_name == "muon" and "adam_learning_rate" in opt_kwargs:
        # a peak on the run's schedule, so the non-matrix leaves' Adam warms up and decays too
        opt_kwargs["adam_learning_rate"] = learning_rate(config, opt_kwargs["adam_learning_rate"])
    try:
        family = optax.contrib if opt_name == "muon" else optax
        opt = getattr(family, opt_name)(lr, **opt_kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.optimizer: bad value for {opt_name!r}: {e}") from None
    if wrapper == "no_exchange":
        if comp_name != "allreduce" or policy != "none":
            raise ValueError(
                "config.wrapper.name: 'no_exchange' sends nothing; use "
                "compressor.name='allreduce' and policy='none'"
            )
        return opt
    if comp_name in ("dgc", "dgc_sgd"):
        if opt_name != "sgd" or opt_kwargs.get("momentum"):
            raise ValueError(
                "config.optimizer: DGC keeps momentum itself and must be followed by plain SGD; "
                "use optimizer.name='sgd' without momentum (or compressor.name='dgc_sgd')"
            )
        if policy != "none" or wrapper in PARAM_AVERAGING:
            raise ValueError(
                "config.compressor.name: 'dgc'/'dgc_sgd' need policy='none', "
                "wrapper 'none' or 'accumulate'"
            )
    try:
        if comp_name == "auto" and params is None:
            comm = jaxcomm.allreduce(axis_name=AXIS)  # validation: the choice needs the mesh
        elif comp_name == "auto":
            lead = jax.process_index() == 0
            log = print if lead else None
            comm = jaxcomm.auto(
                params, mesh, AXIS, **comp_kwargs, costs=costs, rounds=rounds, log=log
            )
        elif comp_name == "dgc_sgd":
            chained = methods.make("dgc_sgd", seed=config.seed, **comp_kwargs,
                                   learning_rate=lr, axis_name=AXIS)  # fmt: skip
            comm = None
        else:
            comm = make_compressor(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.compressor.kwargs: bad value for {comp_name!r}: {e}") from None
    if comm is not None and policy == "matrices":
        labels = lambda params: jax.tree.map(lambda p: "comp" if p.ndim >= 2 else "dense", params)
        comm = optax.partition({"comp": comm, "dense": jaxcomm.allreduce(axis_name=AXIS)}, labels)
    every = config.wrapper.get("every", 1)
    if wrapper != "none":
        every = positive_int(every, "config.wrapper.every")
    if wrapper in PARAM_AVERAGING:
        local_comp = None if comp_name == "allreduce" else comm
        if wrapper == "streaming_diloco":
            w = config.wrapper
            return jaxcomm.streaming_diloco(
                opt, every=every, fragments=w.get("fragments", 1), delay=w.get("delay", 0),
                mix=w.get("mix", 0.0), axis_name=AXIS, compressor=local_comp,
            )  # fmt: skip
        if wrapper == "sparseloco":
            if comp_name != "allreduce":
                raise ValueError(
                    "config.compressor.name: SparseLoCo compresses its outer gradient itself "
                    "(wrapper keys topk, chunk, bits); use 'allreduce'"
                )
            kw = {k: config.wrapper[k] for k in SPARSELOCO_KEYS if k in config.wrapper}
            try:
                return jaxcomm.sparseloco(opt, every=every, axis_name=AXIS, **kw)
            except (TypeError, ValueError) as e:
                raise ValueError(f"config.wrapper: bad value for 'sparseloco': {e}") from None
        if wrapper == "local_sgd":
            warm = positive_int(config.wrapper.get("warmup_steps", 0), "wrapper.warmup_steps", 0)
            return jaxcomm.local_sgd(
                opt, every=every, axis_name=AXIS, warmup_steps=warm, compressor=local_comp
            )
        outer_lr = config.wrapper.get("outer_learning_rate", 0.7)
        if not (isinstance(outer_lr, (int, float)) and outer_lr > 0):
            raise ValueError(f"config.wrapper.outer_learning_rate: must be > 0, got {outer_lr!r}")
        outer = optax.sgd(outer_lr, momentum=0.9, nesterov=True)  # DiLoCo's outer Nesterov
        return jaxcomm.diloco(opt, every=every, axis_name=AXIS, compressor=local_comp, outer=outer)
    if comm is not None:
        chained = optax.chain(comm, opt)
    if wrapper == "accumulate":
        return jaxcomm.accumulate(chained, every=every)
    return chained


def make_compressor(
    config: ml_collections.ConfigDict, axis_name: Any = AXIS
) -> optax.GradientTransformation:
    """``config.compressor``'s transform alone, on ``axis_name`` (None: compress locally).

    Only a plain factory of :mod:`jaxcomm` (not ``auto`` or ``dgc_sgd``, which
    need the mesh or the learning rate): what :func:`make_optimizer` chains
    before the optimizer, for benchmarks that time its parts.
    """
    name = choice(config.compressor.name, "config.compressor.name", compressor_names())
    if name in (AUTO, "dgc_sgd"):
        raise ValueError(f"config.compressor.name: {name!r} is not a plain compressor")
    kwargs = dict(config.compressor.get("kwargs", {}), axis_name=axis_name)
    return methods.make(name, seed=config.seed, **kwargs)


def comm_steps(config: ml_collections.ConfigDict, step: int) -> int:
    """How many of the first ``step`` steps communicate (the wrapper's schedule)."""
    name, every = config.wrapper.name, config.wrapper.get("every", 1)
    if name == "none":
        return step
    if name == "no_exchange":
        return 0
    if name == "local_sgd":
        warm = config.wrapper.get("warmup_steps", 0)
        return min(step, warm) + max(0, step - warm) // every
    return step // every
