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
  A method whose median is outside the band gets no ratio at all: its cell
  says "faster, but ends worse by 3.1%" (:func:`judge`).
- *The headline picks a method that is fast because it learns less.* The
  headline names, per link, the fastest method whose *every* seed ends within
  :data:`HEADLINE_BAND` of dense's median final, with the range of its
  speed-up and both final losses beside it (:func:`headline`).
- *The optimizer, not the network.* Every method uses dense's base optimizer
  and schedule; methods that are optimizers are compared with their own dense
  counterpart too (the study names it), when both end within the band.
- *A time on a shaped link that is an estimate.* A probe's step time is the
  median of at least :data:`MIN_PROBES` probes (fewer are marked), and
  estimates are checked against whole runs on the link: measured within
  :data:`ESTIMATE_TOLERANCE` of the estimate (:func:`estimate_check`).

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
HEADLINE_BAND = 0.01  # a headline method ends within 1% of dense's median, on every seed
MIN_PROBES = 3  # probes of a step time on a shaped link; fewer are marked
ESTIMATE_TOLERANCE = 0.10  # an estimated time within 10% of the measured one checks out


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


def _within(value: float, ref: float, band: float, lower_is_better: bool) -> bool:
    return value <= ref * (1 + band) if lower_is_better else value >= ref - band


def all_within(finals: Sequence[float], ref: float, band: float = HEADLINE_BAND,
               lower_is_better: bool = True) -> bool:  # fmt: skip
    """Whether every final is within ``band`` of ``ref`` (the headline rule per seed)."""
    return all(_within(f, ref, band, lower_is_better) for f in finals)


def worse_text(worse_by: float, band: float = QUALITY_BAND) -> str:
    """``worse_by`` as a percentage, one more digit where one digit would round onto ``band``
    (a 2.04% cost outside a 2% band reads 2.04%, not 2.0%)."""
    text = f"{worse_by:.1%}"
    return f"{worse_by:.2%}" if abs(float(text[:-1])) == round(100 * band, 1) else text


def quality(finals: Sequence[float], dense_finals: Sequence[float], lower_is_better=True) -> dict:
    """Median and range of final quality, and whether the median is within the band of dense's.

    ``worse_by``: how much worse the median is than dense's (a loss: the
    fraction ``median / dense's - 1``; an accuracy: dense's minus the median).
    """
    med, ref = statistics.median(finals), statistics.median(dense_finals)
    worse = med / ref - 1 if lower_is_better else ref - med
    within = _within(med, ref, QUALITY_BAND, lower_is_better)
    return {"median": med, "min": min(finals), "max": max(finals), "dense_median": ref,
            "worse_by": worse, "within_band": within}  # fmt: skip


def judge(dense: dict, method: dict, q: dict) -> dict:
    """The speed-up a table may print for a method's time cell, or the words in its place.

    ``dense`` and ``method``: :func:`summarize` of the times on one link;
    ``q``: :func:`quality` of the method's finals. Returns ``{"speedup", "note"}``:
    a seed that misses the target gives ``"not reached (k/n seeds)"``; a median
    final outside :data:`QUALITY_BAND` gives no ratio but ``"faster, but ends
    worse by 3.1%"`` (its median time below dense's) or ``"slower, and ends worse
    by 3.1%"``; otherwise the speed-up and no note.
    """
    if method["median"] is None:
        missed = f"not reached ({method['reached']}/{method['seeds']} seeds)"
        return {"speedup": None, "note": missed}
    ratio = speedup(dense, method)
    if q["within_band"]:
        return {"speedup": ratio, "note": None}
    pace = "" if ratio is None else ("faster, but " if ratio > 1 else "slower, and ")
    return {"speedup": None, "note": f"{pace}ends worse by {worse_text(q['worse_by'])}"}


def headline(
    dense: dict,
    dense_finals: Sequence[float],
    methods: dict[str, tuple[dict, Sequence[float]]],
    *,
    band: float = HEADLINE_BAND,
    lower_is_better: bool = True,
) -> dict | None:
    """The fastest method on one link among those that end as well as dense on every seed.

    ``dense``: :func:`summarize` of dense's times; ``methods``: name -> (its
    :func:`summarize`, its per-seed finals). A method qualifies when every seed
    reached the target and every seed's final is within ``band`` of dense's
    median final. Returns None when none qualifies, else ``{"method",
    "speedup"`` (dense's median / the method's), ``"low", "high"`` (dense's
    median over the method's slowest and fastest seed), ``"final",
    "dense_final"`` (median, min, max of each)}``.
    """
    ref = statistics.median(dense_finals)
    best = None
    for name, (cell, finals) in methods.items():
        ratio = speedup(dense, cell)
        if ratio is None or not all_within(finals, ref, band, lower_is_better):
            continue
        if best is None or ratio > best["speedup"]:
            best = {
                "method": name, "speedup": ratio,
                "low": dense["median"] / cell["max"], "high": dense["median"] / cell["min"],
                "final": _spread(finals), "dense_final": _spread(dense_finals),
            }  # fmt: skip
    return best


def _spread(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def estimate_check(estimate: float | None, measured: float | None) -> dict:
    """An estimated time to target against the one measured end to end on the same link.

    ``ratio`` = measured / estimated; ``within``: the ratio is within
    :data:`ESTIMATE_TOLERANCE` of 1 (False when either time is missing, e.g. the
    whole run did not reach the target).
    """
    ratio = measured / estimate if estimate and measured is not None else None
    within = ratio is not None and abs(ratio - 1) <= ESTIMATE_TOLERANCE
    return {"estimate": estimate, "measured": measured, "ratio": ratio, "within": within}


def value_at(values: Sequence[float], times: Sequence[float], t: float) -> float | None:
    """The value of the last evaluation at or before time ``t`` (no interpolation); None if none."""
    got = [v for v, s in zip(values, times) if s <= t]
    return got[-1] if got else None
