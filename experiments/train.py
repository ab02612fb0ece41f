"""Data-parallel training with a jaxcomm optimizer: ``train_and_evaluate(config, workdir)``.

The training step runs under ``jax.shard_map`` over a ``("data",)`` mesh of
``config.n_workers`` devices (0: all of them; 8 fake CPU devices here). Every
piece of state (params, BatchNorm statistics, optimizer state with compressor
residuals / PowerSGD Q / keys / counters, the step counter) carries a leading
worker axis sharded over ``"data"``, so local SGD / DiLoCo workers can drift
and error-feedback residuals stay per worker. ``config.steps_per_call``
micro-steps run inside one jitted ``lax.scan`` with donated state; each worker
draws its batch on device from ``(seed, worker, step)``, so there is no host
sync inside the step. Between calls: eval (worker 0's params), JSONL metrics,
orbax checkpoints (SHA-256 checksummed; verified on resume, falling back to the
newest good one: :func:`restore_latest_good`), a tqdm bar. A ``workdir``
holding a checkpoint resumes from it, bit for bit.

Components are picked by name: ``config.model.name`` (:data:`models.MODELS`),
``config.data.name`` (:data:`data.DATASETS`), ``config.compressor.name`` (a
``jaxcomm`` factory, called as ``getattr(jaxcomm, name)(**kwargs,
axis_name="data")``), ``config.optimizer.name`` (an optax optimizer),
``config.policy`` and ``config.wrapper.name`` (how they are composed).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import data as data_lib
from experiments import models
from experiments.studies import runs
from jaxcomm import distributed, netsim

AXIS = "data"
# Every jaxcomm factory that returns a GradientTransformation taking the gradient.
COMPRESSORS = (
    "allreduce",
    "cast",
    "topk",
    "randomk",
    "threshold",
    "int8",
    "qsgd",
    "terngrad",
    "onebit",
    "ef_sign",
    "sign_majority",
    "twobit",
    "dgc",
    "dgc_sgd",
    "powersgd",
    "auto",  # jaxcomm.auto: measured on the run's mesh when training starts
)
# optax's, optax.contrib's Muon (MuLoCo's inner optimizer under wrapper "diloco") and
# jaxcomm.demo (DeMo communicates itself: compressor "allreduce", wrapper "none")
OPTIMIZERS = ("sgd", "adam", "adamw", "muon", "demo")
WRAPPERS = ("none", "accumulate", "local_sgd", "diloco", "streaming_diloco", "sparseloco")
PARAM_AVERAGING = ("local_sgd", "diloco", "streaming_diloco", "sparseloco")  # per-worker params
# wrapper keys passed to jaxcomm.sparseloco (as its keyword arguments)
SPARSELOCO_KEYS = ("outer_learning_rate", "error_decay", "chunk", "topk", "bits")
POLICIES = ("none", "matrices")
# config.on_nonfinite: what a run does when its training loss or state turns NaN/Inf
ON_NONFINITE = ("abort", "continue")


class TrainState(NamedTuple):
    """Everything a run needs to continue; every leaf has a leading worker axis."""

    step: Any  # (n,) int32: steps done; also the data position
    params: Any
    batch_stats: Any  # BatchNorm running statistics (identical on all workers), or {}
    opt_state: Any


class Result(NamedTuple):
    state: TrainState  # final state, numpy on the host; PRNG keys as raw key data
    metrics: list[dict]  # one dict per eval


# --- config validation and composition ---------------------------------------------------


def _choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{key}: unknown {value!r}; choose from {list(allowed)}")
    return value


def _positive_int(value: Any, key: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{key}: expected an int >= {low}, got {value!r}")
    return int(value)


def _positive_float(value: Any, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{key}: expected a finite number > 0, got {value!r}")
    return float(value)


def n_workers_of(config: ml_collections.ConfigDict) -> int:
    n = config.get("n_workers", 0) or jax.device_count()
    if n > jax.device_count():
        raise ValueError(
            f"config.n_workers: {n} > {jax.device_count()} devices; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax"
        )
    if jax.process_count() > 1 and n != jax.device_count():
        raise ValueError(
            f"config.n_workers: {n}, but with {jax.process_count()} processes every one of the "
            f"{jax.device_count()} devices is a worker; set config.n_workers=0"
        )
    return n


def _factory_kwargs(factory: Callable, kwargs: dict, seed: int) -> dict:
    """Add ``axis_name`` and (if the factory takes one and none was given) ``key``."""
    kwargs = dict(kwargs, axis_name=AXIS)
    sig = inspect.signature(factory).parameters
    if "key" in sig and "key" not in kwargs:
        kwargs["key"] = jax.random.key(seed)
    return kwargs


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
    name = _choice(sched.get("name", "constant"), "config.optimizer.schedule.name", SCHEDULES)
    if name == "constant":
        return lr
    warm = _positive_int(sched.get("warmup_steps", 0), "config.optimizer.schedule.warmup_steps", 0)
    total = _positive_int(config.num_train_steps, "config.num_train_steps")
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
    comp_name = _choice(config.compressor.name, "config.compressor.name", COMPRESSORS)
    opt_name = _choice(config.optimizer.name, "config.optimizer.name", OPTIMIZERS)
    wrapper = _choice(config.wrapper.name, "config.wrapper.name", WRAPPERS)
    policy = _choice(config.get("policy", "none"), "config.policy", POLICIES)
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
            kwargs = _factory_kwargs(jaxcomm.dgc, comp_kwargs, config.seed)
            chained = jaxcomm.dgc_sgd(lr, **kwargs)
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
        every = _positive_int(every, "config.wrapper.every")
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
            warm = _positive_int(config.wrapper.get("warmup_steps", 0), "wrapper.warmup_steps", 0)
            return jaxcomm.local_sgd(
                opt, every=every, axis_name=AXIS, warmup_steps=warm, compressor=local_comp
            )
        return jaxcomm.diloco(opt, every=every, axis_name=AXIS, compressor=local_comp)
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
    name = _choice(config.compressor.name, "config.compressor.name", COMPRESSORS)
    if name in ("auto", "dgc_sgd"):
        raise ValueError(f"config.compressor.name: {name!r} is not a plain compressor")
    factory = getattr(jaxcomm, name)
    kwargs = _factory_kwargs(factory, dict(config.compressor.get("kwargs", {})), config.seed)
    return factory(**dict(kwargs, axis_name=axis_name))


def comm_steps(config: ml_collections.ConfigDict, step: int) -> int:
    """How many of the first ``step`` steps communicate (the wrapper's schedule)."""
    name, every = config.wrapper.name, config.wrapper.get("every", 1)
    if name == "none":
        return step
    if name == "local_sgd":
        warm = config.wrapper.get("warmup_steps", 0)
        return min(step, warm) + max(0, step - warm) // every
    return step // every


def validate(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Check every config value (raises ``ValueError`` naming the key); returns the optimizer.

    Runs before any data is read or any function compiled.
    """
    for key in ("seed", "model", "data", "compressor", "optimizer", "wrapper", "num_train_steps"):
        if key not in config:
            raise ValueError(f"config.{key}: missing")
    _choice(config.model.name, "config.model.name", tuple(models.MODELS))
    _choice(config.data.name, "config.data.name", data_lib.DATASETS)
    lm = config.model.name in models.LM_MODELS
    if lm != (config.data.name in data_lib.LM_DATASETS):
        raise ValueError(
            f"config.model.name / config.data.name: language models {list(models.LM_MODELS)} go "
            f"with text datasets {list(data_lib.LM_DATASETS)} and vice versa, got "
            f"{config.model.name!r} with {config.data.name!r}"
        )
    if lm:
        _positive_int(config.data.get("seq_len"), "config.data.seq_len", 2)
    if config.data.name == "cifar10":
        data_lib.check_cifar_dir(config.data.get("dir"))
    # 0 (classification): the whole shard every step (full-batch gradient descent)
    _positive_int(config.data.get("batch_size"), "config.data.batch_size", 1 if lm else 0)
    steps = _positive_int(config.num_train_steps, "config.num_train_steps")
    per_call = _positive_int(config.get("steps_per_call", 1), "config.steps_per_call")
    for key in ("eval_every", "checkpoint_every", "stop_after"):
        value = _positive_int(config.get(key, 0), f"config.{key}", 0)
        if value % per_call:
            raise ValueError(
                f"config.{key}: {value} must be a multiple of config.steps_per_call={per_call}"
            )
    if steps % per_call:
        raise ValueError(
            f"config.num_train_steps: {steps} must be a multiple of steps_per_call={per_call}"
        )
    if not config.netsim.gbps > 0:
        raise ValueError(f"config.netsim.gbps: expected > 0, got {config.netsim.gbps}")
    _choice(config.get("on_nonfinite", "abort"), "config.on_nonfinite", ON_NONFINITE)
    _positive_float(config.optimizer.get("learning_rate"), "config.optimizer.learning_rate")
    _positive_float(config.optimizer.get("lr_scale", 1.0), "config.optimizer.lr_scale")
    n_workers_of(config)
    return make_optimizer(config)


# --- checkpoints ---------------------------------------------------------------------------


def to_host(state: Any) -> Any:
    """Numpy copy of ``state``; PRNG key arrays become their raw uint32 key data."""
    return jax.device_get(distributed.key_data(state))


def from_host(host: Any, like: Any) -> Any:
    """Inverse of :func:`to_host`: re-wrap key data where ``like`` holds keys."""

    def rewrap(h, t):
        if distributed.is_key(t):
            return jax.random.wrap_key_data(h, impl=jax.random.key_impl(t))
        return h

    return jax.tree.map(rewrap, host, like)


def checkpoint_manager(workdir: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, "checkpoints")),
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )


CHECKSUMS = "jaxcomm_checksums.p{}.json"  # beside orbax's files in checkpoints/<step>/
# In checkpoints/: written before the first save of a run that writes checksums, so that a
# checkpoint without them is known to be interrupted, not one from before checksums existed.
CHECKSUMS_MARKER = "jaxcomm_checksums_required"
CONFIG_RECORD = "jaxcomm_config.json"  # in checkpoints/<step>/: the config that saved it


def _last_good(mngr: ocp.CheckpointManager) -> str:
    """The newest checkpoint as ``"step N"``, or ``"none saved"``."""
    step = mngr.latest_step()
    return "none saved" if step is None else f"step {step}"


def _shard_digests(state: Any) -> tuple[dict[str, str], bool]:
    """``({leaf/shard: sha256}, all finite)`` of the shards this process holds.

    Hashes the host copy of every addressable shard (replica 0 only, so each
    shard is hashed by exactly one process): a device-to-host copy between
    steps, no device computation. Finiteness is checked on the same copy.
    """
    digests, finite = {}, True
    for path, leaf in jax.tree_util.tree_leaves_with_path(distributed.key_data(state)):
        name = jax.tree_util.keystr(path)
        shards = getattr(leaf, "addressable_shards", None)
        pieces = (
            [(s.index, s.data) for s in shards if s.replica_id == 0]
            if shards is not None
            else [((), leaf)]
        )
        for index, data in pieces:
            host = np.ascontiguousarray(np.asarray(data))
            digests[f"{name}@{_index_str(index, np.shape(leaf))}"] = hashlib.sha256(
                host.tobytes()
            ).hexdigest()
            if np.issubdtype(host.dtype, np.inexact):
                finite = finite and bool(np.isfinite(host).all())
    return digests, finite


def _index_str(index: tuple, shape: tuple) -> str:
    """A shard's index (tuple of slices) as ``start:stop,...`` over the full shape."""
    parts = [
        f"{sl.start or 0}:{dim if sl.stop is None else sl.stop}" for sl, dim in zip(index, shape)
    ]
    return ",".join(parts)


def _index_of(text: str) -> tuple:
    return tuple(slice(*map(int, p.split(":"))) for p in text.split(",")) if text else ()


def _agree(flag: bool) -> bool:
    """``flag`` and-ed over processes (every process must take the same branch)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.asarray(flag))))


def save_state(
    mngr: ocp.CheckpointManager,
    step: int,
    state: TrainState,
    config: ml_collections.ConfigDict | None = None,
) -> bool:
    """Save the (global, possibly multi-process) state at ``step``; every process calls it.

    Each process writes the shards it holds and process 0 the metadata (orbax's
    multi-process save; on a cluster ``workdir`` must be a shared file system
    or bucket). A checkpoint becomes visible only once complete, so a process
    killed mid-save leaves the previous one as the latest.

    Integrity: each process also writes ``checkpoints/<step>/jaxcomm_checksums.p<i>.json``,
    the SHA-256 of every shard it holds (computed on a host copy, between
    steps), which :func:`restore_latest_good` verifies. A state holding NaN/Inf
    is *not* saved (absl warning; returns False): with ``max_to_keep=2`` it
    would rotate out the last good checkpoint.

    ``config``: recorded by process 0 as ``checkpoints/<step>/jaxcomm_config.json``,
    so that a resume with another configuration can say what differs
    (:func:`check_checkpoint_structure`).
    """
    digests, finite = _shard_digests(state)
    if not _agree(finite):
        logging.warning(
            "step %d: the training state holds NaN/Inf; checkpoint not saved, so that the "
            "last good checkpoint is kept (%s)",
            step,
            _last_good(mngr),
        )
        return False
    marker = os.path.join(str(mngr.directory), CHECKSUMS_MARKER)
    if jax.process_index() == 0 and not os.path.exists(marker):
        open(marker, "w").close()
    mngr.save(step, args=ocp.args.StandardSave(distributed.key_data(state)))
    mngr.wait_until_finished()
    step_dir = os.path.join(str(mngr.directory), str(step))
    if config is not None and jax.process_index() == 0:
        record = os.path.join(step_dir, CONFIG_RECORD)
        with open(record + ".tmp", "w") as f:
            json.dump(runs.json_ready(json.loads(config.to_json_best_effort())), f, indent=1)
        os.replace(record + ".tmp", record)
    path = os.path.join(step_dir, CHECKSUMS.format(jax.process_index()))
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step, "processes": jax.process_count(), "sha256": digests}, f)
    os.replace(path + ".tmp", path)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"jaxcomm checksums {step}")
    return True


def checkpoint_workers(mngr: ocp.CheckpointManager, step: int) -> int:
    """Worker count of checkpoint ``step`` (from its metadata); a clear error if unreadable."""
    try:
        tree = getattr(mngr.item_metadata(step), "tree", None) or {}
        return int(tuple(tree["step"].shape)[0])
    except Exception as e:  # orbax raises JSONDecodeError, FileNotFoundError, KeyError, ...
        raise CorruptCheckpoint(
            f"checkpoint at step {step}: unreadable metadata ({type(e).__name__}: {e})"
        ) from e


class CorruptCheckpoint(RuntimeError):
    """A checkpoint that cannot be read, or whose contents fail verification."""


class CheckpointMismatch(ValueError):
    """Intact checkpoints written by another configuration (worker count, method, model)."""


def check_checkpoint_workers(mngr: ocp.CheckpointManager, step: int, n: int) -> None:
    """The checkpoint's per-worker state must have this run's worker count."""
    held = checkpoint_workers(mngr, step)
    if held != n:
        raise CheckpointMismatch(
            f"checkpoint at step {step} holds per-worker state (error-feedback residuals, keys, "
            f"local params) of {held} workers, but this run has {n}. Resume with "
            f"{held} workers in all (any split into processes x devices works), or use "
            f"a new --workdir. jaxcomm does not merge or split per-worker residuals."
        )


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"opt_state/0/residual/...": (shape, dtype)}`` of a state or of a checkpoint's metadata.

    Paths are spelled alike for both (orbax stores a NamedTuple as a dict, a tuple as a list).
    """

    def name(key: Any) -> str:
        for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {
        "/".join(name(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _config_differences(recorded: dict, config: ml_collections.ConfigDict) -> list[str]:
    """``key=saved (this run: now)`` for the keys that shape the state (method, model)."""

    def flat(d: Any, prefix: str = "") -> dict:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        return {k: v for key, sub in d.items() for k, v in flat(sub, f"{prefix}{key}.").items()}

    saved, now = flat(recorded), flat(runs.json_ready(json.loads(config.to_json_best_effort())))
    shaping = ("model.", "compressor.", "optimizer.name", "optimizer.kwargs.", "wrapper.", "policy")
    keys = sorted(k for k in saved.keys() | now.keys() if k.startswith(shaping))
    show = lambda d, k: repr(d[k]) if k in d else "unset"
    return [
        f"{k}={show(saved, k)} (this run: {show(now, k)})"
        for k in keys
        if show(saved, k) != show(now, k)
    ]


def check_checkpoint_structure(
    mngr: ocp.CheckpointManager,
    step: int,
    like: TrainState,
    config: ml_collections.ConfigDict | None = None,
) -> None:
    """Raise :class:`CheckpointMismatch` unless checkpoint ``step`` holds ``like``'s leaves.

    Compares the checkpoint's metadata (every leaf's path, shape and dtype)
    with this run's state before anything is read: a workdir trained with
    another method (another optimizer state) is not corruption. With
    ``config``, the message names the keys that differ from the config
    recorded at save time (:func:`save_state`).
    """
    try:
        held = _leaf_specs(mngr.item_metadata(step).tree)
    except Exception as e:  # orbax raises JSONDecodeError, FileNotFoundError, KeyError, ...
        raise CorruptCheckpoint(
            f"checkpoint at step {step}: unreadable metadata ({type(e).__name__}: {e})"
        ) from e
    want = _leaf_specs(distributed.key_data(like))
    if held == want:
        return
    fmt = lambda spec: f"{spec[1]}{list(spec[0])}"
    only_saved = sorted(held.keys() - want.keys())
    only_here = sorted(want.keys() - held.keys())
    changed = sorted(k for k in held.keys() & want.keys() if held[k] != want[k])
    parts = []
    if only_saved:
        parts.append(f"{len(only_saved)} leaves only in the checkpoint (e.g. {only_saved[0]})")
    if only_here:
        parts.append(f"{len(only_here)} leaves only in this run (e.g. {only_here[0]})")
    if changed:
        k = changed[0]
        parts.append(
            f"{len(changed)} leaves of another shape or dtype (e.g. {k}: {fmt(held[k])} saved, "
            f"{fmt(want[k])} in this run)"
        )
    saved_by = ""
    path = os.path.join(str(mngr.directory), str(step), CONFIG_RECORD)
    if config is not None and os.path.exists(path):
        with open(path) as f:
            diffs = _config_differences(json.load(f), config)
        if diffs:
            saved_by = " It was saved with " + ", ".join(diffs[:8]) + "."
    raise CheckpointMismatch(
        f"{mngr.directory} holds checkpoints of a different configuration: the state saved "
        f"at step {step} does not fit this run's ({'; '.join(parts)}).{saved_by} The "
        f"checkpoints are intact, not corrupt: resume them with the configuration that "
        f"wrote them, or train this configuration in a fresh --workdir."
    )


def restore_state(mngr: ocp.CheckpointManager, step: int, like: TrainState) -> TrainState:
    """Restore checkpoint ``step`` with ``like``'s structure as host arrays (typed keys kept).

    Every process reads the whole state; :func:`jaxcomm.distributed.shard_rows`
    then keeps each process's own workers' rows. No verification: see
    :func:`verify_state` and :func:`restore_latest_good`.
    """
    template = to_host(like)
    host = mngr.restore(step, args=ocp.args.StandardRestore(template))
    return TrainState(*from_host(tuple(host), tuple(like)))


def verify_state(mngr: ocp.CheckpointManager, step: int, state: TrainState) -> None:
    """Raise :class:`CorruptCheckpoint` unless restored ``state`` matches its checksums.

    Every shard recorded by every saving process must hash to its recorded
    SHA-256, and every float leaf must be finite. A checkpoint written
    without checksums (before they existed) gets the finiteness check only,
    with a warning.
    """
    step_dir = os.path.join(str(mngr.directory), str(step))
    files = sorted(f for f in os.listdir(step_dir) if f.startswith("jaxcomm_checksums.p"))
    host = jax.tree_util.tree_leaves_with_path(distributed.key_data(state))
    leaves = {jax.tree_util.keystr(p): np.asarray(x) for p, x in host}
    bad = [
        k
        for k, x in leaves.items()
        if np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all()
    ]
    if bad:
        raise CorruptCheckpoint(f"checkpoint at step {step}: NaN/Inf in {', '.join(bad[:5])}")
    if not files and os.path.exists(os.path.join(str(mngr.directory), CHECKSUMS_MARKER)):
        raise CorruptCheckpoint(
            f"checkpoint at step {step}: no checksum files (its save was interrupted after "
            "orbax finished and before the checksums were written)"
        )
    if not files:
        logging.warning(
            "checkpoint at step %d has no checksums (older format): finiteness only", step
        )
        return
    recorded: dict[str, str] = {}
    processes = None
    for name in files:
        try:
            with open(os.path.join(step_dir, name)) as f:
                doc = json.load(f)
            recorded.update(doc["sha256"])
            processes = doc["processes"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpoint(
                f"checkpoint at step {step}: unreadable checksum file {name} ({e})"
            ) from e
    if len(files) != processes:
        raise CorruptCheckpoint(
            f"checkpoint at step {step}: {len(files)} checksum files, {processes} processes saved"
        )
    for key, digest in recorded.items():
        name, _, index = key.rpartition("@")
        if name not in leaves:
            raise CorruptCheckpoint(f"checkpoint at step {step}: no leaf {name}")
        piece = np.ascontiguousarray(leaves[name][_index_of(index)])
        if hashlib.sha256(piece.tobytes()).hexdigest() != digest:
            raise CorruptCheckpoint(
                f"checkpoint at step {step}: leaf {name} [{index}] fails its SHA-256 checksum"
            )


def restore_latest_good(
    mngr: ocp.CheckpointManager,
    like: TrainState,
    n: int,
    workdir: str,
    config: ml_collections.ConfigDict | None = None,
) -> tuple[int, TrainState]:
    """``(step, state)`` of the newest checkpoint that reads and verifies; ``(0, like)`` if none.

    Checkpoints are tried newest first. One that cannot be read (truncated
    files, empty or broken metadata) or fails :func:`verify_state` (flipped
    bytes, NaN/Inf) is reported with an absl warning naming the cause and
    moved to ``workdir/corrupt_checkpoints/<step>`` (kept for inspection, and
    out of ``max_to_keep``'s rotation), and the next older one is tried.
    Checkpoints of another configuration are not corruption: a worker-count
    mismatch (:func:`check_checkpoint_workers`) or another state layout, e.g.
    another method's optimizer state (:func:`check_checkpoint_structure`, which
    names the config keys that differ, given ``config``), raises
    :class:`CheckpointMismatch` and moves nothing. If checkpoints exist but
    none is usable, raises :class:`CorruptCheckpoint` listing why.
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    if steps:
        _quiet_closed_loop_callbacks()  # before a read can fail: its noise follows at once
    reasons = []
    for step in steps:
        try:
            check_checkpoint_workers(mngr, step, n)
            check_checkpoint_structure(mngr, step, like, config)
            state = restore_state(mngr, step, like)
            verify_state(mngr, step, state)
        except CheckpointMismatch:
            raise
        except Exception as e:  # orbax/tensorstore errors on truncated files, ...
            reasons.append(f"step {step}: {type(e).__name__}: {e}")
        else:
            if reasons:
                logging.warning(
                    "resuming from checkpoint %d, the newest good one; skipped: %s",
                    step,
                    "; ".join(reasons),
                )
                _set_aside(mngr, [s for s in steps if s > step], workdir)
            return step, state
        logging.warning("checkpoint at step %d is unusable: %s", step, reasons[-1])
    if steps:
        raise CorruptCheckpoint(
            f"no usable checkpoint in {mngr.directory}: "
            + "; ".join(reasons)
            + ". Move them away to start afresh, or use a new --workdir."
        )
    return 0, like


def _is_closed_loop_noise(unraisable: Any) -> bool:
    """A tensorstore read's callback that found orbax's event loop closed (see below)."""
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is None or tb.tb_frame.f_code.co_name == "_check_closed"


def _quiet_closed_loop_callbacks() -> None:
    """Drop the "Event loop is closed" tracebacks that follow a failed restore; keep the rest.

    Orbax runs a restore's reads on a fresh asyncio loop and closes it as soon
    as one read fails (a truncated file). Tensorstore completes the other reads
    afterwards, and their callbacks find the loop closed: a ``RuntimeError``
    that reaches ``sys.unraisablehook`` and is printed as a bare traceback
    (nothing is lost; the failure itself is reported by
    :func:`restore_latest_good`). This wraps the current hook, once per
    process, dropping exactly that error (raised in asyncio's
    ``_check_closed``) and passing every other on.
    """
    hook = sys.unraisablehook
    if getattr(hook, "jaxcomm_quiet_closed_loop", False):
        return

    def quiet(unraisable):
        if not _is_closed_loop_noise(unraisable):
            hook(unraisable)

    quiet.jaxcomm_quiet_closed_loop = True
    sys.unraisablehook = quiet


def _set_aside(mngr: ocp.CheckpointManager, steps: list[int], workdir: str) -> None:
    """Move bad checkpoints to ``workdir/corrupt_checkpoints`` (process 0), then reload."""
    if jax.process_index() == 0:
        aside = os.path.join(workdir, "corrupt_checkpoints")
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            dest = os.path.join(aside, f"{step}.{int(time.time())}")
            shutil.move(os.path.join(str(mngr.directory), str(step)), dest)
            logging.warning("moved unusable checkpoint %d to %s", step, dest)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxcomm set aside checkpoints")
    mngr.reload()


# --- the step ------------------------------------------------------------------------------


def _loss_fn(model, lm: bool) -> Callable:
    def loss_fn(params, batch_stats, x, y):
        variables = {"params": params}
        if batch_stats:
            variables["batch_stats"] = batch_stats
            logits, mut = model.apply(variables, x, train=True, mutable=["batch_stats"])
            batch_stats = mut["batch_stats"]
        else:
            logits = model.apply(variables, x, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, batch_stats

    return loss_fn


def make_train_call(model, tx, mesh, ds: data_lib.Dataset, config) -> Callable:
    """jit(shard_map(scan of ``steps_per_call`` steps)), state donated -> (state, losses).

    ``model`` needs only ``apply(variables, x, train=...)`` (a flax module, or
    :class:`experiments.digits.Net`); ``config`` only ``seed``,
    ``data.batch_size`` (0: the whole shard every step) and ``steps_per_call``.
    """
    loss_fn = _loss_fn(model, ds.is_lm)
    batch_size, seq_len = config.data.batch_size, ds.seq_len
    data_key = jax.random.key(config.seed + 1)

    def call(state: TrainState, x, y):
        state = jax.tree.map(lambda a: a[0], state)
        x = x[0]
        y = None if y is None else y[0]
        key = jax.random.fold_in(data_key, jax.lax.axis_index(AXIS))

        def body(s: TrainState, _):
            if batch_size:
                bx, by = data_lib.sample_batch(x, y, key, s.step, batch_size, seq_len)
            else:  # data.batch_size 0: the worker's whole shard every step, in order
                bx, by = x, y
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, stats), grads = grad_fn(s.params, s.batch_stats, bx, by)
            updates, opt_state = tx.update(grads, s.opt_state, s.params)
            params = optax.apply_updates(s.params, updates)
            stats = jax.lax.pcast(jax.lax.pmean(stats, AXIS), AXIS, to="varying")
            return TrainState(s.step + 1, params, stats, opt_state), loss

        state, losses = jax.lax.scan(body, state, None, length=config.steps_per_call)
        # One all-reduce of the call's losses, not one per step beside the gradient exchange.
        return jax.tree.map(lambda a: a[None], state), jax.lax.pmean(losses, AXIS)

    spec = P(AXIS)
    fn = jax.shard_map(call, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, P()))
    return jax.jit(fn, donate_argnums=0)


def make_eval(model, ds: data_lib.Dataset, batch_size: int) -> Callable[[Any, Any], dict]:
    """Test loss and accuracy (next-token accuracy for LM) of one worker's params."""

    @jax.jit
    def per_example(params, stats, x, y):
        variables = {"params": params, **({"batch_stats": stats} if stats else {})}
        logits = model.apply(variables, x, train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        hit = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        if ds.is_lm:  # a window is one example: its mean over positions
            return loss.mean(-1), hit.mean(-1)
        return loss, hit

    def evaluate(params, stats) -> dict:
        losses, hits = [], []
        for i in range(0, len(ds.x_test), batch_size):
            if ds.is_lm:
                w = ds.x_test[i : i + batch_size]
                x, y = w[:, :-1], w[:, 1:]
            else:
                x, y = ds.x_test[i : i + batch_size], ds.y_test[i : i + batch_size]
            loss, hit = per_example(params, stats, x, y)
            losses.append(np.asarray(loss, np.float64))
            hits.append(np.asarray(hit, np.float64))
        loss, hit = np.concatenate(losses), np.concatenate(hits)
        se = lambda v: float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
        # standard errors over the evaluation examples (LM: windows of equal length)
        return {
            "eval_loss": float(loss.mean()),
            "accuracy": float(hit.mean()),
            "eval_loss_se": se(loss),
            "accuracy_se": se(hit),
            "eval_examples": int(len(loss)),
        }

    return evaluate


# --- the loop ------------------------------------------------------------------------------


class NonFiniteError(FloatingPointError):
    """The training loss or state turned NaN/Inf under ``config.on_nonfinite="abort"``."""


def _nonfinite_error(step: int, what: str, mngr: ocp.CheckpointManager, config) -> NonFiniteError:
    lr = config.optimizer.learning_rate * config.optimizer.get("lr_scale", 1.0)
    last = _last_good(mngr)
    where = "" if last == "none saved" else f" in {mngr.directory}"
    return NonFiniteError(
        f"step {step}: the training {what} is NaN/Inf: the run diverged. Stopped without "
        f"saving (last good checkpoint: {last}{where}). Lower config.optimizer.learning_rate "
        f"(the peak rate is {lr:g}), wrap the optimizer in jaxcomm.skip_nonfinite (it skips "
        f"steps whose update is NaN/Inf), or set config.on_nonfinite=continue to train on."
    )


def _preemption_sync_point(counter: int) -> bool:
    """Whether every process reached JAX's preemption sync point (a SIGTERM to any of them).

    Multi-process runs under ``jax.distributed`` only, whose preemption service
    catches SIGTERM; ``counter`` grows by one per training call on every process.
    """
    if jax.process_count() == 1 or not jax.distributed.is_initialized():
        return False
    if not jax.config.jax_enable_preemption_service:
        return False
    return multihost_utils.reached_preemption_sync_point(counter)


def _jsonl(row: dict) -> str:
    """``row`` as one line of strict JSON: NaN/Inf written as null."""
    return json.dumps(runs.json_ready(row), allow_nan=False) + "\n"


def check_workdir(workdir: str) -> None:
    """Create ``workdir`` if needed and check that this process can write in it."""
    try:
        os.makedirs(workdir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".jaxcomm_write_check", dir=workdir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"--workdir {workdir!r}: cannot write there ({type(e).__name__}: "
            f"{e.strerror or e}); give a directory this process can create and write to"
        ) from None


def _read_metrics(path: str, upto: int) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def build_model(config: ml_collections.ConfigDict, ds: data_lib.Dataset) -> tuple:
    """``(model, params, batch_stats)``: ``config.model`` for ``ds``, initialised from the seed."""
    kwargs = dict(config.model.get("kwargs", {}))
    if not ds.is_lm:
        kwargs["num_classes"] = ds.num_classes
    model = models.build(config.model.name, **kwargs)
    variables = model.init(jax.random.key(config.seed), ds.example_input(), train=False)
    return model, variables["params"], variables.get("batch_stats", {})


def _auto_optimizer(config, params, mesh, workdir: str, lead: bool):
    """The optimizer with jaxcomm.auto's choice; ``workdir/auto_choice.json`` records it.

    A run resuming in ``workdir`` decides from the recorded costs, so the choice
    (and with it the optimizer state's layout) is the one its checkpoints hold.
    """
    path = os.path.join(workdir, "auto_choice.json")
    costs = rounds = None
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        costs = {r["name"]: r["seconds"] for r in recorded["rows"]}
        rounds = recorded.get("rounds")  # None in a record from before the rounds rule
        if rounds is not None:  # null: a round after the candidate left play
            rounds = {k: [float("nan") if x is None else x for x in v] for k, v in rounds.items()}
    tx = make_optimizer(config, params, mesh, costs, rounds)
    kw = {k: v for k, v in config.compressor.kwargs.items() if k != "warmup_steps"}
    # the choice make_optimizer made (its measurement is cached), for the record
    choice = jaxcomm.policy.choose(params, mesh, AXIS, **kw, costs=costs, rounds=rounds)
    if lead and costs is None:
        os.makedirs(workdir, exist_ok=True)
        rows = [r._asdict() for r in choice.rows]
        record = {"choice": choice.name, "reason": choice.reason, "rows": rows,
                  "rounds": choice.rounds}  # fmt: skip
        with open(path + ".tmp", "w") as f:
            json.dump(runs.json_ready(record), f, indent=1, allow_nan=False)
        os.replace(path + ".tmp", path)
    return tx


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> Result:
    """Train per ``config``; write checkpoints, metrics.jsonl and metrics.png to ``workdir``.

    A training loss or state that turns NaN/Inf raises :class:`NonFiniteError`
    (nothing non-finite is saved) unless ``config.on_nonfinite="continue"``.
    In a multi-process run, a SIGTERM to any process (JAX's preemption
    service) makes every process save a checkpoint at the same step and return.
    """
    tx = validate(config)
    n = n_workers_of(config)
    check_workdir(workdir)
    ds = data_lib.load(config.data, n, seed=config.seed)
    if not ds.is_lm and config.data.batch_size > ds.x_train.shape[1]:
        raise ValueError(
            f"config.data.batch_size: {config.data.batch_size} > {ds.x_train.shape[1]} examples "
            "per worker"
        )
    model, params, stats = build_model(config, ds)
    mesh = distributed.global_mesh(AXIS, n)
    lead = jax.process_index() == 0  # only process 0 evaluates, writes metrics and plots
    if config.compressor.name == "auto":  # measured on this mesh, now that it exists
        tx = _auto_optimizer(config, params, mesh, workdir, lead)

    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape), t)
    state = TrainState(
        jnp.zeros((n,), jnp.int32), stack(params), stack(stats), stack(tx.init(params))
    )

    mngr = checkpoint_manager(workdir)
    try:
        start, state = restore_latest_good(mngr, state, n, workdir, config)
    except Exception:
        mngr.close()
        raise
    if start and lead:
        print(f"resumed from the checkpoint of step {start} in {workdir}", flush=True)
    state = distributed.shard_rows(state, mesh, AXIS)
    x_train, y_train = distributed.shard_rows((ds.x_train, ds.y_train), mesh, AXIS)

    report = jaxcomm.accounting.wire_report(tx, params, n)
    bytes_per_comm = sum(c.nbytes for c in report)
    link = netsim.Link.from_gbps(config.netsim.gbps, latency_s=config.netsim.latency_us * 1e-6)
    time_per_comm = netsim.exchange_time(report, n, link) if report else 0.0
    compute_s = config.netsim.get("compute_s", 0.0)

    t_compile = time.perf_counter()
    train_call = make_train_call(model, tx, mesh, ds, config).lower(state, x_train, y_train)
    train_call = train_call.compile()
    compile_s = time.perf_counter() - t_compile
    evaluate = make_eval(model, ds, config.get("eval_batch_size", 1024))
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    metrics = _read_metrics(metrics_path, start)
    if lead:
        with open(metrics_path, "w") as f:
            f.writelines(_jsonl(r) for r in metrics)
    train_s = metrics[-1].get("train_s", 0.0) if metrics else 0.0

    from tqdm import tqdm

    per_call, total = config.steps_per_call, config.num_train_steps
    # stop_after: end the run early on the same schedule (a probe of a long run's first steps)
    total = min(total, _positive_int(config.get("stop_after", 0), "config.stop_after", 0) or total)
    eval_every, ckpt_every = config.get("eval_every", 0), config.get("checkpoint_every", 0)
    abort = config.get("on_nonfinite", "abort") == "abort"
    show = config.get("progress", True) and lead
    bar = tqdm(total=total, initial=start, unit="step", disable=not show)
    t0, step, losses, call_s = time.perf_counter(), start, [], []
    try:
        while step < total:
            t_call = time.perf_counter()
            state, call_losses = train_call(state, x_train, y_train)
            state = jax.block_until_ready(state)  # one collective program in flight (XLA:CPU)
            call_s.append(time.perf_counter() - t_call)
            train_s += call_s[-1]
            step += per_call
            call_losses = np.asarray(call_losses)  # the worker mean: alike on every process
            losses.extend(call_losses.tolist())
            if abort and not np.isfinite(call_losses).all():
                first = int(np.flatnonzero(~np.isfinite(call_losses))[0])
                raise _nonfinite_error(step - per_call + 1 + first, "loss", mngr, config)
            sent = comm_steps(config, step) * bytes_per_comm
            bar.set_postfix(loss=f"{losses[-1]:.4f}", MB_sent=f"{sent / 1e6:.2f}", refresh=False)
            bar.update(per_call)
            if (eval_every and step % eval_every == 0) or step == total:
                # Worker 0's params live on process 0 (the mesh puts its devices first):
                # evaluating them needs no communication, and the others go on meanwhile.
                # call_s: each training call's seconds since the last row (steady state: median)
                row = {"step": step, "loss": float(np.mean(losses)), "call_s": call_s}
                losses, call_s = [], []
                if lead:
                    variables = distributed.local_row((state.params, state.batch_stats), 0)
                    row.update(evaluate(*variables))
                    row.update(
                        wire_bytes=int(sent),
                        sim_time_s=comm_steps(config, step) * time_per_comm + step * compute_s,
                        train_s=train_s,
                        compile_s=compile_s,
                        processes=jax.process_count(),
                        wall_s=time.perf_counter() - t0,
                    )
                    with open(metrics_path, "a") as f:
                        f.write(_jsonl(row))
                    bar.write(
                        f"step {step}: loss {row['loss']:.4f} eval_loss {row['eval_loss']:.4f} "
                        f"acc {row['accuracy']:.4f} sent {sent / 1e6:.2f} MB "
                        f"train {train_s:.2f}s sim {row['sim_time_s']:.3f}s"
                    )
                metrics.append(row)
            saved = None
            if (ckpt_every and step % ckpt_every == 0) or step == total:
                saved = save_state(mngr, step, state, config)
            preempted = _preemption_sync_point(step // per_call)
            if preempted and saved is None:
                saved = save_state(mngr, step, state, config)
            if saved is False and abort:
                raise _nonfinite_error(step, "state", mngr, config)
            if preempted:
                if lead:
                    what = "saved its checkpoint" if saved else "saved nothing (NaN/Inf state)"
                    bar.write(
                        f"preempted (SIGTERM) at step {step}: {what} in {workdir}; the same "
                        "command resumes the run"
                    )
                break
    finally:
        bar.close()
        mngr.wait_until_finished()
        mngr.close()
    if lead and metrics and config.get("plot", True):
        plot_metrics(metrics, os.path.join(workdir, "metrics.png"), config.netsim.gbps)
    host = distributed.gather(tuple(state))  # every process takes part; keys as key data
    return Result(TrainState(*host), metrics)


def plot_metrics(rows: list[dict], path: str, gbps: float) -> None:
    """Accuracy vs step, vs bytes sent per worker, vs simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = [100 * r["accuracy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    xs = [
        ([r["step"] for r in rows], "step"),
        ([r["wire_bytes"] / 1e6 for r in rows], "MB sent per worker"),
        ([r["sim_time_s"] for r in rows], f"simulated time at {gbps:g} Gbps (s)"),
    ]
    for ax, (x, label) in zip(axes, xs):
        ax.plot(x, acc, marker="o", ms=3)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
