r"""jaxcomm.auto on real, shaped links: its choice, step time, time to target vs fixed methods.

Command (root, iproute2; ~30 min on 2 CPU cores):
  python -m experiments.bench.auto --out=experiments/results/auto.json
Tables from the JSON (no runs): ``python -m experiments.bench.auto --report``.

For every model (the digits MLP, 9.6k params; the wide MLP, 1.12M; the LM,
5.06M) and link (``--rates``; 2 processes, ``experiments.launch``, each
egress shaped by ``tc ... tbf``):

* ``experiments.advise`` runs once: the link's calibration, the step with no
  exchange, each candidate's measured cost, the predicted step time of each
  (``compute_s`` + cost) and the recommendation;
* the training cells run side by side in one session: dense, ``auto`` (which
  measures its candidates at start-up, on that link, and trains with its
  choice) and the fixed methods of ``--fixed``. The MLPs train to the end
  (time to target = ``train_s`` at the first evaluation reaching dense's
  loopback accuracy minus 1 point); a cell whose dense exchange would take
  more than ``--max_run_s`` runs ``--probe_steps`` steps and its time to
  target is that step time x the steps the same method needed on loopback.
  The LM runs ``--lm_steps`` steps per cell (its step time only: its
  trajectories are :mod:`experiments.studies.lm`'s).

The report compares, per model and link, auto's step time with dense's (the
rule: <= 1.05x on loopback and 1 Gbit/s), its time to target with the best
fixed method's (within 10% at 10 Mbit/s; not slower than dense at 100
Mbit/s), and advise's predicted step with the measured step of each cell that
ran a candidate (dense, and auto's choice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

from experiments.studies import runs

FLAGS = flags.FLAGS
MLP_CONFIG = "experiments/configs/digits_mlp.py"
LM_CONFIG = "experiments/configs/lm_shakespeare.py"
MODELS = {  # config, overrides, steps, steps per call
    "digits_mlp": (MLP_CONFIG, [], 400, 25),
    "wide_mlp": (
        MLP_CONFIG,
        ["--config.model.kwargs.hidden=1024", "--config.model.kwargs.depth=2"],
        200,
        25,
    ),  # fmt: skip
    "lm": (LM_CONFIG, [], 200, 5),
}


def define_flags() -> None:
    flags.DEFINE_list("models", list(MODELS), "models")
    flags.DEFINE_list("rates", ["loopback", "1gbit", "100mbit", "10mbit"], "links")
    flags.DEFINE_list("lm_rates", ["loopback", "10mbit"], "links of the LM")
    flags.DEFINE_list("fixed", ["topk", "powersgd"], "fixed methods run beside dense and auto")
    flags.DEFINE_integer("lm_steps", 10, "steps of an LM cell (two calls)")
    flags.DEFINE_integer("probe_steps", 10, "steps of a probed MLP cell (two calls of half)")
    flags.DEFINE_float("max_run_s", 120.0, "longest full MLP run; slower cells are probed")
    flags.DEFINE_string("out", "experiments/results/auto.json", "JSON written and updated")
    flags.DEFINE_string("workroot", "runs/auto_bench", "workdirs")
    flags.DEFINE_bool("report", False, "only write the tables from --out")


def _launch(n: int, rate: str) -> list[str]:
    return [sys.executable, "-m", "experiments.launch", f"--processes={n}",
            "--devices_per_process=1", *([] if rate == "loopback" else [f"--rate={rate}"]),
            "--"]  # fmt: skip


def run_advise(model: str, rate: str) -> dict:
    config, overrides, _, per_call = MODELS[model]
    workdir = os.path.join(FLAGS.workroot, model, rate)
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "advice.json")
    argv = [*_launch(2, rate), sys.executable, "-m", "experiments.advise",
            f"--config={config}:dense", f"--out={out}", f"--config.steps_per_call={per_call}",
            *overrides]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def run_cell(model: str, rate: str, method: str, steps: int, per_call: int = 0) -> dict:
    config, overrides, total, default_call = MODELS[model]
    per_call = per_call or default_call
    workdir = os.path.join(FLAGS.workroot, model, rate, method)
    subprocess.run(["rm", "-rf", workdir], check=True)
    stop = [f"--config.stop_after={steps}"] if model == "lm" else [
        f"--config.num_train_steps={steps}"]  # fmt: skip
    argv = [*_launch(2, rate), sys.executable, "-m", "experiments.main",
            f"--config={config}:{method}", f"--workdir={workdir}", *stop,
            f"--config.steps_per_call={per_call}", f"--config.eval_every={per_call}",
            "--config.checkpoint_every=0", "--config.progress=False", "--config.plot=False",
            *overrides]  # fmt: skip
    keep = ("step", "accuracy", "train_s", "wire_bytes", "loss", "eval_loss")
    run = runs.launched(argv, workdir, keep)
    curve = run["curve"]
    first, last = curve[0], curve[-1]
    run["step_s"] = (last["train_s"] - first["train_s"]) / (last["step"] - first["step"])
    choice = os.path.join(workdir, "auto_choice.json")
    if os.path.exists(choice):
        with open(choice) as f:
            run["auto"] = json.load(f)
    return run


def time_to(curve: list[dict], target: float) -> tuple[float | None, int | None]:
    for r in curve:
        if r["accuracy"] >= target:
            return r["train_s"], r["step"]
    return None, None


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
    save()
    print(write_report(FLAGS.out))


RATES = ["loopback", "1gbit", "100mbit", "10mbit"]


def _cell(cells, model, rate, method):
    return next((c for c in cells if (c["model"], c["rate"], c["method"]) == (model, rate, method)),
                None)  # fmt: skip


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
            reached = [c for c in fixed if c.get("tta_s") is not None]
            best = min(reached, key=lambda c: c["tta_s"], default=None)
            out.append({
                "model": model, "rate": rate, "choice": auto["auto"]["choice"],
                "dense_ms": dense["step_s"] * 1e3, "auto_ms": auto["step_s"] * 1e3,
                "auto_vs_dense": auto["step_s"] / dense["step_s"],
                "dense_tta": dense.get("tta_s"), "auto_tta": auto.get("tta_s"),
                "best": None if best is None else best["method"],
                "best_tta": None if best is None else best["tta_s"],
            })  # fmt: skip
    return out


def rows_prediction(results: dict) -> list[dict]:
    """advise's predicted step against the measured step of each cell that ran a candidate."""
    out = []
    for c in results["cells"]:
        adv = results["advice"].get(f"{c['model']}/{c['rate']}")
        name = c["auto"]["choice"] if c["method"] == "auto" else c["method"]
        if adv is None or c["method"] not in ("dense", "auto"):
            continue
        row = next(r for r in adv["rows"] if r["name"] == name)
        out.append({"model": c["model"], "rate": c["rate"], "cell": c["method"], "as": name,
                    "predicted_ms": row["predicted_step_s"] * 1e3,
                    "model_ms": row["model_step_s"] * 1e3,
                    "measured_ms": c["step_s"] * 1e3,
                    "ratio": row["predicted_step_s"] / c["step_s"]})  # fmt: skip
    return out


def report(results: dict) -> str:
    """The markdown tables of the results (README block and ``auto.md``, via studies.tables)."""
    lines = [
        "| model | link | auto's choice | dense ms/step | auto ms/step | auto / dense "
        "| dense to target | auto to target | best fixed to target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_step(results):
        best = "-" if r["best"] is None else f"{_s(r['best_tta'])} ({r['best']})"
        lm = r["model"] == "lm"
        lines.append(
            f"| {r['model']} | {r['rate']} | {r['choice']} | {r['dense_ms']:.2f} | "
            f"{r['auto_ms']:.2f} | {r['auto_vs_dense']:.2f}x | "
            f"{'-' if lm else _s(r['dense_tta'])} | {'-' if lm else _s(r['auto_tta'])} | "
            f"{'-' if lm else best} |"
        )
    pred = rows_prediction(results)
    within = sum(abs(p["ratio"] - 1) <= 0.2 for p in pred)
    lines += [
        "",
        f"advise's predicted step (no-exchange step + the candidate's measured cost) against "
        f"the measured step: {within} of {len(pred)} cells within 20%.",
        "",
        "| model | link | cell | candidate | predicted ms | measured ms | predicted / measured "
        "| alpha-beta ms (no codec time) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pred:
        lines.append(
            f"| {p['model']} | {p['rate']} | {p['cell']} | {p['as']} | {p['predicted_ms']:.2f} | "
            f"{p['measured_ms']:.2f} | {p['ratio']:.2f} | {p['model_ms']:.2f} |"
        )
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
