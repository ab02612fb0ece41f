"""The time-to-target table of :mod:`experiments.bench.fsdp`'s trajectories (no runs).

Each variant's trajectories (the LM study's whole schedule, one run a seed, on
loopback) give its final validation loss and its steps to a target; the
target is :func:`experiments.studies.verdict.choose_target` over dense FSDP's
(``fsdp``) seeds, as the LM study takes it over dense's. A link's time to
target is an estimate: the median steps to target times the variant's median
step on that link from the timing rows (``fsdp.json``), whose own table
(:func:`timing_markdown`: bytes, memory per worker, step) follows.
"""

from __future__ import annotations

import statistics

from experiments.studies import verdict

BASE = "fsdp"  # dense FSDP: every variant's counterpart


def _by_variant(traj: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(traj["runs"], key=lambda r: r["seed"]):
        out.setdefault(r["variant"], []).append(r)
    return out


def _seconds(step_ms: dict[str, float], variant: str, steps: float | None) -> float | None:
    """Estimated seconds to target: median steps to target x the link's median step."""
    if steps is None or variant not in step_ms:
        return None
    return steps * step_ms[variant] / 1e3


def _time_cell(t: float | None, ref: float | None, q: dict | None) -> str:
    """One link's cell: seconds, and the ratio to dense FSDP's only for a variant whose
    median final is within the band (else how much worse it ends, as the LM study does)."""
    if t is None:
        return "—"
    text = f"{t:.0f}" if t >= 1 else f"{t:.2f}"
    if q is None or ref is None:
        return text
    if not q["within_band"]:
        return f"{text} (ends worse by {verdict.worse_text(q['worse_by'])}: no ratio)"
    return f"{text} ({ref / t:.2f}x)" if t > 0 else text


def markdown(traj: dict, timing: dict | None = None) -> str:
    """Per variant: seeds, finals, median against dense FSDP's, steps to target, and per
    timed link the estimated seconds to target and the ratio to dense FSDP's."""
    runs = _by_variant(traj)
    links = [(link["rate"], {r["variant"]: r["step_ms"] for r in link["rows"]})
             for link in (timing or {}).get("links", [])]  # fmt: skip
    lines = [
        f"Time to target, {traj['processes']} processes: each variant trained for the LM "
        f"study's schedule ({traj['steps']} steps) on loopback, its validation loss every "
        f"{traj['eval_every']} steps; seconds to target are estimates (median steps to target "
        "x the variant's median step on that link, from the timing rows in `fsdp.json`).",
        "",
    ]
    base = runs.get(BASE, [])
    if len(base) < verdict.MIN_SEEDS:  # the finals so far, nothing judged
        lines += [f"No target yet: {BASE} has {len(base)} of {verdict.MIN_SEEDS} seeds.", "",
                  "| variant | seeds | finals |", "|---|---|---|"]  # fmt: skip
        for v, rs in runs.items():
            finals = " / ".join(f"{r['curve'][-1]['eval_loss']:.4f}" for r in rs)
            lines.append(f"| {v} | {', '.join(str(r['seed']) for r in rs)} | {finals} |")
        return "\n".join(lines) + "\n"
    tgt = verdict.choose_target([r["curve"] for r in base], traj["steps"])
    base_finals = [r["curve"][-1]["eval_loss"] for r in base]
    lines += [
        f"Target {tgt['target']:.4f} nats/byte ({tgt['rule']}).",
        "",
        "| variant | seeds | finals | median | "
        + " | ".join(
            [
                f"vs fsdp (band {verdict.QUALITY_BAND:.0%})",
                "steps to target",
                *(f"{rate} s (x fsdp)" for rate, _ in links),
            ]
        )  # fmt: skip
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(links),
    ]
    medians = {}
    for v, rs in runs.items():
        first = [verdict.first_reach(r["curve"], tgt["target"], "eval_loss", True) for r in rs]
        steps = [r["curve"][i]["step"] for r, i in zip(rs, first) if i >= 0]
        medians[v] = statistics.median(steps) if len(steps) == len(rs) else None
    for v, rs in runs.items():
        finals = [r["curve"][-1]["eval_loss"] for r in rs]
        q = verdict.quality(finals, base_finals)
        band = "—" if v == BASE else (
            f"{q['worse_by']:+.1%} ({'within' if q['within_band'] else 'outside'})")  # fmt: skip
        reach = "not reached" if medians[v] is None else f"{medians[v]:.0f}"
        cells = [
            _time_cell(
                _seconds(step_ms, v, medians[v]),
                _seconds(step_ms, BASE, medians[BASE]),
                None if v == BASE else q,
            )  # fmt: skip
            for _, step_ms in links
        ]
        lines.append(
            f"| {v} | {', '.join(str(r['seed']) for r in rs)} | "
            f"{' / '.join(f'{x:.4f}' for x in finals)} | {statistics.median(finals):.4f} | "
            f"{band} | {reach} |" + "".join(f" {c} |" for c in cells)
        )
    if timing:
        lines += ["", timing_markdown(timing).rstrip("\n")]
    return "\n".join(lines) + "\n"


def timing_markdown(results: dict) -> str:
    """The timing rows (``fsdp.json``): per link and variant, the bytes one worker puts
    into a step's collectives, its memory read from the arrays' shardings, the step."""
    lines = [
        "Sharded training (`python -m experiments.bench.fsdp`), the LM study's GPT and AdamW, "
        f"{results['processes']} processes; bytes: one worker's collective operands per step; "
        "memory: one worker's parameters, optimizer state and gradient residuals; step: median "
        "(min–max) ms; loss: the last step's, on the same batches for every row.",
        "",
        "| link | variant | MB/step | vs fsdp | params MB | optimizer MB | residual MB "
        "| step ms | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for link in results["links"]:
        base = next((r for r in link["rows"] if r["variant"] == "fsdp"), None)
        for r in link["rows"]:
            ratio = f"{r['bytes_per_step'] / base['bytes_per_step']:.2f}x" if base else "—"
            lines.append(
                f"| {link['rate']} | {r['variant']} | {r['bytes_per_step'] / 1e6:.2f} | {ratio} "
                f"| {r['params'] / 1e6:.2f} | {r['opt_state'] / 1e6:.2f} "
                f"| {r.get('comm_state', 0) / 1e6:.2f} | {r['step_ms']:.0f} "
                f"({r['step_ms_min']:.0f}–{r['step_ms_max']:.0f}) | {r['loss']:.3f} |"
            )
    return "\n".join(lines) + "\n"
