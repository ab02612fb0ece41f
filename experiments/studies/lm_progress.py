"""The learned-regime LM study's final losses so far, from its JSON (no times, no ratios).

``experiments/results/lm_study_learned.json`` fills run by run
(``python -m experiments.studies.lm --phases=runs``): each run is one method
and seed on loopback, its validation loss every 100 steps. Until the
shaped-link probes and the end-to-end validation runs exist, the study has no
time to target on any link, so this table gives quality only:

- each method's final validation loss per seed, their median;
- the median against dense's median final (the study's quality band,
  :data:`experiments.studies.verdict.QUALITY_BAND`, needs 3 seeds of dense);
- whether every seed ends within :data:`~experiments.studies.verdict.HEADLINE_BAND`
  of dense's median (the headline rule; judged at 3 seeds);
- for optimizers and outer loops, the median of their own dense counterpart
  (:data:`experiments.studies.lm_methods.COUNTERPART`);
- variants tried and left out of the grid (:data:`~experiments.studies.lm_methods.TRIED`),
  below the table with their finals;
- the counting models' losses on the same split;
- the shaped-link probes so far: each (method, link) cell's median step and
  range over its probes, and whether each probe's loss equalled the loopback
  trajectory's (no time to target: that needs every method's 3 seeds and
  the validation runs);
- the probes and trajectories set aside (``lm.py --reprobe`` / ``--rerun``), beside
  today's; which trajectories today's code reproduces (``recheck``); and each whole run
  on a link against its seed's loopback trajectory, evaluation by evaluation;
- beside PyTorch DDP and torchft (:mod:`experiments.studies.lm_peers`): time to
  target on every link for the methods probed on all of them, and each
  framework's best.
"""

from __future__ import annotations

import statistics

from experiments.studies import lm_peers, verdict
from experiments.studies.lm_methods import (
    COUNTERPART,
    METHODS,
    OPTIMIZER,
    PROBE_ONLY,
    TRIED,
    tried_lines,
)
from experiments.studies.ngram import ngram_line
from experiments.studies.report import (
    RATE_NAMES,
    RATE_ORDER,
    cell_probes,
    probe_summary,
    running_time,
)


def finals(results: dict, n: int = 2) -> dict[str, dict[int, float]]:
    """``{method: {seed: final validation loss}}`` of the runs on ``n`` processes."""
    out: dict[str, dict[int, float]] = {}
    for r in results["runs"]:
        if r.get("n", 2) == n and r.get("curve"):
            out.setdefault(r["method"], {})[r["seed"]] = r["curve"][-1]["eval_loss"]
    order = {m: i for i, m in enumerate(METHODS)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def rows(results: dict, n: int = 2) -> list[dict]:
    """One row a method: seeds, finals, median, and how it stands against dense."""
    by = finals(results, n)
    dense = list(by.get("dense", {}).values())
    judged = len(dense) >= verdict.MIN_SEEDS
    out = []
    for m, seeds in by.items():
        if m in TRIED or m in PROBE_ONLY:
            continue
        vals = [seeds[s] for s in sorted(seeds)]
        row = {"method": m, "seeds": sorted(seeds), "finals": vals,
               "median": statistics.median(vals), "counterpart": COUNTERPART.get(m)}  # fmt: skip
        if judged and m != "dense":
            q = verdict.quality(vals, dense)
            row.update(worse_by=q["worse_by"], within_band=q["within_band"])
            if len(vals) >= verdict.MIN_SEEDS:
                row["headline_quality"] = verdict.all_within(vals, statistics.median(dense))
        twin = by.get(row["counterpart"] or "")
        if twin:
            row["counterpart_median"] = statistics.median(twin.values())
        out.append(row)
    return out


def _band_cell(r: dict) -> str:
    if "worse_by" not in r:
        return "—"
    where = "within" if r["within_band"] else "outside"
    sign = "+" if r["worse_by"] >= 0 else ""
    return f"{sign}{verdict.worse_text(r['worse_by'])} ({where})"


def _headline_cell(r: dict) -> str:
    if r["method"] == "dense" or "worse_by" not in r:
        return "—"
    if "headline_quality" not in r:
        return f"— ({len(r['seeds'])} of {verdict.MIN_SEEDS} seeds)"
    return "yes" if r["headline_quality"] else "no"


def report(results: dict, n: int = 2) -> str:
    """The markdown: one row a method, then dense's median and the counting models."""
    table = rows(results, n)
    peers = lm_peers.lines(results, n)
    dense = next((r for r in table if r["method"] == "dense"), None)
    steps = results.get("steps")
    lines = [
        f"{n} processes, loopback, {steps} steps a run; final validation loss in nats/byte "
        "(128 held-out windows). The study's verdict waits for every method's shaped-link "
        "probes and the validation runs (`python -m experiments.studies.lm "
        "--phases=probes,validate`)"
        + (
            "; times to target so far only for the methods probed on every link (below, "
            "beside PyTorch's)."
            if peers
            else "."
        ),
        "",
        f"| method | update | seeds | finals | median | vs dense's median (band "
        f"{verdict.QUALITY_BAND:.0%}) | every seed within {verdict.HEADLINE_BAND:.0%} "
        "| own dense counterpart (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        twin = ("—" if not r["counterpart"] else f"{r['counterpart']} "
                + (f"({r['counterpart_median']:.4f})" if "counterpart_median" in r
                   else "(not run)"))  # fmt: skip
        lines.append(
            f"| {r['method']} | {OPTIMIZER.get(r['method'], 'AdamW, every step')} "
            f"| {', '.join(map(str, r['seeds']))} | {' / '.join(f'{v:.4f}' for v in r['finals'])} "
            f"| {r['median']:.4f} | {_band_cell(r)} | {_headline_cell(r)} | {twin} |"
        )
    lines.append("")
    if dense and len(dense["seeds"]) >= verdict.MIN_SEEDS:
        lines.append(f"Dense's median final: {dense['median']:.4f} over seeds "
                     f"{', '.join(map(str, dense['seeds']))}.")  # fmt: skip
    else:
        lines.append(f"Fewer than {verdict.MIN_SEEDS} seeds of dense: nothing is judged yet.")
    lines += tried_lines(results, n)
    lines += probes_table(results, n)
    lines += superseded_lines(results, n)
    lines += superseded_run_lines(results, n)
    lines += recheck_lines(results, n)
    lines += whole_run_lines(results, n)
    lines += peers
    ngram = ngram_line(results)
    if ngram:
        lines += ["", ngram]
    rt = running_time(results)
    lines += ["", f"Running time so far: {rt['total_h']:.1f} h, the sum of every launched run's, "
              "probe's and validation run's wall clock in the JSON."]  # fmt: skip
    return "\n".join(lines) + "\n"


def probes_table(results: dict, n: int = 2) -> list[str]:
    """Markdown lines: each probed (method, link) cell's median step in ms, its range and
    probes, and whether the probes' losses equalled the loopback trajectory's."""
    cells = cell_probes(results, n)
    if not cells:
        return []
    rates = [r for r in RATE_ORDER if any(k[0] == r for k in cells)]
    order = {m: i for i, m in enumerate(METHODS)}
    shown = {m for _, m in cells if m not in TRIED}
    methods = sorted(shown, key=lambda m: (order.get(m, len(order)), m))  # a set: ties by name
    losses: dict[str, set] = {}  # every probe of a method stops at the same step
    for p in (p for p in results["probes"] if p["n"] == n):
        for r in p.get("repeats") or [p]:
            losses.setdefault(p["method"], set()).add(r["probe_check"]["probe_eval_loss"])
    lines = ["", f"Probes so far ({n} processes, seed 0's schedule, today's code): the median "
             "step in ms (range; probes). Every probe of a method stops at the same step; ≠ "
             "marks a cell whose validation loss there differs from another probe's of the "
             "method (on any link) or from the loopback trajectory's where it evaluates at "
             "that step.", "",
             "| method | " + " | ".join(rates) + " |", "|---|" + "---|" * len(rates)]  # fmt: skip
    for m in methods:
        row = []
        for rate in rates:
            c = cells.get((rate, m))
            if c is None:
                row.append("—")
                continue
            mark = " ≠" if c["trajectory_equal"] is False or len(losses[m]) > 1 else ""
            row.append(f"{1e3 * c['step_s']:.0f} ({1e3 * c['step_s_min']:.0f}–"
                       f"{1e3 * c['step_s_max']:.0f}; {c['probes']}){mark}")  # fmt: skip
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return lines


def superseded_lines(results: dict, n: int = 2) -> list[str]:
    """Markdown lines: the probes set aside (``lm.py --reprobe``), each cell's old median
    beside its new one, and why they were set aside. They are kept, never used."""
    old = [p for p in results.get("superseded_probes", []) if p["n"] == n]
    if not old:
        return []
    new = cell_probes(results, n)
    by_why: dict[str, list[str]] = {}
    for c in sorted(old, key=lambda p: (p["method"], RATE_ORDER.index(p["rate"]))):
        now = new.get((c["rate"], c["method"]))
        now_ms = f"{1e3 * now['step_s']:.0f}" if now else "not probed again yet"
        by_why.setdefault(c["why"], []).append(
            f"{c['method']} {c['rate']} {1e3 * probe_summary([c])['step_s']:.0f} → {now_ms}"
        )
    return ["", *(f"Probes set aside ({why}; JSON: superseded_probes), the old median step "
                  f"in ms → today's: {'; '.join(c)}." for why, c in by_why.items())]  # fmt: skip


def superseded_run_lines(results: dict, n: int = 2) -> list[str]:
    """Markdown lines: the trajectories set aside (``lm.py --rerun``), each seed's old final
    validation loss beside today's run's, and why. They are kept, never used."""
    old = [r for r in results.get("superseded_runs", []) if r["n"] == n]
    if not old:
        return []
    now = {(r["method"], r["seed"]): r for r in results["runs"] if r["n"] == n}
    by_why: dict[str, list[str]] = {}
    for r in sorted(old, key=lambda r: (r["method"], r["seed"])):
        new = now.get((r["method"], r["seed"]))
        new_s = f"{new['curve'][-1]['eval_loss']:.4f}" if new else "not run again yet"
        by_why.setdefault(r["why"], []).append(
            f"{r['method']} seed {r['seed']} {r['curve'][-1]['eval_loss']:.4f} → {new_s}"
        )
    return ["", *(f"Trajectories set aside ({why}; JSON: superseded_runs), the old final "
                  f"validation loss → today's run's: {'; '.join(c)}."
                  for why, c in by_why.items())]  # fmt: skip


def whole_run_lines(results: dict, n: int = 2) -> list[str]:
    """Markdown lines: whether each whole run on a shaped link (``--phases=validate``)
    evaluated to the same validation losses as its seed's loopback trajectory, to the last
    digit (the trajectory does not depend on the link), else from which step and by how
    much they differ."""
    runs = {(r["method"], r["seed"]): r for r in results["runs"] if r["n"] == n}
    said = []
    for v in (v for v in results.get("validation", []) if v["n"] == n):
        base = runs.get((v["method"], v["seed"]))
        if base is None:
            continue
        ref = {p["step"]: p["eval_loss"] for p in base["curve"]}
        pairs = [
            (p["step"], p["eval_loss"], ref[p["step"]]) for p in v["curve"] if p["step"] in ref
        ]
        off = [i for i, (_, a, b) in enumerate(pairs) if a != b]
        where = f"{v['method']} at {RATE_NAMES[v['rate']]}"
        if not off:
            said.append(f"{where}: equal at all {len(pairs)} evaluations")
            continue
        most = max(abs(pairs[i][1] - pairs[i][2]) for i in off)
        upto = f"equal through step {pairs[off[0] - 1][0]}, " if off[0] else ""
        said.append(f"{where}: {upto}different from step {pairs[off[0]][0]} (at most {most:.1e})")
    if not said:
        return []
    return ["", "Whole runs on a link against their seed's loopback trajectory, evaluation by "
            f"evaluation: {'; '.join(said)}."]  # fmt: skip


def recheck_lines(results: dict, n: int = 2) -> list[str]:
    """Markdown lines: which seed 0 trajectories today's code reproduces to the last digit at
    their first evaluation (``lm.py --phases=recheck``), and how the others differ there."""
    checks = [c for c in results.get("recheck", []) if c["n"] == n]
    if not checks:
        return []
    same = [c["method"] for c in checks if c["equal"]]
    differ = [f"{c['method']} ({c['eval_loss']:.9f} against {c['trajectory_eval_loss']:.9f})"
              for c in checks if not c["equal"]]  # fmt: skip
    commits = sorted({c["commit"] or "?" for c in checks})
    same_s, differ_s = ", ".join(same) or "none", ", ".join(differ) or "none"
    return ["", f"Seed 0's trajectories re-run to their first evaluation on today's code "
            f"(commit {', '.join(commits)}; JSON: recheck): equal to the last digit for "
            f"{same_s}; different for {differ_s}."]  # fmt: skip
