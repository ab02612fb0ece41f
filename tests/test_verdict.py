"""The verdict rules (experiments/studies/verdict.py) and the LM study's report built on them.

Curves are synthetic with closed-form answers: no training runs here.
"""

import statistics

import pytest

from experiments.studies import lm_figure, lm_methods, report, verdict

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
    """The short block (step_times=False) has the time-to-target tables and a pointer to
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


def test_a_superseded_method_is_marked_in_the_study_file_and_left_out_of_the_readme():
    """A method whose code changed after its runs is marked † in every table of the study file,
    with why; the short block (step_times=False) shows no † row, only a note naming it."""
    study = {**fake_study(), "superseded": {"slow": "ran older code"}}
    md = report.lm_markdown(study)
    assert md.count("| slow † |") == 3 and "| slow |" not in md  # time, loss, step-time tables
    assert "† slow: ran older code." in md
    short = report.lm_markdown(study, step_times=False)
    assert "| slow" not in short and "†" not in short
    assert "Not shown: slow (re-run pending" in short
    assert "†" not in report.lm_markdown(fake_study())  # another study's JSON: none
    assert "Not shown" not in report.lm_markdown(fake_study(), step_times=False)


def add_method(study, name, finals, seconds_per_eval=5.0, probe_step=None):
    """A method with a run per seed (final losses ``finals``) and, optionally, a 10 Mbit/s probe."""
    for seed, f in enumerate(finals):
        times = [seconds_per_eval * (i + 1) for i in range(20)]
        study["runs"].append(
            {"n": 2, "method": name, "seed": seed, "curve": curve(decay(f), times)}
        )
    if probe_step is not None:
        study["probes"].append(probe(name, probe_step))
    return study


def probe(method, step_s, rate="10mbit", repeats=None):
    """A probe entry: old layout (one measurement) or, with ``repeats`` (step times), the new."""

    def one(s):
        return {"step_s": s, "steps": 20, "first_call": {"steps": 10, "train_s": 10 * s + 1.0},
                "probe_check": {"probe_eval_loss": 1.0, "loopback_eval_loss": 1.0}}  # fmt: skip

    if repeats is None:
        return {"n": 2, "rate": rate, "method": method, **one(step_s)}
    reps = [one(s) for s in repeats]
    med = statistics.median(repeats)
    return {"n": 2, "rate": rate, "method": method, "seed": 0, "repeats": reps, "step_s": med,
            "step_s_min": min(repeats), "step_s_max": max(repeats),
            "first_call": one(med)["first_call"],
            "probe_check": reps[0]["probe_check"]}  # fmt: skip


def row_of(md, method, nth=0):
    return [line for line in md.splitlines() if line.startswith(f"| {method} |")][nth]


def test_a_faster_method_that_ends_worse_gets_no_ratio():
    # every seed ends at 2.1115 = 3% above dense's median 2.05 (and reaches the target 2.142)
    study = add_method(fake_study(), "worse", [2.05 * 1.03] * 3, seconds_per_eval=1.0)
    v = report.lm_verdicts(study)[2]["methods"]["worse"]
    assert not v["final"]["within_band"] and v["final"]["worse_by"] == pytest.approx(0.03)
    assert (
        v["links"]["loopback"]["median"] is not None and v["links"]["loopback"]["speedup"] is None
    )
    row = row_of(report.lm_markdown(study), "worse")
    assert "×" not in row and "faster, but ends worse by 3.0%" in row
    # slower than dense: the other wording; a missed seed: "not reached", still no ratio
    dense = verdict.summarize([10.0, 11.0, 12.0])
    q = verdict.quality([2.1, 2.1, 2.1], [2.0, 2.0, 2.0])
    assert verdict.judge(dense, verdict.summarize([20.0, 21.0, 22.0]), q) == {
        "speedup": None, "note": "slower, and ends worse by 5.0%"}  # fmt: skip
    assert verdict.judge(dense, verdict.summarize([1.0, None, 2.0]), q)["note"] == (
        "not reached (2/3 seeds)")  # fmt: skip
    ok = verdict.quality([2.01, 2.0, 2.02], [2.0, 2.0, 2.0])
    assert verdict.judge(dense, verdict.summarize([5.0, 5.5, 6.0]), ok)["speedup"] == 2.0


def test_headline_is_the_fastest_method_within_one_percent_on_every_seed():
    dense = verdict.summarize([10.0, 12.0, 11.0])
    h = verdict.headline(dense, [2.0, 2.0, 2.0], {
        "good": (verdict.summarize([5.0, 5.5, 6.0]), [2.01, 2.0, 2.015]),  # 2x, all within 1%
        "quick": (verdict.summarize([2.0, 2.0, 2.0]), [2.0, 2.0, 2.03]),  # 5.5x, one seed 1.5%
        "miss": (verdict.summarize([1.0, None, 1.0]), [2.0, 2.0, 2.0]),
    })  # fmt: skip
    assert h["method"] == "good" and h["speedup"] == pytest.approx(2.0)
    assert (h["low"], h["high"]) == (pytest.approx(11 / 6), pytest.approx(11 / 5))
    assert h["final"] == {"median": 2.01, "min": 2.0, "max": 2.015}
    assert h["dense_final"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    # in the report: dense's median final 2.05; 'quick' is 5x but one seed ends 1.5% worse
    study = fake_study()  # 'fast' has dense's finals: seed 1 at 2.1 is 2.4% worse than 2.05
    assert report.lm_headline(study)[2] == {"loopback": None, "10mbit": None}
    assert "- At 10 Mbit/s: no method reaches the target" in report.lm_markdown(study)
    add_method(study, "good", [2.05, 2.06, 2.04], 2.0, probe_step=0.4)
    add_method(study, "quick", [2.05, 2.05, 2.05 * 1.015], 1.0, probe_step=0.2)
    h = report.lm_headline(study)[2]["loopback"]
    cells = report.lm_verdicts(study)[2]["methods"]
    assert cells["quick"]["links"]["loopback"]["speedup"] > cells["good"]["links"]["loopback"][
        "speedup"]  # fmt: skip
    assert h["method"] == "good"
    d, g = cells["dense"]["links"]["loopback"], cells["good"]["links"]["loopback"]
    assert h["speedup"] == pytest.approx(d["median"] / g["median"])
    assert (h["low"], h["high"]) == (d["median"] / g["max"], d["median"] / g["min"])
    line = next(ln for ln in report.lm_markdown(study).splitlines() if ln.startswith("- On loop"))
    ratio = d["median"] / g["median"]
    assert line.startswith(f"- On loopback: good reaches the target {ratio:.1f}× sooner (")
    assert "final 2.050 (2.040–2.060) vs dense 2.050 (2.000–2.100)" in line


def test_loss_at_dense_time_to_target_and_at_dense_run_time():
    study = fake_study()
    study["probes"][2] = probe("slow", 4.0)  # slow: 2x dense's step time at 10 Mbit/s
    v = report.lm_verdicts(study)[2]
    # dense: steps to target 180/200/190; loopback 0.5 s/step -> 95 s, run 100 s;
    # 10 Mbit/s: 21 + (steps - 10) * 2 s -> 381 s, run 401 s
    assert v["dense_times"]["loopback"] == (pytest.approx(95.0), pytest.approx(100.0))
    assert v["dense_times"]["10mbit"] == (pytest.approx(381.0), pytest.approx(401.0))
    slow = v["methods"]["slow"]["links"]
    # loss at evaluation k (1..20) is f + (3 - f)(1 - k/20); slow's finals 2.0, 2.1, 2.3
    at = lambda k: statistics.median(f + (3 - f) * (1 - k / 20) for f in (2.0, 2.1, 2.3))  # noqa: E731
    assert slow["loopback"]["loss_at_dense_target"] == pytest.approx(at(19))  # t = 0.5 s x step
    assert slow["loopback"]["loss_at_dense_run"] == pytest.approx(at(20))
    # 10 Mbit/s: 41 + 4 (step - 10) s <= 381 s up to step 95 -> evaluation 9; <= 401 -> 10
    assert slow["10mbit"]["loss_at_dense_target"] == pytest.approx(at(9))
    assert slow["10mbit"]["loss_at_dense_run"] == pytest.approx(at(10))
    md = report.lm_markdown(study)
    assert "| method | loopback (95.0 s / 100 s) | 10 Mbit/s (381 s / 401 s) |" in md
    assert (
        row_of(md, "slow", 1)
        == f"| slow | {at(19):.3f} / {at(20):.3f} | {at(9):.3f} / {at(10):.3f} |"
    )
    assert verdict.value_at([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], 2.5) == 2.0
    assert verdict.value_at([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], 0.5) is None


def test_estimates_checked_against_whole_runs_on_the_link():
    study = fake_study()
    steps = [TOTAL * (i + 1) // 20 for i in range(20)]
    # fast, seed 0 (final 2.0): target at step 180; estimate 2.0 + 170 x 0.1 = 19.0 s; measured 20
    # dense, seed 1 (final 2.1): target at step 200; estimate 21 + 190 x 2.0 = 401 s; measured 460
    study["validation"] = [
        {"n": 2, "rate": "10mbit", "method": "fast", "seed": 0, "estimate_s": None,
         "measured_s": None, "curve": curve(decay(2.0), [20.0 * s / 180 for s in steps])},
        {"n": 2, "rate": "10mbit", "method": "dense", "seed": 1, "estimate_s": None,
         "measured_s": None, "curve": curve(decay(2.1), [460.0 * s / 200 for s in steps])},
        {"n": 2, "rate": "10mbit", "method": "slow", "seed": 0, "estimate_s": 100.0,
         "measured_s": 95.0, "curve": curve(decay(2.0))},
    ]  # fmt: skip
    v = report.lm_verdicts(study)[2]
    checks = {c["method"]: c for c in v["checks"]}
    assert (checks["fast"]["estimate"], checks["fast"]["measured"]) == (
        pytest.approx(19.0), pytest.approx(20.0))  # fmt: skip
    assert checks["fast"]["ratio"] == pytest.approx(20 / 19) and checks["fast"]["within"]
    assert checks["dense"]["estimate"] == pytest.approx(401.0)
    assert checks["dense"]["ratio"] == pytest.approx(460 / 401) and not checks["dense"]["within"]
    assert checks["slow"]["ratio"] == pytest.approx(0.95) and checks["slow"]["within"]
    # the measured seed's time replaces its estimate in the time-to-target cell
    fast = v["methods"]["fast"]["links"]["10mbit"]
    assert fast["times"] == [pytest.approx(20.0), pytest.approx(21.0), pytest.approx(20.0)]
    assert fast["measured_seeds"] == [0]
    assert v["methods"]["slow"]["links"]["10mbit"]["times"][0] == 95.0  # the run's measured_s
    md = report.lm_markdown(study)
    assert "| fast | 10 Mbit/s | 0 | 19.0 | 20.0 | 1.05 | yes |" in md
    assert "| dense | 10 Mbit/s | 1 | 401 | 460 | 1.15 | no |" in md
    assert "seed 0 measured" in row_of(md, "fast") and "measured" not in row_of(
        report.lm_markdown(fake_study()), "fast")  # fmt: skip
    assert verdict.estimate_check(100.0, 111.0)["within"] is False
    assert verdict.estimate_check(100.0, 109.0)["within"] is True
    assert verdict.estimate_check(None, 5.0) == {"estimate": None, "measured": 5.0, "ratio": None,
                                                 "within": False}  # fmt: skip


def test_probes_with_repeats_give_median_range_and_mark_fewer_than_three():
    study = fake_study()
    study["probes"][0] = probe("dense", None, repeats=[2.0, 1.8, 2.6])
    study["probes"][1] = probe("fast", None, repeats=[0.1, 0.12])
    s = report.probe_summary([study["probes"][0]])
    assert (s["step_s"], s["step_s_min"], s["step_s_max"], s["probes"]) == (2.0, 1.8, 2.6, 3)
    assert s["first_call"] == {"steps": 10, "train_s": 21.0}  # the median repeat's
    assert report.probe_summary([fake_study()["probes"][0]])["probes"] == 1  # old layout
    md = report.lm_markdown(study)
    assert row_of(md, "dense", 2).endswith("| 2000 (1800–2600), 3 probes, equal |")
    assert row_of(md, "fast", 2).endswith("| 110 (100–120), only 2 probes, equal |")
    assert row_of(md, "slow", 2).endswith("| 200, only 1 probe, equal |")
    # the time to target uses the median step time: as in the old layout at 2.0 s
    dense = report.lm_verdicts(study)[2]["methods"]["dense"]
    med = statistics.median(dense["steps_to_target"])
    assert dense["links"]["10mbit"]["median"] == pytest.approx(21.0 + (med - 10) * 2.0)
    study["probes"][0]["repeats"][2]["probe_check"]["probe_eval_loss"] = 1.5
    assert "2000 (1800–2600), 3 probes, DIFFERS" in report.lm_markdown(study)
    for r in study["probes"][0]["repeats"]:  # the loopback run has no evaluation at that step
        r["probe_check"]["loopback_eval_loss"] = None
    assert "2000 (1800–2600), 3 probes, not checked" in report.lm_markdown(study)


NGRAM = {"smoothing": "interpolated Kneser-Ney", "train_bytes": 1000, "predicted_bytes": 100,
         "orders": {"1": 3.351, "2": 2.542, "3": 2.082, "4": 1.784, "5": 1.640}}  # fmt: skip


def test_counting_models_are_stated_under_the_tables():
    line = ("Counting models on the same split: unigram 3.351, bigram 2.542, trigram 2.082, "
            "4-gram 1.784, 5-gram 1.640 nats/byte (interpolated Kneser-Ney).")  # fmt: skip
    study = fake_study()
    assert "Counting models" not in report.lm_markdown(study)
    study["ngram"] = NGRAM
    md = report.lm_markdown(study)
    assert md.count(line) == 2  # under the time-to-target table and the loss table
    assert report.lm_markdown(study, step_times=False).count(line) == 2


def test_plot_is_a_grid_of_at_most_three_columns_with_reference_lines(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    study = fake_study()
    for rate in ("1gbit", "100mbit"):
        study["probes"] += [probe(m, s, rate) for m, s in (("dense", 1.0), ("fast", 0.1))]
        study["probes"].append(probe("slow", 0.2, rate))
    study["ngram"] = NGRAM
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to look at it
    path = tmp_path / "lm.png"
    assert lm_figure.lm_plot(study, str(path)) == (2, 3)  # 4 panels: loopback + 3 links
    assert path.stat().st_size > 0
    (fig,) = figs
    assert fig.get_size_inches()[0] == pytest.approx(12)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 4
    for ax in panels:
        texts = " ".join(t.get_text() for t in ax.texts)
        # best final 2.0: the view runs from just below it to just above the unigram
        low, high = ax.get_ylim()
        assert 1.9 < low < 2.0 and 3.351 < high < 3.5  # from the data, not a fixed 3.2
        for name in ("unigram 3.35", "bigram 2.54", "trigram 2.08"):  # inside: drawn, labelled
            assert name in texts
        assert "4-gram" not in texts  # 1.78, below the view
        dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
        assert sorted(round(ln.get_ydata()[0], 3) for ln in dotted) == [2.082, 2.542, 3.351]
    assert len(fig.legends) == 1  # one legend for all panels
    assert "4-gram 1.78, 5-gram 1.64" in " ".join(t.get_text() for t in fig.texts)
    assert lm_figure.lm_plot(fake_study(), str(tmp_path / "two.png")) == (1, 2)


def test_running_time_sums_every_launched_command():
    study = fake_study()
    for r in study["runs"]:
        r["wall_s"] = 120.0  # 9 runs
    study["probes"][0]["process_wall_s"] = 60.0  # no wall_s: process_wall_s
    study["probes"][1] = probe("fast", None, repeats=[0.1, 0.1, 0.1])
    for r in study["probes"][1]["repeats"]:
        r["wall_s"] = 30.0  # each repeat's own wall time
    study["validation"] = [
        {"n": 4, "rate": "10mbit", "method": "dense", "seed": 0, "curve": curve(decay(2.0))}
    ]  # no wall time: its last train_s, 100 s
    # the third probe has neither: 0 (it has no curve either)
    rt = report.running_time(study)
    assert rt["by_processes"] == {2: pytest.approx((9 * 120 + 60 + 90) / 3600),
                                  4: pytest.approx(100 / 3600)}  # fmt: skip
    assert rt["total_h"] == pytest.approx((9 * 120 + 60 + 90 + 100) / 3600)
    assert "Running time of the study: 0.4 h (2 processes 0.3 h, 4 processes 0.0 h)" in (
        report.lm_markdown(study))  # fmt: skip


def test_counterpart_ratio_only_when_both_end_within_the_band(monkeypatch):
    monkeypatch.setattr(report, "COUNTERPART", {"fast": "ref", "slow": "absent"})
    study = add_method(fake_study(), "ref", [2.0, 2.1, 2.05], seconds_per_eval=2.0)
    row = row_of(report.lm_markdown(study), "fast")
    assert "2.00× vs ref" in row  # 1 s per evaluation against 2 s, the same steps
    worse = add_method(fake_study(), "ref", [2.05 * 1.03] * 3, seconds_per_eval=2.0)
    assert "vs ref" not in report.lm_markdown(worse)
    assert "vs absent" not in report.lm_markdown(study)  # a counterpart not run: skipped


def test_loopback_probes_time_loopback_when_every_method_has_them():
    """The trajectories may share the cores, so loopback is timed by its probes where every
    method of the group has them (first call + remaining steps x the median probe step),
    else every method by its runs' clocks (one clock for the column)."""
    study = fake_study()
    before = report.lm_verdicts(study)[2]["methods"]["dense"]["links"]["loopback"]
    # runs' clocks: dense's curve(...) rows take 0.5 s a step
    assert before["step_ms"] == pytest.approx(500.0)
    assert "probes" not in before and "500, runs' clocks" in report.lm_markdown(study)
    study["probes"].append(probe("dense", None, rate="loopback", repeats=[0.3, 0.2, 0.25]))
    # dense alone probed: still the runs' clocks for every method
    alone = report.lm_verdicts(study)[2]["methods"]["dense"]["links"]["loopback"]
    assert alone["step_ms"] == pytest.approx(500.0) and "probes" not in alone
    study["probes"] += [probe(m, 0.05, rate="loopback") for m in ("fast", "slow")]
    v = report.lm_verdicts(study)[2]
    assert v["rates"] == ["loopback", "10mbit"]  # loopback once, not again from the probes
    cell = v["methods"]["dense"]["links"]["loopback"]
    assert (cell["step_ms"], cell["step_ms_min"], cell["step_ms_max"]) == pytest.approx(
        (250.0, 200.0, 300.0)
    )
    med = statistics.median(v["methods"]["dense"]["steps_to_target"])
    assert cell["median"] == pytest.approx(10 * 0.25 + 1.0 + (med - 10) * 0.25)
    assert "| 250 (200–300), 3 probes, equal |" in row_of(report.lm_markdown(study), "dense", 2)
    assert v["methods"]["fast"]["links"]["loopback"]["step_ms"] == pytest.approx(50.0)


def test_validate_best_names_the_headline_method_or_none():
    from experiments.studies import lm

    study = fake_study()
    fast = [r for r in study["runs"] if r["method"] == "fast"]
    for r in fast:  # every seed within 1% of dense's median final (2.05)
        r["curve"][-1]["eval_loss"] = 2.06
    # 'fast' is 20x quicker a step at 10 Mbit/s; 'slow' misses the target on seed 2
    assert lm.best_method(study, 2, "10mbit") == "fast"
    fast[1]["curve"][-1]["eval_loss"] = 2.05 * 1.011  # one seed out of the band: no headline
    assert lm.best_method(study, 2, "10mbit") is None
    assert lm.best_method(study, 4, "10mbit") is None  # no runs at 4 processes


def test_worse_text_adds_a_digit_where_one_would_round_onto_the_band():
    assert verdict.worse_text(0.0204) == "2.04%"  # outside the 2% band, not "2.0%"
    assert verdict.worse_text(0.0196) == "1.96%"  # inside it, not "2.0%" either
    assert verdict.worse_text(0.034) == "3.4%" and verdict.worse_text(0.0116) == "1.2%"
    assert verdict.worse_text(-0.025) == "-2.5%"


def test_a_tried_variant_is_neither_a_row_nor_a_gap(monkeypatch):
    tried = {"fast": "tried, left out"}
    monkeypatch.setattr(report, "TRIED", tried)
    monkeypatch.setattr(lm_methods, "TRIED", tried)
    study = fake_study()
    done, missing = report.complete_groups(study)
    assert "fast" not in done[2] and "slow" in done[2] and 2 not in missing
    assert "fast" not in report.lm_verdicts(study)[2]["methods"]
    said = "Tried and left out of the grid: fast (tried, left out), final 2.0000 / 2.1000 / 2.0500"
    assert said in report.lm_markdown(study)
    # one seed of a method in the grid is a gap; of a tried variant, nothing
    study["runs"].append({"n": 2, "method": "once", "seed": 0, "curve": curve(decay(2.0))})
    assert report.complete_groups(study)[1][2] == "once 1 of 3 seeds"
    study["runs"] = [r for r in study["runs"] if (r["method"], r["seed"]) != ("fast", 1)]
    assert report.complete_groups(study)[1][2] == "once 1 of 3 seeds"


def test_links_are_dense_s_and_the_header_says_which_clock_loopback_has():
    study = fake_study()
    study["probes"].append(probe("fast", 0.05, rate="100mbit"))  # dense has no 100 Mbit/s probe
    v = report.lm_verdicts(study)[2]
    assert v["rates"] == ["loopback", "10mbit"] and not v["loop_probed"]
    assert "Loopback: measured by the runs' clocks." in report.lm_markdown(study)
    for m in ("dense", "fast", "slow"):
        study["probes"].append(probe(m, 0.1, rate="loopback"))
    assert report.lm_verdicts(study)[2]["loop_probed"]
    assert "Every link, loopback too: estimated" in report.lm_markdown(study)
