"""The tables of :mod:`experiments.bench.auto` from its JSON (no runs).

Split from :mod:`experiments.bench.auto` (which runs the cells and writes the
JSON): per model and link, auto's step and time to target beside dense's and
the best fixed method's, advise's predicted step against the measured one,
and the LM's time to target under auto's replayed choice beside the LM
study's methods. ``experiments.studies.tables`` renders ``auto.md`` from
:func:`report`, and the README's headline from :func:`rows_step` and :func:`rows_prediction`.
"""

from __future__ import annotations

import json
import os
import statistics

from experiments.advise import predicted_step
from experiments.configs import lm_shakespeare
from experiments.studies import report as lm_report
from experiments.studies import verdict

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
LM_STUDY = "experiments/results/lm_study.json"


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


def find_cell(cells, model, rate, method):
    """The cell of ``(model, rate, method)`` in ``cells``, or None."""
    return next((c for c in cells if (c["model"], c["rate"], c["method"]) == (model, rate, method)),
                None)  # fmt: skip


def _final(cells: list[dict], cell: dict) -> float | None:
    """An MLP cell's final test accuracy: its own run's, or for a probed cell (a few steps
    on the link, its time to target from loopback's steps) the loopback run's."""
    if cell["model"] == "lm":
        return None
    if cell.get("probed"):
        cell = find_cell(cells, cell["model"], "loopback", cell["method"])
    return cell["curve"][-1]["accuracy"]


def _s(x):
    return "not reached" if x is None else f"{x:.2f} s"


def rows_step(results: dict) -> list[dict]:
    """Per model and link: dense's, auto's and the best fixed method's step time and tta."""
    out = []
    cells = results["cells"]
    for model in dict.fromkeys(c["model"] for c in cells):
        for rate in RATES:
            dense, auto = (
                find_cell(cells, model, rate, "dense"),
                find_cell(cells, model, rate, "auto"),
            )
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
    out = []
    verdicts = lm_report.lm_verdicts(study).get(2)
    for rate, replay in results.get("lm_replay", {}).items():
        if verdicts is None or rate not in verdicts["rates"]:
            continue
        target = verdicts["target"]["target"]
        auto = find_cell(results["cells"], "lm", rate, "auto")
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
    """The markdown tables of the results (``auto.md``, via studies.tables)."""
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
        dense = find_cell(results["cells"], model, "loopback", "dense")
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
