r"""jaxcomm.auto on real, shaped links: its choice, step time, time to target vs fixed methods.

Command (root, iproute2; ~70 min on 2 CPU cores):
  python -m experiments.bench.auto --out=experiments/results/auto.json
Tables from the JSON (no runs): ``python -m experiments.bench.auto --report``.

For every model (the digits MLP, 9.6k params; the wide MLP, 1.12M; the LM,
5.06M) and link (``--rates``; 2 processes, ``experiments.launch``, each
egress shaped by ``tc ... tbf``):

* ``experiments.advise`` runs with the model's ``auto`` config (its guard: the
  LM's ``max_ratio``): the link's calibration, the step with no exchange,
  each candidate's measured cost, the predicted step time of each
  (``compute_s`` + cost) and the recommendation; once per link, and
  ``--step_repeats`` times on the links of ``--repeat_rates`` (the
  prediction's parts are then medians over the runs, as the steps it is
  compared with are);
* the training cells run side by side in one session: dense, ``auto`` (which
  measures its candidates at start-up, on that link, and trains with its
  choice) and the fixed methods of ``--fixed``. The MLPs train to the end
  (time to target = the steps to the first evaluation reaching dense's
  loopback accuracy minus 1 point x the cell's step time, defined below;
  ``train_s`` at that evaluation, which also pays one-time costs, is shown
  beside it; an evaluation every 25 steps for the digits MLP, every 5 for
  the wide MLP, whose accuracy after 25 already met it); a cell whose dense
  exchange would take more than ``--max_run_s`` runs ``--probe_steps``
  steps, and its steps to target are those the same method needed on
  loopback.
  The LM runs ``--lm_steps`` steps per cell (its step time only: its
  trajectories are :mod:`experiments.studies.lm`'s). A cell's step time is
  its median training call after the first (``mean_step_s``: every call,
  stalls between the processes included, which time to target pays); on
  the links of ``--repeat_rates`` dense and auto run ``--step_repeats``
  times each, alternating (auto replaying its recorded choice), and their
  step is the median over the runs;
* on the links of ``--lm_replay``, the LM trains 3 seeds of the study's
  schedule at loopback with the auto cell's recorded choice replayed (the
  computation auto trains with on that link): its time to the study's target
  at the cell's step, beside the study's methods on that link.

The report compares, per model and link, auto's step time with dense's (the
rule: <= 1.05x on loopback and 1 Gbit/s), its time to target with the best
fixed method's (within 10% at 10 Mbit/s; not slower than dense at 100
Mbit/s), and advise's predicted step (``compute_s`` + the larger of the
candidate's measured cost and the alpha-beta time of its collectives; the
measured parts the median of their samples) with the measured step of each
cell that ran a candidate (dense, and auto's choice).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

from experiments.bench.auto_report import MODELS, find_cell, report
from experiments.studies import lm, runs, tables, verdict

FLAGS = flags.FLAGS
LM_STUDY_STEPS = 200  # experiments.studies.lm's schedule (its --steps default)


def define_flags() -> None:
    flags.DEFINE_list("models", list(MODELS), "models")
    flags.DEFINE_list("rates", ["loopback", "1gbit", "100mbit", "10mbit"], "links")
    flags.DEFINE_list("lm_rates", ["loopback", "1gbit", "10mbit"], "links of the LM")
    flags.DEFINE_list("lm_replay", ["10mbit"], "links whose LM auto choice trains 3 seeds")
    flags.DEFINE_list("fixed", ["topk", "powersgd"], "fixed methods run beside dense and auto")
    flags.DEFINE_integer("lm_steps", 10, "steps of an LM cell (two calls)")
    flags.DEFINE_integer("probe_steps", 10, "steps of a probed MLP cell (two calls of half)")
    flags.DEFINE_float("max_run_s", 120.0, "longest full MLP run; slower cells are probed")
    flags.DEFINE_list(
        "repeat_rates",
        ["loopback", "1gbit"],
        "links whose dense and auto "
        "steps are measured over --step_repeats runs (the <= 1.05x rule)",
    )
    flags.DEFINE_integer("step_repeats", 3, "runs of dense and auto on --repeat_rates (median)")
    flags.DEFINE_list(
        "redo_repeats",
        [],
        "models whose repeated runs (steps, advise) are made "
        "again, e.g. with another --step_repeats; their cells' own runs are kept",
    )
    flags.DEFINE_string("out", "experiments/results/auto.json", "JSON written and updated")
    flags.DEFINE_string("workroot", "runs/auto_bench", "workdirs")
    flags.DEFINE_bool("report", False, "only write the tables from --out")


def _launch(n: int, rate: str) -> list[str]:
    return [sys.executable, "-m", "experiments.launch", f"--processes={n}",
            "--devices_per_process=1", *([] if rate == "loopback" else [f"--rate={rate}"]),
            "--"]  # fmt: skip


def run_advise(model: str, rate: str, tag: str = "") -> dict:
    config, overrides, _, per_call = MODELS[model]
    workdir = os.path.join(FLAGS.workroot, model, rate)
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, f"advice{tag}.json")
    argv = [*_launch(2, rate), sys.executable, "-m", "experiments.advise",
            f"--config={config}:auto", f"--out={out}", f"--config.steps_per_call={per_call}",
            *overrides]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def run_cell(model: str, rate: str, method: str, steps: int, per_call: int = 0,
             replay: dict | None = None, tag: str = "") -> dict:  # fmt: skip
    """One training run of ``method``; ``replay``: an ``auto_choice.json`` record to decide from."""
    config, overrides, total, default_call = MODELS[model]
    per_call = per_call or default_call
    workdir = os.path.join(FLAGS.workroot, model, rate, method + tag)
    subprocess.run(["rm", "-rf", workdir], check=True)
    if replay is not None:
        os.makedirs(workdir)
        with open(os.path.join(workdir, "auto_choice.json"), "w") as f:
            json.dump(replay, f, indent=1)
    stop = [f"--config.stop_after={steps}"] if model == "lm" else [
        f"--config.num_train_steps={steps}"]  # fmt: skip
    argv = [*_launch(2, rate), sys.executable, "-m", "experiments.main",
            f"--config={config}:{method}", f"--workdir={workdir}", *stop,
            f"--config.steps_per_call={per_call}", f"--config.eval_every={per_call}",
            "--config.checkpoint_every=0", "--config.progress=False", "--config.plot=False",
            *overrides]  # fmt: skip
    keep = ("step", "accuracy", "train_s", "wire_bytes", "loss", "eval_loss", "call_s")
    run = runs.launched(argv, workdir, keep)
    curve = run["curve"]
    first, last = curve[0], curve[-1]
    # the steady-state step: the median training call after the first (compile, warm-up),
    # per step; the mean (every call's seconds) is what time to target pays, stalls included
    calls = [t for r in curve for t in r["call_s"]][1:]
    run["step_s"] = statistics.median(calls) / per_call
    run["mean_step_s"] = (last["train_s"] - first["train_s"]) / (last["step"] - first["step"])
    choice = os.path.join(workdir, "auto_choice.json")
    if os.path.exists(choice):
        with open(choice) as f:
            run["auto"] = json.load(f)
    return run


def run_lm_replay(choice: dict, rate: str, seeds: list[int]) -> list[dict]:
    """The LM's trajectory under auto's choice on ``rate``: its recorded costs replayed.

    A run whose workdir holds ``auto_choice.json`` decides from the costs there
    (what a resumed run does), so a loopback run with the auto cell's record
    trains with the exchange auto chose on ``rate``: the same computation, on
    the study's schedule and seeds (:mod:`experiments.studies.lm`, 2 processes).
    """
    out = []
    for seed in seeds:
        workdir = os.path.join(FLAGS.workroot, "lm", rate, "auto_replay", f"s{seed}")
        subprocess.run(["rm", "-rf", workdir], check=True)
        os.makedirs(workdir)
        with open(os.path.join(workdir, "auto_choice.json"), "w") as f:
            json.dump(choice, f, indent=1)
        argv = lm.training_argv(workdir, 2, "loopback", "auto", seed, LM_STUDY_STEPS, 0)
        run = runs.launched(argv, workdir, lm.KEEP)
        with open(os.path.join(workdir, "auto_choice.json")) as f:
            if json.load(f)["choice"] != choice["choice"]:
                raise RuntimeError(f"{workdir}: the replay did not keep {choice['choice']}")
        out.append({"seed": seed, **run})
        print(f"lm/{rate} auto replay seed {seed}: val {run['curve'][-1]['eval_loss']:.4f}",
              flush=True)  # fmt: skip
    return out


def time_to(curve: list[dict], target: float) -> tuple[float | None, int | None]:
    """``(train_s, step)`` at the first evaluation reaching ``target`` accuracy, or Nones."""
    i = verdict.first_reach(curve, target, "accuracy", False)
    return (None, None) if i < 0 else (curve[i]["train_s"], curve[i]["step"])


def _dense_step_estimate(results: dict, model: str, rate: str) -> float:
    """Seconds per step dense would take on ``rate``: advise's prediction."""
    adv = results["advice"].get(f"{model}/{rate}")
    return next(r["predicted_step_s"] for r in adv["rows"] if r["name"] == "dense")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.report:
        print(write_report(FLAGS.out))
        return
    results = {"advice": {}, "cells": [], "targets": {}}
    if os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            results = json.load(f)
    results["note"] = "\n\n".join(__doc__.split("\n\n")[2:])

    def save():
        runs.save_json(FLAGS.out, results)

    have = {(c["model"], c["rate"], c["method"]) for c in results["cells"]}
    for model in FLAGS.models:
        _, _, total, per_call = MODELS[model]
        for rate in FLAGS.lm_rates if model == "lm" else FLAGS.rates:
            key = f"{model}/{rate}"
            if key not in results["advice"]:
                results["advice"][key] = run_advise(model, rate)
                save()
                print(f"{key}: advise -> {results['advice'][key]['choice']}", flush=True)
            for method in ["dense", "auto", *FLAGS.fixed]:
                if (model, rate, method) in have:
                    continue
                steps, call = (FLAGS.lm_steps if model == "lm" else total), 0
                probed = False
                if model != "lm" and rate != "loopback" and method == "dense":
                    if _dense_step_estimate(results, model, rate) * total > FLAGS.max_run_s:
                        steps, call, probed = FLAGS.probe_steps, FLAGS.probe_steps // 2, True
                cell = {"model": model, "rate": rate, "method": method, "probed": probed,
                        **run_cell(model, rate, method, steps, call)}  # fmt: skip
                if model != "lm":
                    if rate == "loopback" and method == "dense":
                        results["targets"][model] = round(cell["curve"][-1]["accuracy"] - 0.01, 4)
                    target = results["targets"][model]
                    if probed:
                        base = next(c for c in results["cells"] if (c["model"], c["rate"],
                                    c["method"]) == (model, "loopback", method))  # fmt: skip
                        _, lb_steps = time_to(base["curve"], target)
                        cell["tta_steps"] = lb_steps
                        cell["tta_s"] = None if lb_steps is None else lb_steps * cell["step_s"]
                    else:
                        cell["tta_s"], cell["tta_steps"] = time_to(cell["curve"], target)
                results["cells"].append(cell)
                save()
                pick = cell.get("auto", {}).get("choice", "")
                print(f"{key} {method:9s}: {cell['step_s'] * 1e3:8.2f} ms/step "
                      f"tta {cell.get('tta_s')} {pick}", flush=True)  # fmt: skip
            if rate in FLAGS.repeat_rates:
                repeat_steps(results, model, rate, save)
                repeat_advice(results, model, rate, save)
    for rate in FLAGS.lm_replay if "lm" in FLAGS.models else []:
        auto = find_cell(results["cells"], "lm", rate, "auto")
        if auto is not None and rate not in results.setdefault("lm_replay", {}):
            results["lm_replay"][rate] = {
                "choice": auto["auto"]["choice"],
                "runs": run_lm_replay(auto["auto"], rate, [0, 1, 2]),
            }
            save()
    save()
    print(write_report(FLAGS.out))


def repeat_steps(results: dict, model: str, rate: str, save) -> None:
    """More runs of dense and auto on ``rate``, alternating: ``step_runs_s`` of each cell
    (an MLP's as long as its cell's own run: a run's step is the median of its calls).

    Between two runs of the same program the step moved by more than 2x on
    these 2 shared cores (the digits MLP's dense step: 0.87 ms on loopback,
    0.37 ms at 1 Gbit/s, one run each), so a verdict on auto / dense read
    from one run of each is a coin toss. ``--step_repeats`` runs of each in
    all (the cell's own first); auto's runs replay the cell's recorded choice.
    """
    dense, auto = (find_cell(results["cells"], model, rate, m) for m in ("dense", "auto"))
    if dense is None or auto is None:
        return
    _, _, total, _ = MODELS[model]
    steps = FLAGS.lm_steps if model == "lm" else total  # as many calls as the cell's own run
    for cell in (dense, auto):
        if model in FLAGS.redo_repeats:  # the runs after the cell's own, made again
            cell["step_runs_s"] = [cell["step_s"]]
        cell.setdefault("step_runs_s", [cell["step_s"]])
    while len(auto["step_runs_s"]) < FLAGS.step_repeats:
        rep = len(auto["step_runs_s"])
        for cell in (dense, auto):
            if len(cell["step_runs_s"]) > rep:
                continue
            replay = cell.get("auto")
            run = run_cell(model, rate, cell["method"], steps, 0, replay, f"_r{rep}")
            if replay is not None and run["auto"]["choice"] != replay["choice"]:
                raise RuntimeError(f"{model}/{rate} repeat {rep}: auto left {replay['choice']}")
            cell["step_runs_s"].append(run["step_s"])
            save()
            print(f"{model}/{rate} {cell['method']:9s} run {rep + 1}: "
                  f"{run['step_s'] * 1e3:8.2f} ms/step", flush=True)  # fmt: skip


def repeat_advice(results: dict, model: str, rate: str, save) -> None:
    """More runs of advise on ``rate`` (``repeats`` of its advice): ``--step_repeats`` in all.

    The measured step it is compared with is a median over runs there, and
    one advise run's parts move as much as one training run's (the digits
    MLP's predicted dense step at 1 Gbit/s: 1.61x the measured median), so
    its parts are medians over as many runs (:func:`experiments.bench.auto_report.advice_parts`).
    """
    adv = results["advice"][f"{model}/{rate}"]
    if model in FLAGS.redo_repeats:
        adv["repeats"] = []
    more = adv.setdefault("repeats", [])
    while 1 + len(more) < FLAGS.step_repeats:
        run = run_advise(model, rate, f"_r{len(more) + 1}")
        more.append({k: run[k] for k in ("compute_s", "choice", "rows")})
        save()
        print(f"{model}/{rate} advise run {len(more) + 1}: {run['choice']}", flush=True)


def write_report(path: str) -> str:
    """Regenerate every table (README blocks and study files, ``auto.md`` among them)."""
    with open(path) as f:
        text = report(json.load(f))
    if os.path.abspath(path) == os.path.join(tables.RESULTS, "auto.json"):
        tables.main([])
    return text


if __name__ == "__main__":
    define_flags()
    app.run(main)
