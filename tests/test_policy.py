"""Tests for jaxcomm.policy: the measured choice, its guards, the warm-up and the transform.

The choice is tested with candidates whose cost is known by construction: one
that sends nothing (cheaper than any exchange), one that is dense plus
deliberate extra work (dearer than dense). On 8 CPU devices the measured
costs must order them so.
"""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import calibrate, netsim, policy
from jaxcomm.policy import Candidate
from tests import helpers

PARAMS = {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))}
DENSE = Candidate("dense", lambda ax: jaxcomm.allreduce(axis_name=ax))
LOCAL = Candidate("local", lambda ax: optax.identity())  # no exchange at all


def _burn(rounds: int) -> optax.GradientTransformation:
    """Costs ``rounds`` dependent passes over every leaf, returns the updates unchanged."""

    def update(u, state, params=None):
        def body(_, x):
            return jnp.sin(x) * 0.5 + x * 0.5

        extra = [jax.lax.fori_loop(0, rounds, body, x) for x in jax.tree.leaves(u)]
        keep = sum(jnp.sum(e) for e in extra) * 0  # depends on the work; adds nothing
        return jax.tree.map(lambda x: x + keep, u), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


SLOW = Candidate("slow", lambda ax: optax.chain(jaxcomm.allreduce(axis_name=ax), _burn(100)))


@pytest.fixture(autouse=True)
def fresh_cache():
    policy.clear_cache()
    yield
    policy.clear_cache()


def test_measure_times_every_candidate_and_caches():
    costs = policy.measure(PARAMS, helpers.mesh(), "data", candidates=(DENSE, SLOW, LOCAL),
                           repeats=2)  # fmt: skip
    assert sorted(costs) == ["dense", "local", "slow"]
    assert all(math.isfinite(t) and t >= 0 for t in costs.values())
    again = policy.measure(PARAMS, helpers.mesh(), "data", candidates=(DENSE, SLOW, LOCAL),
                           repeats=2)  # fmt: skip
    assert again == costs  # cached: not measured again


def test_the_choice_follows_the_costs():
    mesh = helpers.mesh()
    cands = (DENSE, SLOW, LOCAL)
    choice = policy.choose(PARAMS, mesh, "data", candidates=cands,
                           costs={"dense": 3e-3, "slow": 9e-3, "local": 1e-4})  # fmt: skip
    assert choice.name == "local" and choice.reason.startswith("30.0x less")
    assert choice.row("dense").wire_bytes == 4 * (256 * 256 + 256)
    assert choice.row("local").wire_bytes == 0 and choice.row("local").ratio == math.inf
    assert "chosen" in choice.table().splitlines()[4]
    choice = policy.choose(PARAMS, mesh, "data", candidates=cands,
                           costs={"dense": 3e-3, "slow": 2e-3, "local": 2.9e-3})  # fmt: skip
    assert choice.name == "slow"
    with pytest.raises(ValueError, match=r"costs: no seconds for candidates \['local'\]"):
        policy.choose(PARAMS, mesh, "data", candidates=cands, costs={"dense": 1, "slow": 1})


def test_dense_wins_when_no_compressed_candidate_beats_it_by_the_margin():
    choice = policy.choose(PARAMS, helpers.mesh(), "data", candidates=(DENSE, SLOW),
                           costs={"dense": 3e-3, "slow": 2.8e-3})  # fmt: skip
    assert choice.name == "dense"
    assert choice.reason == "the fastest compressed candidate, slow, is not 10% faster than dense"


def _row(name, seconds, excluded=""):
    return policy.Row(name, seconds, 1, 1.0, math.nan, excluded)


def test_decide_takes_the_cheapest_eligible_only_past_the_margin():
    rows = [_row("dense", 10.0), _row("a", 8.0), _row("b", 9.5), _row("c", 1.0, "capped")]
    assert policy.decide(rows, 0.1)[0] == "a"  # 8 <= 0.9 * 10; c is excluded
    assert policy.decide(rows, 0.25)[0] == "dense"  # 8 > 0.75 * 10
    assert policy.decide(rows, 0.2)[0] == "a"  # the bound is inclusive
    assert policy.decide([_row("dense", 1.0), _row("a", 0.1, "x")], 0.0)[0] == "dense"
    assert policy.decide([_row("dense", 1.0), _row("a", 1.0)], 0.0)[0] == "a"


def test_max_ratio_excludes_a_candidate_that_compresses_too_much():
    choice = policy.choose(PARAMS, helpers.mesh(), "data", candidates=(DENSE, LOCAL),
                           max_ratio=10.0, costs={"dense": 1.0, "local": 0.0})  # fmt: skip
    assert choice.name == "dense"
    assert choice.row("local").excluded.startswith("compresses inf")
    assert choice.row("dense").excluded == ""


def test_the_prediction_is_the_calibrated_alpha_beta_time_of_the_wire_report():
    link = netsim.Link.from_gbps(1.0, latency_s=50e-6)
    cal = calibrate.Calibration(calibrate.KindLinks.uniform(link), 8, "data", ())
    costs = {"dense": 1.0, "local": 0.0}
    choice = policy.choose(PARAMS, helpers.mesh(), "data", candidates=(DENSE, LOCAL),
                           calibration=cal, costs=costs)  # fmt: skip
    s = 4 * (256 * 256 + 256)  # one fused bucket of fp32
    ring = 2 * 7 * 50e-6 + 2 * 7 / 8 * s / 1.25e8  # 2(n-1)α + 2(n-1)/n·S/B
    assert choice.row("dense").predicted_s == pytest.approx(ring, rel=1e-9)
    assert choice.row("local").predicted_s == 0.0
    plain = policy.choose(PARAMS, helpers.mesh(), "data", candidates=(DENSE, LOCAL), costs=costs)
    assert math.isnan(plain.row("dense").predicted_s)


def test_auto_returns_the_chosen_transform_with_its_updates():
    params = {"w": jnp.zeros((64, 64))}
    g = helpers.per_worker_grads(params, seed=3)
    cands, costs = (DENSE, LOCAL), {"dense": 1.0, "local": 2.0}
    tx = policy.auto(params, helpers.mesh(), "data", candidates=cands, costs=costs, log=None)
    u, _ = helpers.shard_map_update(tx, g, helpers.stack(tx.init(params)))
    np.testing.assert_allclose(u["w"], np.mean(np.asarray(g["w"]), axis=0), rtol=1e-6, atol=1e-7)
    costs = {"dense": 1.0, "local": 0.5}
    tx = policy.auto(params, helpers.mesh(), "data", candidates=cands, costs=costs, log=None)
    u, _ = jax.vmap(tx.update)(g, helpers.stack(tx.init(params)))  # identity: no axis needed
    np.testing.assert_array_equal(u["w"], g["w"])  # each worker's own gradient: nothing sent


def test_auto_logs_the_table():
    seen = []
    policy.auto(PARAMS, helpers.mesh(), "data", candidates=(DENSE, LOCAL), log=seen.append,
                costs={"dense": 1.0, "local": 0.0})  # fmt: skip
    assert len(seen) == 1 and seen[0].startswith("exchange policy over 8 workers: local")


def test_dense_warmup_averages_first_then_runs_the_chosen_transform_from_fresh_state():
    params = {"w": jnp.zeros((48, 40))}
    chosen = jaxcomm.topk(0.05, axis_name="data", min_size=0)  # error feedback on
    tx = policy.dense_warmup(chosen, 2, "data")
    state = helpers.stack(tx.init(params))
    ref_state = helpers.stack(chosen.init(params))
    for step in range(4):
        g = helpers.per_worker_grads(params, seed=10 + step)
        u, state = helpers.shard_map_update(tx, g, state)
        if step < 2:
            np.testing.assert_allclose(u["w"], np.mean(np.asarray(g["w"]), 0), rtol=1e-6,
                                       atol=1e-7)  # fmt: skip
        else:  # top-k from its initial state: the residual did not fill during warm-up
            ref, ref_state = helpers.shard_map_update(chosen, g, ref_state)
            np.testing.assert_array_equal(u["w"], ref["w"])
    assert np.asarray(state.count).tolist() == [4] * 8
    assert policy.dense_warmup(chosen, 0, "data") is chosen


def test_drifted_compares_the_measured_step_with_compute_plus_the_chosen_cost():
    rows = (policy.Row("dense", 0.010, 4, 1.0, math.nan, ""),)
    choice = policy.Choice("dense", rows, 2, "")
    assert not choice.drifted(0.035, compute_s=0.020)  # predicted 0.030: +17%
    assert choice.drifted(0.037, compute_s=0.020)  # +23%
    assert choice.drifted(0.023, compute_s=0.020)  # -23%
    assert not choice.drifted(0.037, compute_s=0.020, tolerance=0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"margin": 1.0}, r"margin: expected a .*float in \[0, 1\), got 1.0"),
        ({"margin": -0.1}, r"margin: expected a .*float in \[0, 1\), got -0.1"),
        ({"max_ratio": 0.5}, r"max_ratio: expected a .*float >= 1"),
        ({"repeats": 0}, r"repeats: expected an int >= 1"),
        ({"candidates": (LOCAL,)}, r"candidates: must include one named 'dense'"),
        ({"candidates": (DENSE, DENSE)}, r"candidates: names must be unique"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy.choose(PARAMS, helpers.mesh(), "data", **kwargs)


def test_bad_axis_and_warmup_name_themselves():
    with pytest.raises(ValueError, match="axis_name: 'model' is not an axis of the mesh"):
        policy.choose(PARAMS, helpers.mesh(), "model")
    with pytest.raises(TypeError, match="candidates: expected a non-empty sequence"):
        policy.choose(PARAMS, helpers.mesh(), "data", candidates=("dense",))
    with pytest.raises(ValueError, match="warmup_steps: expected an int >= 0, got -1"):
        policy.dense_warmup(optax.identity(), -1, "data")


def test_the_default_candidates_run_and_dense_is_among_them():
    choice = policy.choose(PARAMS, helpers.mesh(), "data", repeats=1)
    names = [r.name for r in choice.rows]
    assert names == [c.name for c in policy.DEFAULT_CANDIDATES] and "dense" in names
    assert choice.name in names
    # the compressed candidates put fewer bytes on the wire than dense
    assert all(r.ratio > 1.5 for r in choice.rows if r.name != "dense")


class _Clock:
    """The seconds policy's timer reads: they pass only while a stand-in program runs, so
    the calls per sample and the times are exact on any machine (with real sleeps, a
    0.02 s call took > 0.025 s on a busy CPU and the sample held 2 calls, not 3)."""

    now = 0.0


@pytest.fixture
def fake_clock(monkeypatch):
    _Clock.now = 0.0
    clock = types.SimpleNamespace(perf_counter=lambda: _Clock.now)
    monkeypatch.setattr(policy.timing, "time", clock)  # the module that times programs


class _Sleeper:
    """A stand-in program: ``s`` seconds of the fake clock per call; counts its calls."""

    def __init__(self, s):
        self.s, self.calls = s, 0

    def __call__(self, arg):
        self.calls += 1
        _Clock.now += self.s
        return self

    def block_until_ready(self):
        return self


def test_a_candidate_far_slower_than_the_fastest_leaves_after_one_round(fake_clock):
    base, fast, mid, slow = _Sleeper(0.0), _Sleeper(0.02), _Sleeper(0.03), _Sleeper(0.3)
    best = policy.time_programs([(p, None) for p in (base, fast, mid, slow)], 4)
    # one call to size the samples, then samples of >= SAMPLE_S (0.05 s): 3 calls of 0.02 s,
    # 2 of 0.03 s, 1 of 0.3 s, each after an untimed lead-in call (a call < LEAD_IN_S); the
    # slow one is sampled in round 1 only
    assert [p.calls for p in (fast, mid, slow)] == [1 + 4 * (1 + 3), 1 + 4 * (1 + 2), 1 + 2]
    assert best == pytest.approx([0.0, 0.02, 0.03, 0.3])
    slow.calls, settled = 0, []
    policy.time_programs([(p, None) for p in (base, fast, slow)], 4, drop=False,
                         settle=lambda: settled.append(1))  # fmt: skip
    assert slow.calls == 1 + 4 * 2
    assert len(settled) == 3 * 4  # after every sample: the link drains before the next
    # a call of LEAD_IN_S or more has no lead-in
    long = _Sleeper(policy.LEAD_IN_S)
    policy.time_programs([(base, None), (long, None)], 2, drop=False)
    assert long.calls == 1 + 2


class _Varying:
    """A program whose calls sleep the seconds of ``schedule`` in turn."""

    def __init__(self, schedule):
        self.schedule, self.calls = schedule, 0

    def __call__(self, arg):
        _Clock.now += self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        return self

    def block_until_ready(self):
        return self


def test_time_programs_sums_up_samples_by_the_least_or_the_median(fake_clock):
    # the sizing call sleeps 0.06 s (> SAMPLE_S: one call a sample); each sample follows an
    # untimed lead-in call (0.01 s); the samples are 0.20, 0.10 and 0.06 s: their least is
    # 0.06, their median 0.10
    def times(statistic):
        progs = [(_Sleeper(0.0), None), (_Varying([0.06, 0.01, 0.2, 0.01, 0.1, 0.01, 0.06]), None)]
        return policy.time_programs(progs, 3, drop=False, statistic=statistic)[1]

    least, median = times("min"), times("median")
    assert least == pytest.approx(0.06) and median == pytest.approx(0.1)
    with pytest.raises(ValueError, match="statistic: 'mean' is not one of"):
        policy.time_programs([(_Sleeper(0.0), None)], 1, statistic="mean")


def test_measured_program_runs_a_steady_state_step():
    """A candidate is timed in training's steady state: its program carries the state
    from call to call (after WARM_STEPS untimed steps from init), so top-k's residual
    holds what the earlier draws did not send, as a NumPy top-k with error feedback
    over the same draws says, and the step counter has counted every call."""
    mesh = jax.make_mesh((8,), ("data",))
    params = {"w": jnp.zeros((64, 32))}
    tx = jaxcomm.topk(0.05, axis_name="data", min_size=0)
    call, key = policy.timing.program(mesh, "data", params, tx)
    for _ in range(2):
        call(key).block_until_ready()
    steps = policy.WARM_STEPS + 2
    np.testing.assert_array_equal(np.asarray(call.state.count), np.full(8, steps))
    # every call draws the same per-worker gradient (the key is fixed): the residual of
    # `steps` top-k steps with error feedback on that gradient
    g = np.stack([
        np.asarray(jax.random.normal(jax.random.split(jax.random.fold_in(key, w), 1)[0],
                                     (64, 32))).reshape(-1)
        for w in range(8)
    ])  # fmt: skip
    k = math.ceil(0.05 * g.shape[1])
    res = np.zeros_like(g)
    for _ in range(steps):
        p = g + res
        idx = np.argsort(-np.abs(p), axis=1, kind="stable")[:, :k]
        res = p.copy()
        np.put_along_axis(res, idx, 0.0, axis=1)
    got = np.asarray(call.state.residual["w"]).reshape(8, -1)
    np.testing.assert_allclose(got, res, rtol=1e-5, atol=1e-5)


class _Logger:
    """A stand-in program that appends its name to a shared log at each call."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, arg):
        self.log.append(self.name)
        return self

    def block_until_ready(self):
        return self


def _orders(seed):
    log = []
    progs = [(_Logger(i, log), None) for i in range(4)]
    # settle() runs after each sample: the program called just before it was the one sampled
    samples = policy.time_samples(progs, 6, drop=False, seed=seed,
                                  settle=lambda: log.append("|"))  # fmt: skip
    assert [len(s) for s in samples] == [6] * 4
    sampled = [log[i - 1] for i, x in enumerate(log) if x == "|"]
    return [tuple(sampled[k:k + 4]) for k in range(0, len(sampled), 4)]  # fmt: skip


def test_time_samples_draws_a_fresh_order_each_round_the_same_for_a_seed():
    orders = _orders(0)
    assert len(orders) == 6 and all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert len(set(orders)) > 1  # not one fixed order
    assert orders == _orders(0)  # every process draws the same orders
    assert orders != _orders(1)


def test_a_dropped_program_has_nan_in_the_rounds_after(fake_clock):
    base, fast, slow = _Sleeper(0.0), _Sleeper(0.02), _Sleeper(0.3)
    samples = policy.time_samples([(p, None) for p in (base, fast, slow)], 3)
    assert not math.isnan(samples[2][0]) and all(math.isnan(x) for x in samples[2][1:])
    assert not any(math.isnan(x) for x in samples[1])


def test_wins_over_dense_counts_the_rounds_a_candidate_beat_dense_by_the_margin():
    nan = math.nan
    rounds = {
        "dense": [1.0, 1.0, 1.0, 1.0, nan],
        "a": [0.5, 0.95, 0.9, 0.2, 0.1],  # 0.95 > 0.9 * 1.0; the last round has no dense
        "b": [2.0, 2.0, nan, nan, nan],
    }
    wins = policy.wins_over_dense(rounds, 0.1)
    assert wins["a"] == 3 / 4 and wins["b"] == 0.0 and math.isnan(wins["dense"])
    assert policy.wins_over_dense(rounds, 0.0)["a"] == 1.0


def test_decide_needs_the_wins_in_enough_rounds():
    def row(name, seconds, wins):
        return policy.Row(name, seconds, 1, 1.0, math.nan, "", wins)

    lucky, steady = row("lucky", 0.2, 0.6), row("steady", 0.5, 1.0)
    # the least cost came from a few lucky rounds: the steady one is chosen
    assert policy.decide([row("dense", 1.0, math.nan), lucky, steady], 0.1)[0] == "steady"
    name, reason = policy.decide([row("dense", 1.0, math.nan), lucky], 0.1)
    assert name == "dense" and "in 60% of the rounds, fewer than 80%" in reason
    assert policy.decide([row("dense", 1.0, math.nan), lucky], 0.1, min_wins=0.6)[0] == "lucky"
    with pytest.raises(ValueError, match="min_wins"):
        policy.decide([row("dense", 1.0, math.nan)], 0.1, min_wins=1.5)


def test_choose_reads_the_rounds_of_its_measurement():
    mesh = helpers.mesh()
    cands = (DENSE, SLOW, LOCAL)
    costs = policy.measure(PARAMS, mesh, "data", candidates=cands, repeats=5)
    rounds = policy.measure(PARAMS, mesh, "data", candidates=cands, repeats=5, rounds=True)
    assert sorted(rounds) == sorted(costs) and all(len(r) == 5 for r in rounds.values())
    # the same (cached) samples: min_r (s_r - b_r) <= min s - min b, for every candidate
    for name in costs:
        assert min(x for x in rounds[name] if x == x) <= costs[name] + 1e-12
    # dense stays in play every round (slow may leave)
    assert not any(math.isnan(x) for x in rounds["dense"])
    choice = policy.choose(PARAMS, mesh, "data", candidates=cands, repeats=5)
    wins = policy.wins_over_dense(rounds, 0.1)
    assert choice.row("local").wins == wins["local"] and choice.row("slow").wins == wins["slow"]
    # the choice is decide's on those rows; which candidate wins them is the machine's
    # (the no-exchange candidate lost to dense in a loaded full-suite run)
    assert (choice.name, choice.reason) == policy.decide(choice.rows, 0.1)
    assert "wins" in choice.table().splitlines()[1]


def test_kept_programs_stay_in_play(fake_clock):
    base, fast, slow = _Sleeper(0.0), _Sleeper(0.02), _Sleeper(0.3)
    samples = policy.time_samples([(p, None) for p in (base, fast, slow)], 3, keep=(0, 2))
    assert not any(math.isnan(x) for x in samples[2])


def test_dense_costing_nothing_is_beaten_by_nothing():
    wins = policy.wins_over_dense({"dense": [0.0, 1.0], "a": [0.0, 0.5]}, 0.1)
    assert wins["a"] == 0.5  # the round where dense cost 0 is lost
    rows = [
        policy.Row("dense", 0.0, 1, 1.0, math.nan, ""),
        policy.Row("a", 0.0, 1, 1.0, math.nan, ""),
    ]
    assert policy.decide(rows, 0.0)[0] == "dense"
    with pytest.raises(ValueError, match="rounds: no rounds of 'dense'"):
        policy.wins_over_dense({"a": [1.0]}, 0.1)


def test_choose_with_rounds_checks_them():
    mesh = helpers.mesh()
    cands = (DENSE, LOCAL)
    costs = {"dense": 1.0, "local": 0.0}
    with pytest.raises(ValueError, match="rounds: give them with the costs"):
        policy.choose(PARAMS, mesh, "data", candidates=cands, rounds={"dense": [1.0]})
    # local never compared with dense: not sure, dense stays
    choice = policy.choose(PARAMS, mesh, "data", candidates=cands, costs=costs,
                           rounds={"dense": [1.0, 1.0]})  # fmt: skip
    assert choice.name == "dense" and choice.row("local").wins == 0.0
    choice = policy.choose(PARAMS, mesh, "data", candidates=cands, costs=costs,
                           rounds={"dense": [1.0, 1.0], "local": [0.0, 0.0]})  # fmt: skip
    assert choice.name == "local" and choice.rounds["local"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="min_wins"):
        policy.choose(PARAMS, mesh, "data", candidates=cands, costs=costs, min_wins=-0.1)
