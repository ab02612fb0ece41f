r"""What-if: when is the network the bottleneck, and how much compression does a link need?

Runs the alpha-beta step-time model of :mod:`jaxcomm.netsim` over link speeds
(1 to 400 Gbps) for ResNet-50, VGG-16, BERT-Large, GPT-2 (1.5B) and
FasterRCNN-sized models, dense fp32, bf16 and each jaxcomm compressor, and
prints tables, writes PNG plots and a JSON file to ``--outdir``:

* scaling factor ``SF = T_c / T_iter`` vs bandwidth, per model and compressor;
* the compression ratio needed for ``SF >= --target_sf``;
* Zhang et al. 2020 ("Is Network the Bottleneck of Distributed Training?",
  arXiv:2006.10103): ResNet-50 / VGG-16 on 8-64 V100-class GPUs;
* the DGC speedup pattern at 100 / 10 / 1 Gbps for a FasterRCNN-sized model;
* the top-k all-gather break-even vs a dense ring, as a function of n.

Bytes per step come from analytic per-compressor formulas (default, nothing
traced) or, with ``--from_transforms``, from
``jaxcomm.accounting.wire_report`` of the real transforms traced on
``jax.ShapeDtypeStruct`` parameter trees of the same shapes.

Command (about 10 s on a laptop CPU; add ``--noplots`` to skip matplotlib)::

  python -m experiments.bench.whatif --outdir whatif_out
  python -m experiments.bench.whatif --from_transforms --models resnet50,vgg16

Every input of the model (compute times and their basis, links, latencies,
bucket size, encode costs) is printed and stored in ``whatif.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.bench.whatif_inputs import FP32, MODELS, SCHEMES, Model, Scheme, build_transform
from experiments.studies import runs
from jaxcomm import accounting, netsim

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags; defined only when run as a program, so that importing this
    module does not clash with other experiments' flags of the same name."""
    flags.DEFINE_string("outdir", "whatif_out", "Where PNG plots and whatif.json go.")
    flags.DEFINE_list(
        "bandwidths_gbps", ["1", "2", "5", "10", "25", "40", "100", "200", "400"],
        "Inter-node (per node) bandwidths to sweep, Gbps.",
    )  # fmt: skip
    flags.DEFINE_list(
        "models",
        ["resnet50", "vgg16", "bert_large", "gpt2_xl", "fasterrcnn"],
        "Models to evaluate.",
    )
    flags.DEFINE_integer("n_nodes", 8, "Nodes in the cluster.")
    flags.DEFINE_integer("per_node", 8, "Workers (GPUs) per node.")
    flags.DEFINE_float("intra_gbps", 1200.0, "Per-GPU intra-node bandwidth, Gbps (V100 NVLink).")
    flags.DEFINE_float("intra_latency_us", 5.0, "Intra-node latency per message, microseconds.")
    flags.DEFINE_float("inter_latency_us", 25.0, "Inter-node latency per message, microseconds.")
    flags.DEFINE_float("target_sf", 0.9, "Scaling factor wanted by the required-compression table.")
    flags.DEFINE_float("backward_fraction", 2 / 3, "Part of the compute that is the backward pass.")
    flags.DEFINE_float("bucket_mb", 25.0, "Gradient bucket size, MiB (PyTorch DDP default 25).")
    flags.DEFINE_float("hbm_gbytes_per_s", 800.0, "Achieved device memory bandwidth, GB/s.")
    flags.DEFINE_bool("from_transforms", False, "Bytes from jaxcomm.accounting.wire_report.")
    flags.DEFINE_bool("plots", True, "Write PNG plots (needs matplotlib).")


ZHANG_BANDWIDTHS = (100.0, 25.0, 10.0)
DGC_BANDWIDTHS = (100.0, 10.0, 1.0)
DGC_PUBLISHED = {100.0: 1.0, 10.0: 1.5, 1.0: 6.5}


# --- the model ------------------------------------------------------------------


def cluster_at(gbps: float) -> netsim.Cluster:
    """The cluster of the flags with a ``gbps`` network between nodes."""
    return netsim.Cluster(
        FLAGS.n_nodes,
        FLAGS.per_node,
        intra=netsim.Link.from_gbps(FLAGS.intra_gbps, FLAGS.intra_latency_us * 1e-6),
        inter=netsim.Link.from_gbps(gbps, FLAGS.inter_latency_us * 1e-6),
    )


def _costs(scheme: Scheme, payload: float, d: int, n: int) -> tuple[float, float]:
    """(encode, decode) seconds: passes over the gradient, and reading what arrived."""
    if scheme.encode_passes == 0:
        return 0.0, 0.0
    hbm = FLAGS.hbm_gbytes_per_s * 1e9
    received = n * payload if scheme.kind == "all_gather" else payload
    return scheme.encode_passes * FP32 * d / hbm, (received + FP32 * d) / hbm


def _options() -> dict:
    return dict(
        algorithm="hierarchical",
        bucket_bytes=FLAGS.bucket_mb * 2**20,
        backward_fraction=FLAGS.backward_fraction,
    )


def scheme_step(
    scheme: Scheme, model: Model, cluster: netsim.Cluster, report: Sequence | None = None
) -> netsim.StepTime:
    """Step time of ``model`` on ``cluster`` exchanging with ``scheme``.

    Bytes from the scheme's analytic formula, or from a ``wire_report`` list of
    collectives when ``report`` is given (each collective then costed by its kind).
    """
    shapes = model.shapes()
    d = sum(math.prod(s) for s in shapes)
    payload = scheme.payload(d, shapes) if report is None else sum(c.nbytes for c in report)
    enc, dec = _costs(scheme, payload, d, cluster.n_workers)
    common = dict(
        compute_time=model.compute_s, gradient_bytes=FP32 * d, encode_time=enc, decode_time=dec,
        **_options(),
    )  # fmt: skip
    if report is not None:  # params are listed in forward order; backward readies them reversed
        return netsim.step_time_for_collectives(report[::-1], cluster, **common)
    return netsim.step_time(payload, cluster, kind=scheme.kind, rounds=scheme.rounds, **common)


def transform_reports(names: Sequence[str]) -> dict[tuple[str, str], list]:
    """``wire_report`` of the real jaxcomm transforms (traced on shapes, nothing computed)."""
    out = {}
    n = FLAGS.n_nodes * FLAGS.per_node
    for name in names:
        params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in MODELS[name].shapes()]
        for scheme in SCHEMES:
            out[name, scheme.label] = accounting.wire_report(
                build_transform(scheme),
                params,
                n,
                backend="gpu",  # the clusters modelled
            )
    return out


# --- tables ---------------------------------------------------------------------


def _analytic_bytes(name: str, label: str) -> float:
    shapes = MODELS[name].shapes()
    scheme = next(s for s in SCHEMES if s.label == label)
    return scheme.payload(sum(math.prod(s) for s in shapes), shapes)


def _fmt_ratio(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:.1f}x"


def _print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def sf_sweep(names, bandwidths, reports) -> dict:
    """SF[model][scheme][i] at bandwidths[i]; with ``reports``, only the schemes reported."""
    out = {}
    for name in names:
        model = MODELS[name]
        out[name] = {}
        for scheme in SCHEMES:
            report = None if reports is None else reports.get((name, scheme.label))
            if reports is not None and report is None:
                continue
            out[name][scheme.label] = [
                scheme_step(scheme, model, cluster_at(g), report).scaling_factor for g in bandwidths
            ]
    return out


def required_table(names, bandwidths) -> dict:
    """Compression ratio needed for SF >= target, all-reduce- and all-gather-style."""
    out = {}
    for name in names:
        model = MODELS[name]
        d = sum(math.prod(s) for s in model.shapes())
        out[name] = {
            kind: [
                netsim.required_compression(
                    FP32 * d, model.compute_s, cluster_at(g), FLAGS.target_sf, kind=kind,
                    **_options(),
                )
                for g in bandwidths
            ]
            for kind in ("all_reduce", "all_gather")
        }  # fmt: skip
    return out


def zhang_table() -> list[dict]:
    """Zhang et al. 2020: ResNet-50 / VGG-16, 8-64 GPUs, dense SF and ratio for SF >= target."""
    rows = []
    for name in ("resnet50", "vgg16"):
        model = MODELS[name]
        d = sum(math.prod(s) for s in model.shapes())
        for nodes in (1, 2, 4, 8):
            for gbps in ZHANG_BANDWIDTHS:
                c = dataclasses.replace(cluster_at(gbps), n_nodes=nodes)
                sf = scheme_step(SCHEMES[0], model, c).scaling_factor
                ratio = netsim.required_compression(
                    FP32 * d, model.compute_s, c, FLAGS.target_sf, **_options()
                )
                rows.append(dict(model=name, gpus=c.n_workers, gbps=gbps, sf=sf, ratio=ratio))
    return rows


def dgc_table() -> list[dict]:
    """DGC (0.1% density, all-gather) vs dense fp32 on a FasterRCNN-sized model."""
    dense, dgc = SCHEMES[0], next(s for s in SCHEMES if s.label.startswith("DGC"))
    model = MODELS["fasterrcnn"]
    rows = []
    for gbps in DGC_BANDWIDTHS:
        c = cluster_at(gbps)
        t_dense = scheme_step(dense, model, c).iteration_s
        t_dgc = scheme_step(dgc, model, c).iteration_s
        rows.append(dict(gbps=gbps, dense_s=t_dense, dgc_s=t_dgc, speedup=t_dense / t_dgc,
                         published=DGC_PUBLISHED[gbps]))  # fmt: skip
    return rows


def topk_table(ns: Sequence[int], densities: Sequence[float]) -> dict:
    """Top-k all-gather / dense ring bandwidth-term ratio and break-even density vs n."""
    return {
        "n": list(ns),
        "ratio": {str(r): [netsim.topk_allgather_ratio(r, n) for n in ns] for r in densities},
        "break_even_density": [netsim.topk_break_even_density(n) for n in ns],
    }


# --- plots ----------------------------------------------------------------------


def write_plots(outdir, names, bandwidths, sf, req, topk, dgc) -> list[str]:
    # lazy: matplotlib is optional (--noplots runs without it), and headless here (Agg)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name):
        path = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    cols = min(3, len(names))
    rows = math.ceil((len(names) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.8 * rows), squeeze=False)
    axes = list(axes.flat)
    colors = plt.get_cmap("tab20").colors
    for ax, name in zip(axes, names, strict=False):
        for i, (label, values) in enumerate(sf[name].items()):
            style = "-" if label in ("dense fp32", "bf16") else "--"
            ax.plot(bandwidths, values, style, marker=".", color=colors[i % 20], label=label)
        ax.axhline(FLAGS.target_sf, color="gray", lw=0.8)
        ax.set(xscale="log", ylim=(0, 1.02), xlabel="inter-node bandwidth (Gbps)",
               ylabel="SF = T_c / T_iter",
               title=f"{MODELS[name].label} ({FLAGS.n_nodes}x{FLAGS.per_node} GPUs)")  # fmt: skip
    handles, labels = axes[0].get_legend_handles_labels()
    axes[len(names)].legend(handles, labels, loc="center", fontsize=8)
    for ax in axes[len(names) :]:
        ax.axis("off")
    save(fig, "sf_vs_bandwidth.png")

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, name in enumerate(names):
        for kind, style in (("all_reduce", "-"), ("all_gather", ":")):
            ys = [r if math.isfinite(r) else float("nan") for r in req[name][kind]]
            ax.plot(bandwidths, ys, style, marker=".", color=f"C{i}",
                    label=f"{MODELS[name].label} ({kind})")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="inter-node bandwidth (Gbps)",
           ylabel=f"compression ratio for SF >= {FLAGS.target_sf}")  # fmt: skip
    ax.legend(fontsize=7)
    save(fig, "required_compression.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r, ys in topk["ratio"].items():
        ax1.plot(topk["n"], ys, marker=".", label=f"density {float(r):g}")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xscale="log", yscale="log", xlabel="workers n",
            ylabel="top-k all-gather / dense ring (bytes term)",
            title="n·ρ·(v+i) / (2·b),  v=i=b=4")  # fmt: skip
    ax1.legend()
    ax2.plot(topk["n"], topk["break_even_density"], marker=".")
    ax2.set(xscale="log", yscale="log", xlabel="workers n", ylabel="break-even density ρ*",
            title="ρ* = 2·b / (n·(v+i)) = 1/n")  # fmt: skip
    save(fig, "topk_break_even.png")

    fig, ax = plt.subplots(figsize=(5, 4))
    xs = range(len(dgc))
    ax.bar([x - 0.2 for x in xs], [r["speedup"] for r in dgc], 0.4, label="this model")
    ax.bar([x + 0.2 for x in xs], [r["published"] for r in dgc], 0.4, label="published")
    ax.set_xticks(list(xs), [f"{r['gbps']:g} Gbps" for r in dgc])
    ax.set(ylabel="DGC speedup over dense", title="FasterRCNN-sized model")
    ax.legend()
    save(fig, "dgc_speedup.png")
    return paths


# --- main -----------------------------------------------------------------------


def main(argv: Sequence[str]) -> None:
    del argv
    names = list(FLAGS.models)
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise app.UsageError(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    bandwidths = [float(g) for g in FLAGS.bandwidths_gbps]
    os.makedirs(FLAGS.outdir, exist_ok=True)
    c = cluster_at(bandwidths[0])
    print(f"Cluster: {c.n_nodes} nodes x {c.per_node} GPUs, intra {FLAGS.intra_gbps:g} Gbps "
          f"({FLAGS.intra_latency_us:g} us), inter latency {FLAGS.inter_latency_us:g} us, "
          f"hierarchical all-reduce, buckets {FLAGS.bucket_mb:g} MiB, backward fraction "
          f"{FLAGS.backward_fraction:.3f}")  # fmt: skip
    _print_table("Models", ["model", "params", "T_c (s)", "basis"], [
        [MODELS[m].label, f"{sum(math.prod(s) for s in MODELS[m].shapes()) / 1e6:.1f}M",
         f"{MODELS[m].compute_s:.3f}", MODELS[m].basis] for m in names
    ])  # fmt: skip

    reports = transform_reports(names) if FLAGS.from_transforms else None
    if reports is not None:
        _print_table(
            "Wire bytes per worker per step: analytic formula vs wire_report",
            ["model", "scheme", "analytic", "wire_report", "kinds"],
            [[MODELS[m].label, label, f"{_analytic_bytes(m, label) / 1e6:.3f} MB",
              f"{sum(c.nbytes for c in r) / 1e6:.3f} MB", ",".join(sorted({c.kind for c in r}))]
             for (m, label), r in reports.items()],
        )  # fmt: skip
    sf = sf_sweep(names, bandwidths, reports)
    for name in names:
        _print_table(
            f"SF vs inter-node bandwidth: {MODELS[name].label}",
            ["scheme"] + [f"{g:g}G" for g in bandwidths],
            [[label] + [f"{v:.2f}" for v in vs] for label, vs in sf[name].items()],
        )
    req = required_table(names, bandwidths)
    _print_table(
        f"Compression ratio needed for SF >= {FLAGS.target_sf} (all-reduce / all-gather payload)",
        ["model"] + [f"{g:g}G" for g in bandwidths],
        [[MODELS[m].label] + [f"{_fmt_ratio(a)}/{_fmt_ratio(b)}" for a, b in
                              zip(req[m]["all_reduce"], req[m]["all_gather"], strict=True)]
         for m in names],
    )  # fmt: skip
    zhang = zhang_table()
    _print_table(
        "Zhang et al. 2020 check: dense fp32 SF and ratio for SF >= target",
        ["model", "GPUs", "Gbps", "SF dense", "ratio"],
        [[MODELS[r["model"]].label, r["gpus"], f"{r['gbps']:g}", f"{r['sf']:.3f}",
          _fmt_ratio(r["ratio"])] for r in zhang],
    )  # fmt: skip
    dgc = dgc_table()
    _print_table(
        f"DGC 0.1% vs dense, FasterRCNN-sized, {c.n_workers} GPUs",
        ["Gbps", "T dense (s)", "T DGC (s)", "speedup", "published"],
        [[f"{r['gbps']:g}", f"{r['dense_s']:.3f}", f"{r['dgc_s']:.3f}",
          f"{r['speedup']:.2f}x", f"{r['published']:g}x"] for r in dgc],
    )  # fmt: skip
    ns = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    topk = topk_table(ns, [0.001, 0.01, 0.1])
    _print_table(
        "Top-k all-gather / dense ring, bandwidth terms: n·ρ·(v+i)/(2·b), v=i=b=4",
        ["n", "rho=0.1%", "rho=1%", "rho=10%", "break-even rho*"],
        [[n] + [f"{topk['ratio'][str(r)][i]:.3f}" for r in (0.001, 0.01, 0.1)]
         + [f"{topk['break_even_density'][i]:.4g}"] for i, n in enumerate(ns)],
    )  # fmt: skip

    result = {
        "inputs": {
            "n_nodes": FLAGS.n_nodes, "per_node": FLAGS.per_node,
            "intra_gbps": FLAGS.intra_gbps, "intra_latency_us": FLAGS.intra_latency_us,
            "inter_latency_us": FLAGS.inter_latency_us, "bucket_mb": FLAGS.bucket_mb,
            "backward_fraction": FLAGS.backward_fraction, "target_sf": FLAGS.target_sf,
            "hbm_gbytes_per_s": FLAGS.hbm_gbytes_per_s, "algorithm": "hierarchical",
            "bytes_from": "wire_report" if FLAGS.from_transforms else "analytic",
            "models": {m: {"params": sum(math.prod(s) for s in MODELS[m].shapes()),
                           "compute_s": MODELS[m].compute_s, "basis": MODELS[m].basis}
                       for m in names},
            "schemes": {s.label: {"kind": s.kind, "encode_passes": s.encode_passes,
                                  "rounds": s.rounds} for s in SCHEMES},
        },
        "bandwidths_gbps": bandwidths,
        "scaling_factor": sf,
        "required_compression": req,
        "zhang2020": zhang,
        "dgc_fasterrcnn": dgc,
        "topk_break_even": topk,
    }  # fmt: skip
    path = os.path.join(FLAGS.outdir, "whatif.json")
    with open(path, "w") as f:
        json.dump(runs.json_ready(result), f, indent=1)
    print(f"\nwrote {path}")
    if FLAGS.plots:
        for p in write_plots(FLAGS.outdir, names, bandwidths, sf, req, topk, dgc):
            print(f"wrote {p}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
