"""Markdown tables and plots generated from a study's results JSON (never typed by hand).

:func:`lm_verdicts` applies :mod:`experiments.studies.verdict` to the LM
study's JSON (``experiments/studies/lm.py``); :func:`lm_headline` picks each
link's headline method; :func:`lm_markdown` renders them, with the counting
models' losses (:func:`experiments.studies.ngram.ngram_line`) and the study's :func:`running_time`;
:func:`lm_plot` draws the curves; :func:`write_lm` writes the plot beside the
JSON and regenerates the tables (:mod:`experiments.studies.tables`).

Older JSON is read as well: a probe without ``repeats`` is one probe; no
``ngram`` gives no reference lines; no ``validation`` means every shaped-link
time is an estimate.
"""

from __future__ import annotations

import statistics

from experiments.studies import verdict
from experiments.studies.lm_methods import COUNTERPART, PROBE_ONLY, TRIED, peak_factor, tried_lines
from experiments.studies.ngram import ngram_line

RATE_ORDER = ("loopback", "1gbit", "100mbit", "10mbit")
RATE_NAMES = {"loopback": "loopback", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s",
              "10mbit": "10 Mbit/s"}  # fmt: skip


def superseded(results: dict) -> dict[str, str]:
    """The study JSON's own ``superseded``: its methods whose code changed after their runs
    (method -> why), marked † in its tables and left out of its headline."""
    return results.get("superseded", {})


def label(method: str, stale: dict | set = frozenset()) -> str:
    """The method's name in a table: † when ``stale`` (:func:`superseded`) names it."""
    return f"{method} †" if method in stale else method


def seed_time(curve: list[dict], i: int, probe: dict | None) -> float:
    """Seconds of training calls to evaluation row ``i``: measured, or timed on the probe's link.

    Loopback (``probe`` None): the run's own ``train_s``. A shaped link: the
    probe's first call (its measured warm-up) plus the remaining steps at the
    probe's steady step time.
    """
    if probe is None:
        return curve[i]["train_s"]
    steps = curve[i]["step"]
    first = probe["first_call"]
    if steps <= first["steps"]:
        return first["train_s"] * steps / first["steps"]
    return first["train_s"] + (steps - first["steps"]) * probe["step_s"]


def probe_summary(entries: list[dict]) -> dict:
    """One cell's probes on a shaped link (every entry of that process count, rate and method).

    An entry holds ``repeats`` (each with ``step_s``, ``first_call`` and
    ``probe_check``); an entry without them is one repeat. Returns the median
    step time and its range over all repeats, their number (``probes``), the
    ``first_call`` of the repeat nearest the median, and ``trajectory_equal``:
    whether every repeat's validation loss equalled the loopback run's (None when
    none could be compared: the loopback run has no evaluation at that step).
    """
    reps = [r for p in entries for r in (p.get("repeats") or [p])]
    times = [r["step_s"] for r in reps]
    med = statistics.median(times)
    nearest = min(reps, key=lambda r: abs(r["step_s"] - med))
    checks = [r["probe_check"] for r in reps if r.get("probe_check")]
    checks = [c for c in checks if c.get("loopback_eval_loss") is not None]
    return {
        "step_s": med, "step_s_min": min(times), "step_s_max": max(times), "probes": len(reps),
        "first_call": nearest["first_call"],
        "trajectory_equal": all(c["probe_eval_loss"] == c["loopback_eval_loss"] for c in checks)
        if checks else None,
    }  # fmt: skip


def cell_probes(results: dict, n: int) -> dict[tuple[str, str], dict]:
    cells: dict[tuple[str, str], list[dict]] = {}
    for p in results["probes"]:
        if p["n"] == n:
            cells.setdefault((p["rate"], p["method"]), []).append(p)
    return {k: probe_summary(ps) for k, ps in cells.items()}


def _measured(val: dict, target: float) -> float | None:
    """A whole run on a shaped link: seconds of training calls to its first evaluation at target."""
    if val.get("measured_s") is not None:
        return val["measured_s"]
    i = verdict.first_reach(val["curve"], target, "eval_loss", True)
    return val["curve"][i]["train_s"] if i >= 0 else None


def time_axis(curve: list[dict], probe: dict | None, val: dict | None) -> tuple[list, list]:
    """One seed's (validation losses, seconds) on a link: a whole run there, else estimated."""
    if val is not None:
        return [r["eval_loss"] for r in val["curve"]], [r["train_s"] for r in val["curve"]]
    return [r["eval_loss"] for r in curve], [seed_time(curve, i, probe) for i in range(len(curve))]


def complete_groups(results: dict) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Per process count, the methods with every seed run (dense among them), and the gaps.

    A process count is reported when dense has :data:`verdict.MIN_SEEDS` seeds;
    a method with fewer is left out of its table, and named in the gaps. Variants
    tried and left out of the grid (:data:`~experiments.studies.lm_methods.TRIED`)
    are neither: their runs are shown apart, whatever their seeds; nor are the methods
    only probed (:data:`~experiments.studies.lm_methods.PROBE_ONLY`: the compute floors,
    DDP without its overlap).
    """
    done, missing = {}, {}
    for n in sorted({r["n"] for r in results["runs"]}):
        apart = {*TRIED, *PROBE_ONLY}
        runs = [r for r in results["runs"] if r["n"] == n and r["method"] not in apart]
        methods = list(dict.fromkeys(r["method"] for r in runs))
        seeds = {m: {r["seed"] for r in runs if r["method"] == m} for m in methods}
        full = [m for m in methods if len(seeds[m]) >= verdict.MIN_SEEDS]
        few = {m: len(seeds[m]) for m in methods if m not in full}
        if "dense" in full:
            done[n] = full
        if few or "dense" not in full:
            missing[n] = (
                f"{', '.join(f'{m} {k} of {verdict.MIN_SEEDS} seeds' for m, k in few.items())}"
                if "dense" in full
                else f"{len(runs)} runs so far, dense has {len(seeds.get('dense', ()))} seeds"
            )
    return done, missing


def _link_cell(runs: list[dict], probe: dict | None, vals: list, target: float, total: int):
    """One method's cell on one link (``probe`` None: loopback) and its seeds' (losses, times).

    ``vals``: per run, its seed's whole run on the link or None.
    """
    axes = [time_axis(r["curve"], probe, v) for r, v in zip(runs, vals)]
    times = [
        _measured(v, target) if v is not None
        else next((t for loss, t in zip(ls, ts) if loss <= target), None)
        for v, (ls, ts) in zip(vals, axes)
    ]  # fmt: skip
    cell = verdict.summarize(times)
    cell["times"] = times
    cell["measured_seeds"] = [r["seed"] for r, v in zip(runs, vals) if v is not None]
    cell["run_s"] = [ts[-1] for _, ts in axes]
    if probe is None:
        cell["step_ms"] = 1e3 * statistics.median(r["curve"][-1]["train_s"] / total for r in runs)
    else:
        cell.update(probes=probe["probes"], trajectory_equal=probe["trajectory_equal"])
        for key in ("", "_min", "_max"):
            cell[f"step_ms{key}"] = 1e3 * probe[f"step_s{key}"]
    return cell, axes


def lm_verdicts(results: dict) -> dict:
    """Per complete process count: the target and, per method and link, the verdict numbers.

    A seed with a whole run on a shaped link (``results["validation"]``) takes
    its time and losses on that link from that run ("measured"); the others are
    estimated from their loopback trajectory and the link's probes.
    """
    total = results["steps"]
    out = {}
    for n, methods in complete_groups(results)[0].items():
        runs = sorted((r for r in results["runs"] if r["n"] == n and r["method"] in methods),
                      key=lambda r: r["seed"])  # fmt: skip
        by = {m: [r for r in runs if r["method"] == m] for m in methods}
        for r in runs:
            verdict.check_curve(r["curve"], total)
        dense_finals = [r["curve"][-1]["eval_loss"] for r in by["dense"]]
        tgt = verdict.choose_target([r["curve"] for r in by["dense"]], total)
        target = tgt["target"]
        se = statistics.median(r["curve"][-1]["eval_loss_se"] for r in by["dense"])
        probes = cell_probes(results, n)
        vals = {(v["rate"], v["method"], v["seed"]): v
                for v in results.get("validation", []) if v["n"] == n}  # fmt: skip
        # the links dense is probed on (a method probed where dense is not has no ratio there)
        rates = ["loopback"] + [r for r in RATE_ORDER[1:] if (r, "dense") in probes]
        loop_probed = all(("loopback", m) in probes for m in methods)
        rows, axes = {}, {}
        for m in methods:
            finals = [r["curve"][-1]["eval_loss"] for r in by[m]]
            first = [verdict.first_reach(r["curve"], target, "eval_loss", True) for r in by[m]]
            row = {
                "seeds": [r["seed"] for r in by[m]], "finals": finals,
                "steps_to_target": [r["curve"][i]["step"] if i >= 0 else None
                                    for r, i in zip(by[m], first)],
                "final": verdict.quality(finals, dense_finals),
                "mb_per_step": statistics.median(r["curve"][-1]["wire_bytes"] for r in by[m])
                / total / 1e6,
                "links": {},
            }  # fmt: skip
            for rate in rates:
                # loopback's probes when every method of the group has them (the runs may
                # have shared the cores), else every method on its runs' own clocks: one
                # clock for the whole column
                probe = probes.get((rate, m)) if rate != "loopback" or loop_probed else None
                if rate != "loopback" and probe is None:
                    continue
                got = [vals.get((rate, m, r["seed"])) for r in by[m]]
                cell, axes[m, rate] = _link_cell(by[m], probe, got, target, total)
                row["links"][rate] = cell
            rows[m] = row
        dense_times = {}
        for rate in rates:
            d = rows["dense"]["links"][rate]
            dense_times[rate] = (d["median"], statistics.median(d["run_s"]))
        for m, row in rows.items():
            for rate, cell in row["links"].items():
                cell.update(verdict.judge(rows["dense"]["links"][rate], cell, row["final"]))
                for key, t in zip(("loss_at_dense_target", "loss_at_dense_run"), dense_times[rate]):
                    at = [verdict.value_at(ls, ts, t) for ls, ts in axes[m, rate]] if t else []
                    cell[key] = statistics.median(at) if at and None not in at else None
                # a counterpart other than dense (whose ratio is the cell's own)
                cp = COUNTERPART.get(m)
                ref = rows.get(cp, {}) if cp not in (None, "dense") else {}
                cell["speedup_counterpart"] = (
                    verdict.speedup(ref["links"][rate], cell)
                    if ref and rate in ref["links"] and cell["speedup"] is not None
                    and ref["final"]["within_band"] else None
                )  # fmt: skip
        checks = []
        for (rate, m, seed), val in vals.items():
            if m not in by:
                continue
            estimate, probe = val.get("estimate_s"), probes.get((rate, m))
            if estimate is None and probe is not None:  # no probe: no estimate ("—")
                c = next((r["curve"] for r in by[m] if r["seed"] == seed), None)
                i = verdict.first_reach(c, target, "eval_loss", True) if c else -1
                estimate = seed_time(c, i, probe) if i >= 0 else None
            check = verdict.estimate_check(estimate, _measured(val, target))
            checks.append({"method": m, "rate": rate, "seed": seed, **check})
        out[n] = {"target": tgt, "target_se": se, "rates": rates, "methods": rows,
                  "dense_times": dense_times, "checks": checks, "loop_probed": loop_probed,
                  "superseded": superseded(results)}  # fmt: skip
    return out


def lm_headline(results: dict, verdicts: dict | None = None) -> dict[int, dict[str, dict | None]]:
    """Per process count and link: :func:`verdict.headline` over the methods (dense and
    superseded methods excluded); None where no method qualifies."""
    out = {}
    for n, v in (verdicts or lm_verdicts(results)).items():
        rows, out[n] = v["methods"], {}
        for rate in v["rates"]:
            stale = v["superseded"]
            cands = {m: (row["links"][rate], row["finals"]) for m, row in rows.items()
                     if m != "dense" and m not in stale and rate in row["links"]}  # fmt: skip
            out[n][rate] = verdict.headline(rows["dense"]["links"][rate], rows["dense"]["finals"],
                                            cands)  # fmt: skip
    return out


def _wall(entry: dict) -> float:
    for key in ("wall_s", "process_wall_s"):
        if entry.get(key) is not None:
            return entry[key]
    return entry["curve"][-1]["train_s"] if entry.get("curve") else 0.0


def running_time(results: dict) -> dict:
    """Hours of launched commands: every run and probe (those set aside too; each probe's
    repeats), trajectory re-run to its first evaluation (``recheck``) and whole run on a link.

    Each entry's ``wall_s``, else its ``process_wall_s``, else its last curve
    row's ``train_s``; a probe's repeats count separately when they carry a wall
    time. Returns ``{"total_h", "by_processes": {n: hours}}``.
    """
    by: dict[int, float] = {}
    old = results.get("superseded_runs", [])
    spent = results.get("validation", []) + results.get("recheck", [])
    spent += [r["recheck"] for r in old if "recheck" in r]  # set aside with its trajectory
    for e in results["runs"] + old + spent:
        by[e["n"]] = by.get(e["n"], 0.0) + _wall(e)
    for p in results["probes"] + results.get("superseded_probes", []):
        reps = p.get("repeats") or []
        each = [_wall(r) for r in reps] if reps and all(_wall(r) for r in reps) else [_wall(p)]
        by[p["n"]] = by.get(p["n"], 0.0) + sum(each)
    hours = {n: s / 3600 for n, s in sorted(by.items())}
    return {"total_h": sum(hours.values()), "by_processes": hours}


def _s(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def _time_cell(cell: dict, method: str) -> str:
    if cell["median"] is None:
        return f"not reached ({cell['reached']}/{cell['seeds']} seeds)"
    text = f"{_s(cell['median'])} ({_s(cell['min'])}–{_s(cell['max'])})"
    if cell.get("measured_seeds"):
        seeds = ", ".join(map(str, cell["measured_seeds"]))
        text += f", seed{'s' if len(cell['measured_seeds']) > 1 else ''} {seeds} measured"
    if method != "dense":
        text += f", {cell['speedup']:.2f}×" if cell["speedup"] is not None else f"; {cell['note']}"
    if cell.get("speedup_counterpart"):
        text += f"; {cell['speedup_counterpart']:.2f}× vs {COUNTERPART[method]}"
    return text


def _headline_lines(heads: dict) -> list[str]:
    lines = [
        f"Headline per link: the method with the largest speed-up among those whose every seed "
        f"reaches the target and ends within {verdict.HEADLINE_BAND:.0%} of dense's median final "
        "loss (range: dense's median time over the method's slowest … fastest seed):",
        "",
    ]
    for rate, h in heads.items():
        at = "On loopback" if rate == "loopback" else f"At {RATE_NAMES[rate]}"
        if h is None:
            lines.append(f"- {at}: no method reaches the target on every seed with every seed's "
                         f"final within {verdict.HEADLINE_BAND:.0%} of dense's.")  # fmt: skip
            continue
        f, d = h["final"], h["dense_final"]
        finals = (f"final {f['median']:.3f} ({f['min']:.3f}–{f['max']:.3f}) vs dense "
                  f"{d['median']:.3f} ({d['min']:.3f}–{d['max']:.3f})")  # fmt: skip
        x = (lambda r: f"{r:.1f}") if h["speedup"] >= 1 else (lambda r: f"{r:.2f}")
        ratio = f"{x(h['speedup'])}× ({x(h['low'])}–{x(h['high'])}×)"
        if h["speedup"] > 1:
            lines.append(f"- {at}: {h['method']} reaches the target {x(h['speedup'])}× sooner "
                         f"({x(h['low'])}–{x(h['high'])}×), {finals}.")  # fmt: skip
        else:
            lines.append(f"- {at}: no such method reaches the target sooner than dense; the "
                         f"fastest, {h['method']}, is at {ratio}, {finals}.")  # fmt: skip
    return lines + [""]


def _time_table(v: dict, methods: list[str]) -> list[str]:
    t = v["target"]
    lines = [
        "Time to target: seconds of training calls, median (min–max) over "
        f"{len(t['dense_first_steps'])} seeds; × = dense's median / the method's, printed only "
        f"when the method's median final loss is within {verdict.QUALITY_BAND:.0%} of dense's "
        "(otherwise the cell says how it ends). "
        + ("Every link, loopback too: estimated" if v.get("loop_probed") else
           "Loopback: measured by the runs' clocks. Shaped links: estimated")
        + " (the seed's steps to target × the median step time probed on that link), except a "
        "seed a cell names as measured: a whole run on that link, end to end.",
        "",
        "| method | MB/step (peak) | final val loss, median (min–max) | "
        + " | ".join(RATE_NAMES[r] for r in v["rates"]) + " |",
        "|---|---|---|" + "---|" * len(v["rates"]),
    ]  # fmt: skip
    for m in methods:
        row = v["methods"][m]
        f = row["final"]
        mark = "" if f["within_band"] or m == "dense" else " (worse than dense by > 2%)"
        cells = [_time_cell(row["links"][r], m) if r in row["links"] else "" for r in v["rates"]]
        lines.append(
            f"| {label(m, v['superseded'])} | {row['mb_per_step']:.2f} "
            f"({row['mb_per_step'] * peak_factor(m):.1f}) | {f['median']:.4f} "
            f"({f['min']:.4f}–{f['max']:.4f}){mark} | " + " | ".join(cells) + " |"
        )
    return lines


def _checks_table(v: dict, methods: list[str]) -> list[str]:
    checks = [c for c in v["checks"] if c["method"] in methods]
    if not checks:
        return []
    tol = f"{verdict.ESTIMATE_TOLERANCE:.0%}"
    lines = [
        "",
        "Estimates checked end to end: a whole run on the link against the estimate from the "
        f"same seed's loopback trajectory and the link's probes (ratio = measured / estimated; "
        f"within {tol}):",
        "",
        f"| method | link | seed | estimated s | measured s | ratio | within {tol} |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for c in checks:
        est, got = ("—" if x is None else _s(x) for x in (c["estimate"], c["measured"]))
        ratio = "—" if c["ratio"] is None else f"{c['ratio']:.2f}"
        name = label(c["method"], v["superseded"])
        lines.append(f"| {name} | {RATE_NAMES[c['rate']]} | {c['seed']} | {est} "
                     f"| {got} | {ratio} | {'yes' if c['within'] else 'no'} |")  # fmt: skip
    return lines


def _loss_table(v: dict, methods: list[str]) -> list[str]:
    heads = [
        f"{RATE_NAMES[r]} ({'—' if a is None else _s(a)} s / {_s(b)} s)"
        for r, (a, b) in ((r, v["dense_times"][r]) for r in v["rates"])
    ]
    lines = [
        "",
        "Loss at dense's time to target / at dense's run time: each method's validation loss "
        "at the last evaluation at or before dense's median time to target, and at or before "
        "dense's median time for the whole run on that link (the same time budget), median over "
        "seeds (— no evaluation yet):",
        "",
        "| method | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(v["rates"]),
    ]
    for m in methods:
        links = v["methods"][m]["links"]
        cells = [
            " / ".join("—" if x is None else f"{x:.3f}"
                       for x in (links[r]["loss_at_dense_target"], links[r]["loss_at_dense_run"]))
            if r in links else ""
            for r in v["rates"]
        ]  # fmt: skip
        lines.append(f"| {label(m, v['superseded'])} | " + " | ".join(cells) + " |")
    return lines


def _probe_cell(c: dict) -> str:
    if "probes" not in c:  # loopback without probes: whole runs' clocks
        return f"{c['step_ms']:.0f}, runs' clocks"
    eq = {True: ", equal", False: ", DIFFERS", None: ", not checked"}[c["trajectory_equal"]]
    k = c["probes"]
    span = f" ({c['step_ms_min']:.0f}–{c['step_ms_max']:.0f})" if k > 1 else ""
    count = f"{k} probes" if k >= verdict.MIN_PROBES else f"only {k} probe{'s' if k > 1 else ''}"
    return f"{c['step_ms']:.0f}{span}, {count}{eq}"


def _step_table(v: dict, methods: list[str]) -> list[str]:
    lines = [
        "",
        "Measured step time (ms; every link, loopback too where probed, else its runs' "
        "clocks: median (min–max) over the probes of the steps after each probe's first "
        f'call, with their number, "only" where fewer than {verdict.MIN_PROBES}) and whether '
        "every probe's validation loss equalled the loopback run's at the same step:",
        "",
        "| method | " + " | ".join(RATE_NAMES[r] for r in v["rates"]) + " |",
        "|---|" + "---|" * len(v["rates"]),
    ]
    for m in methods:
        links = v["methods"][m]["links"]
        cells = [_probe_cell(links[r]) if r in links else "" for r in v["rates"]]
        lines.append(f"| {label(m, v['superseded'])} | " + " | ".join(cells) + " |")
    return lines


def lm_markdown(results: dict, step_times: bool = True) -> str:
    """The LM study's tables: headline, time to target, loss at dense's times, step times.

    ``step_times=False`` (a short block, for a headline elsewhere) leaves out the measured step-time
    tables and the superseded methods (:func:`superseded`, named in a note:
    re-run pending), and points to ``experiments/results/lm_study.md``, which
    has both (superseded rows marked †) and the study's running time.
    """
    verdicts = lm_verdicts(results)
    heads = lm_headline(results, verdicts)
    ngram = ngram_line(results)
    ref = [] if ngram is None else ["", ngram]
    lines, hidden = [], set()
    for n, v in verdicts.items():
        t = v["target"]
        methods = [m for m in v["methods"] if step_times or m not in v["superseded"]]
        hidden |= set(v["methods"]) - set(methods)
        firsts = "/".join(str(s) for s in t["dense_first_steps"])
        lines += [
            f"**{n} processes** — target: validation loss ≤ {t['target']:.4f} nats/byte "
            f"(± {v['target_se']:.4f} standard error over the 128 validation windows; rule: "
            f"{t['rule']}); dense first reaches it at steps {firsts} of {results['steps']}.",
            "",
        ]
        lines += _headline_lines(heads[n])
        lines += _time_table(v, methods) + ref
        lines += _checks_table(v, methods)
        lines += _loss_table(v, methods) + ref
        lines += tried_lines(results, n)
        if step_times:
            lines += _step_table(v, methods)
        else:
            differs = [f"{m} at {RATE_NAMES[r]}" for m in methods
                       for r, c in v["methods"][m]["links"].items()
                       if c.get("trajectory_equal") is False]  # fmt: skip
            if differs:
                lines += ["", "A probe's trajectory DIFFERS from the loopback run's: "
                          + ", ".join(differs) + "."]  # fmt: skip
        lines.append("")
    done, missing = complete_groups(results)
    for n, why in missing.items():
        what = "left out of the table above" if n in done else "not reported"
        lines += [f"**{n} processes**, {what} (fewer than {verdict.MIN_SEEDS} seeds): {why}.", ""]
    shown = {m for v in verdicts.values() for m in v["methods"]} - hidden
    lines += [f"† {m}: {why}.\n" for m, why in superseded(results).items() if m in shown]
    if hidden:
        lines += [f"Not shown: {', '.join(sorted(hidden))} (re-run pending: its code changed "
                  "after its runs; the study file, lm_study.md, keeps its rows).", ""]  # fmt: skip
    if not step_times:
        lines += [
            "Each cell's measured step time, and the check that the probe's trajectory "
            "equals the loopback run's: "
            "[`experiments/results/lm_study.md`](experiments/results/lm_study.md).",
            "",
        ]
    else:
        rt = running_time(results)
        per = ", ".join(f"{n} processes {h:.1f} h" for n, h in rt["by_processes"].items())
        lines += [f"Running time of the study: {rt['total_h']:.1f} h ({per}), the sum of every "
                  "launched run's, probe's and whole shaped run's wall clock.", ""]  # fmt: skip
    return "\n".join(lines)
