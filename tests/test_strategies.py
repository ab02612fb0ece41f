"""Exchange strategies as objects (jaxcomm.strategies): a new one written by the module's
recipe runs in a transform on 8 workers through the real collectives, equals a NumPy
reference, and its traffic model and the ledger equal the compiled program's bytes; core
dispatches through the table, and the strategies own their validation."""

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm import accounting, buckets, collectives, stages, strategies
from jaxcomm.compressors import dense, quantize, sparse
from jaxcomm.ledger import Collective
from tests import helpers as H


@dataclasses.dataclass(frozen=True)
class DecodedSum(strategies.Strategy):
    """Every worker decodes its own payload; one all-reduce sums the decoded vectors.

    The dense leaves and the NaN rule's flag (one entry) ride in the same
    bucketed all-reduce. Traffic: ``2(n-1)/n·d·itemsize`` per vector.
    """

    name: ClassVar[str] = "decoded_sum"
    kinds: ClassVar[tuple[str, ...]] = ("all_gather",)

    def traffic(self, compressor, vectors, n):
        sent = [
            Collective("all_reduce", None, d * collectives.moved_itemsize(t), "", (d,))
            for d, t in vectors
        ]
        return accounting.traffic_bytes(sent, n)

    def run(self, compressor, step, state, config):
        encoded, ok = stages.encode(compressor, step, config)
        n = collectives.axis_size(config.axis_name)
        own = [
            compressor.decode(tuple(x[None] for x in payload), aux, v.shape[0], v.dtype)
            for v, (payload, aux) in zip(step.vecs, encoded)
        ]
        dense_ids = sorted(step.dense)
        flag = (~ok).astype(jnp.float32)[None]
        arrays = own + [step.grads[i] for i in dense_ids] + [flag]
        sums = buckets.bucketed_psum(arrays, config.axis_name, config.bucket_bytes)
        ok = sums[-1][0] == 0
        outputs = [None] * len(step.grads)
        for i, x in zip(dense_ids, sums[len(own) : -1]):
            outputs[i] = x / jnp.asarray(n, x.dtype)
        for gi, group in enumerate(step.groups):
            mean = sums[gi] / jnp.asarray(n, sums[gi].dtype)
            stages.put_mean(compressor, step, group, mean, ok, outputs)
        return outputs, stages.memory(compressor, step, state, encoded, ok, config)


PARAMS = {"w": jnp.zeros((48, 40)), "v": jnp.zeros((1500,)), "b": jnp.zeros((10,))}
RATIO, MIN_SIZE = 0.05, 1024


def _topk(p):
    """NumPy top-k of one worker's flat ``g + e``: (sent, residual)."""
    k = max(1, math.ceil(RATIO * p.size))
    keep = np.argsort(-np.abs(p), kind="stable")[:k]
    sent = np.zeros_like(p)
    sent[keep] = p[keep]
    return sent, p - sent


def _tx(strategy=None):
    return jaxcomm.compress(
        sparse.TopK(RATIO), axis_name=H.AXIS, min_size=MIN_SIZE, exchange=strategy or DecodedSum()
    )


def test_a_new_strategy_runs_in_a_transform_and_equals_numpy():
    tx = _tx()
    grads_seq = [H.per_worker_grads(PARAMS, seed=s) for s in (1, 2, 3)]
    ref_outs, ref_res = H.ef_reference(_topk, grads_seq, PARAMS, MIN_SIZE)
    state = H.stack(tx.init(PARAMS))
    for g, ref in zip(grads_seq, ref_outs):
        out, state = H.shard_map_update(tx, g, state)
        for k in PARAMS:
            np.testing.assert_allclose(np.asarray(out[k]), ref[k], rtol=1e-5, atol=1e-6)
    for k in ("w", "v"):  # each worker's residual: what its top-k did not send
        got = np.asarray(state.residual[k]).reshape(H.N, -1)
        np.testing.assert_allclose(got, ref_res[k], rtol=1e-5, atol=1e-6)
    assert int(np.asarray(state.nonfinite)[0]) == 0


def test_a_new_strategy_applies_the_nan_rule_on_every_worker():
    tx = _tx()
    g = H.per_worker_grads(PARAMS, seed=4)
    g["v"] = g["v"].at[3, 7].set(jnp.nan)  # worker 3 only
    state = H.stack(tx.init(PARAMS))
    out, new = H.shard_map_update(tx, g, state)
    assert np.isnan(np.asarray(out["v"])).all() and np.isnan(np.asarray(out["w"])).all()
    np.testing.assert_array_equal(np.asarray(new.residual["v"]), np.asarray(state.residual["v"]))
    assert (np.asarray(new.nonfinite) == 1).all()


def test_a_new_strategys_traffic_and_ledger_equal_the_compiled_bytes():
    tx = _tx()
    g = H.per_worker_grads(PARAMS, seed=5)
    compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(PARAMS)))
    hlo = accounting.hlo_collectives(compiled)
    assert {c.kind for c in hlo} == {"all_reduce"}
    assert sum(c.nbytes for c in hlo) == jaxcomm.wire_bytes(tx, PARAMS, H.N)
    vectors = [(int(np.size(PARAMS[k])), jnp.float32) for k in ("v", "w")]
    # the payloads as modelled, plus what rides with them: leaf "b" (10 f32), the flag (1 f32)
    riding = 2 * (H.N - 1) / H.N * 4 * (10 + 1)
    modelled = DecodedSum().traffic(sparse.TopK(RATIO), vectors, H.N)
    assert modelled == 2 * (H.N - 1) / H.N * 4 * (1500 + 1920)  # the closed form
    assert math.isclose(accounting.traffic_bytes(hlo, H.N), modelled + riding)


def test_a_new_strategy_refuses_what_its_kinds_exclude():
    with pytest.raises(ValueError, match="'decoded_sum' is for compressors whose payloads are all"):
        jaxcomm.compress(dense.Dense(), axis_name=H.AXIS, exchange=DecodedSum())

    @dataclasses.dataclass(frozen=True)
    class SummedOnly(DecodedSum):
        kinds: ClassVar[tuple[str, ...]] = ("psum",)

    with pytest.raises(ValueError, match=r"of kind \('psum',\), not kind='all_gather'"):
        jaxcomm.compress(sparse.TopK(RATIO), axis_name=H.AXIS, exchange=SummedOnly())
    jaxcomm.compress(dense.Dense(), axis_name=H.AXIS, exchange=SummedOnly())  # accepted


def test_core_dispatches_through_the_table():
    assert strategies.EXCHANGES == ("gather", "two_phase", "auto", "reduce_scatter")
    for name, strategy in strategies.STRATEGIES.items():
        assert strategy.name == name and strategies.get(name) is strategy
    with pytest.raises(ValueError, match="expected one of"):
        jaxcomm.compress(sparse.TopK(RATIO), axis_name=H.AXIS, exchange="ring")
    # a name and its object build the same transform: the same update, bit for bit
    g = H.per_worker_grads(PARAMS, seed=6)
    comp = quantize.Int8(256, False)
    outs = []
    for option in ("two_phase", strategies.TWO_PHASE):
        tx = jaxcomm.compress(comp, axis_name=H.AXIS, exchange=option)
        outs.append(H.shard_map_update(tx, g, H.stack(tx.init(PARAMS)))[0])
    for k in PARAMS:
        np.testing.assert_array_equal(np.asarray(outs[0][k]), np.asarray(outs[1][k]))


def test_auto_chooses_by_the_strategies_traffic_models():
    comp = quantize.Int8(512, False)
    vectors = [(2**20, jnp.float32)]
    auto = strategies.STRATEGIES["auto"]
    for n in (2, 3, 8):
        gather = strategies.GATHER.traffic(comp, vectors, n)
        two = strategies.TWO_PHASE.traffic(comp, vectors, n)
        assert gather == (n - 1) * accounting.payload_bytes(comp, 2**20, jnp.float32, n)
        want = strategies.TWO_PHASE if two < gather else strategies.GATHER
        assert auto.choose(comp, vectors, n) is want
        assert auto.traffic(comp, vectors, n) == min(gather, two)
    assert auto.choose(comp, vectors, 2) is strategies.GATHER  # a tie on 2 workers
    assert auto.choose(comp, vectors, 8) is strategies.TWO_PHASE
    assert auto.choose(sparse.TopK(0.01), vectors, 8) is strategies.GATHER  # not auto_two_phase


def test_the_old_traffic_path_warns_and_forwards():
    comp = quantize.Int8(512, False)
    with pytest.warns(DeprecationWarning, match="import it from jaxcomm.strategies"):
        old = accounting.exchange_traffic
    assert old(comp, [(4096, jnp.float32)], 8) == strategies.exchange_traffic(
        comp, [(4096, jnp.float32)], 8
    )
