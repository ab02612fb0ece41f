"""Launcher: ``python -m experiments.main --config CONFIG_FILE[:VARIANT] [--workdir DIR]``.

Flags only; everything else is in the config file (see ``experiments/configs``).
Override any value on the command line, e.g. ``--config.num_train_steps=100``.
Without real accelerators, 8 fake CPU devices are used (set ``XLA_FLAGS``
yourself to choose another count).

Several processes: the same command on every process, with
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` set
(``experiments/launch.py`` does that for local processes) or under SLURM
(``srun``); :func:`jaxcomm.distributed.initialize` reads them.
"""

from __future__ import annotations

import difflib
import os
import sys
import traceback

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import train
from jaxcomm import distributed

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "training config file", lock_config=True)
flags.DEFINE_string(
    "workdir",
    None,
    "checkpoints, metrics.jsonl, metrics.png; resumes if present "
    "(default: runs/<config file>[_<variant>])",
)
flags.mark_flags_as_required(["config"])


def default_workdir(config_arg: str) -> str:
    """``runs/<config file stem>[_<variant>]`` for ``--config=path/name.py[:variant]``."""
    path, _, variant = config_arg.partition(":")
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", f"{stem}_{variant}" if variant else stem)


def _config_keys(config, prefix: str = "") -> list[str]:
    """Every key of ``config`` as a dotted path, nested ConfigDicts and dicts included."""
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            keys += _config_keys(value, f"{prefix}{key}.")
    return keys


def unknown_override(argv: list[str]) -> str | None:
    """The message for the first ``--config.KEY`` of ``argv`` its config lacks, else None."""
    spec, overrides = None, []
    for i, arg in enumerate(argv[1:], 1):
        name, eq, value = arg.partition("=")
        if name.lstrip("-") == "config":
            spec = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        elif name.lstrip("-").startswith("config."):
            overrides.append(name.lstrip("-").partition(".")[2])
    if spec is None:
        return None
    keys = _config_keys(FLAGS["config"].parser.parse(spec))
    for key in overrides:
        if key in keys:
            continue
        parts = key.split(".")
        depth = next(d for d in range(len(parts)) if ".".join(parts[: d + 1]) not in keys)
        parent = ".".join(parts[:depth])
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "."
        return (
            f"--config.{key}: the config {spec} has no key {key!r}{hint} "
            f"{'config.' + parent if parent else 'The config'} has: "
            f"{', '.join(siblings) if siblings else 'no keys'}"
        )
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a clear message for a ``--config.KEY`` the config lacks."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError):
        try:
            message = unknown_override(argv)
        except Exception:  # the config itself does not load: absl's own error says why
            message = None
        if message is None:
            raise
        sys.stderr.write(f"FATAL Flags parsing error: {message}\n")
        sys.exit(1)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    info = distributed.initialize()  # several processes if the environment says so
    workdir = FLAGS.workdir or default_workdir(FLAGS["config"].config_filename)
    if not FLAGS.workdir:
        print(f"workdir: {workdir}", flush=True)
    try:
        train.train_and_evaluate(FLAGS.config, workdir)
    except train.NonFiniteError as e:
        _exit(f"error: {e}", 1, info.num_processes)
    except Exception as e:
        if info.num_processes == 1:
            raise
        traceback.print_exc()
        why = ""
        if isinstance(e, jax.errors.JaxRuntimeError):  # a collective (gloo, NCCL) failed
            why = (
                " A collective failed: most likely another process died (see its log); the "
                "same command resumes from the last checkpoint."
            )
        _exit(
            f"process {info.process_id}: the run failed ({type(e).__name__}).{why} Exiting "
            "without jax.distributed's shutdown barrier, which waits for every process (a "
            "dead one never comes: it would time out and abort).",
            1,
            info.num_processes,
        )


def _exit(message: str, code: int, processes: int) -> None:
    """Print ``message`` and exit; with several processes skip the shutdown barrier.

    JAX's exit handler waits in ``jax.distributed``'s shutdown barrier for every
    process; after a failure some process may never come (it died), and the
    barrier would time out and abort this one.
    """
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if processes > 1:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
