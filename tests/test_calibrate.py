"""Tests for jaxcomm.calibrate: the α/β fit, per-kind links, and measuring on 8 CPU devices.

The synthetic times are written out from the alpha-beta formulas here (not
taken from netsim), so a fit that read the wrong coefficients off netsim
would not recover the link.
"""

import math

import jax
import numpy as np
import pytest

import jaxcomm
from jaxcomm import calibrate as C
from jaxcomm import netsim
from jaxcomm.calibrate import measure as M  # the module that times the probes
from jaxcomm.ledger import Collective
from jaxcomm.netsim import Link

ALPHA, B = 37e-6, 1.3e9  # seconds, bytes/s
SIZES = [4e3, 2.5e5, 3e6]


def closed_form(kind, n, s, alpha, b, algorithm="ring"):
    """Seconds of one collective of ``kind`` from the formulas of ALGORITHMS.md."""
    if kind == "all_reduce" and algorithm == "halving_doubling":
        return 2 * math.ceil(math.log2(n)) * alpha + 2 * (n - 1) / n * s / b
    return {
        "all_reduce": 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / b,
        "all_gather": (n - 1) * alpha + (n - 1) * s / b,
        "reduce_scatter": (n - 1) * alpha + (n - 1) / n * s / b,
        "all_to_all": (n - 1) * alpha + (n - 1) / n * s / b,
        "collective_permute": alpha + s / b,
    }[kind]


# --- fit_alpha_beta ---------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("kind", netsim.KINDS)
def test_fit_recovers_alpha_and_bandwidth_exactly(kind, n):
    times = [closed_form(kind, n, s, ALPHA, B) for s in SIZES]
    alpha, bw = C.fit_alpha_beta(kind, n, SIZES, times)
    assert alpha == pytest.approx(ALPHA, rel=1e-9)
    assert bw == pytest.approx(B, rel=1e-9)


def test_fit_uses_the_all_reduce_algorithm_of_the_model():
    times = [closed_form("all_reduce", 8, s, ALPHA, B, "halving_doubling") for s in SIZES]
    alpha, bw = C.fit_alpha_beta("all_reduce", 8, SIZES, times, algorithm="halving_doubling")
    assert (alpha, bw) == (pytest.approx(ALPHA, rel=1e-9), pytest.approx(B, rel=1e-9))
    ring_alpha, _ = C.fit_alpha_beta("all_reduce", 8, SIZES, times)
    assert ring_alpha == pytest.approx(ALPHA * 3 / 7, rel=1e-9)  # 2·3 messages read as 2·7


@pytest.mark.parametrize("kind", netsim.KINDS)
def test_fit_with_5_percent_noise_stays_within_10_percent(kind):
    rng = np.random.default_rng(0)
    sizes = np.geomspace(2**10, 2**22, 6)
    for _ in range(20):
        noise = 1 + rng.uniform(-0.05, 0.05, sizes.size)
        times = [closed_form(kind, 8, s, ALPHA, B) * e for s, e in zip(sizes, noise)]
        alpha, bw = C.fit_alpha_beta(kind, 8, sizes, times)
        assert alpha == pytest.approx(ALPHA, rel=0.10)
        assert bw == pytest.approx(B, rel=0.10)


def test_negative_alpha_is_clipped_and_bandwidth_refitted():
    sizes = [1e5, 1e6, 4e6]
    times = [closed_form("all_gather", 4, s, 0.0, B) - 5e-6 for s in sizes]  # α would be < 0
    alpha, bw = C.fit_alpha_beta("all_gather", 4, sizes, times)
    assert alpha == 0.0
    w = np.array([3 * s / t for s, t in zip(sizes, times)])  # b(S)/T per row, β = Σw/Σw²
    assert bw == pytest.approx(1 / (w.sum() / (w @ w)), rel=1e-12)


@pytest.mark.parametrize(
    "args, match",
    [
        (("all_gather", 8, [1e6], [1e-3]), "sizes: need at least 2 different"),
        (("all_gather", 8, [1e6, 1e6], [1e-3, 2e-3]), "sizes: need at least 2 different"),
        (("all_gather", 8, [1e5, 1e6], [1e-3]), "one time per size"),
        (("all_gather", 8, [1e5, 1e6], [0.0, 1e-3]), "times: .*> 0"),
        (("all_gather", 8, [1e5, 1e6], [-1e-3, 1e-3]), "times: .*> 0"),
        (("all_gather", 8, [1e5, 1e6], [math.nan, 1e-3]), "times: .*> 0"),
        (("all_gather", 8, [-1e5, 1e6], [1e-3, 2e-3]), "sizes: .*> 0"),
        (("broadcast", 8, [1e5, 1e6], [1e-3, 2e-3]), "kind: must be one of"),
        (("all_gather", 1, [1e5, 1e6], [1e-3, 2e-3]), "n: .*>= 2"),
        (("all_gather", 8, [1e5, 1e6], [2e-3, 1e-3]), "do not grow with the size"),
    ],
)
def test_fit_errors(args, match):
    with pytest.raises(ValueError, match=match):
        C.fit_alpha_beta(*args)


# --- KindLinks and exchange_time --------------------------------------------------


def test_kind_links_charge_each_collective_at_its_own_link():
    slow, fast = Link(8e9, 1e-5), Link(16e9, 2e-5)  # 1 GB/s, 2 GB/s
    links = C.KindLinks.uniform(fast)._replace(all_gather=slow)
    report = [
        Collective("all_gather", "data", 1_000_000, "uint8", (1_000_000,)),
        Collective("all_reduce", "data", 4_000_000, "float32", (1_000_000,)),
    ]
    gather = 7 * 1e-5 + 7 * 1e6 / 1e9
    reduce = 2 * 7 * 2e-5 + 2 * 7 / 8 * 4e6 / 2e9
    assert C.exchange_time(report, links, 8) == pytest.approx(gather + reduce, rel=1e-12)
    # a uniform KindLinks is plain netsim
    assert C.exchange_time(report, C.KindLinks.uniform(fast), 8) == pytest.approx(
        netsim.exchange_time(report, 8, fast), rel=1e-12
    )


def test_extra_operands_pay_latency_at_their_kind():
    links = C.KindLinks(all_gather=Link(8e9, 1e-5))
    report = [Collective("all_gather", "data", 1000, "uint8", (1000,), operands=3)]
    assert C.exchange_time(report, links, 4) == pytest.approx(3 * 3e-5 + 3 * 1000 / 1e9)


def test_kind_links_errors():
    links = C.KindLinks(all_reduce=Link(8e9))
    with pytest.raises(ValueError, match="kind: no link for 'all_gather'"):
        links.link("all_gather")
    with pytest.raises(ValueError, match="kind: must be one of"):
        links.link("broadcast")
    with pytest.raises(ValueError, match="n: the number of workers is required"):
        C.exchange_time([], links)
    with pytest.raises(TypeError, match="links: expected a KindLinks"):
        C.exchange_time([], Link(8e9), 8)
    with pytest.raises(TypeError, match="link: expected a netsim.Link"):
        C.KindLinks.uniform(8e9)


# --- calibrate on 8 fake CPU devices ----------------------------------------------

PROBE_SIZES = (16 * 2**10, 256 * 2**10, 2 * 2**20)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def cal(mesh):
    C.clear_cache()
    return C.calibrate(mesh, "data", sizes=PROBE_SIZES, repeats=3)


@pytest.mark.parametrize("kind", netsim.KINDS)
def test_each_probe_is_one_collective_of_its_kind_and_size(mesh, kind):
    compiled, x = C.probe_program(mesh, "data", kind, 64 * 2**10)
    (found,) = jaxcomm.accounting.hlo_collectives(compiled)
    group = 1 if kind == "collective_permute" else 8  # a permute has pairs, not a group
    assert found.kind == kind and found.nbytes == 64 * 2**10 and found.axis == group
    assert np.all(np.isfinite(np.asarray(compiled(x))))


def test_probe_program_errors(mesh):
    with pytest.raises(ValueError, match="nbytes: must be a positive multiple of 4 \\* n = 32"):
        C.probe_program(mesh, "data", "all_reduce", 100)
    with pytest.raises(ValueError, match="kind: must be one of"):
        C.probe_program(mesh, "data", "broadcast", 64)


def test_calibrate_gives_a_finite_positive_link_per_kind(cal):
    assert cal.n == 8 and cal.axis_name == "data"
    for kind in C.DEFAULT_KINDS:
        link = cal.links.link(kind)
        assert math.isfinite(link.bandwidth_bps) and link.bandwidth_bps > 0
        assert math.isfinite(link.latency_s) and link.latency_s >= 0
        mine = [p for p in cal.probes if p.kind == kind]
        assert [p.nbytes for p in mine] == list(PROBE_SIZES)  # already whole rows of 8 floats
        assert all(p.n == 8 and math.isfinite(p.seconds) and p.seconds > 0 for p in mine)
    assert cal.links.collective_permute is None


def test_calibrated_links_fit_their_own_probes(cal):
    for kind in C.DEFAULT_KINDS:
        mine = [p for p in cal.probes if p.kind == kind]
        alpha, bw = C.fit_alpha_beta(kind, 8, [p.nbytes for p in mine], [p.seconds for p in mine])
        assert cal.links.link(kind) == Link(8 * bw, alpha)


def test_report_time_charges_an_all_gather_at_the_all_gather_link(cal):
    params = {"w": jax.numpy.zeros((100, 100))}
    report = jaxcomm.accounting.wire_report(jaxcomm.topk(0.01, axis_name="data"), params, 8)
    assert [c.kind for c in report] == ["all_gather"]
    link = cal.links.all_gather
    by_hand = 7 * link.latency_s + 7 * report[0].nbytes / (link.bandwidth_bps / 8)
    assert C.exchange_time(report, cal) == pytest.approx(by_hand, rel=1e-12)
    other = cal.links.all_reduce
    assert C.exchange_time(report, cal) != pytest.approx(
        netsim.exchange_time(report, 8, other), rel=1e-6
    )


def test_table_lists_every_kind_relative_to_the_all_reduce(cal):
    text = str(cal)
    assert text == cal.table()
    lines = text.splitlines()
    assert "alpha (us)" in lines[1] and "MB/s" in lines[1] and "vs all_reduce" in lines[1]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert set(rows) == set(C.DEFAULT_KINDS)
    assert rows["all_reduce"][2] == "1.00"
    ag = cal.links.all_gather
    assert float(rows["all_gather"][0]) == pytest.approx(ag.latency_s * 1e6, abs=0.05)
    assert float(rows["all_gather"][1]) == pytest.approx(ag.bytes_per_s / 1e6, abs=0.05)
    ratio = ag.bytes_per_s / cal.links.all_reduce.bytes_per_s
    assert float(rows["all_gather"][2]) == pytest.approx(ratio, abs=0.005)


def test_calibrate_is_cached_per_mesh_axis_and_sizes(cal, mesh):
    assert C.calibrate(mesh, "data", sizes=PROBE_SIZES, repeats=3) is cal
    again = C.calibrate(mesh, "data", sizes=PROBE_SIZES, repeats=3, refresh=True)
    assert again is not cal
    assert C.calibrate(mesh, "data", sizes=PROBE_SIZES, repeats=3) is again
    two = PROBE_SIZES[::2]
    small = C.calibrate(mesh, "data", sizes=two, repeats=3, kinds=("all_reduce",))
    assert small is not again and small.links.all_gather is None
    three = C.calibrate(mesh, "data", sizes=PROBE_SIZES, repeats=3, kinds=("all_reduce",))
    assert three is not small and len(three.probes) == 3  # differs only in sizes
    other = jax.make_mesh((8,), ("data",), devices=jax.devices()[::-1])
    flipped = C.calibrate(other, "data", sizes=two, repeats=3, kinds=("all_reduce",))
    assert flipped is not small


def test_calibrate_one_axis_of_a_2d_mesh_and_a_tuple_of_axes():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sizes = PROBE_SIZES[::2]
    cal = C.calibrate(mesh, "data", sizes=sizes, repeats=3, kinds=("all_gather", "all_to_all"))
    assert cal.n == 4 and cal.links.all_gather.bandwidth_bps > 0
    both = C.calibrate(mesh, ("data", "model"), sizes=sizes, repeats=3, kinds=("reduce_scatter",))
    assert both.n == 8 and both.links.reduce_scatter.bandwidth_bps > 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(axis_name="model"), ValueError, "axis_name: 'model' is not an axis"),
        (dict(axis_name=3), TypeError, "axis_name: expected"),
        (dict(sizes=(2**20,)), ValueError, "sizes: need at least 2 different"),
        (dict(sizes=(2, 2**20)), ValueError, "sizes: .*>= 4"),
        (dict(repeats=0), ValueError, "repeats: .*>= 1"),
        (dict(kinds=("broadcast",)), ValueError, "kinds: each must be one of"),
        (dict(kinds=()), ValueError, "kinds: need at least one"),
        (dict(algorithm="tree"), ValueError, "algorithm: must be one of"),
        (dict(sizes=(4, 8)), ValueError, "sizes: .* round to one size, 32 bytes"),
    ],
)
def test_calibrate_errors(mesh, kwargs, error, match):
    kwargs = {"axis_name": "data", **kwargs}
    with pytest.raises(error, match=match):
        C.calibrate(mesh, **kwargs)


def test_calibrate_needs_two_devices_on_the_axis():
    mesh = jax.make_mesh((8, 1), ("data", "one"))
    with pytest.raises(ValueError, match="axis_name: 'one' has 1 device; calibration needs >= 2"):
        C.calibrate(mesh, "one")


def test_calibrate_times_more_rounds_while_a_kind_does_not_fit(mesh, monkeypatch):
    # probes: all_reduce at 64 and 128 bytes; rounds give these times in turn
    rounds = iter([[2e-3, 1.5e-3], [1e-3, 3e-3], [5e-3, 5e-3]])
    monkeypatch.setattr(M, "_measure", lambda programs, repeats: next(rounds))
    cal = C.calibrate(mesh, "data", sizes=(64, 128), kinds=("all_reduce",), refresh=True)
    assert [p.seconds for p in cal.probes] == [1e-3, 1.5e-3]  # minimum over the 2 sets
    assert next(rounds) == [5e-3, 5e-3]  # the third set was not needed


def test_calibrate_gives_up_after_attempts(mesh, monkeypatch):
    calls = []
    monkeypatch.setattr(M, "_measure", lambda programs, repeats: calls.append(1) or [2e-3, 1e-3])
    with pytest.raises(ValueError, match="all_reduce times do not grow.*after 3 x 2 rounds"):
        C.calibrate(mesh, "data", sizes=(64, 128), repeats=2, kinds=("all_reduce",), refresh=True)
    assert len(calls) == C.ATTEMPTS


def test_calibrate_fits_the_model_of_its_algorithm(mesh, monkeypatch):
    # exact halving/doubling times for the probes: the Link comes back exactly
    sizes = (64, 128, 256)
    times = [closed_form("all_reduce", 8, s, ALPHA, B, "halving_doubling") for s in sizes]
    monkeypatch.setattr(M, "_measure", lambda programs, repeats: list(times))
    kw = dict(sizes=sizes, kinds=("all_reduce",), refresh=True)
    link = C.calibrate(mesh, "data", algorithm="halving_doubling", **kw).links.all_reduce
    assert link.latency_s == pytest.approx(ALPHA, rel=1e-9)
    assert link.bytes_per_s == pytest.approx(B, rel=1e-9)
    ring = C.calibrate(mesh, "data", **kw).links.all_reduce
    assert ring.latency_s == pytest.approx(ALPHA * 3 / 7, rel=1e-9)
