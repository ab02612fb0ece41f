"""The tables of :mod:`experiments.bench.step_parts` from its JSON (no runs).

Split from :mod:`experiments.bench.step_parts` (which times the steps):
per link, each method's median step and its parts (codec, collectives,
the rest) in ms per step. ``experiments.studies.tables`` renders
``step_parts.md`` from :func:`report`.
"""

from __future__ import annotations

#: The issue's bound: a compressed step within this many ms of the step with no exchange.
TARGET_MS = 1.5


def report(results: dict) -> str:
    """Per link, each method's median step and its parts (ms per step); the bound's column
    (:data:`TARGET_MS`, the digits MLP's issue) only for the digits MLP."""
    bound = results["links"] and next(iter(results["links"].values())).get("config") != (
        "lm_shakespeare"
    )
    lines = []
    for rate, res in results["links"].items():
        none = res["methods"]["none"]["step_s"]
        lines += [
            f"**{rate}**, 2 processes"
            + (f", {res['params']:,} parameters" if "params" in res else "")
            + f": median of {res['rounds']} calls of "
            f"{res['steps_per_call']} steps; no exchange {none * 1e3:.2f} ms/step.",
            "",
            "| method | bytes/step | step ms (mean) | - none | codec | collectives | rest |"
            + (f" within {TARGET_MS} ms of none |" if bound else ""),
            "|---|---|---|---|---|---|---|" + ("---|" if bound else ""),
        ]
        for m, r in res["methods"].items():
            if m == "none":
                continue
            over = r["step_s"] - none
            coll = r["exchange_s"] - r["codec_s"]
            rest = r["step_s"] - none - r["exchange_s"]
            ok = "yes" if over * 1e3 <= TARGET_MS else "**no**"
            lines.append(
                f"| {m} | {r['wire_bytes']:,} | {r['step_s'] * 1e3:.2f} "
                f"({r['mean_step_s'] * 1e3:.2f}) | {over * 1e3:.2f} | {r['codec_s'] * 1e3:.2f} "
                f"| {coll * 1e3:.2f} | {rest * 1e3:.2f} |" + (f" {ok} |" if bound else "")
            )
        lines.append("")
    return "\n".join(lines)
