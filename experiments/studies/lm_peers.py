"""jaxcomm beside what users would pick instead, on the LM study's workload and links.

The peers (:data:`experiments.studies.lm_methods.TORCH`) are the study's GPT in
PyTorch: DDP with its fp32 all-reduce, ``fp16_compress_hook`` or
``powerSGD_hook``, and torchft's DiLoCo and Streaming DiLoCo. They run the same
data, AdamW, schedule and seeds, and are judged by the study's rules
(:mod:`experiments.studies.verdict`): the target is dense jaxcomm's, a time to
target is steps to target × the link's probed step (the median over the cell's
probes; a note says when a cell, or a floor, has fewer than three), and a
method whose median final is outside the 2% band has no time that counts.

This block is built only from methods with 3 seeds and probes on every link of
:data:`RATES`, loopback included (so that the loopback column is timed on quiet
cores for every row alike). Per link, each framework's best method is the fastest
on AdamW that counts (the same optimizer on both sides: Muon, MuLoCo and DeMo
are in the time table, not in this choice); jaxcomm's is then set against
DDP's and torchft's best.

Each framework's own compute floor (:data:`~experiments.studies.lm_methods.FLOORS`:
the same step with nothing exchanged, probed on loopback) sets the step times
apart from kernel speed: a method's step over its floor (the milliseconds a
step spends beyond the floor's, and the ratio) is what its exchange costs, so
jaxcomm's dense, bf16 and PowerSGD steps are set against DDP's with its hooks
by that excess, not by the raw step. Only methods that run the floor's step plus
an exchange get that column (:func:`has_floor`): not Muon or DeMo (another
optimizer's compute) nor the overlapped Streaming DiLoCo (one call a step, not
the harness's ten). DDP overlaps its buckets' all-reduces with the backward pass
and jaxcomm's harness exchanges after it, so DDP's exchange is also probed
without that overlap (:data:`~experiments.studies.lm_methods.UNOVERLAPPED`: one
all-reduce of the flat gradient after the backward pass): its step over the
floor minus DDP's is what the overlap saves, and jaxcomm's excess is set against
both.
"""

from __future__ import annotations

import statistics

from experiments.configs import lm_shakespeare
from experiments.studies import report, verdict
from experiments.studies.lm_methods import (
    FLOORS,
    METHODS,
    OVERLAP,
    PROBE_ONLY,
    TORCH,
    UNOVERLAPPED,
    floor_of,
    variant,
)

#: The links of the comparison, in order.
RATES = ("loopback", "100mbit", "10mbit")
#: jaxcomm's method beside PyTorch DDP's hook that does the same exchange.
PAIRS = (("dense", "torch_ddp"), ("bf16", "torch_fp16"), ("powersgd", "torch_powersgd"))
#: Framework -> does this method belong to it.
FRAMEWORKS = {
    "jaxcomm": lambda m: m not in TORCH and m not in PROBE_ONLY,
    "PyTorch DDP": lambda m: m in TORCH and m not in PROBE_ONLY and not TORCH[m].startswith("ft_"),
    "torchft": lambda m: m in TORCH and TORCH[m].startswith("ft_"),
}


def probed_everywhere(results: dict, n: int) -> list[str]:
    """Methods with probes on every link of :data:`RATES` (in the study's order)."""
    cells = report.cell_probes(results, n)
    order = {m: i for i, m in enumerate(METHODS)}
    found = {m for _, m in cells if m not in PROBE_ONLY and all((r, m) in cells for r in RATES)}
    return sorted(found, key=lambda m: (order.get(m, len(order)), m))  # a set: ties by name


def verdicts(results: dict, n: int = 2) -> dict | None:
    """:func:`report.lm_verdicts` over the methods probed on every link (dense among
    them, with 3 seeds), or None."""
    shown = probed_everywhere(results, n)
    if "dense" not in shown:
        return None
    sub = {**results, "runs": [r for r in results["runs"] if r["method"] in shown]}
    sub["validation"] = [v for v in results.get("validation", []) if v["method"] in shown]
    return report.lm_verdicts(sub).get(n)


def best(v: dict, rate: str) -> dict[str, dict | None]:
    """Per framework, its fastest method on ``rate`` on AdamW (:func:`on_adamw`: the same
    optimizer on both sides) whose time counts (every seed reached the target and the
    median final is within the band): ``{"method", "cell", "final"}``,
    or None with the fastest that does not count as ``{"method": None, "fastest": ...}``."""
    out = {}
    for name, belongs in FRAMEWORKS.items():
        cands = {m: row for m, row in v["methods"].items()
                 if belongs(m) and on_adamw(m) and m not in v["superseded"]
                 and rate in row["links"]}  # fmt: skip
        if not cands:
            out[name] = None
            continue
        counts = {m: row for m, row in cands.items() if row["links"][rate]["speedup"] is not None}
        pool = counts or cands
        times = {m: row["links"][rate]["median"] for m, row in pool.items()}
        reached = {m: t for m, t in times.items() if t is not None}
        pick = min(reached, key=reached.get) if reached else next(iter(pool))
        entry = {"method": pick, "cell": pool[pick]["links"][rate], "final": pool[pick]["final"]}
        out[name] = entry if counts else {"method": None, "fastest": entry}
    return out


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "none with 3 seeds and every link probed"
    if entry["method"] is None:
        f = entry["fastest"]
        why = f["cell"]["note"] or "no time that counts"
        return f"none counts (fastest: {f['method']}, {why})"
    c, f = entry["cell"], entry["final"]
    return (f"{entry['method']}: {report._s(c['median'])} s ({report._s(c['min'])}–"
            f"{report._s(c['max'])}), final {f['median']:.4f}")  # fmt: skip


def _ratio(jax: dict | None, other: dict | None) -> tuple[float, float, float] | None:
    """The other's median time over jaxcomm's median, slowest and fastest seed (above 1:
    jaxcomm reaches the target sooner), or None where either side has no time that counts."""
    if not jax or jax["method"] is None or not other or other["method"] is None:
        return None
    j, o = jax["cell"], other["cell"]
    return o["median"] / j["median"], o["median"] / j["max"], o["median"] / j["min"]


def _versus(jax: dict | None, other: dict | None) -> str:
    r = _ratio(jax, other)
    return "—" if r is None else f"{r[0]:.2f}× ({r[1]:.2f}–{r[2]:.2f})"


def lines(results: dict, n: int = 2) -> list[str]:
    """The markdown block: each method's time to target on every link, the whole runs
    against their estimates, then per link
    each framework's best and jaxcomm's against the others'. Empty until dense and at
    least one peer are probed on every link."""
    v = verdicts(results, n)
    if v is None or not any(m in TORCH for m in v["methods"]):
        return []
    methods = [m for m in METHODS if m in v["methods"]]
    t = v["target"]
    out = [
        "",
        f"**Beside PyTorch DDP and torchft** ({n} processes; the methods with 3 seeds and "
        f"≥ 1 probe on every link; target ≤ {t['target']:.4f} nats/byte, {t['rule']}).",
        "",
    ]
    out += report._time_table(v, methods)
    out += report._checks_table(v, methods)
    out += [
        "",
        "Per link, each framework's fastest method on AdamW whose time counts (every seed "
        "reaches the target and the median final is within the band), and jaxcomm's against "
        "the others': "
        "the other's median time over jaxcomm's median (above 1: jaxcomm reaches the target "
        "sooner; range: over jaxcomm's slowest … fastest seed):",
        "",
        "| link | jaxcomm | PyTorch DDP | torchft | jaxcomm vs DDP | jaxcomm vs torchft |",
        "|---|---|---|---|---|---|",
    ]
    for rate in RATES:
        b = best(v, rate)
        out.append(
            f"| {report.RATE_NAMES[rate]} | {_cell(b['jaxcomm'])} | {_cell(b['PyTorch DDP'])} "
            f"| {_cell(b['torchft'])} | {_versus(b['jaxcomm'], b['PyTorch DDP'])} "
            f"| {_versus(b['jaxcomm'], b['torchft'])} |"
        )
    out += floor_lines(results, v, n)
    cells = report.cell_probes(results, n)
    probes = [c.get("probes", 0) for row in v["methods"].values() for c in row["links"].values()]
    probes += [c["probes"] for (_, m), c in cells.items() if m in PROBE_ONLY]
    if min(probes) < verdict.MIN_PROBES:
        out += ["", f"Some cells or floors have fewer than {verdict.MIN_PROBES} probes (the "
                "probes table above)."]  # fmt: skip
    return out


def on_adamw(method: str) -> bool:
    """Whether ``method`` trains with the peers' optimizer, AdamW (every torch method does;
    Muon, MuLoCo's Muon inner steps and DeMo do not)."""
    return method in TORCH or lm_shakespeare.get_config(variant(method)).optimizer.name == "adamw"


def has_floor(method: str) -> bool:
    """Whether ``method``'s step is its framework's floor plus an exchange: the torch twin's,
    or the harness's on AdamW (not overlapped: one call a step)."""
    return on_adamw(method) and (method in TORCH or method not in OVERLAP)


def over_floor(results: dict, v: dict, n: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per method of ``v`` (and DDP's exchange without its overlap,
    :data:`~experiments.studies.lm_methods.UNOVERLAPPED`, where probed) and link: (its
    probed step, its framework's floor), in ms; only where the floor is probed on loopback."""
    cells = report.cell_probes(results, n)
    steps = {m: {r: c["step_ms"] for r, c in row["links"].items()}
             for m, row in v["methods"].items() if has_floor(m)}  # fmt: skip
    for m in UNOVERLAPPED:
        steps[m] = {r: 1e3 * cells[(r, m)]["step_s"] for r in RATES if (r, m) in cells}
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for m, by_rate in steps.items():
        floor = cells.get(("loopback", floor_of(m)))
        if floor is not None and by_rate:
            out[m] = {r: (step, 1e3 * floor["step_s"]) for r, step in by_rate.items()}
    return out


def floor_lines(results: dict, v: dict, n: int) -> list[str]:
    """The step over each framework's floor: a table, then jaxcomm against DDP pair by
    pair (:data:`PAIRS`). Empty until a floor is probed."""
    cells = report.cell_probes(results, n)
    floors = {m: cells[("loopback", m)] for m in FLOORS if ("loopback", m) in cells}
    over = over_floor(results, v, n)
    if not floors or not over:
        return []
    said = ", ".join(
        f"{FLOORS[m]}'s {1e3 * c['step_s']:.0f} ms ({1e3 * c['step_s_min']:.0f}–"
        f"{1e3 * c['step_s_max']:.0f}; {c['probes']} probes)"
        for m, c in floors.items()
    )
    out = [
        "",
        f"The step over its framework's compute floor (the same step with nothing exchanged, "
        f"each worker alone, probed on loopback: {said}): the probed step in ms, + the ms "
        "beyond the floor (× the floor):",
        "",
        "| method | " + " | ".join(report.RATE_NAMES[r] for r in RATES) + " |",
        "|---|" + "---|" * len(RATES),
    ]
    for m in [m for m in (*METHODS, *UNOVERLAPPED) if m in over]:
        row = []
        for r in RATES:
            step, floor = over[m].get(r, (None, None))
            row.append("" if step is None else f"{step:.0f}: {step - floor:+.0f} "
                       f"({step / floor:.1f}×)")  # fmt: skip
        out.append(f"| {m} | " + " | ".join(row) + " |")
    pairs = []
    for jax, torch in PAIRS:
        after = _unoverlapped(over, torch)
        if jax in over and torch in over:
            ex = []
            for r in RATES:
                if r in over[jax] and r in over[torch]:
                    cell = (f"{report.RATE_NAMES[r]} {over[jax][r][0] - over[jax][r][1]:.0f} "
                            f"against {over[torch][r][0] - over[torch][r][1]:.0f}")  # fmt: skip
                    if after and r in over[after]:
                        cell += f" ({over[after][r][0] - over[after][r][1]:.0f} without overlap)"
                    ex.append(cell)
            pairs.append(f"- {jax} against {torch}, ms beyond each one's floor: {'; '.join(ex)}.")
    return out + ([""] + pairs if pairs else [])


def _unoverlapped(over: dict, method: str) -> str | None:
    """The probed diagnostic of DDP ``method`` without its overlap
    (:data:`~experiments.studies.lm_methods.UNOVERLAPPED`), or None."""
    return next((a for a, of in UNOVERLAPPED.items() if of == method and a in over), None)


def _step_against(v: dict, over: dict, rate: str, theirs: str, mine: str) -> str:
    """Why a DDP method reaches the target before jaxcomm's best on ``rate``: the median
    steps to target and the probed step of each, over its framework's floor (DDP's also
    without its overlap, where probed), and the bytes each sends a step."""

    def steps(m: str) -> str:
        got = [s for s in v["methods"][m]["steps_to_target"] if s is not None]
        return f"{statistics.median(got):.0f}" if got else "—"

    def step(m: str) -> str:
        ms, floor = over[m][rate]
        return f"{ms:.0f} ms a step ({ms - floor:+.0f} over its floor"

    after = _unoverlapped(over, theirs)
    unlapped = ""
    if after and rate in over[after]:
        unlapped = f", {over[after][rate][0] - over[after][rate][1]:+.0f} without DDP's overlap"
    mb = lambda m: f"{v['methods'][m]['mb_per_step']:.2f}"
    return (f"at {report.RATE_NAMES[rate]} {theirs} is ahead: {steps(theirs)} steps to target "
            f"at {step(theirs)}{unlapped}) against {mine}'s {steps(mine)} at {step(mine)}), "
            f"{mb(theirs)} against {mb(mine)} MB a step")  # fmt: skip


def headline(results: dict, n: int = 2) -> str | None:
    """One sentence for the README: per shaped link, each framework's best time to target
    (:func:`best`), jaxcomm's dense step over its floor against DDP's, and the whole runs'
    times over their estimates; None until the block exists (:func:`lines`)."""
    v = verdicts(results, n)
    if v is None or not any(m in TORCH for m in v["methods"]):
        return None

    def one(e: dict | None) -> str:
        if e is None or e["method"] is None:
            return "none that counts" if e else "not probed on every link"
        return f"{e['method']} {report._s(e['cell']['median'])} s"

    parts, ahead_on = [], []
    for rate in RATES[1:]:
        b = best(v, rate)
        ratios = {k: _ratio(b["jaxcomm"], b[k]) for k in ("PyTorch DDP", "torchft")}
        ahead_on += [(rate, b[k]["method"], b["jaxcomm"]["method"])
                     for k, r in ratios.items() if r is not None and r[0] < 1]  # fmt: skip
        ddp, ft = (f"{r[0]:.2f}×" if r else "—" for r in ratios.values())
        parts.append(
            f"at {report.RATE_NAMES[rate]} jaxcomm's {one(b['jaxcomm'])}, DDP's "
            f"{one(b['PyTorch DDP'])} ({ddp}), torchft's {one(b['torchft'])} ({ft})"
        )
    over = over_floor(results, v, n)
    floor = ""
    if "dense" in over and "torch_ddp" in over:
        ex = [f"{over['dense'][r][0] - over['dense'][r][1]:+.0f} against "
              f"{over['torch_ddp'][r][0] - over['torch_ddp'][r][1]:+.0f} ms"
              for r in RATES[1:] if r in over["dense"] and r in over["torch_ddp"]]  # fmt: skip
        floor = (f"; jaxcomm's dense step over its floor against DDP's: {', '.join(ex)} "
                 f"({', '.join(report.RATE_NAMES[r] for r in RATES[1:])})")  # fmt: skip
    why = ""
    # a peer ahead: how jaxcomm's run of the same method ends
    for m in sorted({m for _, m, _ in ahead_on}):
        twin = variant(m)
        if twin != "dense" and twin in v["methods"]:
            mine, theirs = v["methods"][twin], v["methods"][m]
            reach = mine["links"]["loopback"]
            why += (f"; {m} is ahead: jaxcomm's {twin} (the same settings) reaches the target on "
                    f"{reach['reached']} of {reach['seeds']} seeds, finals "
                    f"{' / '.join(f'{x:.4f}' for x in mine['finals'])} against "
                    f"{' / '.join(f'{x:.4f}' for x in theirs['finals'])}")  # fmt: skip
    for rate, m, mine in ahead_on:  # a DDP hook ahead: its step and steps against jaxcomm's
        if variant(m) == "dense" and m in over and mine in over and rate in over[m]:
            why += "; " + _step_against(v, over, rate, m, mine)
    checked = ", ".join(f"{c['method']} at {report.RATE_NAMES[c['rate']]} {c['ratio']:.2f}"
                        for c in v["checks"] if c["ratio"] is not None)  # fmt: skip
    checked = checked and f"; whole runs against their estimates (measured / estimated): {checked}"
    return (f"{n} processes, time to target of each framework's fastest method on AdamW that ends "
            f"in the band (× = the other's time over jaxcomm's): {'; '.join(parts)}{floor}"
            f"{checked}{why}.")  # fmt: skip
