"""experiments.studies.lm_progress: the learned-regime study's finals table, from its JSON."""

import pytest

from experiments.studies import lm_progress


def _run(method, seed, loss, n=2):
    return {"n": n, "method": method, "seed": seed, "process_wall_s": 450.0,
            "curve": [{"eval_loss": 9.0}, {"eval_loss": loss}]}  # fmt: skip


RESULTS = {
    "steps": 2000,
    "probes": [],
    "runs": [
        *[_run("dense", s, x) for s, x in enumerate((1.74, 1.70, 1.72))],
        *[_run("bf16", s, x) for s, x in enumerate((1.73, 1.72, 1.71))],
        *[_run("int8_2p", s, x) for s, x in enumerate((1.73, 1.74, 1.75))],
        _run("muloco", 0, 1.80),
        _run("muon", 0, 1.65),
        _run("dense", 0, 1.0, n=4),  # another process count: not in the 2-process table
    ],
}


def test_rows_judge_against_dense_median_only_with_three_seeds():
    rows = {r["method"]: r for r in lm_progress.rows(RESULTS)}
    assert list(rows) == ["dense", "bf16", "int8_2p", "muloco", "muon"]  # the study's order
    assert rows["dense"]["median"] == 1.72 and rows["dense"]["finals"] == [1.74, 1.70, 1.72]
    # int8_2p: median 1.74, 1.16% worse (inside 2%), but one seed over 1.72 * 1.01
    assert rows["int8_2p"]["worse_by"] == pytest.approx(1.74 / 1.72 - 1)
    assert rows["int8_2p"]["within_band"] and not rows["int8_2p"]["headline_quality"]
    assert rows["bf16"]["headline_quality"]  # 1.73 <= 1.7372
    # one seed: judged against the band, never for the headline
    assert not rows["muloco"]["within_band"] and "headline_quality" not in rows["muloco"]
    assert rows["muloco"]["counterpart_median"] == 1.65
    # fewer than 3 dense seeds: nothing judged
    two = {**RESULTS, "runs": RESULTS["runs"][1:]}
    assert all("worse_by" not in r for r in lm_progress.rows(two))


def test_report_cells():
    text = lm_progress.report(RESULTS)
    assert "| int8_2p | AdamW, every step | 0, 1, 2 | 1.7300 / 1.7400 / 1.7500 | 1.7400 " in text
    assert "| +1.2% (within) | no | — |" in text
    assert "| +4.7% (outside) | — (1 of 3 seeds) | muon (1.6500) |" in text
    assert "Dense's median final: 1.7200 over seeds 0, 1, 2." in text
    assert "Running time so far: 1.5 h," in text  # 12 runs (one of 4 processes) x 450 s


def test_a_tried_variant_is_shown_apart_and_dilocos_counterpart_is_dense():
    results = {**RESULTS, "runs": [*RESULTS["runs"], _run("diloco_h1", 0, 2.5),
                                   *[_run("diloco", s, 1.9) for s in range(3)]]}  # fmt: skip
    rows = {r["method"]: r for r in lm_progress.rows(results)}
    assert "diloco_h1" not in rows  # not a row of the grid
    assert rows["diloco"]["counterpart"] == "dense" and rows["diloco"]["counterpart_median"] == 1.72
    text = lm_progress.report(results)
    assert "| diloco_h1 |" not in text
    assert (
        "Tried and left out of the grid: diloco_h1 (" in text and "final 2.5000 (seed 0)." in text
    )
    assert "| +10.5% (outside) | no | dense (1.7200) |" in text  # 1.9 / 1.72 - 1


def _probe(method, rate, times, loss=1.5, ref=1.5):
    reps = [{"step_s": t, "first_call": {"steps": 10, "train_s": 9.0},
             "probe_check": {"step": 30, "probe_eval_loss": loss, "loopback_eval_loss": ref}}
            for t in times]  # fmt: skip
    return {"n": 2, "rate": rate, "method": method, "repeats": reps}


def test_the_probes_so_far_are_tabled_per_method_and_link():
    results = {**RESULTS, "probes": [
        _probe("dense", "loopback", [0.21, 0.2, 0.25]),
        _probe("dense", "10mbit", [2.9, 2.8, 3.1]),
        _probe("bf16", "10mbit", [1.5, 1.4, 1.6], loss=1.5001),
    ]}  # fmt: skip
    text = lm_progress.report(results)
    assert "| method | loopback | 10mbit |" in text  # links in the study's order
    assert "| dense | 210 (200–250; 3) | 2900 (2800–3100; 3) |" in text
    assert "| bf16 | — | 1500 (1400–1600; 3) ≠ |" in text  # its loss left the trajectory
    assert "Probes so far" not in lm_progress.report(RESULTS)
    # not comparable with the trajectory (no evaluation at the probe's step): the probes of
    # a method are compared with each other, across links
    results["probes"] = [_probe("dense", "loopback", [0.2] * 3, ref=None),
                         _probe("dense", "10mbit", [3.0] * 3, ref=None)]  # fmt: skip
    assert "| dense | 200 (200–200; 3) | 3000 (3000–3000; 3) |" in lm_progress.report(results)
    results["probes"][1]["repeats"][2]["probe_check"]["probe_eval_loss"] = 1.5000001
    assert "| dense | 200 (200–200; 3) ≠ | 3000 (3000–3000; 3) ≠ |" in lm_progress.report(results)


def test_probes_set_aside_are_shown_beside_todays_and_never_used():
    from experiments.studies import lm, report

    results = {**RESULTS, "probes": [
        _probe("dense", "loopback", [0.21, 0.2, 0.25]),
        {**_probe("nocomm", "loopback", [0.07, 0.069, 0.063]), "process_wall_s": 360.0},
        _probe("diloco", "10mbit", [0.37, 0.38, 0.36]),
        {**_probe("diloco", "10mbit", [9.0]), "n": 4},  # another process count: kept
    ]}  # fmt: skip
    with pytest.raises(ValueError, match="--reprobe_why"):
        lm.set_aside(results, ["nocomm"], " ", [2])
    with pytest.raises(ValueError, match=r"--reprobe: unknown methods \['nocom'\]"):
        lm.set_aside(results, ["nocom"], "why", [2])
    hours = report.running_time(results)["total_h"]
    lm.set_aside(results, ["nocomm", "diloco"], "taken before the barrier", [2])
    assert report.running_time(results)["total_h"] == hours  # their time was spent
    assert [(p["method"], p["n"]) for p in results["probes"]] == [("dense", 2), ("diloco", 4)]
    assert [(p["method"], p["why"]) for p in results["superseded_probes"]] == [
        ("nocomm", "taken before the barrier"),
        ("diloco", "taken before the barrier"),
    ]
    text = lm_progress.report(results)
    assert "| nocomm |" not in text and "| diloco |" not in text  # never used
    line = ("Probes set aside (taken before the barrier; JSON: superseded_probes), the old median "
            "step in ms → today's: diloco 10mbit 370 → not probed again yet; nocomm loopback 69 "
            "→ not probed again yet.")  # fmt: skip
    assert line in text
    results["probes"].append(
        {**_probe("nocomm", "loopback", [0.11, 0.108, 0.112]), "evaluation_barrier": True}
    )
    assert "nocomm loopback 69 → 110." in lm_progress.report(results)
    # the same command again (an interrupted re-probe resumed) keeps the new probes
    lm.set_aside(results, ["nocomm", "diloco"], "taken before the barrier", [2])
    assert [p["method"] for p in results["probes"]] == ["dense", "diloco", "nocomm"]
    assert len(results["superseded_probes"]) == 2


def test_the_trajectories_rechecked_on_todays_code_are_named():
    def check(method, now, then):
        return {"n": 2, "method": method, "seed": 0, "step": 100, "commit": "abc1234",
                "eval_loss": now, "trajectory_eval_loss": then, "equal": now == then}  # fmt: skip

    results = {**RESULTS, "recheck": [check("dense", 2.6555, 2.6555),
                                      check("int8_2p", 2.6555972, 2.6555941),
                                      {**check("bf16", 1.0, 1.0), "n": 4}]}  # fmt: skip
    text = lm_progress.report(results)
    assert (
        "Seed 0's trajectories re-run to their first evaluation on today's code (commit "
        "abc1234; JSON: recheck): equal to the last digit for dense; different for int8_2p "
        "(2.655597200 against 2.655594100)." in text
    )
    assert "re-run to their first evaluation" not in lm_progress.report(RESULTS)


def test_trajectories_set_aside_are_shown_beside_todays_and_run_again():
    from experiments.studies import lm, report

    results = {**RESULTS, "runs": [*RESULTS["runs"], {**_run("dense", 1, 7.0), "commit": "abc"}],
               "recheck": [{"n": 2, "method": "int8_2p", "seed": 0, "step": 100,
                            "process_wall_s": 90.0, "equal": False, "commit": "abc",
                            "eval_loss": 2.5, "trajectory_eval_loss": 2.6},
                           {"n": 2, "method": "bf16", "seed": 0, "step": 100,
                            "process_wall_s": 90.0, "equal": True, "commit": "abc",
                            "eval_loss": 2.5, "trajectory_eval_loss": 2.5}]}  # fmt: skip
    with pytest.raises(ValueError, match="--rerun_why"):
        lm.set_aside_runs(results, ["int8_2p"], "", [2], [0, 1, 2])
    with pytest.raises(ValueError, match=r"--rerun: unknown methods \['nocomm'\]"):
        lm.set_aside_runs(results, ["nocomm"], "why", [2], [0, 1, 2])  # probed only: no runs
    hours = report.running_time(results)["total_h"]
    lm.set_aside_runs(results, ["int8_2p", "dense"], "older code", [2], [0, 1])
    assert report.running_time(results)["total_h"] == hours  # their time was spent
    kept = [(r["method"], r["seed"], r["n"]) for r in results["runs"]]
    assert ("int8_2p", 2, 2) in kept and ("dense", 2, 2) in kept  # a seed not in --seeds
    assert ("dense", 0, 4) in kept  # another process count
    assert ("dense", 1, 2) in kept and ("dense", 0, 2) not in kept  # stamped: today's code
    assert ("int8_2p", 0, 2) not in kept and ("int8_2p", 1, 2) not in kept
    old = {(r["method"], r["seed"]): r for r in results["superseded_runs"]}
    assert sorted(old) == [("dense", 0), ("dense", 1), ("int8_2p", 0), ("int8_2p", 1)]
    assert old[("int8_2p", 0)]["recheck"]["equal"] is False  # the recheck goes with it
    assert [c["method"] for c in results["recheck"]] == ["bf16"]
    text = lm_progress.report(results)
    assert "equal to the last digit for bf16; different for none." in text  # int8_2p's went
    assert ("Trajectories set aside (older code; JSON: superseded_runs), the old final "
            "validation loss → today's run's: dense seed 0 1.7400 → not run again yet; dense "
            "seed 1 1.7000 → 7.0000; int8_2p seed 0 1.7300 → not run again yet; int8_2p seed 1 "
            "1.7400 → not run again yet.") in text  # fmt: skip
    results["runs"].append({**_run("int8_2p", 0, 1.7369), "commit": "def"})
    assert "int8_2p seed 0 1.7300 → 1.7369;" in lm_progress.report(results)
    # the same command again (an interrupted re-run resumed) keeps the new runs
    lm.set_aside_runs(results, ["int8_2p", "dense"], "older code", [2], [0, 1])
    assert len(results["superseded_runs"]) == 4 and ("int8_2p", 0) in {
        (r["method"], r["seed"]) for r in results["runs"]
    }


def test_a_set_aside_that_would_not_be_taken_again_is_refused():
    from experiments.studies import lm

    lm.taken_again("rerun", ["int8_2p"], "runs", {"runs"}, ["int8_2p", "bf16"])
    lm.taken_again("reprobe", [], "probes", {"runs"}, ["dense"])  # nothing asked
    with pytest.raises(ValueError, match=r"--rerun=\['int8_2p'\]: needs the runs phase"):
        lm.taken_again("rerun", ["int8_2p"], "runs", {"probes"}, ["int8_2p"])
    with pytest.raises(ValueError, match=r"--reprobe=\['dense', 'bf16'\]: needs the probes"):
        lm.taken_again("reprobe", ["dense", "bf16"], "probes", {"probes"}, ["dense"])


def test_the_probes_phase_probes_a_cell_once_unless_asked_again():
    from experiments.studies import lm

    probed, have = {(2, "loopback", "dense"), (2, "loopback", "nocomm")}, {(2, "dense", 0)}
    assert not lm.to_probe(2, "loopback", "dense", probed, have, [])
    assert lm.to_probe(2, "loopback", "dense", probed, have, ["dense"])  # --probe_again
    assert lm.to_probe(2, "10mbit", "dense", probed, have, [])
    assert not lm.to_probe(2, "10mbit", "bf16", probed, have, [])  # no trajectory yet
    assert not lm.to_probe(2, "loopback", "nocomm", probed, have, [])
    assert lm.to_probe(2, "loopback", "nocomm", probed, have, ["nocomm"])
    assert not lm.to_probe(2, "10mbit", "nocomm", probed, have, ["nocomm"])  # a floor
    assert lm.to_probe(2, "10mbit", "torch_after", probed, have, [])  # only probed, every link


def test_whole_runs_are_set_against_their_trajectory_evaluation_by_evaluation():
    def rows(*losses):
        return [{"step": 100 * (i + 1), "eval_loss": x, "train_s": 10.0 * (i + 1)}
                for i, x in enumerate(losses)]  # fmt: skip

    def whole(method, rate, *losses):
        return {"n": 2, "method": method, "rate": rate, "seed": 0, "curve": rows(*losses)}

    results = {**RESULTS, "runs": [
        {"n": 2, "method": "dense", "seed": 0, "curve": rows(2.5, 2.0, 1.74)},
        {"n": 2, "method": "int8_2p", "seed": 0, "curve": rows(2.6, 2.1, 1.73)},
    ], "validation": [
        whole("dense", "100mbit", 2.5, 2.0 + 3e-7, 1.74 - 2e-6),
        whole("int8_2p", "10mbit", 2.6, 2.1, 1.73),
        whole("int8_2p", "100mbit", 2.6 + 1e-8, 2.1, 1.73),
        {**whole("dense", "10mbit", 9.0), "n": 4},  # another process count
    ]}  # fmt: skip
    assert lm_progress.whole_run_lines(results) == [
        "",
        "Whole runs on a link against their seed's loopback trajectory, evaluation by "
        "evaluation: dense at 100 Mbit/s: equal through step 100, different from step 200 "
        "(at most 2.0e-06); int8_2p at 10 Mbit/s: equal at all 3 evaluations; int8_2p at "
        "100 Mbit/s: different from step 100 (at most 1.0e-08).",
    ]
    assert lm_progress.whole_run_lines(RESULTS) == []
    assert "Whole runs on a link against" in lm_progress.report(results)
