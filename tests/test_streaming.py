"""Streaming DiLoCo (jaxcomm.loco.streaming) against a plain NumPy reference.

The reference runs N workers with inner SGD on per-worker quadratics, the
fragments' staggered schedule, the outer Nesterov step per fragment, the
delayed merge and the mix; the transform runs under ``jax.shard_map`` on 8
devices with the real collectives (tests/test_sync.py's harness).
"""

import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm.loco.streaming import fragment_of, streaming_diloco
from tests.test_sync import (
    LR,
    PARAMS,
    N,
    assert_close,
    exchanges,  # noqa: F401 (a fixture)
    np_problem,
    run,
)

AX = "data"
KEYS = ["b", "w"]  # tree order of PARAMS' leaves: fragment_of gives b -> 0, w -> 1


def np_streaming(steps, every, fragments, delay=0, mix=0.0, lr=LR, outer_lr=0.7, mu=0.9,
                 quantize=None):  # fmt: skip
    """Per-step per-worker params of Streaming DiLoCo with inner SGD and outer Nesterov SGD."""
    w0, a, b = np_problem()
    w = {k: np.broadcast_to(v, (N,) + v.shape).copy() for k, v in w0.items()}
    anchor = {k: v.copy() for k, v in w0.items()}
    mom = {k: np.zeros_like(v) for k, v in w0.items()}
    frag = dict(zip(KEYS, fragment_of(PARAMS, fragments)))
    offset = lambda f: ((f + 1) * every // fragments) % every
    out = []
    for t in range(steps):
        s = t + 1
        for k in w:
            w[k] = w[k] - lr * (a[k] * w[k] - b[k])
        for k in KEYS:
            f = frag[k]
            if s % every == offset(f):
                delta = anchor[k] - w[k].mean(0)
                mom[k] = delta + mu * mom[k]
                anchor[k] = anchor[k] - outer_lr * (delta + mu * mom[k])
            if s - delay >= 1 and (s - delay) % every == offset(f):
                w[k] = mix * w[k] + (1 - mix) * anchor[k][None]
        out.append({k: v.copy() for k, v in w.items()})
    return out


def test_fragments_split_leaves_by_size_and_none_is_empty():
    import jax.numpy as jnp

    tree = [jnp.zeros(s) for s in (10, 10, 10, 10, 1000, 1, 1)]
    assert fragment_of(tree, 1) == [0] * 7
    assert fragment_of(tree, 2) == [0, 0, 0, 0, 1, 1, 1]  # the big leaf's middle: 2nd half
    assert fragment_of(tree, 4) == [0, 0, 0, 1, 2, 3, 3]  # fragment 1 took leaf 3: none empty
    assert fragment_of([jnp.zeros(5)] * 6, 3) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="fragments: 3 fragments need at least"):
        fragment_of([jnp.zeros(4)] * 2, 3)


@pytest.mark.parametrize(
    "every,fragments,delay,mix",
    [(4, 2, 0, 0.0), (4, 2, 1, 0.0), (6, 2, 2, 0.5), (4, 1, 0, 0.0)],
)
def test_equals_numpy_reference_on_8_devices(every, fragments, delay, mix):
    tx = streaming_diloco(
        optax.sgd(LR), every=every, fragments=fragments, delay=delay, mix=mix, axis_name=AX
    )
    hist, state = run(tx, 3 * every + 1)
    ref = np_streaming(3 * every + 1, every, fragments, delay, mix)
    for t, want in enumerate(ref):
        assert_close(hist["params"][t + 1], want, rtol=2e-5, atol=2e-5)
    assert int(np.asarray(state.syncs)[0]) == sum(
        1 for s in range(1, 3 * every + 2) for f in range(fragments)
        if s % every == ((f + 1) * every // fragments) % every
    )  # fmt: skip


def test_one_fragment_no_delay_is_diloco():
    kw = dict(every=3, axis_name=AX)
    a, _ = run(streaming_diloco(optax.adam(0.05), fragments=1, **kw), 10)
    b, _ = run(jaxcomm.diloco(optax.adam(0.05), **kw), 10)
    for x, y in zip(a["params"], b["params"]):
        assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_fragments_sync_at_their_own_steps(exchanges):  # noqa: F811
    # every=4, 2 fragments: fragment 0 (b) at steps 2, 6, 10; fragment 1 (w) at 4, 8, 12
    tx = streaming_diloco(optax.sgd(LR), every=4, fragments=2, axis_name=AX)
    run(tx, 12, on_step=exchanges.on_step)
    assert exchanges.steps() == [1, 3, 5, 7, 9, 11]  # 0-based steps: s = 2, 4, ..., 12


def test_compressor_path_with_a_dense_compressor_equals_the_reference():
    comp = jaxcomm.allreduce(axis_name=AX)
    tx = streaming_diloco(optax.sgd(LR), every=4, fragments=2, delay=1, axis_name=AX,
                          compressor=comp)  # fmt: skip
    hist, _ = run(tx, 13)
    for t, want in enumerate(np_streaming(13, 4, 2, delay=1)):
        assert_close(hist["params"][t + 1], want, rtol=2e-5, atol=2e-5)


def test_quantised_outer_gradient_with_error_feedback_on_8_devices():
    comp = jaxcomm.int8(
        axis_name=AX, min_size=0, error_feedback=True, exchange="two_phase", stochastic=False
    )
    tx = streaming_diloco(optax.sgd(LR), every=4, fragments=2, axis_name=AX, compressor=comp)
    hist, state = run(tx, 13)
    ref = np_streaming(13, 4, 2)
    # int8 codes: close to the fp32 reference, not equal; the residual carries what was lost
    for t, want in enumerate(ref):
        assert_close(hist["params"][t + 1], want, rtol=0.05, atol=0.05)
    assert max(abs(hist["params"][-1][k] - ref[-1][k]).max() for k in KEYS) > 1e-6
    residuals = [np.abs(np.asarray(x)).max() for x in jax_leaves(state.compressor_state)]
    assert max(residuals) > 0


def jax_leaves(tree):
    import jax

    return [x for x in jax.tree.leaves(tree) if np.issubdtype(np.asarray(x).dtype, np.floating)]


def test_bad_arguments_name_the_argument():
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match="fragments: must divide every=6"):
        streaming_diloco(sgd, every=6, fragments=4, axis_name=None)
    with pytest.raises(ValueError, match=r"delay: must be in \[0, every/fragments\)"):
        streaming_diloco(sgd, every=6, fragments=2, delay=3, axis_name=None)
    with pytest.raises(ValueError, match=r"mix: expected a float in \[0, 1\], got 1.5"):
        streaming_diloco(sgd, every=6, fragments=2, mix=1.5, axis_name=None)
    with pytest.raises(ValueError, match="every"):
        streaming_diloco(sgd, every=0, fragments=1, axis_name=None)
    tx = streaming_diloco(sgd, every=2, fragments=1, axis_name=None)
    with pytest.raises(ValueError, match="params"):
        tx.update(PARAMS, tx.init(PARAMS))


def test_each_sync_moves_one_fragment_and_all_fragments_move_the_model():
    import jax.numpy as jnp

    params = {f"l{i}": jnp.zeros((256, 64)) for i in range(4)}
    full = sum(x.size * 4 for x in params.values())
    report = jaxcomm.accounting.wire_report(
        streaming_diloco(optax.sgd(0.1), every=8, fragments=4, axis_name=AX), params, N
    )
    # one all-reduce per fragment (each in the branch of its own sync step)
    assert sorted(c.nbytes for c in report) == [full // 4] * 4
    dense = jaxcomm.accounting.wire_report(
        jaxcomm.diloco(optax.sgd(0.1), every=8, axis_name=AX), params, N
    )
    assert sum(c.nbytes for c in dense) == full


@pytest.mark.parametrize("delay,compressed", [(1, False), (2, True)])
def test_exchange_in_a_host_thread_equals_the_exchange_in_the_step(delay, compressed):
    from jaxcomm.loco import Overlap, StreamingDiLoCo
    from tests import helpers as H
    from tests.test_sync import place, problem, shard_map_step

    comp = jaxcomm.int8(axis_name=AX, min_size=0, error_feedback=True, stochastic=False)
    rule = StreamingDiLoCo(optax.adam(0.05), every=6, fragments=2, delay=delay, axis_name=AX,
                           compressor=comp if compressed else None)  # fmt: skip
    want, _ = run(rule.transform(), 20)

    w0, a, b = problem()
    tx = rule.transform(overlap=True)
    p, s = place(H.stack(w0)), place(H.stack(tx.init(w0)))
    a, b = place(a), place(b)
    fn, ov = shard_map_step(tx), Overlap(rule, H.mesh())
    ov.warm_up(p, s)  # runs each fragment's exchange once, discarding it: changes nothing
    started = []
    for t in range(20):
        p, s, _ = ov.step(fn, p, s, a, b)
        started.append(ov.in_flight)
        if t == 11:  # fragment 1 sent at step 12 is in flight: joined early, then not again
            assert ov.in_flight == [1]
            s = ov.drain(s)
        np.testing.assert_array_equal(
            H.np_tree(p)["w"], want["params"][t + 1]["w"], err_msg=f"step {t + 1}"
        )
        np.testing.assert_array_equal(H.np_tree(p)["b"], want["params"][t + 1]["b"])
    # fragment 0 sends at s = 3, 9, 15; fragment 1 at 6, 12, 18: in flight for `delay` steps
    assert started[2] == [0] and started[5] == [1] and started[2 + delay] == []
    assert started[11] == [1] and started[12] == []  # drained after step 12
    s = ov.drain(s)
    assert ov.in_flight == []
    with pytest.raises(ValueError, match="delay: overlap=True needs delay >= 1"):
        StreamingDiLoCo(optax.sgd(0.1), every=4, fragments=2, axis_name=AX).transform(overlap=True)
