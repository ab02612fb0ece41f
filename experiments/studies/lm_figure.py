"""The LM study's figure, and the files written from its JSON (plot, tables).

One panel per (processes, link), at most three to a row: validation loss
against training time on a log axis, the target dashed, the byte n-gram
counting models dotted. Built on :mod:`experiments.studies.report`.
"""

from __future__ import annotations

import json
import os

from experiments.studies import report
from experiments.studies.ngram import NGRAM_NAMES


def _ylim(curves: list[list[dict]], target: float, ngram: dict | None) -> tuple[float, float]:
    """From a margin below the best final to a margin above the unigram model (without
    n-grams: the 10th percentile of the first evaluations), the target always inside."""
    best = min(c[-1]["eval_loss"] for c in curves)
    unigram = (ngram or {}).get("orders", {}).get("1")
    if unigram is not None and unigram > best:
        top = unigram
    else:
        firsts = sorted(c[0]["eval_loss"] for c in curves)
        top = firsts[int(0.1 * (len(firsts) - 1))]
    top = max(top, target)
    margin = 0.06 * (top - best)
    return best - margin, top + margin


def lm_plot(results: dict, path: str) -> tuple[int, int]:
    """Validation loss against training time, one panel per (processes, link), at most 3 a row.

    Counting models (``results["ngram"]``) are dotted, labelled lines; the target is
    dashed. Returns the grid's (rows, columns); (0, 0) and no file when no process
    count is complete.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    verdicts = report.lm_verdicts(results)
    panels = [(n, r) for n, v in verdicts.items() for r in v["rates"]]
    if not panels:  # no complete grid yet
        return (0, 0)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    names = list(dict.fromkeys(m for v in verdicts.values() for m in v["methods"]))
    style = {m: (f"C{k % 10}", ("-", "-.")[k // 10 % 2]) for k, m in enumerate(names)}
    ngram = results.get("ngram")
    orders = sorted((ngram or {}).get("orders", {}).items(), key=lambda kv: int(kv[0]))
    legend_h = 0.18 * -(-(len(names) + 1) // 6) + 0.1 + (0.15 if orders else 0)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.2 * rows + legend_h), squeeze=False)
    for ax, (n, rate) in zip(axes.flat, panels):
        probes = report.cell_probes(results, n)
        vals = {(v["method"], v["seed"]): v for v in results.get("validation", [])
                if (v["n"], v["rate"]) == (n, rate)}  # fmt: skip
        curves = []
        for m in verdicts[n]["methods"]:
            probe = None if rate == "loopback" else probes.get((rate, m))
            if rate != "loopback" and probe is None:
                continue
            for r in (r for r in results["runs"] if (r["n"], r["method"]) == (n, m)):
                ls, xs = report.time_axis(r["curve"], probe, vals.get((m, r["seed"])))
                curves.append(r["curve"])
                label = report.label(m, report.superseded(results)) if r["seed"] == 0 else None
                ax.plot(xs, ls, color=style[m][0], ls=style[m][1], lw=0.9, label=label)
        target = verdicts[n]["target"]["target"]
        ax.axhline(target, color="gray", lw=0.8, ls="--", label="target")
        low, high = _ylim(curves, target, ngram)
        ax.set_ylim(low, high)
        for k, v in orders:  # labelled where the curves are not: upper right, lower left
            if low <= v <= high:
                up = v > (low + high) / 2
                ax.axhline(v, color="black", lw=0.7, ls=":")
                name = NGRAM_NAMES.get(k, f"{k}-gram")
                ax.text(0.99 if up else 0.01, v, f"{name} {v:.2f}",
                        transform=ax.get_yaxis_transform(), ha="right" if up else "left",
                        va="bottom", fontsize=7)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded labels
        ax.set_title(f"{n} processes, {report.RATE_NAMES[rate]}", fontsize=9)
        ax.set_xlabel("training time (s)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("validation loss (nats/byte)", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=6, fontsize=8,
               frameon=False)  # fmt: skip
    if orders:
        refs = ", ".join(f"{NGRAM_NAMES.get(k, f'{k}-gram')} {v:.2f}" for k, v in orders)
        fig.text(0.5, legend_h / fig.get_size_inches()[1], f"Dotted: byte n-gram counting "
                 f"models ({refs} nats/byte; drawn where inside a panel's range).",
                 ha="center", va="top", fontsize=7)  # fmt: skip
    fig.tight_layout(rect=(0, legend_h / (3.2 * rows + legend_h), 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return (rows, cols)


def write_lm(path: str) -> str:
    """Write the plot beside ``path`` (``.png``); regenerate the study's tables (``.md``)."""
    from experiments.studies import tables

    with open(path) as f:
        results = json.load(f)
    lm_plot(results, path.removesuffix(".json") + ".png")
    if os.path.abspath(path) == os.path.join(tables.RESULTS, "lm_study.json"):
        tables.main([])
    md = report.lm_markdown(results)
    print(md)
    return md
