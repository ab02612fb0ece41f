r"""The LM study: time to a validation-loss target on real, shaped links, several seeds.

Command (root, iproute2; ~1 h on 2 CPU cores for the default grid):
  python -m experiments.studies.lm --out=experiments/results/lm_study.json
Tables and plot from the JSON (no runs):
  python -m experiments.studies.lm --report

What runs. Every method of ``experiments/configs/lm_shakespeare.py`` (AdamW
with one warm-up + cosine schedule for all; DiLoCo's inner optimizer is the
same) trains for ``--steps`` steps with ``--processes`` real processes
(``experiments.launch``, gloo, one CPU device each) for every seed of
``--seeds``, on loopback, evaluating the validation loss every 10 steps.
Those runs give each (method, seed) its trajectory: validation loss against
step, and the measured wall clock of the training calls on loopback.

On each shaped rate (``--rates``: every process in its own network namespace,
each egress shaped by ``tc ... tbf``) every method runs ``--probe_steps``
steps of the same schedule (seed 0) and the measured training-call time per
step is recorded. A full run at 10 Mbit/s would take hours (dense moves
20.5 MB per step), so a shaped cell's time to target is *steps to target on
the seed's trajectory x the measured step time on that link*. The trajectory
does not depend on the link (the same processes run the same arithmetic): the
probe's validation loss at its last step is stored beside the loopback run's
at that step (``probe_check``) and the report says whether they are equal.

The verdict rules are :mod:`experiments.studies.verdict`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

from experiments.studies import runs

FLAGS = flags.FLAGS
CONFIG = "experiments/configs/lm_shakespeare.py"
METHODS = ["dense", "bf16", "powersgd", "threshold", "ef_sign", "int8_2p", "diloco", "diloco_h1",
           "streaming", "streaming_int8", "streaming_q4", "sparseloco", "muloco",
           "demo"]  # fmt: skip


def define_flags() -> None:
    flags.DEFINE_list("processes", ["2"], "process counts")
    flags.DEFINE_list("rates", ["100mbit", "10mbit"], "shaped link rates (loopback always runs)")
    flags.DEFINE_list("methods", METHODS, "lm_shakespeare config variants")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of the loopback trajectories")
    flags.DEFINE_integer("steps", 200, "training steps of a full run (the schedule's length)")
    flags.DEFINE_integer("probe_steps", 20, "steps measured on a shaped link (two calls)")
    flags.DEFINE_integer("probe_steps_per_call", 10, "training steps per call in a probe")
    flags.DEFINE_string("out", "experiments/results/lm_study.json", "JSON written and updated")
    flags.DEFINE_string("workroot", "runs/lm_study", "workdirs of the runs")
    flags.DEFINE_bool("report", False, "only write the tables (.md) and plot (.png) from --out")


#: The metrics kept of each row of a run.
KEEP = ("step", "loss", "eval_loss", "eval_loss_se", "accuracy", "train_s", "wire_bytes")


def training_argv(
    workdir: str, n: int, rate: str, method: str, seed: int, steps: int, stop: int,
    per_call: int = 10,
) -> list[str]:  # fmt: skip
    """The launched command of one run of the study (``stop``: steps to run, 0 all)."""
    return [
        sys.executable, "-m", "experiments.launch", f"--processes={n}", "--devices_per_process=1",
        *([] if rate == "loopback" else [f"--rate={rate}"]), "--",
        sys.executable, "-m", "experiments.main", f"--config={CONFIG}:{method}",
        f"--workdir={workdir}", f"--config.seed={seed}", f"--config.num_train_steps={steps}",
        f"--config.stop_after={stop}", "--config.progress=False", "--config.plot=False",
        f"--config.steps_per_call={per_call}",
        *([] if per_call == 10 else [f"--config.eval_every={per_call}"]),  # a probe's 2 calls
    ]  # fmt: skip


def run_training(
    n: int, rate: str, method: str, seed: int, steps: int, stop: int, per_call: int = 10
) -> dict:
    """One launched run; returns its command, wall time and metrics rows."""
    workdir = os.path.join(FLAGS.workroot, f"n{n}", rate, method, f"s{seed}")
    subprocess.run(["rm", "-rf", workdir], check=True)
    argv = training_argv(workdir, n, rate, method, seed, steps, stop, per_call)
    return runs.launched(argv, workdir, KEEP)


def write_report(path: str) -> None:
    from experiments.studies import report

    report.write_lm(path)


def probe(results: dict, n: int, rate: str, method: str) -> dict:
    """``--probe_steps`` steps of seed 0 on ``rate``: step time and the trajectory check."""
    run = run_training(n, rate, method, 0, FLAGS.steps, FLAGS.probe_steps,
                       FLAGS.probe_steps_per_call)  # fmt: skip
    last = run["curve"][-1]
    base = next(r for r in results["runs"] if (r["n"], r["method"], r["seed"]) == (n, method, 0))
    ref = next(p for p in base["curve"] if p["step"] == last["step"])
    first = run["curve"][0]  # the first call (10 steps) carries one-time warm-up costs
    step_s = (last["train_s"] - first["train_s"]) / (last["step"] - first["step"])
    ms = step_s * 1e3
    print(f"n={n} {rate:8s} {method:10s}: {ms:.0f} ms/step (val {last['eval_loss']:.5f} "
          f"vs loopback {ref['eval_loss']:.5f})", flush=True)  # fmt: skip
    return {
        "n": n, "rate": rate, "method": method, "seed": 0, **run,
        "first_call": {"steps": first["step"], "train_s": first["train_s"]},
        "steps_per_call": FLAGS.probe_steps_per_call,
        "step_s": step_s,
        "probe_check": {"step": last["step"], "probe_eval_loss": last["eval_loss"],
                        "loopback_eval_loss": ref["eval_loss"]},
    }  # fmt: skip


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.report:
        write_report(FLAGS.out)
        return
    results = {"runs": [], "probes": []}
    if os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            results = json.load(f)
    results.update(steps=FLAGS.steps, config=CONFIG, note=__doc__.split("\n\n")[1])

    def save():
        runs.save_json(FLAGS.out, results)

    have = {(r["n"], r["method"], r["seed"]) for r in results["runs"]}
    probed = {(p["n"], p["rate"], p["method"]) for p in results["probes"]}
    for n in map(int, FLAGS.processes):
        for seed in map(int, FLAGS.seeds):
            for method in FLAGS.methods:
                if (n, method, seed) in have:
                    continue
                run = run_training(n, "loopback", method, seed, FLAGS.steps, 0)
                results["runs"].append({"n": n, "method": method, "seed": seed, **run})
                save()
                last = run["curve"][-1]
                print(f"n={n} {method:10s} seed {seed}: val {last['eval_loss']:.4f} "
                      f"in {last['train_s']:.1f} s", flush=True)  # fmt: skip
            if seed == 0:  # the shaped links' step times, checked against seed 0's trajectory
                for rate in FLAGS.rates:
                    for method in FLAGS.methods:
                        if (n, rate, method) not in probed:
                            results["probes"].append(probe(results, n, rate, method))
                            save()
    save()
    write_report(FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
