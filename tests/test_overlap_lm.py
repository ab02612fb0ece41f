"""Streaming DiLoCo overlapped (experiments.bench.overlap_lm_train) trains as the harness does.

The LM study's variant, its exchanges in host threads, on 2 launched processes."""

import json

import pytest

from experiments.studies import lm_methods


@pytest.mark.slow
def test_overlapped_run_follows_the_harness_in_step_run(tmp_path):
    """Streaming DiLoCo (2 fragments, delay 1, mix 0.5; a fragment syncs every 5 steps),
    20 steps: evaluations, training loss and bytes of the overlapped run equal the
    harness's run of the same variant (the same rule, batches, AdamW and schedule)."""
    from tests.test_distributed import launch

    config = "experiments/configs/lm_shakespeare.py:streaming"
    over, step = tmp_path / "overlap", tmp_path / "in_step"
    runs = [
        launch(2, 1, "-m", "experiments.bench.overlap_lm_train", "--variant=streaming",
               f"--workdir={over}", "--stop_after=20", "--eval_every=10", timeout=900),
        launch(2, 1, "-m", "experiments.main", f"--config={config}", f"--workdir={step}",
               "--config.stop_after=20", "--config.steps_per_call=10", "--config.eval_every=10",
               "--config.progress=False", "--config.plot=False", timeout=900),
    ]  # fmt: skip
    for run in runs:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [[json.loads(line) for line in open(w / "metrics.jsonl")] for w in (over, step)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [10, 20]
    for a, b in zip(*rows):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["wire_bytes"] == b["wire_bytes"] > 0
    assert rows[0][1]["eval_loss"] < rows[0][0]["eval_loss"]


def test_the_study_runs_each_overlapped_variant_beside_its_in_step_one():
    for method, variant in lm_methods.OVERLAP.items():
        assert method in lm_methods.METHODS and variant in lm_methods.METHODS
        assert lm_methods.sync_period(method) == lm_methods.sync_period(variant)
        assert lm_methods.peak_factor(method) == lm_methods.peak_factor(variant)
