"""The verdict rules (experiments/studies/verdict.py) and the LM study's report built on them.

Curves are synthetic with closed-form answers: no training runs here.
"""

import statistics

import pytest

from experiments.studies import report, verdict

TOTAL = 200


def curve(losses, times=None, se=0.01, wire=1000):
    """Evaluation rows every 10 steps ending at step TOTAL."""
    n = len(losses)
    steps = [TOTAL * (i + 1) // n for i in range(n)]
    times = times or [0.5 * s for s in steps]
    return [
        {"step": s, "eval_loss": v, "eval_loss_se": se, "train_s": t, "wire_bytes": wire * s}
        for s, v, t in zip(steps, losses, times)
    ]


def decay(final, start=3.0, evals=20, power=1.0):
    """Loss falling from ``start`` to ``final`` over ``evals`` evaluations."""
    return [final + (start - final) * (1 - (i + 1) / evals) ** power for i in range(evals)]


def test_target_is_worst_dense_final_plus_band_when_dense_reaches_it_late():
    curves = [curve(decay(f)) for f in (2.00, 2.10, 2.05)]
    t = verdict.choose_target(curves, TOTAL)
    assert t["target"] == pytest.approx(2.10 * 1.02)
    assert t["rule"].startswith("worst dense final")
    # closed form: loss_i = f + (3 - f)(1 - (i + 1)/20) <= 2.142 first at
    # i + 1 = ceil(20 (1 - (2.142 - f)/(3 - f))): 18, 20, 19 evaluations
    assert t["dense_first_steps"] == [180, 200, 190]


def test_target_is_tightened_when_a_dense_seed_reaches_it_early():
    # seed 1 plunges at step 20 to 2.05, below the relaxed target 2.05 * 1.02
    fast = decay(2.0, power=1.0)
    fast[1] = 2.05
    curves = [curve(decay(2.05)), curve(fast), curve(decay(2.10))]
    t = verdict.choose_target(curves, TOTAL)
    assert t["rule"].startswith("tightened")
    assert t["target"] < 2.05  # strictly better than anything dense had before 30%
    early = [r["eval_loss"] for c in curves for r in c if r["step"] < 0.3 * TOTAL]
    assert min(early) > t["target"]
    assert all(s is None or s >= 0.3 * TOTAL for s in t["dense_first_steps"])


def test_rules_refuse_too_few_seeds_and_evaluations():
    with pytest.raises(ValueError, match="dense seeds"):
        verdict.choose_target([curve(decay(2.0))] * 2, TOTAL)
    with pytest.raises(ValueError, match="evaluations"):
        verdict.choose_target([curve(decay(2.0, evals=19))] * 3, TOTAL)
    with pytest.raises(ValueError, match="seeds"):
        verdict.summarize([1.0, 2.0])


def test_a_seed_that_misses_gives_not_reached_and_no_ratio():
    dense = verdict.summarize([10.0, 12.0, 11.0])
    assert (dense["min"], dense["median"], dense["max"]) == (10.0, 11.0, 12.0)
    miss = verdict.summarize([2.0, None, 3.0])
    assert miss["reached"] == 2 and miss["median"] is None
    assert verdict.speedup(dense, miss) is None
    assert verdict.speedup(dense, verdict.summarize([5.5, 5.0, 6.0])) == pytest.approx(2.0)


def test_quality_band():
    q = verdict.quality([2.06, 2.07, 2.05], [2.00, 2.01, 2.02])
    assert q["median"] == 2.06 and not q["within_band"]  # 2.06 > 2.01 * 1.02 = 2.0502
    assert (q["min"], q["max"]) == (2.05, 2.07)
    assert verdict.quality([2.05, 2.03, 2.04], [2.00, 2.01, 2.02])["within_band"]


def fake_study():
    """Three methods x three seeds; 'slow' misses the target on seed 2."""
    runs = []
    for seed, f in enumerate((2.0, 2.1, 2.05)):
        runs.append({"n": 2, "method": "dense", "seed": seed, "curve": curve(decay(f))})
        fast_times = [0.1 * (i + 1) * 10 for i in range(20)]  # 5x faster per step than dense
        runs.append({"n": 2, "method": "fast", "seed": seed, "curve": curve(decay(f), fast_times)})
        final = 2.3 if seed == 2 else f
        runs.append({"n": 2, "method": "slow", "seed": seed, "curve": curve(decay(final))})
    probes = [
        {"n": 2, "rate": "10mbit", "method": m, "step_s": s, "first_call": {"steps": 10,
         "train_s": 10 * s + 1.0}, "probe_check": {"probe_eval_loss": 1.0,
         "loopback_eval_loss": 1.0}}
        for m, s in (("dense", 2.0), ("fast", 0.1), ("slow", 0.2))
    ]  # fmt: skip
    return {"steps": TOTAL, "runs": runs, "probes": probes}


def test_report_times_speedups_and_not_reached_follow_the_rules():
    study = fake_study()
    v = report.lm_verdicts(study)[2]
    target = v["target"]["target"]
    assert target == pytest.approx(2.10 * 1.02)
    dense, fast, slow = (v["methods"][m] for m in ("dense", "fast", "slow"))
    # loopback: dense at 0.5 s/step, fast at 0.1 s/step, the same steps to target
    steps = dense["steps_to_target"]
    assert fast["steps_to_target"] == steps
    assert dense["links"]["loopback"]["median"] == pytest.approx(0.5 * statistics.median(steps))
    assert fast["links"]["loopback"]["speedup"] == pytest.approx(5.0)
    # 10 Mbit/s: first call (10 steps) measured, the rest at the probe's step time
    med = statistics.median(steps)
    assert dense["links"]["10mbit"]["median"] == pytest.approx(21.0 + (med - 10) * 2.0)
    assert fast["links"]["10mbit"]["speedup"] == pytest.approx(
        (21.0 + (med - 10) * 2.0) / (2.0 + (med - 10) * 0.1)
    )
    assert slow["links"]["10mbit"]["median"] is None and slow["steps_to_target"][2] is None
    md = report.lm_markdown(study)
    slow_row = next(line for line in md.splitlines() if line.startswith("| slow |"))
    assert "not reached (2/3 seeds)" in slow_row and "×" not in slow_row
    assert "worse than dense" in slow_row  # median final 2.1 > dense's 2.05 x 1.02
    fast_row = next(line for line in md.splitlines() if line.startswith("| fast |"))
    assert "5.00×" in fast_row


def test_report_flags_a_probe_whose_trajectory_differs():
    study = fake_study()
    study["probes"][1]["probe_check"]["probe_eval_loss"] = 1.5
    md = report.lm_markdown(study)
    assert "DIFFERS" in md and md.count("DIFFERS") == 1


def test_readme_block_leaves_the_step_times_to_the_study_file():
    """The README's block (step_times=False) has the time-to-target tables and a pointer to
    lm_study.md; the study file keeps the step-time table with each probe's check."""
    study = fake_study()
    study["probes"][1]["probe_check"]["probe_eval_loss"] = 1.5
    full, short = report.lm_markdown(study), report.lm_markdown(study, step_times=False)
    assert "Measured step time" in full and "DIFFERS" in full
    assert "Measured step time" not in short and short.count("DIFFERS") == 1
    assert "experiments/results/lm_study.md" in short
    assert "DIFFERS" not in report.lm_markdown(fake_study(), step_times=False)
    rows = [line for line in full.splitlines() if line.startswith("| fast |")]
    assert rows[0] in short  # the time-to-target row is the same


def test_a_superseded_method_is_marked_with_its_reason(monkeypatch):
    """A method whose code changed after its runs is marked † in every table, with why."""
    monkeypatch.setattr(report, "SUPERSEDED", {"slow": "ran older code"})
    md = report.lm_markdown(fake_study())
    assert md.count("| slow † |") == 2 and "| slow |" not in md  # both tables
    assert "† slow: ran older code." in md
    monkeypatch.setattr(report, "SUPERSEDED", {})
    assert "†" not in report.lm_markdown(fake_study())
