"""Markdown tables and plots generated from a study's results JSON (never typed by hand).

:func:`lm_verdicts` applies :mod:`experiments.studies.verdict` to the LM
study's JSON (``experiments/studies/lm.py``); :func:`lm_markdown` renders it;
:func:`write_lm` writes the plot beside the JSON and regenerates the tables
(:mod:`experiments.studies.tables`).
"""

from __future__ import annotations

import json
import os
import statistics

from experiments.studies import verdict

RATE_ORDER = ("loopback", "1gbit", "100mbit", "10mbit")
RATE_NAMES = {"loopback": "loopback", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s",
              "10mbit": "10 Mbit/s"}  # fmt: skip
OPTIMIZER = {  # what each method's update is, beside the shared AdamW + warm-up/cosine
    "diloco": "AdamW inner, Nesterov outer (H=10)",
    "diloco_h1": "AdamW, Nesterov outer every step",
    "streaming": "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments)",
    "streaming_int8": "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments)",
    "streaming_q4": "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments)",
    "sparseloco": "AdamW inner, outer step 1 on top-k + 2-bit codes with EF (H=10)",
    "muloco": "Muon inner (AdamW's RMS, schedule, decay), Nesterov outer (H=10)",
    "demo": "DeMo: sign of the decoded top-k DCT momentum (its own optimizer)",
}
# methods whose code changed after their runs: marked † in the tables, with the reason
SUPERSEDED = {
    "threshold": "ran the two-period selection that jaxcomm.threshold had until commit 58d4ac7 "
    "(0.70 of the true top-k sent on i.i.d. entries; today's sends 0.97, "
    "experiments/results/threshold_fill.json); not re-run since",
}
# methods that are optimizers: their own dense baseline
COUNTERPART = {m: "diloco_h1" for m in ("diloco", "streaming", "streaming_int8", "streaming_q4",
                                         "sparseloco", "muloco")}  # fmt: skip


def _label(method: str) -> str:
    return f"{method} †" if method in SUPERSEDED else method


def peak_factor(method: str) -> float:
    """Peak bytes of one step / mean bytes per step, from the method's config variant.

    Methods that sync every ``H`` steps send everything at once (``H``); Streaming
    DiLoCo sends one of ``P`` fragments ``P`` times per ``H`` steps (``H / P``).
    """
    from experiments.configs import lm_shakespeare

    v = lm_shakespeare.VARIANTS.get(method, {})
    if "wrapper" not in v:
        return 1.0
    name, every, *more = v["wrapper"]
    return every / (more[0].get("fragments", 1) if more else 1)


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


def complete_groups(results: dict) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Per process count, the methods with every seed run (dense among them), and the gaps.

    A process count is reported when dense has :data:`verdict.MIN_SEEDS` seeds;
    a method with fewer is left out of its table, and named in the gaps.
    """
    done, missing = {}, {}
    for n in sorted({r["n"] for r in results["runs"]}):
        runs = [r for r in results["runs"] if r["n"] == n]
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


def lm_verdicts(results: dict) -> dict:
    """Per complete process count: the target and, per method and link, the verdict numbers."""
    total = results["steps"]
    out = {}
    for n, methods in complete_groups(results)[0].items():
        runs = [r for r in results["runs"] if r["n"] == n and r["method"] in methods]
        curves = {m: [r["curve"] for r in runs if r["method"] == m] for m in methods}
        for c in (c for cs in curves.values() for c in cs):
            verdict.check_curve(c, total)
        tgt = verdict.choose_target(curves["dense"], total)
        target = tgt["target"]
        se = statistics.median(c[-1]["eval_loss_se"] for c in curves["dense"])
        probes = {(p["rate"], p["method"]): p for p in results["probes"] if p["n"] == n}
        rates = ["loopback"] + [r for r in RATE_ORDER if any(k[0] == r for k in probes)]
        rows = {}
        for m in methods:
            cs = curves[m]
            first = [verdict.first_reach(c, target, "eval_loss", True) for c in cs]
            row = {
                "steps_to_target": [c[i]["step"] if i >= 0 else None for c, i in zip(cs, first)],
                "final": verdict.quality([c[-1]["eval_loss"] for c in cs],
                                         [c[-1]["eval_loss"] for c in curves["dense"]]),
                "mb_per_step": statistics.median(c[-1]["wire_bytes"] for c in cs) / total / 1e6,
                "links": {},
            }  # fmt: skip
            for rate in rates:
                probe = None if rate == "loopback" else probes.get((rate, m))
                if rate != "loopback" and probe is None:
                    continue
                times = [seed_time(c, i, probe) if i >= 0 else None for c, i in zip(cs, first)]
                cell = verdict.summarize(times)
                cell["step_ms"] = (
                    1e3 * statistics.median(c[-1]["train_s"] / total for c in cs)
                    if probe is None
                    else 1e3 * probe["step_s"]
                )
                if probe is not None:
                    chk = probe["probe_check"]
                    cell["trajectory_equal"] = chk["probe_eval_loss"] == chk["loopback_eval_loss"]
                row["links"][rate] = cell
            rows[m] = row
        for m, row in rows.items():
            for rate, cell in row["links"].items():
                cell["speedup"] = verdict.speedup(rows["dense"]["links"][rate], cell)
                if m in COUNTERPART and COUNTERPART[m] in rows:
                    ref = rows[COUNTERPART[m]]["links"].get(rate)
                    cell["speedup_counterpart"] = ref and verdict.speedup(ref, cell)
        out[n] = {"target": tgt, "target_se": se, "rates": rates, "methods": rows}
    return out


def _s(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def _time_cell(cell: dict, method: str) -> str:
    if cell["median"] is None:
        return f"not reached ({cell['reached']}/{cell['seeds']} seeds)"
    text = f"{_s(cell['median'])} ({_s(cell['min'])}–{_s(cell['max'])})"
    if method != "dense" and cell["speedup"] is not None:
        text += f", {cell['speedup']:.2f}×"
    if cell.get("speedup_counterpart"):
        text += f"; {cell['speedup_counterpart']:.2f}× vs {COUNTERPART[method]}"
    return text


def lm_markdown(results: dict, step_times: bool = True) -> str:
    """The LM study's tables: time to target per link, final quality, step times.

    ``step_times=False`` (the README's block) leaves out the measured step-time
    tables and points to ``experiments/results/lm_study.md``, which has them.
    """
    lines = []
    for n, v in lm_verdicts(results).items():
        t = v["target"]
        firsts = "/".join(str(s) for s in t["dense_first_steps"])
        lines += [
            f"**{n} processes** — target: validation loss ≤ {t['target']:.4f} nats/byte "
            f"(± {v['target_se']:.4f} standard error over the 128 validation windows; rule: "
            f"{t['rule']}); dense first reaches it at steps {firsts} of {results['steps']}.",
            "",
            "Time to target: measured seconds of training calls, median (min–max) over "
            f"{len(t['dense_first_steps'])} seeds, × = dense's median / the method's "
            "(shaped links: the seed's steps to target at the step time measured on that link):",
            "",
            "| method | MB/step (peak) | final val loss, median (min–max) | "
            + " | ".join(RATE_NAMES[r] for r in v["rates"])
            + " |",
            "|---|---|---|" + "---|" * len(v["rates"]),
        ]
        for m, row in v["methods"].items():
            f = row["final"]
            mark = "" if f["within_band"] or m == "dense" else " (worse than dense by > 2%)"
            links = row["links"]
            cells = [_time_cell(links[r], m) if r in links else "" for r in v["rates"]]
            lines.append(
                f"| {_label(m)} | {row['mb_per_step']:.2f} "
                f"({row['mb_per_step'] * peak_factor(m):.1f}) "
                f"| {f['median']:.4f} "
                f"({f['min']:.4f}–{f['max']:.4f}){mark} | " + " | ".join(cells) + " |"
            )
        if not step_times:
            differs = [
                f"{m} at {RATE_NAMES[r]}"
                for m, row in v["methods"].items()
                for r, c in row["links"].items()
                if c.get("trajectory_equal") is False
            ]
            if differs:
                lines += [
                    "",
                    "A probe's trajectory DIFFERS from the loopback run's: "
                    + ", ".join(differs)
                    + ".",
                ]
            lines.append("")
            continue
        lines += [
            "",
            "Measured step time (ms; loopback: median over seeds of whole runs; shaped: the "
            "probe's second call) and whether the probe's validation loss equalled the loopback "
            "run's at the same step:",
            "",
            "| method | " + " | ".join(RATE_NAMES[r] for r in v["rates"]) + " |",
            "|---|" + "---|" * len(v["rates"]),
        ]
        for m, row in v["methods"].items():
            cells = []
            for r in v["rates"]:
                c = row["links"].get(r)
                if c is None:
                    cells.append("")
                    continue
                eq = {True: ", equal", False: ", DIFFERS", None: ""}[c.get("trajectory_equal")]
                cells.append(f"{c['step_ms']:.0f}{eq}")
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
        lines.append("")
    done, missing = complete_groups(results)
    for n, why in missing.items():
        what = "left out of the table above" if n in done else "not reported"
        lines += [f"**{n} processes**, {what} (fewer than {verdict.MIN_SEEDS} seeds): {why}.", ""]
    shown = {m for v in lm_verdicts(results).values() for m in v["methods"]}
    lines += [f"† {m}: {why}.\n" for m, why in SUPERSEDED.items() if m in shown]
    if not step_times:
        lines += [
            "Each cell's measured step time, and the check that the probe's trajectory "
            "equals the loopback run's: "
            "[`experiments/results/lm_study.md`](experiments/results/lm_study.md).",
            "",
        ]
    return "\n".join(lines)


def lm_plot(results: dict, path: str) -> None:
    """Validation loss against measured training time, one panel per (processes, link)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    verdicts = lm_verdicts(results)
    panels = [(n, r) for n, v in verdicts.items() for r in v["rates"]]
    if not panels:  # no complete grid yet
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (n, rate) in zip(axes[0], panels):
        probes = {p["method"]: p for p in results["probes"] if (p["n"], p["rate"]) == (n, rate)}
        for k, m in enumerate(verdicts[n]["methods"]):
            probe = None if rate == "loopback" else probes.get(m)
            if rate != "loopback" and probe is None:
                continue
            for r in (r for r in results["runs"] if (r["n"], r["method"]) == (n, m)):
                c = r["curve"]
                xs = [seed_time(c, i, probe) for i in range(len(c))]
                ax.plot(xs, [p["eval_loss"] for p in c], color=f"C{k}", lw=0.9,
                        label=m if r["seed"] == 0 else None)  # fmt: skip
        ax.axhline(verdicts[n]["target"]["target"], color="gray", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded labels
        ax.set_ylim(top=3.2)
        ax.set_title(f"{n} processes, {RATE_NAMES[rate]}", fontsize=9)
        ax.set_xlabel("training time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_lm(path: str) -> str:
    """Write the plot beside ``path`` (``.png``); regenerate the tables (README, ``.md``)."""
    from experiments.studies import tables

    with open(path) as f:
        results = json.load(f)
    lm_plot(results, path.removesuffix(".json") + ".png")
    if os.path.abspath(path) == os.path.join(tables.RESULTS, "lm_study.json"):
        tables.main([])
    md = lm_markdown(results)
    print(md)
    return md
