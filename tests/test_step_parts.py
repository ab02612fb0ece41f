"""experiments.bench.step_parts on 8 CPU devices: one session's rows, and its report."""

import pytest

from experiments.bench import step_parts, step_parts_report


@pytest.fixture(scope="module")
def measured():
    return step_parts.session(["dense", "topk"], steps_per_call=2, rounds=2, repeats=1)


def test_a_session_times_each_method_beside_no_exchange(measured):
    assert measured["n"] == 8 and list(measured["methods"]) == ["none", "dense", "topk"]
    for name, row in measured["methods"].items():
        assert row["step_s"] > 0 and row["mean_step_s"] > 0
        if name != "none":
            assert row["exchange_s"] >= 0 and row["codec_s"] >= 0
    # the peers bench's MLP: 64 inputs, 256 hidden, 10 classes (closed form); the dense
    # all-reduce moves every float32 parameter once per step
    entries = 64 * 256 + 256 + 256 * 10 + 10
    assert measured["hidden"] == 256 and measured["params"] == entries
    assert measured["methods"]["dense"]["wire_bytes"] == 4 * entries
    assert measured["methods"]["topk"]["wire_bytes"] < entries  # 1%: values + indices


def test_the_report_splits_each_step_into_its_parts(measured):
    res = {"links": {"loopback": measured}}
    text = step_parts_report.report(res)
    assert "**loopback**, 2 processes, 19,210 parameters: median of 2 calls of 2 steps" in text
    lines = text.splitlines()
    m = measured["methods"]
    row = next(x for x in lines if x.startswith("| topk |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    none, t = m["none"]["step_s"], m["topk"]
    assert cells[3] == f"{(t['step_s'] - none) * 1e3:.2f}"
    assert cells[5] == f"{(t['exchange_s'] - t['codec_s']) * 1e3:.2f}"
    assert cells[6] == f"{(t['step_s'] - none - t['exchange_s']) * 1e3:.2f}"


def test_the_lm_config_times_the_study_s_gpt_and_drops_the_digits_bound():
    """``--config=lm_shakespeare``: the LM study's GPT, its dense all-reduce moving every
    float32 parameter once a step; its tables have no digits-MLP bound column."""
    study_params = 875_520  # lm_shakespeare.py's docstring (and tests/test_torch_lm.py)
    lm = step_parts.session(["dense"], steps_per_call=1, rounds=1, repeats=1,
                            config="lm_shakespeare")  # fmt: skip
    assert lm["config"] == "lm_shakespeare" and "hidden" not in lm
    assert lm["params"] == study_params
    assert lm["methods"]["dense"]["wire_bytes"] == 4 * study_params
    text = step_parts_report.report({"links": {"loopback": lm}})
    header = next(x for x in text.splitlines() if x.startswith("| method |"))
    assert header.endswith("| rest |") and "within" not in text
