"""experiments.bench.peers without processes or torch: the configurations' steps
(peers_jax) build on 2 devices, and the report's numbers (merged launches, step minus
nocomm, ratios) are computed right from synthetic cells."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.bench import peers_jax, peers_report

# --- the configurations' steps ------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sh, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    model, params0, bstats0 = peers_jax.build_model("digits")
    rng = np.random.default_rng(0)  # the two workers' batches differ
    x = rng.normal(size=(2, 8, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(2, 8)).astype(np.int32)

    def glob(t):  # both workers' copies, stacked
        return jax.tree.map(lambda a: jax.device_put(np.stack([np.asarray(a)] * 2), sh), t)

    def replicate(t):
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a), rep), t)

    x, y = jax.device_put(x, sh), jax.device_put(y, sh)
    return mesh, model, params0, bstats0, glob, replicate, x, y


def test_digits_is_the_19k_mlp_with_leaves_below_the_default_min_size():
    _, params, bstats = peers_jax.build_model("digits")
    sizes = sorted(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    assert sizes == [10, 256, 2560, 16384] and not bstats  # 64-256-10: 19,210 params
    assert sum(sizes) == 19210  # the biases (10, 256) are below min_size=1024


@pytest.mark.parametrize("cfg", peers_report.CONFIGS)
def test_each_configuration_builds_and_steps(digits, cfg):
    mesh, model, params0, bstats0, glob, replicate, x, y = digits
    fn, st = peers_jax.build_step(cfg, model, params0, bstats0, mesh, glob, replicate)
    compiled = fn.lower(*st, x, y).compile()
    new = jax.block_until_ready(compiled(*st, x, y))[0]
    import jaxcomm

    n_coll = jaxcomm.accounting.collective_count(compiled)
    leaves = [np.asarray(a) for a in jax.tree.leaves(new)]
    assert all(np.isfinite(a).all() for a in leaves)
    if cfg == "nocomm":  # each worker applied its own gradient: no collective, params differ
        assert n_coll == 0
        assert max(np.abs(a[0] - a[1]).max() for a in leaves) > 0
    else:  # one exchange: params replicated and moved
        assert n_coll >= 1
        moved = [np.abs(a - np.asarray(b)).max() for a, b in zip(leaves, jax.tree.leaves(params0))]
        assert max(moved) > 0
    assert peers_report.JAX_CONFIGS[cfg]


def test_an_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="unknown configuration"):
        peers_jax.jaxcomm_tx("topk_1pct")


# --- the report -------------------------------------------------------------------------------


def _run(medians_ms: dict, iqr_ms: float = 1.0) -> dict:
    """One launch's worker JSON with these median step times (ms)."""
    return {
        "model": "digits",
        "world": 2,
        "params": 19210,
        "configs": {
            c: {"step_s": {"median": m / 1e3, "iqr": iqr_ms / 1e3, "n": 50}, "wire_bytes": 8}
            for c, m in medians_ms.items()
        },
    }


def _cell(tag, jax_runs, torch_runs, network="10mbit"):
    return {
        "tag": tag,
        "model": "digits",
        "processes": 2,
        "network": network,
        "repeats": len(jax_runs),
        "jaxcomm": peers_report.merge_runs([_run(r) for r in jax_runs]),
        "torch": peers_report.merge_runs([_run(r) for r in torch_runs]),
    }


# three launches each; jaxcomm's nocomm (1 ms) and torch's (3 ms) differ, so a Δ taken from
# the wrong framework's nocomm, or from a mean instead of the median, is caught
_JAX = [
    dict(nocomm=1.0, allreduce=20.0, bf16_default=12.0, topk=6.0),
    dict(nocomm=1.5, allreduce=22.0, bf16_default=30.0, topk=7.0),
    dict(nocomm=0.5, allreduce=21.0, bf16_default=11.0, topk=5.0),
]
_TORCH = [
    dict(nocomm=3.0, allreduce=18.0, bf16=10.0),
    dict(nocomm=2.0, allreduce=19.0, bf16=16.0),
    dict(nocomm=4.0, allreduce=17.0, bf16=13.0),
]


def test_merge_runs_takes_the_median_of_the_launches_medians_and_their_range():
    m = peers_report.merge_runs([_run(r) for r in _JAX])
    s = m["configs"]["bf16_default"]["step_s"]
    assert s["median"] == pytest.approx(0.012)  # of 12, 30, 11 ms (the mean would be 17.7)
    assert s["range"] == pytest.approx([0.011, 0.030])
    assert s["run_medians"] == pytest.approx([0.012, 0.030, 0.011])
    assert s["n_runs"] == 3 and s["n_steps"] == 50
    assert m["configs"]["bf16_default"]["wire_bytes"] == 8 and len(m["runs"]) == 3
    assert peers_report.merge_runs([]) == {"configs": {}, "runs": []}


def test_step_table_subtracts_each_frameworks_own_nocomm():
    table = peers_report.step_table([_cell("after", _JAX, _TORCH)])
    rows = {r["config"]: r for r in table["steps"]}
    assert list(rows) == ["nocomm", "allreduce", "bf16", "bf16_default", "topk"]  # CONFIGS order
    # jaxcomm: medians nocomm 1, allreduce 21, bf16_default 12, topk 6 ms
    assert rows["allreduce"]["jaxcomm_ms"] == pytest.approx(21.0)
    assert rows["allreduce"]["jaxcomm_minus_nocomm_ms"] == pytest.approx(20.0)
    assert rows["bf16_default"]["jaxcomm_minus_nocomm_ms"] == pytest.approx(11.0)
    assert rows["topk"]["jaxcomm_minus_nocomm_ms"] == pytest.approx(5.0)
    assert rows["nocomm"]["jaxcomm_minus_nocomm_ms"] == 0.0
    assert rows["allreduce"]["jaxcomm_range_ms"] == pytest.approx([20.0, 22.0])
    # torch: medians nocomm 3, allreduce 18, bf16 13 ms
    assert rows["allreduce"]["torch_minus_nocomm_ms"] == pytest.approx(15.0)
    assert rows["bf16"]["torch_minus_nocomm_ms"] == pytest.approx(10.0)
    assert rows["nocomm"]["torch_ms"] == pytest.approx(3.0)
    # a configuration one side lacks is None (printed "—")
    assert rows["topk"]["torch_ms"] is None and rows["topk"]["torch_minus_nocomm_ms"] is None
    assert rows["bf16"]["jaxcomm_ms"] is None
    (ratio,) = table["ratios"]
    assert ratio["jaxcomm_bf16_over_jaxcomm_dense"] == pytest.approx(12.0 / 21.0)
    assert ratio["jaxcomm_bf16_over_torch_bf16"] == pytest.approx(12.0 / 13.0)
    assert (ratio["tag"], ratio["network"]) == ("after", "10mbit")


def test_step_table_without_nocomm_or_bf16_gives_none():
    cell = _cell(None, [dict(allreduce=20.0)], [dict(allreduce=18.0)], network="loopback")
    table = peers_report.step_table([cell])
    (row,) = table["steps"]
    assert row["jaxcomm_minus_nocomm_ms"] is None and row["torch_minus_nocomm_ms"] is None
    assert row["jaxcomm_range_ms"] == pytest.approx([20.0, 20.0])
    assert table["ratios"][0]["jaxcomm_bf16_over_jaxcomm_dense"] is None


def test_report_prints_two_tags_side_by_side(capsys):
    before = [dict(nocomm=1.0, allreduce=20.0, bf16_default=25.0, topk=9.0)] * 3
    cells = [_cell("before", before, _TORCH), _cell("after", _JAX, _TORCH)]
    summary = peers_report.summarise(cells)
    assert {r["tag"] for r in summary["steps"]["ratios"]} == {"before", "after"}
    for cell in cells:
        peers_report.print_cell(cell)
    peers_report.print_summary(summary)
    out = capsys.readouterr().out
    assert "tag before" in out and "tag after" in out
    line = next(x for x in out.splitlines() if x.startswith("topk ") and "|" in x)
    # before: 9.0 (+8.0), after: 6.0 (+5.0) on one line; torch has no top-k
    assert "9.0" in line and "+8.0" in line and "6.0" in line and "+5.0" in line
    assert line.count("—") == 4
    assert "0.57x" in out  # after: bf16_default / allreduce = 12 / 21
    assert "1.25x" in out  # before: 25 / 20


def test_a_new_cell_replaces_only_the_one_of_its_tag():
    results = {"peers": [_cell("before", _JAX, _TORCH), _cell("after", _JAX, _TORCH)]}
    results["peers"].append(_cell(None, _JAX, _TORCH))  # a cell from before tags existed
    new = _cell("after", [dict(nocomm=2.0, allreduce=40.0)], [dict(nocomm=2.0)])
    peers_report.add_cell(results, new)
    got = [
        (c["tag"], c["jaxcomm"]["configs"]["allreduce"]["step_s"]["median"])
        for c in results["peers"]
    ]
    assert got == [("before", 0.021), (None, 0.021), ("after", 0.040)]
    steps = results["peers_summary"]["steps"]["steps"]
    after = {r["config"]: r for r in steps if r["tag"] == "after"}
    assert after["allreduce"]["jaxcomm_minus_nocomm_ms"] == pytest.approx(38.0)
    peers_report.add_cell(results, _cell("other", _JAX, _TORCH, network="100mbit"))
    assert len(results["peers"]) == 4
