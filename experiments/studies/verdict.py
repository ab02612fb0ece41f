"""The verdict rules every "faster to target" table uses: targets, times, seeds, speed-ups.

A reviewer's objections to a time-to-quality claim, and the rule that answers each:

- *The target is decided by a handful of examples.* Quality is validation
  loss (LM) or test accuracy (classifiers) on a held-out set; its standard
  error over the evaluation examples is stated next to the target.
- *The target is reached by accident, at the first evaluation.* Runs are
  evaluated at least :data:`MIN_EVALS` times, and the target is chosen so that
  every dense seed first reaches it no earlier than :data:`MIN_FRACTION` of its
  run (:func:`choose_target`).
- *One lucky seed.* Every cell has at least :data:`MIN_SEEDS` seeds; times are
  reported as min / median / max, and a speed-up (dense median / method
  median) only when every seed of the method reaches the target; otherwise
  the cell says "not reached" (:func:`summarize`).
- *A faster method that ends worse.* Every method's final quality is shown
  (median and range over seeds) beside its time, with whether its median is
  within :data:`QUALITY_BAND` of dense's.
- *The optimizer, not the network.* Every method uses dense's base optimizer
  and schedule; methods that are optimizers are compared with their own dense
  counterpart too (the study names it).

Quality values follow one convention here: ``lower_is_better=True`` for a loss,
``False`` for an accuracy.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MIN_EVALS = 20
MIN_FRACTION = 0.3
MIN_SEEDS = 3
QUALITY_BAND = 0.02  # a final loss within 2% of dense's counts as the same quality


def reached(value: float, target: float, lower_is_better: bool) -> bool:
    return value <= target if lower_is_better else value >= target


def first_reach(curve: Sequence[dict], target: float, key: str, lower_is_better: bool) -> int:
    """Index of the first evaluation row whose ``key`` meets ``target``; -1 if none does."""
    for i, row in enumerate(curve):
        if reached(row[key], target, lower_is_better):
            return i
    return -1


def check_curve(curve: Sequence[dict], total_steps: int) -> None:
    """A run must be evaluated :data:`MIN_EVALS` times and end at ``total_steps``."""
    if len(curve) < MIN_EVALS:
        raise ValueError(f"{len(curve)} evaluations in a run; the rules need >= {MIN_EVALS}")
    if curve[-1]["step"] != total_steps:
        raise ValueError(f"run ends at step {curve[-1]['step']}, expected {total_steps}")


def choose_target(
    dense_curves: Sequence[Sequence[dict]],
    total_steps: int,
    *,
    key: str = "eval_loss",
    lower_is_better: bool = True,
    band: float = QUALITY_BAND,
) -> dict:
    """The target quality, from dense's runs (one curve per seed).

    Start from the worst dense seed's final quality relaxed by ``band`` (a loss
    times ``1 + band``; an accuracy minus ``band``), so every dense seed reaches
    it by the end of its run. If any dense seed met that
    value before :data:`MIN_FRACTION` of its run, tighten it to the best value
    any dense seed had before then (so no dense seed meets it earlier, and at
    least one meets it at the first evaluation at or after the fraction).

    Returns ``{"target", "rule", "dense_first_steps", "dense_final_median"}``.
    """
    if len(dense_curves) < MIN_SEEDS:
        raise ValueError(f"{len(dense_curves)} dense seeds; the rules need >= {MIN_SEEDS}")
    for c in dense_curves:
        check_curve(c, total_steps)
    finals = [c[-1][key] for c in dense_curves]
    med = statistics.median(finals)
    worst = max(finals) if lower_is_better else min(finals)
    target = worst * (1 + band) if lower_is_better else worst - band
    rule = f"worst dense final x (1 + {band:g})" if lower_is_better else f"worst dense - {band:g}"
    cutoff = MIN_FRACTION * total_steps
    early = [r[key] for c in dense_curves for r in c if r["step"] < cutoff]
    best_early = (min if lower_is_better else max)(early) if early else None
    if best_early is not None and reached(best_early, target, lower_is_better):
        # strictly better than anything seen before the cutoff
        target = best_early - abs(best_early) * 1e-9 if lower_is_better else best_early + 1e-9
        rule = f"tightened to the best dense value before {MIN_FRACTION:.0%} of the run"
    firsts = [
        c[i]["step"] if (i := first_reach(c, target, key, lower_is_better)) >= 0 else None
        for c in dense_curves
    ]
    return {"target": target, "rule": rule, "dense_first_steps": firsts, "dense_final_median": med}


def summarize(times: Sequence[float | None]) -> dict:
    """Min / median / max of per-seed times to target; ``reached`` counts the seeds that did.

    A median is given only when every seed reached the target (``None`` otherwise):
    a method that misses it on any seed is "not reached", never a ratio.
    """
    if len(times) < MIN_SEEDS:
        raise ValueError(f"{len(times)} seeds; the rules need >= {MIN_SEEDS}")
    got = [t for t in times if t is not None]
    full = len(got) == len(times)
    return {
        "reached": len(got),
        "seeds": len(times),
        "min": min(got) if got else None,
        "median": statistics.median(got) if full else None,
        "max": max(got) if full else None,
    }


def speedup(dense: dict, method: dict) -> float | None:
    """Dense's median time over the method's, when both reached on every seed."""
    if dense["median"] is None or method["median"] is None:
        return None
    return dense["median"] / method["median"]


def quality(finals: Sequence[float], dense_finals: Sequence[float], lower_is_better=True) -> dict:
    """Median and range of final quality, and whether the median is within the band of dense's."""
    med, ref = statistics.median(finals), statistics.median(dense_finals)
    within = med <= ref * (1 + QUALITY_BAND) if lower_is_better else med >= ref - QUALITY_BAND
    return {"median": med, "min": min(finals), "max": max(finals), "within_band": within}
