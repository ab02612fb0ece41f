"""experiments.bench.goodput: the failure schedule, the accounting, and tiny runs of both sides.

Fast: the schedule's victims (seeded, the next one up when the drawn one is
down, nobody when fewer than two are up) and the accounting on hand-written
logs against its closed form. Processes (``-m slow``): 3 replicas of a tiny GPT,
one killed by the schedule and restarted, on each side: both finish, the
goodput equals its closed form from the recorded events (committed rounds x
steps per round, per replica), and the restarted replica ends bit-equal to its
peers.

Skipped without torchft, except where ``JAXCOMM_REQUIRE_TORCHFT`` is set (CI
installs torchft over torch's CPU build and sets it): then a failed import fails.
"""

import json
import os

import pytest

if os.environ.get("JAXCOMM_REQUIRE_TORCHFT"):
    import torchft  # noqa: F401
else:
    pytest.importorskip("torchft", reason='needs torchft: pip install -e ".[ft]"')

from experiments.bench import goodput, goodput_report  # noqa: E402


def test_schedule_draws_the_same_victims_and_skips_the_down():
    a, b = goodput.Schedule(3, 10.0, 2.0, seed=7), goodput.Schedule(3, 10.0, 2.0, seed=7)
    draws = a.draws[:5]
    assert draws == b.draws[:5]
    assert [a.victim({0, 1, 2}) for _ in range(5)] == draws
    # the drawn replica is down: the next one up (cyclically) instead
    c = goodput.Schedule(3, 10.0, 2.0, seed=7)
    first = c.draws[0]
    assert c.victim({0, 1, 2} - {first}) == (first + 1) % 3
    assert c.victim({first}) is None and c.kills == 2  # one up: nobody killed, slot passes
    assert not c.due(100.0 + 29.9, 100.0) and c.due(100.0 + 30.0, 100.0)  # third slot
    once = goodput.Schedule(3, 10.0, 2.0, seed=7, max_kills=1)
    assert once.victim(set()) is None  # a slot with nobody up is skipped, not a kill
    assert once.victim({0, 1, 2}) is not None and once.victim({0, 1, 2}) is None


def _write(run_dir, i, lines):
    with open(run_dir / f"replica_{i}.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)


def _sync(inc, t, r, committed=True, healed=False, steps=10, participants=2):
    return {"incarnation": inc, "t": t, "round": r, "rounds": r + committed,
            "committed": committed, "healed": healed, "participants": participants,
            "steps": steps, "position": 0, "sync_s": 0.1, "loss": 1.0}  # fmt: skip


def test_account_counts_committed_contributed_steps(tmp_path):
    # replica 0: four rounds, the third rolled back; replica 1: killed after round 1,
    # restarted (ready at 12, healed in round 3 with 4 own steps, as torchft's DiLoCo does)
    final = {"final": True, "position": 40, "params": "p", "eval_loss": 2.0, "eval_loss_se": 0.1}
    _write(tmp_path, 0, [{"incarnation": 0, "t": 0.0, "event": "ready"},
                         *[_sync(0, 1.0 + r, r, committed=r != 2) for r in range(4)],
                         {**final, "incarnation": 0, "t": 20.0}])  # fmt: skip
    _write(tmp_path, 1, [{"incarnation": 0, "t": 0.0, "event": "ready"}, _sync(0, 1.0, 0),
                         {"incarnation": 1, "t": 12.0, "event": "ready"},
                         _sync(1, 14.0, 3, healed=True, steps=4),
                         {**final, "incarnation": 1, "t": 19.0}])  # fmt: skip
    events = [{"t": 5.0, "event": "kill", "replica": 1, "incarnation": 0},
              {"t": 7.0, "event": "start", "replica": 1, "incarnation": 1}]  # fmt: skip
    out = goodput_report.account(str(tmp_path), 2, events, t_start=0.0)
    # closed form: replica 0's committed rounds (3) x 10, replica 1's one before the kill
    assert out["useful_steps_by_replica"] == {0: 30, 1: 10}
    assert out["useful_steps"] == 40 and out["steps_taken"] == 54
    # the wall clock: from the start to the last sync (replica 1's, at 14; the finals
    # come after the evaluation)
    assert out["wall_s"] == 14.0 and out["goodput"] == 40 / (2 * 14.0)
    assert out["rounds_committed"] == 3 and out["rollbacks"] == 1 and out["kills"] == 1
    (heal,) = out["heals"]
    assert heal["startup_s"] == 5.0 and heal["heal_s"] == 7.0 and heal["rejoin_s"] == 2.0
    assert out["params_agree"] and out["eval_loss"] == 2.0


def test_dense_band_needs_three_seeds():
    run = lambda s, loss: {"method": "dense", "n": 2, "seed": s, "curve": [{"eval_loss": loss}]}
    assert goodput_report.dense_band({"runs": [run(0, 1.7), run(1, 1.8)]})["median"] is None
    band = goodput_report.dense_band({"runs": [run(0, 1.7), run(1, 1.8), run(2, 1.75)]})
    assert band["median"] == 1.75 and band["seeds"] == 3


TINY = ['--model={"dim": 32, "depth": 1, "heads": 2, "max_len": 32}', "--seq_len=32",
        "--batch_size=4", "--test_windows=16"]  # fmt: skip


def _closed_form(run_dir, out, h):
    """Useful steps from the logs, round by round: H x the rounds each replica committed."""
    per = {}
    for i in range(out["replicas"]):
        syncs = [x for x in goodput.goodput_workload.read(run_dir, i) if "committed" in x]
        # a round counts for a replica when it committed there having done the round's H
        # steps itself (not the round it healed in, nor the join)
        per[i] = h * sum(1 for x in syncs if x["committed"] and not x["healed"]
                         and x["steps"] == h)  # fmt: skip
    return per


@pytest.mark.slow
@pytest.mark.parametrize("side", goodput.SIDES)
def test_a_killed_replica_is_restarted_and_heals(tmp_path, side):
    # 3 replicas of a tiny GPT, DiLoCo H=10, 400 inner steps of at least 0.1 s (40 s: time
    # for a restart); the schedule kills one replica 8 s after the start (or the first slot
    # where all have joined) and restarts it 1 s later
    args = goodput.parse([f"--workdir={tmp_path}", "--steps=400", "--step_s=0.1",
                          "--kill_every=8", "--max_kills=1", "--restart_after=1",
                          "--deadline_s=600", "--heartbeat_timeout_ms=1000",
                          "--join_timeout_ms=5000", *TINY])  # fmt: skip
    out = goodput.run(args, side, "diloco", 3, failures=True)
    kills = [e for e in out["events"] if e["event"] == "kill"]
    assert kills, "the schedule killed nobody"
    victim = kills[0]["replica"]
    assert out["codes"][victim][0] == -9
    assert sorted(out["finished"]) == [0, 1, 2]  # the restarted one rejoined and finished
    assert out["params_agree"], out["final_params"]  # healed: bit-equal to its peers
    assert out["position"] == 400
    run_dir = str(tmp_path / f"{side}_diloco_n3_failures")
    assert out["useful_steps_by_replica"] == _closed_form(run_dir, out, 10)
    assert out["useful_steps"] == sum(_closed_form(run_dir, out, 10).values())
    assert out["useful_steps"] < 3 * 400  # the victim lost steps
    assert out["goodput"] == pytest.approx(out["useful_steps"] / (3 * out["wall_s"]), rel=1e-12)
    syncs = [x for i in range(3) for x in goodput.goodput_workload.read(run_dir, i)
             if "committed" in x]  # fmt: skip
    assert out["t_end"] == max(x["t"] for x in syncs)
    # the start: every replica up (torchft: ready; jaxcomm: past its join)
    assert all(x["t"] <= out["t_start"] for x in syncs if x["incarnation"] == 0
               and x["steps"] == 0)  # fmt: skip
    (heal, *_) = out["heals"]
    assert heal["replica"] == victim and heal["heal_s"] is not None and heal["heal_s"] > 0
    for i in set(range(3)) - {e["replica"] for e in kills}:  # survivors: every step useful
        assert out["useful_steps_by_replica"][i] == 400 - 10 * sum(
            not x["committed"]
            for x in goodput.goodput_workload.read(run_dir, i)
            if "committed" in x
        )


@pytest.mark.slow
def test_streaming_with_overlap_survives_a_kill(tmp_path):
    # jaxcomm's Streaming DiLoCo at the study's overlap (delay 1, mix 0.5, as torchft's):
    # 3 replicas, one killed and restarted; every replica finishes on the same global copy
    # (the params differ by each one's mixed-in local fragment)
    args = goodput.parse([f"--workdir={tmp_path}", "--steps=400", "--step_s=0.1",
                          "--kill_every=8", "--max_kills=1", "--restart_after=1",
                          "--deadline_s=600", "--heartbeat_timeout_ms=1000",
                          "--join_timeout_ms=5000", *TINY])  # fmt: skip
    assert goodput.sync_settings(args, "jaxcomm", "streaming") == goodput.sync_settings(
        args, "torchft", "streaming"
    )
    out = goodput.run(args, "jaxcomm", "streaming", 3, failures=True)
    assert out["kills"] == 1 and sorted(out["finished"]) == [0, 1, 2]
    assert out["anchors_agree"] and not out["params_agree"]
    assert set(out["positions"].values()) == {400} and out["useful_steps"] < 3 * 400
    run_dir = str(tmp_path / "jaxcomm_streaming_n3_failures")
    assert out["useful_steps_by_replica"] == _closed_form(run_dir, out, 5)  # H / F steps a round


def test_a_manager_advertises_its_own_address_to_healing_peers():
    # the replicas of a lab share a hostname, which each resolves to itself: torchft's own
    # transport would send a healing peer to its own address (connection refused)
    from datetime import timedelta

    from jaxcomm import elastic, ft_manager

    assert elastic.route_address("localhost") == "127.0.0.1"
    transport = ft_manager._transport("10.211.0.7", timedelta(seconds=5))
    try:
        assert transport.address().startswith("http://10.211.0.7:")
    finally:
        transport.shutdown()


def _lab_reason() -> str | None:
    from experiments.netlab import Lab, LabError

    try:
        Lab.check()
    except LabError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_a_killed_replica_heals_across_a_shaped_link(tmp_path):
    # each replica in its own network namespace of a 100 Mbit/s lab, the lighthouse in one
    # more: the outer all-reduce and the restarted replica's heal cross the shaped links
    reason = _lab_reason()
    if reason is not None:
        pytest.skip(f"netlab unavailable: {reason}")
    # 600 steps of >= 0.1 s: a minute for the restarted replica to start and rejoin
    args = goodput.parse([f"--workdir={tmp_path}", "--steps=600", "--step_s=0.1",
                          "--kill_every=8", "--max_kills=1", "--restart_after=1",
                          "--deadline_s=600", "--heartbeat_timeout_ms=1000",
                          "--join_timeout_ms=5000", "--rate=100mbit", *TINY])  # fmt: skip
    out = goodput.run(args, "jaxcomm", "diloco", 2, failures=True)
    victim = next(e["replica"] for e in out["events"] if e["event"] == "kill")
    assert out["codes"][victim][0] == -9
    assert sorted(out["finished"]) == [0, 1]  # the restarted one rejoined and finished
    assert out["params_agree"], out["final_params"]  # healed from its peer over the lab
    (heal, *_) = out["heals"]
    assert heal["heal_s"] is not None and heal["heal_s"] > 0


def test_ratio_withheld_where_failures_cost_more_than_the_band():
    """The goodput ratio stands only where the run under failures ends within the study's
    band of its own clean run; else the table gives the measured ratio beside the cost."""

    def run(side, kind, goodput, loss):
        return {"side": side, "method": "diloco", "replicas": 2, "goodput": goodput,
                "eval_loss": loss, "heals": [], "kills": 3, "rounds_committed": 200,
                "rollbacks": 0}  # fmt: skip

    results = {
        "config": {
            "kill_every": 120,
            "restart_after": 30,
            "failure_seed": 0,
            "steps": 2000,
            "link": "100mbit",
            "streaming": "no_overlap",
        },
        "runs": {
            "a/clean": run("jaxcomm", "clean", 4.0, 1.90),
            "a/failures": run("jaxcomm", "failures", 3.0, 1.90 * 1.019),
            "b/clean": run("torchft", "clean", 5.0, 1.80),
            "b/failures": run("torchft", "failures", 4.5, 1.80 * 1.021),
        },
    }
    a, b = goodput_report.rows(results)
    assert a["ratio"] == pytest.approx(0.75) and a["loss_cost"] == pytest.approx(0.019)
    assert b["ratio"] is None and b["measured_ratio"] == pytest.approx(0.9)
    table = goodput_report.report(results)
    assert "| 75.0% |" in table and "‡" not in table  # no "cores" in this config
    assert "— (90.0%, but ends 2.1% worse than clean)" in table and "| 90.0% |" not in table
    # as many replicas as cores: the rows are marked, and the note says why
    table = goodput_report.report({**results, "config": {**results["config"], "cores": 2}})
    assert table.count("| 2 ‡ |") == 2
    assert "‡ As many replicas as the machine has cores (2)" in table
    # jaxcomm's goodput over torchft's, clean (4.0 / 5.0) and under failures (3.0 / 4.5)
    assert "- diloco, 2 replicas: clean 0.80×, under failures 0.67×." in table
    assert "inner step alone" not in table
    inner = {
        s: {str(k): {"step_s": t * k, "steps": 10, "calls": 20, "copies": k} for k in (1, 2)}
        for s, t in (("jaxcomm", 0.125), ("torchft", 0.1))
    }
    table = goodput_report.report(
        {**results, "inner_step": inner, "config": {**results["config"], "cores": 2}}
    )
    assert ("alone / 2 at once on the 2 cores, nothing else running): jaxcomm 125 / 250 ms, "
            "torchft 100 / 200 ms") in table  # fmt: skip
    # a side measured alone only: the counts both sides have
    inner["torchft"].pop("2")
    table = goodput_report.report({**results, "inner_step": inner})
    assert "; alone on the ? cores" in table and "jaxcomm 125 ms, torchft 100 ms" in table


@pytest.mark.slow
def test_each_side_s_inner_step_alone_is_timed_as_its_replicas_run_it(tmp_path):
    args = goodput.parse([f"--workdir={tmp_path}", "--inner_calls=3", *TINY])
    inner = goodput.inner_steps(args, [("jaxcomm", 1), ("torchft", 2)])
    assert set(inner) == {"jaxcomm", "torchft"}
    assert set(inner["jaxcomm"]) == {"1"} and set(inner["torchft"]) == {"2"}
    for side in (inner["jaxcomm"]["1"], inner["torchft"]["2"]):  # DiLoCo's H = 10 a call
        assert side["steps"] == 10 and side["calls"] == 3 and 0 < side["step_s"] < 10
    assert inner["torchft"]["2"]["copies"] == 2
