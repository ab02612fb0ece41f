"""experiments.advise on 8 CPU devices: its rows compose as documented; its choice is policy's."""

import pytest

from experiments import advise
from experiments.configs import digits_mlp
from jaxcomm import policy


@pytest.fixture(scope="module")
def advice():
    config = digits_mlp.get_config("dense")
    config.model.kwargs = {"hidden": 32, "depth": 1}
    config.steps_per_call = 5
    policy.clear_cache()
    return advise.advise(config, repeats=1)


def test_predicted_step_takes_the_larger_of_measured_cost_and_alpha_beta():
    assert advise.predicted_step(0.5, 0.25, 0.125) == 0.75
    assert advise.predicted_step(0.5, 0.25, 2.0) == 2.5  # the link bounds a short timed program
    assert advise.predicted_step(0.5, 0.25, float("nan")) == 0.75  # no calibration


def test_each_predicted_step_is_the_no_exchange_step_plus_the_larger_cost(advice):
    assert advice["compute_s"] > 0 and advice["n"] == 8
    names = [r["name"] for r in advice["rows"]]
    assert names == [c.name for c in policy.DEFAULT_CANDIDATES]
    for r in advice["rows"]:
        assert r["seconds"] >= 0
        assert r["measured_step_s"] == advice["compute_s"] + r["seconds"]
        assert r["model_step_s"] == advice["compute_s"] + r["predicted_s"]
        assert r["predicted_step_s"] == max(r["measured_step_s"], r["model_step_s"])
        assert r["predicted_s"] > 0  # every candidate here communicates


def test_the_recommendation_is_policys_decision_on_the_same_rows(advice):
    rows = [policy.Row(**{k: r[k] for k in policy.Row._fields}) for r in advice["rows"]]
    assert policy.decide(rows, 0.1) == (advice["choice"], advice["reason"])
    text = advise.render(advice)
    assert "all_reduce" in text and f"recommendation: {advice['choice']}" in text


def test_an_auto_configs_guard_decides_the_recommendation():
    from experiments.configs import lm_shakespeare

    assert advise.guard_options(lm_shakespeare.get_config("auto")) == {"max_ratio": 32}
    assert advise.guard_options(lm_shakespeare.get_config("dense")) == {}
    config = digits_mlp.get_config("auto")
    config.model.kwargs = {"hidden": 32, "depth": 1}
    config.steps_per_call = 5
    config.compressor.kwargs = {"max_ratio": 1.5, "warmup_steps": 3}
    result = advise.advise(config, repeats=1)
    # every candidate but dense compresses more than 1.5x: the cap leaves dense alone
    for r in result["rows"]:
        assert (r["excluded"] == "") == (r["name"] == "dense"), r
    assert result["choice"] == "dense"
