"""Checksummed orbax checkpoints of a run's state, and finding the newest good one on resume.

The state is a NamedTuple (:class:`experiments.train.TrainState`) whose leaves
carry a leading worker axis, ``step`` among its fields. :func:`save_state`
writes it with the SHA-256 of every shard beside orbax's files (never a state
holding NaN/Inf); :func:`restore_latest_good` verifies checkpoints newest
first, sets unusable ones aside and refuses those of another configuration
(:class:`CheckpointMismatch`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any, TypeVar

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from experiments.studies import runs
from jaxcomm import distributed

State = TypeVar("State", bound=tuple)  # the run's state: a NamedTuple of per-worker leaves


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


def last_good(mngr: ocp.CheckpointManager) -> str:
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
    state: State,
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
            last_good(mngr),
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
    like: State,
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


def restore_state(mngr: ocp.CheckpointManager, step: int, like: State) -> State:
    """Restore checkpoint ``step`` with ``like``'s structure as host arrays (typed keys kept).

    Every process reads the whole state; :func:`jaxcomm.distributed.shard_rows`
    then keeps each process's own workers' rows. No verification: see
    :func:`verify_state` and :func:`restore_latest_good`.
    """
    template = to_host(like)
    host = mngr.restore(step, args=ocp.args.StandardRestore(template))
    return type(like)(*from_host(tuple(host), tuple(like)))


def verify_state(mngr: ocp.CheckpointManager, step: int, state: State) -> None:
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
    like: State,
    n: int,
    workdir: str,
    config: ml_collections.ConfigDict | None = None,
) -> tuple[int, State]:
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
