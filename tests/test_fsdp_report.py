"""experiments.bench.fsdp_report: the FSDP variants' time to target, from hand-made curves."""

from experiments.bench import fsdp_report


def _run(variant, seed, final, steps=2000, every=100):
    # validation loss falling linearly from 3.0 at step 0 to ``final`` at the last step
    curve = [{"step": s, "eval_loss": 3.0 - (3.0 - final) * s / steps}
             for s in range(every, steps + 1, every)]  # fmt: skip
    return {"variant": variant, "seed": seed, "curve": curve}


TRAJ = {"processes": 2, "steps": 2000, "eval_every": 100, "runs": [
    *[_run("fsdp", s, f) for s, f in enumerate((1.70, 1.72, 1.74))],
    *[_run("fsdp_q8w_q8g", s, 1.60) for s in range(3)],
    *[_run("fsdp_q8w", s, 1.76) for s in range(3)],  # 2.3% worse than dense: outside
    _run("fsdp_bf16w", 0, 1.90),
]}  # fmt: skip
TIMING = {
    "processes": 2,
    "links": [
        {
            "rate": "100mbit",
            "rows": [
                {
                    "variant": v,
                    "step_ms": ms,
                    "step_ms_min": ms - 5,
                    "step_ms_max": ms + 5,
                    "bytes_per_step": b,
                    "params": 2e6,
                    "opt_state": 4e6,
                    "comm_state": r,
                    "loss": 3.3,
                }
                for v, ms, b, r in (
                    ("fsdp", 100.0, 6e6, 0),
                    ("fsdp_q8w_q8g", 50.0, 1.5e6, 4e6),
                    ("fsdp_q8w", 40.0, 4.5e6, 0),
                )
            ],  # fmt: skip
        }
    ],
}


def test_time_to_target_from_the_dense_fsdp_target_and_each_links_step():
    text = fsdp_report.markdown(TRAJ, TIMING)
    # target: the worst dense FSDP final x 1.02 = 1.7748; dense seeds reach it at steps
    # 1900, 2000, 2000 (median 2000); int8 at 1800 (3 - 1.4 x 0.9 = 1.74)
    assert "Target 1.7748 nats/byte" in text
    assert "| fsdp | 0, 1, 2 | 1.7000 / 1.7200 / 1.7400 | 1.7200 | — | 2000 | 200 |" in text
    # 1800 steps x 50 ms = 90 s against 200 s: 2.22x
    assert "| fsdp_q8w_q8g | 0, 1, 2 | 1.6000 / 1.6000 / 1.6000 | 1.6000 | -7.0% (within) " \
           "| 1800 | 90 (2.22x) |" in text  # fmt: skip
    assert "| fsdp_bf16w | 0 | 1.9000 | 1.9000 | +10.5% (outside) | not reached | — |" in text
    # outside the band: seconds (2000 x 40 ms), no ratio beside them
    assert "| +2.3% (outside) | 2000 | 80 (ends worse by 2.3%: no ratio) |" in text


def test_without_timing_rows_the_table_keeps_its_columns():
    text = fsdp_report.markdown(TRAJ)
    head = next(x for x in text.splitlines() if x.startswith("| variant"))
    rule = next(x for x in text.splitlines() if x.startswith("|---"))
    assert head.count("|") == rule.count("|") == 7  # six columns, no link
    assert "| fsdp_q8w_q8g | 0, 1, 2 | 1.6000 / 1.6000 / 1.6000 | 1.6000 | -7.0% (within) " \
           "| 1800 |" in text  # fmt: skip


def test_no_target_before_dense_fsdp_has_three_seeds():
    few = {**TRAJ, "runs": [r for r in TRAJ["runs"] if (r["variant"], r["seed"]) != ("fsdp", 2)]}
    text = fsdp_report.markdown(few, TIMING)
    assert "No target yet: fsdp has 2 of 3 seeds." in text and "Target" not in text
    assert "| fsdp | 0, 1 | 1.7000 / 1.7200 |" in text and "| fsdp_bf16w | 0 | 1.9000 |" in text


def test_the_timing_rows_follow_the_time_to_target():
    text = fsdp_report.markdown(TRAJ, TIMING)
    assert text.index("| variant | seeds |") < text.index("| link | variant | MB/step |")
    # bytes against dense FSDP's (1.5 MB / 6 MB), memory per worker, residuals, step range
    assert "| 100mbit | fsdp_q8w_q8g | 1.50 | 0.25x | 2.00 | 4.00 | 4.00 | 50 (45–55) | 3.300 |" \
        in text  # fmt: skip
