r"""A short check on a shaped link after a change to the exchange: step and time to target.

Command (root, iproute2; ~4 min on 2 CPU cores):
  python -m experiments.studies.shaped_check --out=experiments/results/shaped_check.json
Table from the JSON (no runs): ``python -m experiments.studies.shaped_check --report``.

2 processes (``experiments.launch``), each egress shaped to ``--rate`` (tc
tbf), the digits MLP (``experiments/configs/digits_mlp.py`` variants
``--methods``: the same SGD for every method), ``--steps`` steps, 25 a call,
an evaluation every call, seeds ``--seeds``. A run's step: its median
training call after the first, per step. Target: dense's worst final test
accuracy minus 1 point (:func:`experiments.studies.verdict.choose_target`'s
rule for accuracy), checked to lie above dense's first evaluation. Time to
target: steps to the first evaluation at or above it x the run's step (one-time
costs, auto's start-up measurement among them, left out alike); ``train_s``
there beside it. A check, not a study: one session.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

from experiments.studies import runs, verdict

FLAGS = flags.FLAGS
CONFIG = "experiments/configs/digits_mlp.py"
PER_CALL = 25
KEEP = ("step", "accuracy", "train_s", "call_s")


def define_flags() -> None:
    flags.DEFINE_list("methods", ["dense", "bf16", "auto"], "digits_mlp config variants")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
    flags.DEFINE_string("rate", "100mbit", "the shaped link's rate (tc syntax)")
    flags.DEFINE_integer("steps", 400, "training steps of a run")
    flags.DEFINE_string("out", "experiments/results/shaped_check.json", "JSON written")
    flags.DEFINE_string("workroot", "runs/shaped_check", "workdirs")
    flags.DEFINE_bool("report", False, "only print the table from --out")


def run(method: str, seed: int) -> dict:
    workdir = os.path.join(FLAGS.workroot, method, f"s{seed}")
    subprocess.run(["rm", "-rf", workdir], check=True)
    argv = [sys.executable, "-m", "experiments.launch", "--processes=2",
            "--devices_per_process=1", f"--rate={FLAGS.rate}", "--",
            sys.executable, "-m", "experiments.main", f"--config={CONFIG}:{method}",
            f"--workdir={workdir}", f"--config.seed={seed}",
            f"--config.num_train_steps={FLAGS.steps}", f"--config.steps_per_call={PER_CALL}",
            f"--config.eval_every={PER_CALL}", "--config.checkpoint_every=0",
            "--config.progress=False", "--config.plot=False"]  # fmt: skip
    out = runs.launched(argv, workdir, KEEP)
    calls = [t for r in out["curve"] for t in r["call_s"]][1:]
    out["step_s"] = statistics.median(calls) / PER_CALL
    choice = os.path.join(workdir, "auto_choice.json")
    if os.path.exists(choice):
        with open(choice) as f:
            out["auto_choice"] = json.load(f)["choice"]
    return {"method": method, "seed": seed, **out}


def rows(results: dict) -> dict:
    """Per method: step (ms), time to target at the step and logged, final accuracy (and
    whether its median is within the quality band of dense's)."""
    target = results["target"]
    dense_finals = [r["curve"][-1]["accuracy"] for r in results["runs"] if r["method"] == "dense"]
    out = {}
    for method in dict.fromkeys(r["method"] for r in results["runs"]):
        mine = [r for r in results["runs"] if r["method"] == method]
        firsts = [verdict.first_reach(r["curve"], target, "accuracy", False) for r in mine]
        steady = [None if i < 0 else r["curve"][i]["step"] * r["step_s"]
                  for r, i in zip(mine, firsts)]  # fmt: skip
        logged = [None if i < 0 else r["curve"][i]["train_s"] for r, i in zip(mine, firsts)]
        finals = [r["curve"][-1]["accuracy"] for r in mine]
        out[method] = {
            "step_ms": verdict.summarize([r["step_s"] * 1e3 for r in mine]),
            "tta_s": verdict.summarize(steady),
            "train_s_at_target": verdict.summarize(logged),
            "final": verdict.quality(finals, dense_finals, lower_is_better=False),
            "choices": sorted({r["auto_choice"] for r in mine if "auto_choice" in r}),
        }  # fmt: skip
    return out


def report(results: dict) -> str:
    def cell(s: dict, fmt: str) -> str:
        if s["median"] is None:
            return f"not reached ({s['reached']}/{s['seeds']} seeds)"
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    dense = results["rows"]["dense"]["tta_s"]
    lines = [
        f"Target {results['target']:.4f} (dense's first evaluation "
        f"{min(results['dense_first']):.4f}-{max(results['dense_first']):.4f}); medians "
        f"(min-max) over {len(results['seeds'])} seeds, {results['rate']}, 2 processes.",
        "",
        "| method | step ms | time to target s (steps x step) | x dense | train_s at target "
        "| final accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for method, r in results["rows"].items():
        x = verdict.speedup(dense, r["tta_s"])
        name = method + (f" ({', '.join(r['choices'])})" if r["choices"] else "")
        f = r["final"]
        lines.append(
            f"| {name} | {cell(r['step_ms'], '.2f')} | {cell(r['tta_s'], '.3f')} | "
            f"{'-' if x is None else f'{x:.2f}x'} | {cell(r['train_s_at_target'], '.3f')} | "
            f"{f['median']:.4f} ({f['min']:.4f}-{f['max']:.4f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.report:
        with open(FLAGS.out) as f:
            print(report(json.load(f)))
        return
    seeds = [int(s) for s in FLAGS.seeds]
    if len(set(seeds)) < verdict.MIN_SEEDS:  # the rows' rules need them: refuse before running
        need = verdict.MIN_SEEDS
        raise ValueError(f"--seeds: {len(set(seeds))} given; the check needs >= {need}")
    results = {"note": __doc__.split("\n\n", 2)[2].strip(), "rate": FLAGS.rate,
               "steps": FLAGS.steps, "seeds": seeds, "runs": []}  # fmt: skip
    for method in FLAGS.methods:
        for seed in seeds:
            results["runs"].append(run(method, seed))
            r = results["runs"][-1]
            print(f"{method} s{seed}: {r['step_s'] * 1e3:.2f} ms/step, final "
                  f"{r['curve'][-1]['accuracy']:.4f}", flush=True)  # fmt: skip
    dense = [r for r in results["runs"] if r["method"] == "dense"]
    results["target"] = round(min(r["curve"][-1]["accuracy"] for r in dense) - 0.01, 4)
    results["dense_first"] = [r["curve"][0]["accuracy"] for r in dense]
    if max(results["dense_first"]) >= results["target"]:
        raise RuntimeError(f"dense's first evaluation meets the target {results['target']}")
    results["rows"] = rows(results)
    runs.save_json(FLAGS.out, results)
    print(report(results))


if __name__ == "__main__":
    define_flags()
    app.run(main)
