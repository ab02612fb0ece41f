"""Tests for jaxcomm.netsim: closed forms, limits, monotonicity, inversion, bad inputs.

Expected values are written out from the alpha-beta formulas here, not taken
from the implementation. Pure Python: fast, no devices.
"""

import ast
import inspect
import math
from typing import NamedTuple

import pytest

from jaxcomm import netsim
from jaxcomm.netsim import Cluster, Link

GBIT = 1e9
S = 123_456_789.0  # an awkward payload, bytes


def beta(link):  # seconds per byte
    return 8 / link.bandwidth_bps


# --- value types ----------------------------------------------------------------


@pytest.mark.parametrize("bw", [0, -1.0, math.inf, math.nan])
def test_link_rejects_bad_bandwidth(bw):
    with pytest.raises(ValueError, match="bandwidth_bps.*> 0"):
        Link(bw)


@pytest.mark.parametrize("lat", [-1e-6, math.inf, math.nan])
def test_link_rejects_bad_latency(lat):
    with pytest.raises(ValueError, match="latency_s.*>= 0"):
        Link(1e9, lat)


def test_link_rejects_non_numbers():
    with pytest.raises(TypeError, match="bandwidth_bps"):
        Link("10G")
    with pytest.raises(TypeError, match="latency_s"):
        Link(1e9, True)


def test_link_units():
    link = Link.from_gbps(10, 5e-6)
    assert link.bandwidth_bps == 10e9
    assert link.bytes_per_s == 10e9 / 8
    assert link.latency_s == 5e-6


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n_nodes=0), "n_nodes"),
        (dict(n_nodes=-2), "n_nodes"),
        (dict(n_nodes=2, per_node=0), "per_node"),
    ],
)
def test_cluster_rejects_counts_below_one(kwargs, name):
    with pytest.raises(ValueError, match=f"{name}.*>= 1"):
        Cluster(**kwargs, inter=Link(1e9))


def test_cluster_rejects_bad_types():
    with pytest.raises(TypeError, match="n_nodes"):
        Cluster(2.5, inter=Link(1e9))
    with pytest.raises(TypeError, match="inter"):
        Cluster(2, 2)
    with pytest.raises(TypeError, match="intra"):
        Cluster(2, 2, intra=1e9, inter=Link(1e9))


def test_cluster_defaults_and_flat_link():
    eth = Link(10e9, 20e-6)
    nv = Link(1000e9, 2e-6)
    assert Cluster(4, 8, inter=eth).intra == eth
    c = Cluster(4, 8, intra=nv, inter=eth)
    assert c.n_workers == 32
    assert c.flat_link == Link(10e9, 20e-6)
    assert Cluster(1, 8, intra=nv, inter=eth).flat_link == nv
    with pytest.raises(AttributeError):
        c.n_nodes = 3  # frozen


# --- collective closed forms ----------------------------------------------------

LINK = Link(25 * GBIT, 7e-6)


@pytest.mark.parametrize(
    "fn",
    [
        netsim.ring_allreduce_time,
        netsim.halving_doubling_allreduce_time,
        netsim.allgather_time,
        netsim.reduce_scatter_time,
        netsim.collective_permute_time,
        netsim.parameter_server_time,
    ],
)
def test_one_worker_costs_nothing(fn):
    assert fn(S, 1, LINK) == 0.0


def test_one_worker_costs_nothing_on_a_cluster():
    c = Cluster(1, 1, inter=LINK)
    assert netsim.hierarchical_allreduce_time(S, c) == 0.0
    for kind in netsim.KINDS:
        assert netsim.collective_time(kind, S, c) == 0.0
    assert netsim.exchange_time([_C("all_reduce", S), _C("all_gather", S)], None, c) == 0.0


@pytest.mark.parametrize("n", [2, 3, 8, 13, 64])
def test_closed_forms(n):
    a, b = LINK.latency_s, beta(LINK)
    assert netsim.ring_allreduce_time(S, n, LINK) == pytest.approx(
        2 * (n - 1) * a + 2 * (n - 1) / n * S * b, rel=1e-12
    )
    rounds = {2: 1, 3: 2, 8: 3, 13: 4, 64: 6}[n]
    assert netsim.halving_doubling_allreduce_time(S, n, LINK) == pytest.approx(
        2 * rounds * a + 2 * (n - 1) / n * S * b, rel=1e-12
    )
    assert netsim.allgather_time(S, n, LINK) == pytest.approx((n - 1) * (a + S * b), rel=1e-12)
    assert netsim.reduce_scatter_time(S, n, LINK) == pytest.approx(
        (n - 1) * a + (n - 1) / n * S * b, rel=1e-12
    )
    assert netsim.collective_permute_time(S, n, LINK) == pytest.approx(a + S * b, rel=1e-12)
    assert netsim.parameter_server_time(S, n, LINK, shards=4) == pytest.approx(
        2 * a + 2 * n * S * b / 4, rel=1e-12
    )


def test_ring_bandwidth_term_tends_to_2S_over_B():
    link = Link(10 * GBIT)  # no latency: the bandwidth term alone
    limit = 2 * S / (10 * GBIT / 8)
    times = [netsim.ring_allreduce_time(S, n, link) for n in (2, 10, 1000, 10**6)]
    assert times == sorted(times)
    assert times[0] == pytest.approx(limit / 2)
    assert times[-1] == pytest.approx(limit, rel=1e-5)
    assert all(t < limit for t in times)


def test_reduce_scatter_plus_allgather_is_ring():
    n = 6
    rs = netsim.reduce_scatter_time(S, n, LINK)
    ag = netsim.allgather_time(S / n, n, LINK)
    assert rs + ag == pytest.approx(netsim.ring_allreduce_time(S, n, LINK), rel=1e-12)


@pytest.mark.parametrize("m, p", [(2, 2), (4, 8), (8, 8), (3, 5), (1, 8), (8, 1)])
def test_hierarchical_equal_links_is_flat_ring_up_to_latency(m, p):
    """Equal links: the node's interface gives each worker the intra bandwidth."""
    bw, a_in, a_out = 40 * GBIT, 3e-6, 11e-6
    c = Cluster(m, p, intra=Link(bw, a_in), inter=Link(p * bw, a_out))
    n = m * p
    flat_bw_term = 2 * (n - 1) / n * S * 8 / bw
    latency = 2 * (p - 1) * a_in + 2 * (m - 1) * a_out
    hier = netsim.hierarchical_allreduce_time(S, c)
    assert hier == pytest.approx(flat_bw_term + latency, rel=1e-12)
    no_latency = Cluster(m, p, intra=Link(bw), inter=Link(p * bw))
    flat = netsim.ring_allreduce_time(S, n, Link(bw))
    assert netsim.hierarchical_allreduce_time(S, no_latency) == pytest.approx(flat, rel=1e-12)
    assert netsim.allreduce_time(S, no_latency, algorithm="ring") == pytest.approx(flat)


def test_hierarchical_with_a_shared_interface_pays_extra():
    """Same bandwidth inside and out, one interface per node: 2(p-1)(m-1)/(pm)·S/B extra."""
    m, p, bw = 4, 8, 100 * GBIT
    c = Cluster(m, p, intra=Link(bw), inter=Link(bw))
    extra = 2 * (p - 1) * (m - 1) / (p * m) * S * 8 / bw
    flat = netsim.allreduce_time(S, c, algorithm="ring")
    assert netsim.hierarchical_allreduce_time(S, c) == pytest.approx(flat + extra, rel=1e-12)


def test_hierarchical_fast_intra_is_inter_node_ring():
    nic = Link(10 * GBIT, 20e-6)
    c = Cluster(8, 8, intra=Link(1e18), inter=nic)
    expected = 2 * 7 * 20e-6 + 2 * 7 / 8 * S * 8 / (10 * GBIT)
    # the intra stages add ~1e-8 of the total
    assert netsim.hierarchical_allreduce_time(S, c) == pytest.approx(expected, rel=1e-6)


def test_powersgd_is_two_sequential_allreduces():
    n, p, q, dense = 16, 3e6, 5e6, 1e6
    a, b = LINK.latency_s, beta(LINK)
    one = lambda x: 2 * (n - 1) * a + 2 * (n - 1) / n * x * b
    got = netsim.powersgd_time(p, q, LINK, n=n, dense_bytes=dense)
    assert got == pytest.approx(one(p) + one(q) + one(dense), rel=1e-12)
    assert netsim.powersgd_time(p, q, LINK, n=n) == pytest.approx(one(p) + one(q), rel=1e-12)


def test_powersgd_bytes():
    # 1000x500 rank 2: P 2000, Q 1000 values; a 3x3x64x64 conv as 3 x 576: (3+576)·2 = 1158
    # < 1728/2 is False -> dense; vectors dense.
    shapes = [(1000, 500), (3, 3, 64, 64), (10,)]
    p, q, dense = netsim.powersgd_bytes(shapes, 2)
    assert (p, q) == (4 * 2000, 4 * 1000)
    assert dense == 4 * (3 * 3 * 64 * 64 + 10)


# --- exchange_time: duck-typed wire_report lists ---------------------------------


class _C(NamedTuple):
    kind: str
    nbytes: float
    axis: object = "data"


def test_exchange_time_sums_each_kind():
    n, a, b = 8, LINK.latency_s, beta(LINK)
    report = [
        _C("all_reduce", 4e6),
        _C("all_gather", 1e5),
        _C("reduce_scatter", 2e6),
        _C("collective_permute", 3e3),
    ]
    expected = (
        2 * (n - 1) * a + 2 * (n - 1) / n * 4e6 * b
        + (n - 1) * (a + 1e5 * b)
        + (n - 1) * a + (n - 1) / n * 2e6 * b
        + a + 3e3 * b
    )  # fmt: skip
    assert netsim.exchange_time(report, n, LINK) == pytest.approx(expected, rel=1e-12)


def test_exchange_time_axis_links():
    fast, slow = Link(800 * GBIT), Link(8 * GBIT)
    report = [_C("all_reduce", 1e6, "local"), _C("all_gather", 1e4, ("node",))]
    got = netsim.exchange_time(
        report, None, Cluster(4, 8, intra=fast, inter=slow),
        axis_links={"local": (8, fast), "node": (4, slow)},
    )  # fmt: skip
    expected = 2 * 7 / 8 * 1e6 * 8 / (800 * GBIT) + 3 * 1e4 * 8 / (8 * GBIT)
    assert got == pytest.approx(expected, rel=1e-12)


def test_exchange_time_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        netsim.exchange_time([_C("broadcast", 10)], 4, LINK)


def test_all_to_all_is_priced_as_n_minus_1_rows():
    """The two-phase exchange's all-to-all: (n-1) alpha + (n-1)/n of the operand."""
    link = Link(8 * GBIT, latency_s=1e-4)
    got = netsim.exchange_time([_C("all_to_all", 8e6)], 4, link)
    assert got == pytest.approx(3 * 1e-4 + 3 / 4 * 8e6 * 8 / (8 * GBIT), rel=1e-12)


# --- step time ------------------------------------------------------------------


def test_single_bucket_does_not_overlap():
    st = netsim.bucketed_step_time([0.25], compute_time=1.0, backward_fraction=0.9)
    assert st.iteration_s == pytest.approx(1.25)
    assert st.scaling_factor == pytest.approx(1 / 1.25)
    assert st.exposed_s == pytest.approx(0.25)


@pytest.mark.parametrize("c, m", [(0.3, 4), (2.0, 4), (0.6, 10), (0.05, 1)])
def test_bucketed_overlap_closed_form(c, m):
    t_c, f = 1.0, 2 / 3
    st = netsim.bucketed_step_time([c / m] * m, compute_time=t_c, backward_fraction=f)
    expected = max(t_c + c / m, (1 - f) * t_c + f * t_c / m + c)
    assert st.iteration_s == pytest.approx(expected, rel=1e-12)
    assert st.comm_s == pytest.approx(c)


def test_many_buckets_tend_to_zhang_formula():
    t_c, f, c, m = 1.0, 0.6, 0.9, 10_000
    st = netsim.bucketed_step_time([c / m] * m, compute_time=t_c, backward_fraction=f)
    assert st.iteration_s == pytest.approx(t_c + max(0.0, c - f * t_c), rel=1e-3)


def test_no_backward_no_overlap():
    st = netsim.bucketed_step_time([0.1] * 5, compute_time=1.0, backward_fraction=0.0)
    assert st.iteration_s == pytest.approx(1.5)


def test_encode_decode_on_compute_stream():
    # one bucket: compute, encode, send, decode, all in sequence
    st = netsim.bucketed_step_time([0.2], compute_time=1.0, encode_time=0.05, decode_time=0.03)
    assert st.iteration_s == pytest.approx(1.0 + 0.05 + 0.2 + 0.03)
    # communication fully hidden: encode and decode remain on the critical path
    st = netsim.bucketed_step_time([0.0] * 4, compute_time=1.0, encode_time=0.08, decode_time=0.04)
    assert st.iteration_s == pytest.approx(1.0 + 0.08 + 0.04)


def test_step_time_buckets_and_rounds():
    link, n, t_c = Link(10 * GBIT, 1e-5), 8, 0.2
    payload, m = 100e6, 4
    per = 2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * (payload / m) * 8 / (10 * GBIT)
    st = netsim.step_time(payload, link, n=n, compute_time=t_c, bucket_bytes=payload / m)
    assert st.n_buckets == m
    f = netsim.DEFAULT_BACKWARD_FRACTION
    assert st.iteration_s == pytest.approx(max(t_c + per, (1 - f) * t_c + f * t_c / m + m * per))
    # two rounds per bucket: one more latency term per bucket, same bandwidth term
    st2 = netsim.step_time(payload, link, n=n, compute_time=t_c, bucket_bytes=None, rounds=2)
    one = 2 * 2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * payload * 8 / (10 * GBIT)
    assert st2.iteration_s == pytest.approx(t_c + one)


def test_collectives_path_matches_analytic_path():
    link, n = Link(10 * GBIT, 2e-5), 16
    leaves = [_C("all_reduce", 10e6)] * 8  # 80 MB in 8 equal leaves, 4 buckets of 2
    a = netsim.step_time_for_collectives(leaves, link, n=n, compute_time=0.1, bucket_bytes=20e6)
    b = netsim.step_time(80e6, link, n=n, compute_time=0.1, bucket_bytes=20e6)
    assert a.n_buckets == b.n_buckets == 4
    assert a.iteration_s == pytest.approx(b.iteration_s, rel=1e-12)


BANDWIDTHS = [0.5, 1, 2, 5, 10, 25, 40, 100, 200, 400, 800]


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "hierarchical"])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_more_bandwidth_never_slower(algorithm, kind):
    times = []
    for g in BANDWIDTHS:
        c = Cluster(4, 8, intra=Link(1000 * GBIT, 3e-6), inter=Link(g * GBIT, 20e-6))
        st = netsim.step_time(
            3e7, c, compute_time=0.15, kind=kind, algorithm=algorithm, gradient_bytes=4e8,
            encode_time=0.01, decode_time=0.002,
        )  # fmt: skip
        times.append(st.iteration_s)
    assert all(t1 >= t2 for t1, t2 in zip(times, times[1:], strict=False))
    assert times[0] > times[-1]


def test_collectives_more_bandwidth_never_slower():
    for fn in (
        netsim.ring_allreduce_time,
        netsim.halving_doubling_allreduce_time,
        netsim.allgather_time,
        netsim.reduce_scatter_time,
        netsim.parameter_server_time,
    ):
        ts = [fn(S, 16, Link(g * GBIT, 1e-5)) for g in BANDWIDTHS]
        assert ts == sorted(ts, reverse=True), fn.__name__


# --- required_compression -------------------------------------------------------

SLOW = Cluster(8, 8, intra=Link(1200 * GBIT, 5e-6), inter=Link(10 * GBIT, 25e-6))


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("target_sf", [0.5, 0.9, 0.97])
def test_required_compression_inverts_step_time(kind, target_sf):
    model, t_c = 4 * 25.6e6, 0.1
    opts = dict(kind=kind, algorithm="hierarchical", backward_fraction=0.6)
    r = netsim.required_compression(model, t_c, SLOW, target_sf, **opts)
    assert 1 < r < math.inf

    def sf(ratio):
        return netsim.step_time(
            model / ratio, SLOW, compute_time=t_c, gradient_bytes=model, **opts
        ).scaling_factor

    assert sf(r) >= target_sf
    assert sf(r) == pytest.approx(target_sf, abs=1e-6)
    assert sf(r * (1 - 1e-4)) < target_sf


def test_required_compression_against_closed_form():
    # one bucket, a Link, no latency: T = T_c + 2(n-1)/n · (S/r)/B  =>  r = closed form
    n, bw, t_c, model, target = 16, 10 * GBIT, 0.2, 4e8, 0.8
    comm_dense = 2 * (n - 1) / n * model * 8 / bw
    expected = comm_dense / (t_c / target - t_c)
    r = netsim.required_compression(
        model, t_c, Link(bw), target, n=n, bucket_bytes=None, backward_fraction=0.5
    )
    assert r == pytest.approx(expected, rel=1e-7)


def test_required_compression_none_needed_and_unreachable():
    fast = Cluster(8, 8, intra=Link(1200 * GBIT), inter=Link(400 * GBIT))
    assert netsim.required_compression(4e8, 1.0, fast, 0.9) == 1.0
    # latency alone exceeds the budget: no compression ratio helps
    laggy = Link(10 * GBIT, 0.05)
    assert netsim.required_compression(4e8, 0.1, laggy, 0.9, n=8) == math.inf


@pytest.mark.parametrize("target_sf", [0, 1, 1.5, -0.1])
def test_required_compression_rejects_target_outside_open_interval(target_sf):
    with pytest.raises(ValueError, match=r"target_sf.*\(0, 1\)"):
        netsim.required_compression(4e8, 0.1, SLOW, target_sf)


# --- top-k break-even -----------------------------------------------------------


@pytest.mark.parametrize("n", [2, 8, 64, 1000])
def test_topk_break_even_matches_the_collective_costs(n):
    d, link = 10**7, Link(GBIT)  # no latency: bandwidth terms only
    rho = netsim.topk_break_even_density(n)
    assert rho == pytest.approx(1 / n)
    sparse = netsim.allgather_time(rho * d * (4 + 4), n, link)
    dense = netsim.ring_allreduce_time(4 * d, n, link)
    assert sparse == pytest.approx(dense, rel=1e-12)
    assert netsim.topk_allgather_ratio(rho, n) == pytest.approx(1.0)
    assert netsim.topk_allgather_ratio(0.01, n) == pytest.approx(
        netsim.allgather_time(0.01 * d * 8, n, link) / dense, rel=1e-12
    )


def test_topk_ratio_with_bf16_values():
    # bf16 values + int32 indices vs an fp32 ring: n·ρ·6/8
    assert netsim.topk_allgather_ratio(0.01, 100, value_bytes=2) == pytest.approx(0.75)


# --- bad inputs -----------------------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: netsim.ring_allreduce_time(S, 0, LINK), "n"),
        (lambda: netsim.allgather_time(S, -3, LINK), "n"),
        (lambda: netsim.ring_allreduce_time(-1.0, 4, LINK), "nbytes"),
        (lambda: netsim.parameter_server_time(S, 4, LINK, shards=0), "shards"),
        (lambda: netsim.bucketed_step_time([0.1], compute_time=0.0), "compute_time"),
        (lambda: netsim.bucketed_step_time([0.1], compute_time=1, backward_fraction=1.5),
         "backward_fraction"),
        (lambda: netsim.bucketed_step_time([0.1], compute_time=1, backward_fraction=-0.1),
         "backward_fraction"),
        (lambda: netsim.bucketed_step_time([0.1], compute_time=1, encode_time=-1), "encode_time"),
        (lambda: netsim.bucketed_step_time([], compute_time=1), "bucket_comm_s"),
        (lambda: netsim.step_time(S, LINK, n=4, compute_time=1, bucket_bytes=0), "bucket_bytes"),
        (lambda: netsim.allreduce_time(S, LINK, n=4, algorithm="tree"), "algorithm"),
        (lambda: netsim.allreduce_time(S, LINK), "n"),
        (lambda: netsim.allreduce_time(S, SLOW, n=7), "n"),
        (lambda: netsim.topk_allgather_ratio(0.0, 8), "density"),
        (lambda: netsim.topk_break_even_density(1), "n"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


def test_netsim_does_not_import_jax_at_module_level():
    tree = ast.parse(inspect.getsource(netsim))
    top = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in getattr(node, "names", [])
    ]
    heavy = {"jax", "jaxlib", "numpy", "optax"}
    assert not [m for m in top if m.split(".")[0] in heavy or m == "jaxcomm.accounting"], top
