"""jaxcomm beside what users would pick instead, on the LM study's workload and links.

The peers (:data:`experiments.studies.lm_methods.TORCH`) are the study's GPT in
PyTorch: DDP with its fp32 all-reduce, ``fp16_compress_hook`` or
``powerSGD_hook``, and torchft's DiLoCo and Streaming DiLoCo. They run the same
data, AdamW, schedule and seeds, and are judged by the study's rules
(:mod:`experiments.studies.verdict`): the target is dense jaxcomm's, a time to
target is steps to target × the link's probed step (the probes'
median over at least three), and a method whose median final is outside the
2% band has no time that counts.

This block is built only from methods with 3 seeds and probes on every link of
:data:`RATES`, loopback included (so that the loopback column is timed on quiet
cores for every row alike). Per link, each framework's best method is the fastest
that counts; jaxcomm's is then set against DDP's and torchft's best.
"""

from __future__ import annotations

from experiments.studies import report, verdict
from experiments.studies.lm_methods import METHODS, TORCH

#: The links of the comparison, in order.
RATES = ("loopback", "100mbit", "10mbit")
#: Framework -> does this method belong to it.
FRAMEWORKS = {
    "jaxcomm": lambda m: m not in TORCH,
    "PyTorch DDP": lambda m: m in TORCH and not TORCH[m].startswith("ft_"),
    "torchft": lambda m: m in TORCH and TORCH[m].startswith("ft_"),
}


def probed_everywhere(results: dict, n: int) -> list[str]:
    """Methods with probes on every link of :data:`RATES` (in the study's order)."""
    cells = report.cell_probes(results, n)
    order = {m: i for i, m in enumerate(METHODS)}
    found = {m for _, m in cells if all((r, m) in cells for r in RATES)}
    return sorted(found, key=lambda m: order.get(m, len(order)))


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
    """Per framework, its fastest method on ``rate`` whose time counts (every seed reached
    the target and the median final is within the band): ``{"method", "cell", "final"}``,
    or None with the fastest that does not count as ``{"method": None, "fastest": ...}``."""
    out = {}
    for name, belongs in FRAMEWORKS.items():
        cands = {m: row for m, row in v["methods"].items() if belongs(m) and rate in row["links"]}
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
        return "not run"
    if entry["method"] is None:
        f = entry["fastest"]
        why = f["cell"]["note"] or "no time that counts"
        return f"none counts (fastest: {f['method']}, {why})"
    c, f = entry["cell"], entry["final"]
    return (f"{entry['method']}: {report._s(c['median'])} s ({report._s(c['min'])}–"
            f"{report._s(c['max'])}), final {f['median']:.4f}")  # fmt: skip


def _versus(jax: dict | None, other: dict | None) -> str:
    if not jax or jax["method"] is None or not other or other["method"] is None:
        return "—"
    j, o = jax["cell"], other["cell"]
    return (f"{o['median'] / j['median']:.2f}× ({o['median'] / j['max']:.2f}–"
            f"{o['median'] / j['min']:.2f})")  # fmt: skip


def lines(results: dict, n: int = 2) -> list[str]:
    """The markdown block: each method's time to target on every link, then per link
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
    out += [
        "",
        "Per link, each framework's fastest method whose time counts (every seed reaches the "
        "target and the median final is within the band), and jaxcomm's against the others': "
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
    probes = min(c.get("probes", 0) for row in v["methods"].values() for c in row["links"].values())
    if probes < verdict.MIN_PROBES:
        out += ["", f"Some cells have fewer than {verdict.MIN_PROBES} probes (the step table)."]
    return out
