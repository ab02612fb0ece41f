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

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    distributed.initialize()  # several processes if the environment says so; else nothing
    workdir = FLAGS.workdir or default_workdir(FLAGS["config"].config_filename)
    if not FLAGS.workdir:
        print(f"workdir: {workdir}", flush=True)
    train.train_and_evaluate(FLAGS.config, workdir)


if __name__ == "__main__":
    app.run(main)
