"""experiments/bench/compressors.py: the timed repetitions carry the state along."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments.bench import compressors as B
from tests import helpers as H


def test_benchmark_repetitions_evolve_the_state():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (B.AXIS,))
    d = 2048
    tx = jaxcomm.topk(0.01, axis_name=B.AXIS)
    params = {"g": jax.ShapeDtypeStruct((d,), jnp.float32)}
    g = np.asarray(jax.random.normal(jax.random.key(0), (n, d), jnp.float32))
    grads = jax.device_put({"g": g}, NamedSharding(mesh, P(B.AXIS)))
    step, state = B.sharded_update(tx, params, mesh)
    fn = B.Evolving(step, grads, state)
    for _ in range(3):
        fn()
    assert np.all(np.asarray(fn.state.count) == 3)
    # error feedback, top-k of 1%: after 3 steps of the same gradient the residual
    # is 3 g minus the 3 sent rounds, the NumPy reference of three steps
    res = np.zeros((n, d), np.float32)
    for _ in range(3):
        p = g + res
        k = int(np.ceil(0.01 * d))
        idx = np.argsort(-np.abs(p), axis=1, kind="stable")[:, :k]
        res = p.copy()
        np.put_along_axis(res, idx, 0.0, axis=1)
    np.testing.assert_allclose(np.asarray(fn.state.residual["g"]), res, rtol=1e-6, atol=1e-6)


def test_threshold_fill_study_measures_the_transform_under_each_selection():
    """experiments/bench/threshold_fill.py: its fills are what jaxcomm.threshold (now) and
    the transform built from the old revision's Threshold (before) send, counted here
    from the updates; and the new selection sends more of the true top-k."""
    from experiments.bench import threshold_fill as T
    from jaxcomm import core

    shape, ratio = (3, 3, 32, 32), 0.01
    d, k = int(np.prod(shape)), int(np.ceil(ratio * np.prod(shape)))
    leaves = np.random.default_rng(2).standard_normal((6, d)).astype(np.float32)
    rules = T.selections()
    if "before" not in rules:
        pytest.skip("no git history here: the old selection cannot be loaded")
    got = {rule: T.fills(leaves, ratio, cls) for rule, cls in rules.items()}
    for rule, cls in rules.items():
        tx = core.compress(cls(ratio, 0.01))
        state = tx.init({"w": jnp.zeros(shape)})
        update = jax.jit(tx.update)
        for p, f in zip(leaves, got[rule]):
            out, _ = update({"w": jnp.asarray(p.reshape(shape))}, state)
            top = np.argsort(-np.abs(p), kind="stable")[:k]
            sent = np.flatnonzero(np.asarray(out["w"]).reshape(-1))
            assert f == np.intersect1d(sent, top).size / k
    assert rules["before"] is not rules["now"]
    assert got["now"].min() >= 0.9 > got["before"].max()


def test_floor_bench_times_every_case_against_the_copy_and_reports_its_targets():
    """experiments/bench/floor.py on a small vector: one row per case, the copy is the unit,
    and the report's verdicts follow the measured ratios (a ratio set past a target flips
    its 'met')."""
    from experiments.bench import floor as F
    from experiments.bench import revision

    res = F.run(d=8192, ratio=0.01, reps=1, tree=False)
    names = [r["case"] for r in res["vector"]]
    want = ["copy"] + [c for c, _, _ in F.VECTOR_CASES] + [c for c, _, _ in F.KERNELS]
    if F.threshold_fill.threshold_at(F.threshold_fill.BEFORE) is None:
        want.remove("threshold_before")
    if revision.jaxcomm_at(F.REV) is None:
        want = [c for c in want if not c.endswith("_rev")]
    assert names == want
    assert F._row(res["vector"], "copy")["time_over_copy"] == 1.0
    assert all(r["step_s"] > 0 for r in res["vector"])
    results = {"ratio": 0.01, "reps": 1, "rev": F.REV, "before": "x", "layouts": [res]}
    thr = F._row(res["vector"], "threshold")
    thr["time_over_copy"] = 2.5
    assert "| threshold + EF <= 3x the copy | 2.50x | yes |" in F.report(results)
    thr["time_over_copy"] = 3.5
    assert "| threshold + EF <= 3x the copy | 3.50x | **no** |" in F.report(results)
    assert F.parse_layouts("8x4000000, 2X16") == [(8, 4000000), (2, 16)]
    for bad in ("8", "8x", "0x5", "ax4"):
        with pytest.raises(ValueError, match="layouts"):
            F.parse_layouts(bad)


def test_revision_loads_the_library_beside_todays():
    """experiments.bench.revision: the package at the floor bench's revision imports as a
    package of its own, and (the change since then kept every bit) its threshold step gives
    today's update and residual on 8 devices."""
    from experiments.bench import floor as F
    from experiments.bench import revision

    old = revision.jaxcomm_at(F.REV)
    if old is None:
        pytest.skip("no git history at hand")
    assert old.__name__ == f"jaxcomm_{F.REV}" and old is not jaxcomm
    assert old.compressors.sparse.__name__ == f"jaxcomm_{F.REV}.compressors.sparse"
    params = {"w": jnp.zeros((64, 50))}
    results = []
    for lib in (old, jaxcomm):
        tx = lib.threshold(0.05, axis_name="data", min_size=0)
        state = H.stack(tx.init(params))
        for seed in range(3):
            out, state = H.shard_map_update(tx, H.per_worker_grads(params, seed=seed), state)
        results.append((np.asarray(out["w"]), np.asarray(state.residual["w"])))
    (u0, r0), (u1, r1) = results
    np.testing.assert_array_equal(u0.view(np.uint32), u1.view(np.uint32))
    np.testing.assert_array_equal(r0.view(np.uint32), r1.view(np.uint32))
    assert np.count_nonzero(u1) > 0
    with pytest.raises(ValueError, match="rev"):
        revision.jaxcomm_at("HEAD; rm")


def test_accelerator_bench_reads_the_agreement_test_output():
    from experiments.bench import accelerator

    text = (
        "\ntopk float32: largest relative error 1.41e-08, 0 flips\n.\n"
        "onebit:bucket bfloat16: largest relative error 1.48e-01, 128 flips\nF\n"
        "PASSED tests/test_accelerator.py::test_accelerator_agrees_with_cpu[topk-f32]\n"
        "XFAIL tests/test_accelerator.py::test_accelerator_agrees_with_cpu[onebit:bucket-bf16]"
        " - a reason\n"
    )
    rows = accelerator.parse_agree(text)
    assert rows == [
        {"transform": "onebit:bucket", "dtype": "bf16", "rel_error": 0.148, "flips": 128,
         "outcome": "xfail"},
        {"transform": "topk", "dtype": "f32", "rel_error": 1.41e-08, "flips": 0,
         "outcome": "passed"},
    ]  # fmt: skip
    md = accelerator.report({"platform": "gpu", "device": "X", "jax": "0", "agree": rows})
    assert "| `onebit:bucket` | - | 1.5e-01, 128 flips (xfail) |" in md
    assert "2 cases, 1 passed" in md


def test_auto_bench_predicts_from_the_median_of_advises_runs():
    from experiments.bench import auto_report

    def run(compute, cost, model):
        return {"compute_s": compute, "choice": "dense",
                "rows": [{"name": "dense", "seconds": cost, "predicted_s": model}]}  # fmt: skip

    adv = run(1.0, 0.5, 0.1)
    adv["repeats"] = [run(3.0, 0.2, 0.4), run(2.0, 0.9, 0.3)]
    assert auto_report.advice_parts(adv, "dense") == (2.0, 0.5, 0.3, 3)
    cell = {"model": "m", "rate": "r", "method": "dense", "step_s": 4.0, "step_runs_s": [2, 5, 3]}
    results = {"advice": {"m/r": adv}, "cells": [cell]}
    (row,) = auto_report.rows_prediction(results)
    # compute 2.0 + max(cost 0.5, alpha-beta 0.3), against the median step 3
    assert row["predicted_ms"] == 2500.0 and row["measured_ms"] == 3000.0
    assert row["advise_runs"] == 3 and row["ratio"] == 2.5 / 3
    del adv["repeats"]  # one run: its own parts
    assert auto_report.advice_parts(adv, "dense") == (1.0, 0.5, 0.1, 1)


def test_accelerator_bench_names_the_gpu_backend_for_jax_platforms():
    from experiments.bench import accelerator

    assert accelerator.platforms("gpu", "NVIDIA H200") == "cuda,cpu"
    assert accelerator.platforms("gpu", "AMD Instinct MI300X") == "rocm,cpu"
    assert accelerator.platforms("tpu", "TPU v5 lite") == "tpu,cpu"


def test_auto_bench_times_the_target_at_the_steady_step():
    from experiments.bench import auto_report

    # steps to target x the median of the cell's runs, not the training time it logged
    cell = {"tta_steps": 35, "tta_s": 1.37, "step_s": 0.040, "step_runs_s": [0.030, 0.036, 0.050]}
    assert auto_report._steady_tta(cell) == 35 * 0.036
    assert auto_report._steady_tta({"tta_steps": None, "tta_s": None, "step_s": 0.04}) is None
    del cell["step_runs_s"]
    assert auto_report._steady_tta(cell) == 35 * 0.040


def test_shaped_check_times_each_seed_to_the_target_at_its_step():
    from experiments.studies import shaped_check

    def run(method, seed, accs, step_s):
        curve = [{"step": 25 * (i + 1), "accuracy": a, "train_s": 0.1 * (i + 1)}
                 for i, a in enumerate(accs)]  # fmt: skip
        return {"method": method, "seed": seed, "curve": curve, "step_s": step_s}

    results = {"target": 0.9, "runs": [
        run("dense", 0, [0.8, 0.9, 0.95], 0.006), run("dense", 1, [0.8, 0.85, 0.92], 0.006),
        run("dense", 2, [0.7, 0.91, 0.93], 0.006),
        run("bf16", 0, [0.9, 0.95, 0.95], 0.002), run("bf16", 1, [0.8, 0.9, 0.95], 0.002),
        run("bf16", 2, [0.8, 0.8, 0.85], 0.002),  # never reaches: the method is not reached
    ]}  # fmt: skip
    rows = shaped_check.rows(results)
    # dense's seeds reach it at steps 50, 75, 50: 0.3, 0.45, 0.3 s at 6 ms a step (the
    # training time logged there: 0.2, 0.3, 0.2 s)
    assert rows["dense"]["tta_s"]["median"] == pytest.approx(0.3)
    assert rows["dense"]["tta_s"]["max"] == pytest.approx(0.45)
    assert rows["dense"]["train_s_at_target"]["max"] == pytest.approx(0.3)
    assert rows["bf16"]["tta_s"]["median"] is None and rows["bf16"]["tta_s"]["reached"] == 2
    # dense's finals 0.95, 0.92, 0.93: bf16's median 0.95 is within the band of their 0.93
    assert rows["bf16"]["final"] == {"median": 0.95, "min": 0.85, "max": 0.95, "within_band": True,
                                     "dense_median": 0.93,
                                     "worse_by": pytest.approx(-0.02)}  # fmt: skip
    assert rows["bf16"]["step_ms"]["median"] == pytest.approx(2.0)


def test_buckets_report_takes_the_median_run():
    """experiments/bench/buckets.py's table: each cell the median of the runs' ratios with
    their range, and the verdict on the median (one slow run does not flip it, two do)."""
    from experiments.bench import buckets

    def run(ratio):
        tree = {"params": 100, "allreduce_per_leaf": 1.0, "allreduce_bucketed": ratio,
                "allreduce_bucketed_vs_per_leaf": ratio, "allreduce_bucketed_25mib": 2 * ratio,
                "allreduce_bucketed_25mib_vs_per_leaf": 2 * ratio}  # fmt: skip
        return {"mlp": tree, "alpha_fit": {"per_allreduce_s": ratio * 1e-4}}

    results = {"reps": 2, "two_processes_runs": [run(0.9), run(1.3), run(0.8)]}
    md = buckets.report(results)
    assert "| mlp (100) | allreduce | 0.90 (0.80–1.30) | 1.80 (1.60–2.60) | yes |" in md
    assert "(never slower)" in md and "costs 0.090 ms" in md
    results["two_processes_runs"][2] = run(1.2)
    assert "| allreduce | 1.20 (0.90–1.30) |" in buckets.report(results)
    assert "**no**" in buckets.report(results)
    # one run (older files): the ratio alone
    assert "| mlp (100) | allreduce | 0.90 | 1.80 | yes |" in buckets.report(
        {"reps": 2, "two_processes": run(0.9)}
    )
