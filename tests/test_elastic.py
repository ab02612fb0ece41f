"""jaxcomm.elastic: DiLoCo replicas over torchft that survive a lost worker.

In-process (threads, torchft's lighthouse in this process): the outer step
against a NumPy reference of DiLoCo's rule (DiLoCo and Streaming DiLoCo), the
healing state's bit-exact round trip. Processes (``-m slow``, through
``experiments/elastic_demo.py``): a replica SIGKILLed between syncs and
restarted, and one killed inside the outer all-reduce.

Skipped without torchft, except where ``JAXCOMM_REQUIRE_TORCHFT`` is set (CI
installs torchft over torch's CPU build and sets it): then a failed import fails.
"""

import io
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

if os.environ.get("JAXCOMM_REQUIRE_TORCHFT"):
    import torchft  # noqa: F401
else:
    pytest.importorskip("torchft", reason='needs torchft: pip install -e ".[ft]"')

import torch  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

import jaxcomm  # noqa: E402
from experiments import elastic_demo  # noqa: E402
from jaxcomm import elastic  # noqa: E402
from jaxcomm.loco.streaming import fragment_of  # noqa: E402

PARAMS = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4), "v": jnp.zeros(5)}


@pytest.fixture
def lighthouse():
    def start(min_replicas):
        server = LighthouseServer(
            bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=5000,
            heartbeat_timeout_ms=2000,
        )  # fmt: skip
        started.append(server)
        return "http://localhost:" + server.address().rsplit(":", 1)[1]

    started = []
    yield start
    for server in started:
        server.shutdown()


def _replicas(address, n, body):
    """Run ``body(i, manager)`` for replicas ``0..n-1``, each in a thread: their results."""
    results, errors = [None] * n, []

    def run(i):
        manager = elastic.gloo_manager(f"replica_{i}", address, min_replicas=n, timeout_s=20)
        try:
            results[i] = body(i, manager)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            manager.shutdown(wait=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a replica hung"
    if errors:
        raise errors[0]
    return results


def _drift(i, r):
    """Replica ``i``'s inner steps of round ``r``: a fixed random move of every leaf."""
    rng = np.random.default_rng(100 * i + r)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in PARAMS.items()}


def _run_rounds(address, *, rounds, fragments=1, n=2):
    def body(i, manager):
        inner = optax.sgd(0.1)
        loop = jaxcomm.ElasticDiLoCo(manager, PARAMS, inner.init(PARAMS), fragments=fragments)
        params, state = loop.join()
        seen = []
        for r in range(rounds):
            local = jax.tree.map(lambda p, d: p + d, params, _drift(i, r))
            anchor = jax.tree.map(np.asarray, loop.anchor)
            params, state, committed = loop.sync(params=local, inner_state=state, steps=3)
            assert committed and loop.participants == n and not loop.healed
            seen.append((jax.tree.map(np.asarray, local), anchor, jax.tree.map(np.asarray, params)))
        return seen, loop.rounds, loop.inner_steps

    return _replicas(address, n, body)


def _nesterov_reference(seen_per_replica, fragments_of_round):
    """NumPy DiLoCo: mean delta over replicas, Nesterov SGD (lr 0.7, momentum 0.9) per leaf."""
    anchor = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
    momentum = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
    params = []
    for r in range(len(seen_per_replica[0])):
        locals_ = [seen[r][0] for seen in seen_per_replica]
        # the leaves not synced this round stay local (each replica its own)
        out = [dict(loc) for loc in locals_]
        for k in fragments_of_round(r):
            g = np.mean([anchor[k] - loc[k] for loc in locals_], axis=0, dtype=np.float32)
            momentum[k] = 0.9 * momentum[k] + g
            anchor[k] = anchor[k] - 0.7 * (g + 0.9 * momentum[k])
            for o in out:
                o[k] = anchor[k]
        params.append(out)
    return params


def test_outer_step_is_diloco_rule(lighthouse):
    # two replicas, two rounds (the second has momentum): each replica's params after the
    # sync equal NumPy's DiLoCo rule on the two replicas' mean pseudo-gradient
    seen = _run_rounds(lighthouse(2), rounds=2)
    ref = _nesterov_reference([s for s, _, _ in seen], lambda r: PARAMS)
    for i, (rounds_seen, rounds, inner_steps) in enumerate(seen):
        assert rounds == 3 and inner_steps == 6  # the join round, then two
        for r, (_, _, after) in enumerate(rounds_seen):
            for k in PARAMS:
                np.testing.assert_allclose(after[k], ref[r][i][k], rtol=1e-6, atol=1e-6)
    for k in PARAMS:  # the replicas agree bit for bit
        np.testing.assert_array_equal(seen[0][0][-1][2][k], seen[1][0][-1][2][k])


def test_streaming_fragments_take_turns(lighthouse):
    # fragments=2: the round after the join (manager step 1) syncs fragment 1, then 0, then 1
    seen = _run_rounds(lighthouse(2), rounds=3, fragments=2)
    owner = fragment_of(PARAMS, 2)
    names = sorted(PARAMS)  # tree order of a dict
    members = [[names[j] for j, f in enumerate(owner) if f == g] for g in range(2)]
    ref = _nesterov_reference([s for s, _, _ in seen], lambda r: members[(r + 1) % 2])
    for i, (rounds_seen, _, _) in enumerate(seen):
        for r, (local, _, after) in enumerate(rounds_seen):
            for k in PARAMS:
                np.testing.assert_allclose(after[k], ref[r][i][k], rtol=1e-6, atol=1e-6)
            for k in members[r % 2]:  # the fragment not synced stays this replica's own
                np.testing.assert_array_equal(after[k], local[k])


@pytest.mark.parametrize("via", ["start_finish", "round"])
def test_streaming_overlap_is_the_papers_rule(lighthouse, via):
    # Streaming DiLoCo with overlap (tau inner steps while the fragment travels, alpha 0.25,
    # not 0.5, so that swapped roles show): the pseudo-gradient is taken at start, the outer
    # step applied at finish, and the fragment becomes (1 - alpha) * new anchor + alpha *
    # the params after the tau steps; ``round`` makes the same calls (3 steps from the
    # round's first position, start, 1 step from the position after them, finish)
    owner = fragment_of(PARAMS, 2)
    names = sorted(PARAMS)
    members = [[names[j] for j, f in enumerate(owner) if f == g] for g in range(2)]

    def body(i, manager):
        loop = jaxcomm.ElasticDiLoCo(manager, PARAMS, (), fragments=2, mix=0.25, delay=1)
        params, _ = loop.join()
        seen = []
        for r in range(3):
            if via == "round":
                calls = []

                def inner(p, s, position, n, r=r, calls=calls):
                    calls.append((position, n))
                    p = jax.tree.map(lambda p, d: p + d, p, _drift(i, r + 10 * (n == 1)))
                    return p, s, p

                params, _, committed, (at_start, at_finish) = loop.round(params, (), inner, steps=4)
                assert calls == [(4 * r, 3), (4 * r + 3, 1)]
            else:
                at_start = jax.tree.map(lambda p, d: p + d, params, _drift(i, r))
                params, _ = loop.start(at_start, (), steps=3)
                at_finish = jax.tree.map(lambda p, d: p + d, params, _drift(i, 10 + r))
                params, _, committed = loop.finish(at_finish, (), steps=1)
            assert committed
            seen.append(jax.tree.map(np.asarray, (at_start, at_finish, params)))
        return seen, loop.inner_steps

    out = _replicas(lighthouse(2), 2, body)
    assert [steps for _, steps in out] == [12, 12]
    anchor = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
    momentum = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
    for r in range(3):
        starts = [seen[r][0] for seen, _ in out]
        for k in members[(r + 1) % 2]:  # the join took manager step 0: fragment 1 first
            g = np.mean([anchor[k] - s[k] for s in starts], axis=0, dtype=np.float32)
            momentum[k] = 0.9 * momentum[k] + g
            anchor[k] = anchor[k] - 0.7 * (g + 0.9 * momentum[k])
        for seen, _ in out:
            _, at_finish, after = seen[r]
            for k in PARAMS:
                want = (0.75 * anchor[k] + 0.25 * at_finish[k]
                        if k in members[(r + 1) % 2] else at_finish[k])  # fmt: skip
                np.testing.assert_allclose(after[k], want, rtol=1e-6, atol=1e-6)


def test_overlap_refuses_out_of_order_calls(lighthouse):
    def body(i, manager):
        with pytest.raises(ValueError, match=r"mix: 1.5 is outside \[0, 1\]"):
            jaxcomm.ElasticDiLoCo(manager, PARAMS, (), mix=1.5)
        loop = jaxcomm.ElasticDiLoCo(manager, PARAMS, (), delay=2)
        with pytest.raises(RuntimeError, match="finish: no round was started"):
            loop.finish(PARAMS, (), steps=2)
        loop.start(PARAMS, (), steps=0)
        with pytest.raises(RuntimeError, match="start: the round started before"):
            loop.start(PARAMS, (), steps=0)
        with pytest.raises(ValueError, match=r"steps: 1 inner steps since start, but delay=2"):
            loop.finish(PARAMS, (), steps=1)
        assert loop.finish(PARAMS, (), steps=2)[2] and loop.committed  # still pending: it ran
        with pytest.raises(ValueError, match=r"steps: 2 in a round, but delay=2"):
            loop.round(PARAMS, (), lambda p, s, position, n: (p, s, None), steps=2)

    _replicas(lighthouse(1), 1, body)


TREE = {
    "f32": np.array([1.5, -0.0, np.inf, np.nan], np.float32),
    "bf16": jnp.asarray([1.0, 2.5, -3.0], jnp.bfloat16),
    "f16": jnp.asarray([[0.1, 65504.0]], jnp.float16),
    "i32": jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
    "u8": jnp.asarray([0, 255], jnp.uint8),
    "bool": jnp.asarray([True, False, True]),
    "scalar": jnp.float32(3.25),
    "empty": jnp.zeros((0, 4)),
    "count": 7,
}


def _bytes(tree):
    arrays = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return [(a.dtype, a.shape, a.tobytes()) for a in arrays]


def _wire(state):
    """Through torch's serialisation, as torchft's HTTP transport sends it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_tree_state_dict_round_trip_bit_exact():
    zeros = {np.ndarray: np.zeros_like, int: lambda x: 0}
    like = jax.tree.map(lambda x: zeros.get(type(x), jnp.zeros_like)(x), TREE)
    back = elastic.load_tree_state_dict(like, _wire(elastic.tree_state_dict(TREE)))
    assert _bytes(back) == _bytes(TREE)
    assert isinstance(back["bf16"], jax.Array) and isinstance(back["f32"], np.ndarray)
    assert back["count"] == 7 and isinstance(back["count"], int)


def test_tree_state_dict_refuses_another_shape_naming_the_leaf():
    state = elastic.tree_state_dict({"a": jnp.zeros(3), "b": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"params: leaf 1 sent as float32\(2,\)"):
        elastic.load_tree_state_dict({"a": jnp.zeros(3), "b": jnp.zeros(4)}, state, "params")
    with pytest.raises(ValueError, match="params: 2 leaves sent, 1 expected"):
        elastic.load_tree_state_dict({"a": jnp.zeros(3)}, state, "params")


def test_loop_state_dict_round_trip_bit_exact(lighthouse):
    # what a healing replica loads: params, inner state, anchor, outer state, counters
    address = lighthouse(1)
    params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.arange(3.0)}
    inner = optax.adamw(1e-2)

    def body(i, manager):
        loop = jaxcomm.ElasticDiLoCo(manager, params, inner.init(params))
        if i == 0:  # a replica some rounds in: every part of its state non-trivial
            p, s = loop.join()
            for r in (1.0, 2.0):
                g = jax.tree.map(lambda x, r=r: jnp.full_like(x, r), p)
                u, s = inner.update(g, s, p)
                p, s, _ = loop.sync(optax.apply_updates(p, u), s, steps=4)
        return loop

    (source,) = _replicas(address, 1, body)
    assert source.rounds == 3
    address2 = lighthouse(1)
    (fresh,) = _replicas(address2, 1, lambda i, m: jaxcomm.ElasticDiLoCo(
        m, jax.tree.map(lambda x: x + 1, params), inner.init(params)))  # fmt: skip
    fresh.load_state_dict(_wire(source.state_dict()))
    for part in ("params", "inner_state", "anchor", "outer_state"):
        assert _bytes(getattr(fresh, part)) == _bytes(getattr(source, part)), part
    assert fresh.inner_steps == source.inner_steps == 8
    assert any(np.any(np.asarray(m) != 0) for m in jax.tree.leaves(source.outer_state))


def test_refusals_name_the_argument(lighthouse):
    def body(i, manager):
        with pytest.raises(TypeError, match="params: leaf 0 has dtype int32"):
            jaxcomm.ElasticDiLoCo(manager, {"n": jnp.zeros(2, jnp.int32)}, ())
        with pytest.raises(ValueError, match="fragments"):
            jaxcomm.ElasticDiLoCo(manager, PARAMS, (), fragments=0)
        loop = jaxcomm.ElasticDiLoCo(manager, PARAMS, ())
        with pytest.raises(ValueError, match="params: structure"):
            loop.sync({"w": PARAMS["w"]}, (), steps=1)
        with pytest.raises(ValueError, match="manager: DiLoCo needs a synchronous quorum"):
            jaxcomm.ElasticDiLoCo(object(), PARAMS, ())

    _replicas(lighthouse(1), 1, body)


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r'pip install "jaxcomm\[ft\]"'):
        elastic.gloo_manager("replica_0", "http://localhost:1")


def _demo(tmp_path, *flags):
    summary = elastic_demo.launch(
        elastic_demo.parse([f"--out={tmp_path}", "--inner_steps=5", "--deadline_s=400", *flags])
    )
    return summary["codes"], summary["replicas"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [["--fragments=1"], ["--fragments=2"], ["--fragments=2", "--delay=2", "--mix=0.5"]],
    ids=["diloco", "streaming", "streaming_overlap"],
)
def test_replica_killed_between_syncs_rejoins_and_heals(tmp_path, flags):
    # replica 2 SIGKILLs itself after its inner steps (between syncs) and is restarted:
    # the others never stop, every one of their syncs commits, the restarted one heals at
    # its join, and the three end bit-equal (with fragments, their anchors: the fragment
    # not synced last stays each replica's own) at the same data position (with overlap the
    # peer serves the heal 2 steps before its round's end: the joiner skips those steps)
    codes, reps = _demo(tmp_path, "--replicas=3", "--rounds=4", "--kill=2@2",
                        "--restart_after=0.5", *flags)  # fmt: skip
    assert codes == {0: [0], 1: [0], 2: [-9, 0]}
    finals = {i: r["final"] for i, r in reps.items()}
    for k in ["rounds", "anchor", "inner_steps"] + (["params"] if flags == ["--fragments=1"]
                                                     else []):  # fmt: skip
        assert len({f[k] for f in finals.values()}) == 1, k
    for i in (0, 1):  # survivors: one incarnation, every sync committed
        assert {s["incarnation"] for s in reps[i]["syncs"]} == {0}
        assert all(s["committed"] for s in reps[i]["syncs"])
        assert any(s["participants"] == 2 for s in reps[i]["syncs"])
    back = [s for s in reps[2]["syncs"] if s["incarnation"] == 1]
    assert back[0]["healed"] and back[0]["participants"] == 3
    at = {s["round"]: s["anchor_after"] for s in reps[0]["syncs"]}
    assert back[0]["anchor_after"] == at[back[0]["round"]]  # joined the survivors' trajectory
    assert reps[2]["syncs"][-1]["participants"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [[], ["--delay=2", "--mix=0.5"]], ids=["sync", "overlap"])
def test_replica_killed_in_allreduce_rolls_the_round_back(tmp_path, overlap):
    # fault injection: replica 2 joins the round's quorum, then SIGKILLs itself on entering
    # the outer all-reduce (it never sends). The survivors' all-reduce fails: that round is
    # rolled back to the anchor (not half-applied), the next commits without replica 2.
    # With overlap the all-reduce is launched in start and fails in finish, 2 steps later.
    codes, reps = _demo(tmp_path, "--replicas=3", "--rounds=4", "--kill=2@2",
                        "--kill_in=allreduce", *overlap)  # fmt: skip
    assert codes == {0: [0], 1: [0], 2: [-9]}
    assert reps[2]["final"] is None
    # the survivors share the anchor; with mix > 0 their params hold their own local part
    assert reps[0]["final"]["anchor"] == reps[1]["final"]["anchor"]
    assert (reps[0]["final"]["params"] == reps[1]["final"]["params"]) == (not overlap)
    lost = {}
    for i in (0, 1):
        syncs = reps[i]["syncs"]
        failed = [j for j, s in enumerate(syncs) if not s["committed"]]
        assert failed, f"replica {i}: no round rolled back"
        j = failed[0]
        lost[i], after = syncs[j], syncs[j + 1]
        assert lost[i]["participants"] == 3  # replica 2 was in the round's quorum
        assert lost[i]["params_after"] == lost[i]["anchor_after"]  # back to the anchor
        # the anchor untouched by the failed round (a replica healing in it took a peer's)
        assert lost[i]["anchor_after"] == lost[i]["anchor_before"] or lost[i]["healed"]
        assert after["committed"] and after["participants"] == 2
        assert after["anchor_before"] == lost[i]["anchor_after"]
    assert lost[0]["params_after"] == lost[1]["params_after"]
    assert not (lost[0]["healed"] and lost[1]["healed"])
