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

from experiments.studies import runs, verdict

FLAGS = flags.FLAGS
MLP_CONFIG = "experiments/configs/digits_mlp.py"
LM_CONFIG = "experiments/configs/lm_shakespeare.py"
MODELS = {  # config, overrides, steps, steps per call
    "digits_mlp": (MLP_CONFIG, [], 400, 25),
    "wide_mlp": (
        MLP_CONFIG,
        ["--config.model.kwargs.hidden=1024", "--config.model.kwargs.depth=2"],
        200,
        5,  # its first evaluation after 25 steps already met the target (0.9577 >= 0.9566)
    ),  # fmt: skip
    "lm": (LM_CONFIG, [], 200, 5),
}
LM_STUDY_STEPS = 200  # experiments.studies.lm's schedule (its --steps default)
LM_STUDY = "experiments/results/lm_study.json"


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
    from experiments.studies import lm

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
        auto = _cell(results["cells"], "lm", rate, "auto")
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
    dense, auto = (_cell(results["cells"], model, rate, m) for m in ("dense", "auto"))
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
    its parts are medians over as many runs (:func:`advice_parts`).
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


def advice_parts(adv: dict, name: str) -> tuple[float, float, float, int]:
    """``(compute_s, measured cost, alpha-beta time, runs)`` of candidate ``name``: each part
    the median over advise's runs (the first and its ``repeats``)."""
    runs_ = [adv, *adv.get("repeats", [])]
    rows = [next(r for r in a["rows"] if r["name"] == name) for a in runs_]
    med = statistics.median
    return (med(a["compute_s"] for a in runs_), med(r["seconds"] for r in rows),
            med(r["predicted_s"] for r in rows), len(runs_))  # fmt: skip


def _step(cell: dict) -> float:
    """A cell's step: the median over its runs (``step_runs_s``), else its one run's."""
    return statistics.median(cell.get("step_runs_s") or [cell["step_s"]])


RATES = ["loopback", "1gbit", "100mbit", "10mbit"]


def _cell(cells, model, rate, method):
    return next((c for c in cells if (c["model"], c["rate"], c["method"]) == (model, rate, method)),
                None)  # fmt: skip


def _final(cells: list[dict], cell: dict) -> float | None:
    """An MLP cell's final test accuracy: its own run's, or for a probed cell (a few steps
    on the link, its time to target from loopback's steps) the loopback run's."""
    if cell["model"] == "lm":
        return None
    if cell.get("probed"):
        cell = _cell(cells, cell["model"], "loopback", cell["method"])
    return cell["curve"][-1]["accuracy"]


def _s(x):
    return "not reached" if x is None else f"{x:.2f} s"


def rows_step(results: dict) -> list[dict]:
    """Per model and link: dense's, auto's and the best fixed method's step time and tta."""
    out = []
    cells = results["cells"]
    for model in dict.fromkeys(c["model"] for c in cells):
        for rate in RATES:
            dense, auto = _cell(cells, model, rate, "dense"), _cell(cells, model, rate, "auto")
            if dense is None or auto is None:
                continue
            fixed = [c for c in cells if (c["model"], c["rate"]) == (model, rate)
                     and c["method"] != "auto"]  # fmt: skip
            reached = [c for c in fixed if c.get("tta_steps") is not None]
            best = min(reached, key=_steady_tta, default=None)
            out.append({
                "final": {m: _final(cells, c) for m, c in
                          (("dense", dense), ("auto", auto), ("best", best)) if c},
                "model": model, "rate": rate, "choice": auto["auto"]["choice"],
                "dense_ms": _step(dense) * 1e3, "auto_ms": _step(auto) * 1e3,
                "dense_range": _range_ms(dense), "auto_range": _range_ms(auto),
                "auto_vs_dense": _step(auto) / _step(dense),
                "runs": len(auto.get("step_runs_s") or [0]),
                "dense_tta": _steady_tta(dense), "auto_tta": _steady_tta(auto),
                "best": None if best is None else best["method"],
                "best_tta": None if best is None else _steady_tta(best),
                "measured": {m: c.get("tta_s") for m, c in
                             (("dense", dense), ("auto", auto), ("best", best)) if c},
            })  # fmt: skip
    return out


def _range_ms(cell: dict) -> str:
    """`` (min-max)`` of a cell's repeated runs' steps in ms; ``""`` for one run."""
    runs_ = cell.get("step_runs_s") or []
    return f" ({min(runs_) * 1e3:.2f}-{max(runs_) * 1e3:.2f})" if len(runs_) > 1 else ""


def _steady_tta(cell: dict) -> float | None:
    """Time to target at the steady step: steps to target x the cell's step (its median call;
    over its runs where repeated). ``tta_s``, the training time at that evaluation, also pays
    one-time costs (the first call's warm-up; after auto's start-up measurement, a link
    whose burst it spent): on the wide MLP at 10 Mbit/s auto's first call of 5 steps took
    0.33 s, fixed PowerSGD's 0.20 s, for the same steps at the same step time. The probed
    cells' times were this product already; the LM study's rule on shaped links is too."""
    steps = cell.get("tta_steps")
    return None if steps is None else steps * _step(cell)


def rows_prediction(results: dict, advice: str = "advice") -> list[dict]:
    """advise's predicted step against the measured step of each cell that ran a candidate.

    ``advice``: the key of the advise runs to compare (``"advice_run1"``: an
    earlier run of advise, where the JSON keeps one).
    """
    from experiments.advise import predicted_step

    out = []
    for c in results["cells"]:
        adv = results[advice].get(f"{c['model']}/{c['rate']}")
        name = c["auto"]["choice"] if c["method"] == "auto" else c["method"]
        if adv is None or c["method"] not in ("dense", "auto"):
            continue
        # advise's rule, from the stored parts (their medians where advise ran several times)
        compute, cost, model, runs_ = advice_parts(adv, name)
        pred = predicted_step(compute, cost, model)
        out.append({"model": c["model"], "rate": c["rate"], "cell": c["method"], "as": name,
                    "predicted_ms": pred * 1e3, "cost_ms": (compute + cost) * 1e3,
                    "model_ms": (compute + model) * 1e3, "advise_runs": runs_,
                    "measured_ms": _step(c) * 1e3,
                    "ratio": pred / _step(c)})  # fmt: skip
    return out


def rows_lm_tta(results: dict, study: dict) -> list[dict]:
    """Per replayed link: auto's LM time to the study's target beside the study's methods.

    auto's seeds reach the study's 2-process target at the steps of their
    replayed trajectories, timed at the auto cell's measured step on that link
    (its first call, then the median call: the study's rule for shaped links).
    """
    from experiments.configs import lm_shakespeare
    from experiments.studies import report as lm_report

    out = []
    verdicts = lm_report.lm_verdicts(study).get(2)
    for rate, replay in results.get("lm_replay", {}).items():
        if verdicts is None or rate not in verdicts["rates"]:
            continue
        target = verdicts["target"]["target"]
        auto = _cell(results["cells"], "lm", rate, "auto")
        calls = [t for r in auto["curve"] for t in r["call_s"]]
        probe = {"first_call": {"steps": MODELS["lm"][3], "train_s": calls[0]},
                 "step_s": auto["step_s"]}  # fmt: skip
        curves = [r["curve"] for r in replay["runs"]]
        first = [verdict.first_reach(c, target, "eval_loss", True) for c in curves]
        times = [lm_report.seed_time(c, i, probe) if i >= 0 else None
                 for c, i in zip(curves, first)]  # fmt: skip
        rows = verdicts["methods"]
        linked = {m: r["links"][rate] for m, r in rows.items() if rate in r["links"]}
        reached = {m: c["median"] for m, c in linked.items() if c["median"] is not None}
        # the fixed methods auto stands beside: an exchange every step on the same AdamW
        # (DeMo brings its own optimizer, the DiLoCo family syncs every H steps)
        own = lambda m: {"wrapper", "optimizer"} & set(lm_shakespeare.VARIANTS[m])
        every_step = {m: t for m, t in reached.items() if not own(m)}
        dense_finals = [r["curve"][-1]["eval_loss"] for r in study["runs"]
                        if (r["n"], r["method"]) == (2, "dense")]  # fmt: skip
        best = min(reached, key=reached.get)
        best_step = min(every_step, key=every_step.get)
        out.append({
            "rate": rate, "choice": replay["choice"], "target": target,
            "auto": verdict.summarize(times),
            "final": verdict.quality([c[-1]["eval_loss"] for c in curves], dense_finals),
            "dense": linked["dense"]["median"],
            "best": best, "best_s": reached[best],
            "best_step": best_step, "best_step_s": every_step[best_step],
        })  # fmt: skip
    return out


def _lm_tta_lines(results: dict) -> list[str]:
    if not results.get("lm_replay") or not os.path.exists(LM_STUDY):
        return []
    with open(LM_STUDY) as f:
        rows = rows_lm_tta(results, json.load(f))
    lines = [
        "",
        "The LM's time to target (2 processes; the study's target, schedule and seeds; auto's "
        "trajectory: its choice on the link replayed at loopback, 3 seeds, timed at its cell's "
        "step on the link; the other methods: `lm_study.json`):",
        "",
        "| link | auto's choice | auto's final val loss | auto to target | dense | "
        "best every-step exchange on the same AdamW | best of the study | "
        "auto / best every-step | auto / best of the study |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, f = r["auto"], r["final"]
        got = (f"{a['median']:.1f} s ({a['min']:.1f}-{a['max']:.1f})" if a["median"] is not None
               else f"not reached ({a['reached']}/{a['seeds']} seeds)")  # fmt: skip
        ratio = lambda b, t=a["median"]: "-" if t is None else f"{t / b:.2f}x"
        band = "" if f["within_band"] else " (worse than dense by > 2%)"
        lines.append(
            f"| {r['rate']} | {r['choice']} | {f['median']:.4f}{band} | {got} | "
            f"{r['dense']:.0f} s | {r['best_step_s']:.1f} s ({r['best_step']}) | "
            f"{r['best_s']:.1f} s ({r['best']}) | {ratio(r['best_step_s'])} | "
            f"{ratio(r['best_s'])} |"
        )
    return lines


def _earlier_advice(results: dict) -> list[str]:
    if "advice_run1" not in results:
        return []
    pred = rows_prediction(results, "advice_run1")
    within = sum(abs(p["ratio"] - 1) <= 0.2 for p in pred)
    return [
        "",
        f"advise's first run (beside the training cells, before samples had a lead-in call "
        f"spending the link's burst): {within} of {len(pred)} cells within 20%; the table "
        "shows the second run (after the training cells, same code as the repository's).",
    ]


def _trio(values: dict, fmt: str) -> str:
    """``dense / auto / best`` of ``values`` (``-`` where one is missing)."""
    return " / ".join(
        "-" if values.get(m) is None else f"{values[m]:{fmt}}" for m in ("dense", "auto", "best")
    )


def report(results: dict) -> str:
    """The markdown tables of the results (README block and ``auto.md``, via studies.tables)."""
    steps = rows_step(results)
    repeated = sorted({r["runs"] for r in steps if r["runs"] > 1})
    lines = [
        *(
            [
                f"Step times where several runs were made (loopback and 1 Gbit/s): the median "
                f"(min-max) over {', '.join(map(str, repeated))} runs of dense and of auto, "
                "alternating. Where auto chose dense, auto trains dense's program (its "
                "transform is `jaxcomm.allreduce`, as dense's): their ratio is the spread "
                "between runs of one program on these 2 shared cores, which on sub-millisecond "
                "steps is wider than the rule's 5%.",
                "",
            ]
            if repeated
            else []
        ),
        "| model | link | auto's choice | dense ms/step | auto ms/step | auto / dense "
        "| dense to target | auto to target | best fixed to target "
        "| training time to target: dense / auto / best fixed "
        "| final accuracy: dense / auto / best fixed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        best = "-" if r["best"] is None else f"{_s(r['best_tta'])} ({r['best']})"
        lm = r["model"] == "lm"
        same = " (the same program)" if r["choice"] == "dense" else ""
        measured = "-" if lm else _trio(r["measured"], ".2f")
        finals = "-" if lm else _trio(r["final"], ".4f")
        lines.append(
            f"| {r['model']} | {r['rate']} | {r['choice']} | "
            f"{r['dense_ms']:.2f}{r['dense_range']} | "
            f"{r['auto_ms']:.2f}{r['auto_range']} | {r['auto_vs_dense']:.2f}x{same} | "
            f"{'-' if lm else _s(r['dense_tta'])} | {'-' if lm else _s(r['auto_tta'])} | "
            f"{'-' if lm else best} | {measured} | {finals} |"
        )
    firsts = []
    for model, target in results.get("targets", {}).items():
        dense = _cell(results["cells"], model, "loopback", "dense")
        if dense is not None:
            first = dense["curve"][0]["accuracy"]
            warn = (", **at or above the target: this model's times to target time the first "
                    "evaluation, not convergence**") if first >= target else ""  # fmt: skip
            firsts.append(f"{model} {target:.4f} (dense's first evaluation {first:.4f}{warn})")
    if firsts:
        rule = "dense's loopback final test accuracy minus 1 point: " + "; ".join(firsts)
        lines += ["", f"MLP cells: one seed, the same SGD for every method; target: {rule}."]
    pred = rows_prediction(results)
    within = sum(abs(p["ratio"] - 1) <= 0.2 for p in pred)
    lines += [
        "",
        "advise's predicted step (the no-exchange step + the larger of the candidate's "
        "measured cost and the alpha-beta time of its collectives: "
        "``experiments.advise.predicted_step``; each part the median over advise's runs on "
        "the link, as many as the measured step's) against the measured step: "
        f"{within} of {len(pred)} cells within 20%.",
        *_earlier_advice(results),
        "",
        "| model | link | cell | candidate | advise runs | no-exchange + measured cost ms "
        "| no-exchange + alpha-beta ms | predicted ms | measured ms | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pred:
        lines.append(
            f"| {p['model']} | {p['rate']} | {p['cell']} | {p['as']} | "
            f"{p.get('advise_runs', 1)} | {p['cost_ms']:.2f} | "
            f"{p['model_ms']:.2f} | {p['predicted_ms']:.2f} | {p['measured_ms']:.2f} | "
            f"{p['ratio']:.2f} |"
        )
    lines += _lm_tta_lines(results)
    return "\n".join(lines) + "\n"


def write_report(path: str) -> str:
    """Regenerate every table (README blocks and study files, ``auto.md`` among them)."""
    from experiments.studies import tables

    with open(path) as f:
        text = report(json.load(f))
    if os.path.abspath(path) == os.path.join(tables.RESULTS, "auto.json"):
        tables.main([])
    return text


if __name__ == "__main__":
    define_flags()
    app.run(main)
