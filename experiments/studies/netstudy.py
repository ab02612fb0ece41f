r"""Time-to-accuracy on real, shaped links: every method, several rates and process counts.

Command (root, iproute2; ~35 min on 2 CPU cores for the default grid):
  python -m experiments.studies.netstudy --out=experiments/results/netstudy.json
Quick look (one model, one rate):
  python -m experiments.studies.netstudy --models=digits_mlp --rates=100mbit --processes=2

Every cell is a real run: ``experiments.launch`` starts the processes (one fake
CPU device each, gloo collectives), each in its own network namespace with every
egress shaped by ``tc ... tbf`` to the rate (``--rates`` entry ``loopback``: no
lab). ``experiments.main`` trains the digits MLP config's variant for the method
and process 0 records, after every ``eval_every`` steps, the accuracy and
``train_s``: the measured wall clock of the training calls (compute, encode,
exchange, decode; compile and evaluation excluded). Time-to-accuracy is
``train_s`` at the first evaluation reaching the model's target (the dense
loopback run's final accuracy minus 1 point).

Cells whose dense exchange would take more than ``--max_run_s`` are run for
``--probe_steps`` steps only; their time-to-accuracy is the measured time per
step times the steps the same method needed on loopback (the trajectory does
not depend on the link: same processes, same arithmetic). They are flagged
``"extrapolated": true``.

For every shaped cell the JSON also holds jaxcomm.netsim's prediction,
calibrated on the loopback run of the same cell: measured loopback step time
(compute, loopback latency, encode/decode) + the collectives per step times the
extra latency of the shaped link over loopback (each measured first, as the
median time of a dependent scalar all-reduce inside one compiled scan, on
loopback and on each link: ``alpha_s``) + the bytes the compiled exchange moves
(``wire_report(..., backend="cpu")``: XLA:CPU sums bf16 in f32) at the shaped
rate, as TCP goodput over Ethernet (1448 payload bytes per 1514-byte frame).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import PartitionSpec as P

from experiments import data as data_lib
from experiments import models, optimizers
from experiments.configs import digits_mlp
from experiments.netlab import parse_rate
from experiments.studies import runs
from jaxcomm import accounting, distributed, netsim
from jaxcomm.compressors.dgc import dgc_density_schedule

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (defined only when run, so the module imports beside others)."""
    flags.DEFINE_list("models", ["digits_mlp", "wide_mlp"], "models (see MODELS)")
    flags.DEFINE_list("rates", ["loopback", "1gbit", "100mbit", "10mbit"], "link rates")
    flags.DEFINE_list("processes", ["2"], "process counts")
    flags.DEFINE_list(
        "methods",
        [
            "dense",
            "dense_leaf",
            "bf16",
            "topk",
            "threshold",
            "dgc",
            "powersgd",
            "ef_sign",
            "local_sgd",
            "diloco",
        ],
        "digits_mlp config variants",
    )
    flags.DEFINE_float(
        "max_run_s", 150.0, "longest full run; slower cells are probed and extrapolated"
    )
    flags.DEFINE_integer("probe_steps", 25, "steps measured in an extrapolated cell")
    flags.DEFINE_string(
        "out", "experiments/results/netstudy.json", "JSON written (and updated) here"
    )
    flags.DEFINE_string("workroot", "runs/netstudy", "workdirs of the runs")
    flags.DEFINE_bool(
        "report", False, "only print the markdown tables and write the plot from --out"
    )
    flags.DEFINE_bool("alpha_worker", False, "internal: time chained scalar psums (run by --alpha)")
    flags.DEFINE_list(
        "rerun", [], "cells to measure again although --out has them: MODEL/N/METHOD (all rates)"
    )
    flags.DEFINE_bool(
        "repredict",
        False,
        "only recompute the netsim predictions of the cells in --out, then report",
    )


# Model overrides on top of experiments/configs/digits_mlp.py.
MODELS = {
    "digits_mlp": {"steps": 400, "overrides": []},  # 9.6k params, 38 KB of fp32 gradient
    "wide_mlp": {  # 1.12M params, 4.5 MB of fp32 gradient: communication dominates
        "steps": 200,
        "overrides": ["--config.model.kwargs.hidden=1024", "--config.model.kwargs.depth=2"],
    },
}
ETHERNET_GOODPUT = 1448 / 1514  # TCP payload per Ethernet frame (MTU 1500, timestamps)
EVERY = 25


def _run_cell(model: str, n: int, rate: str, method: str, steps: int) -> dict:
    workdir = os.path.join(FLAGS.workroot, model, f"n{n}", rate, method)
    subprocess.run(["rm", "-rf", workdir], check=True)
    argv = [
        sys.executable, "-m", "experiments.launch", f"--processes={n}", "--devices_per_process=1",
        *([] if rate == "loopback" else [f"--rate={rate}"]), "--",
        sys.executable, "-m", "experiments.main",
        f"--config=experiments/configs/digits_mlp.py:{method}", f"--workdir={workdir}",
        f"--config.num_train_steps={steps}", f"--config.steps_per_call={EVERY}",
        f"--config.eval_every={EVERY}", "--config.checkpoint_every=0",
        "--config.progress=False", "--config.plot=False", *MODELS[model]["overrides"],
    ]  # fmt: skip
    return runs.launched(argv, workdir, ("step", "accuracy", "train_s", "wire_bytes", "loss"))


ALPHA_CHAIN = 200  # dependent scalar all-reduces per compiled call


def alpha_worker() -> None:
    """Per-collective latency inside a compiled program: a scan of dependent scalar psums."""
    distributed.initialize()
    mesh = distributed.global_mesh("data")
    x = distributed.shard_rows(jnp.ones((mesh.size,)), mesh, "data")

    def chain(v):
        def body(c, _):
            s = jax.lax.psum(c, "data") / mesh.size + 1e-3
            return jax.lax.pcast(s, "data", to="varying"), None

        return jax.lax.scan(body, v, None, length=ALPHA_CHAIN)[0]

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    f = f.lower(x).compile()
    jax.block_until_ready(f(x))
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append((time.perf_counter() - t0) / ALPHA_CHAIN)
    if jax.process_index() == 0:
        print("ALPHA_S", sorted(times)[len(times) // 2], flush=True)


def measure_alpha(n: int, rate: str) -> float:
    """Median seconds per small all-reduce between ``n`` processes on ``rate`` (or loopback)."""
    argv = [
        sys.executable, "-m", "experiments.launch", f"--processes={n}", "--devices_per_process=1",
        *([] if rate == "loopback" else [f"--rate={rate}"]), "--",
        sys.executable, "-m", "experiments.studies.netstudy", "--alpha_worker",
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return float(out.split("ALPHA_S")[1].split()[0])


def _comm_prediction(
    model: str, n: int, method: str, rate_bps: float, steps: int
) -> tuple[float, float, float]:
    """Per step: bytes a worker moves, netsim seconds at ``rate_bps`` (no latency), collectives.

    Averaged over the first ``steps`` steps (DGC's warm-up sends more at first).

    Collectives: the transform's (``wire_report``) plus the training step's loss
    ``pmean``; local SGD / DiLoCo's are amortised over their sync period.
    """
    config = digits_mlp.get_config(method)
    for o in MODELS[model]["overrides"]:
        key, value = o.removeprefix("--config.").split("=")
        config.model.kwargs[key.split(".")[-1]] = int(value)
    ds = data_lib.load(config.data, n, seed=0)
    net = models.build("mlp", num_classes=ds.num_classes, **dict(config.model.kwargs))
    params = net.init(jax.random.key(0), ds.example_input(), train=False)["params"]
    link = netsim.Link(rate_bps * ETHERNET_GOODPUT, 0.0)
    fraction = optimizers.comm_steps(config, 1000) / 1000  # local SGD / DiLoCo sync 1 step in H
    wire = per_comm = colls = 0.0
    for weight, cfg in _phases(config, steps):
        # the bytes CPU processes move: XLA:CPU sums bf16 in f32 (see jaxcomm.accounting)
        moved = accounting.wire_report(optimizers.make_optimizer(cfg), params, n, backend="cpu")
        per_comm += weight * (netsim.exchange_time(moved, n, link) if moved else 0.0)
        wire += weight * sum(netsim_bytes(c, n) for c in moved)
        colls += weight * len(moved)
    return wire * fraction, per_comm * fraction, 1 + colls * fraction


def _phases(config, steps: int) -> list[tuple[float, object]]:
    """``(fraction of the run's steps, config)`` for each phase with its own payload.

    One phase for most methods. DGC's warm-up sends a larger share of the
    gradient in its first epochs; its wire report counts every warm-up branch
    at once (an upper bound), so each density of ``dgc_density_schedule`` is
    priced as a DGC without warm-up at that density, weighted by its steps.
    """
    kw = dict(config.compressor.kwargs)
    if config.compressor.name not in ("dgc", "dgc_sgd") or not kw.get("warmup_steps"):
        return [(1.0, config)]
    sched_keys = ("ratio", "warmup_steps", "warmup_epochs", "warmup_ratios")
    schedule = dgc_density_schedule(**{k: kw[k] for k in sched_keys if k in kw})
    counts: dict[float, int] = {}
    for t in range(steps):
        counts[schedule(t)] = counts.get(schedule(t), 0) + 1
    phases = []
    for density, count in counts.items():
        cfg = config.copy_and_resolve_references()
        cfg.compressor.kwargs.ratio = density
        cfg.compressor.kwargs.warmup_steps = 0
        phases.append((count / steps, cfg))
    return phases


def predict(cell: dict, base: dict, alphas: dict, steps: int) -> dict:
    """netsim's prediction for a shaped cell, calibrated on its loopback run ``base``.

    ``steps``: the steps the cell runs (its probe's when extrapolated).
    """
    n, rate = cell["n"], cell["rate"]
    wire, comm_s, colls = _comm_prediction(cell["model"], n, cell["method"], _rate_bps(rate), steps)
    step_lb = base["train_s"] / base["steps"]
    extra_alpha = alphas[f"{n}/{rate}"] - alphas[f"{n}/loopback"]
    return {
        "wire_bytes_per_step": wire,
        "collectives_per_step": colls,
        "predicted_step_s": step_lb + colls * extra_alpha + comm_s,
        "loopback_step_s": step_lb,
    }


def netsim_bytes(c, n: int) -> float:
    """Bytes one worker sends for a collective (ring all-reduce, all-gather)."""
    if c.kind == "all_reduce":
        return 2 * (n - 1) / n * c.nbytes
    if c.kind == "all_gather":
        return (n - 1) * c.nbytes
    return c.nbytes


def time_to(curve: list[dict], target: float) -> tuple[float | None, int | None]:
    for r in curve:
        if r["accuracy"] >= target:
            return r["train_s"], r["step"]
    return None, None


def _rate_bps(rate: str) -> float:
    return float(parse_rate(rate))


def _fmt_s(x: float | None) -> str:
    return "—" if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def report(results: dict, plot_path: str | None) -> str:
    """Markdown tables (time to accuracy and final accuracy; netsim vs measured) and a plot."""
    cells = results["cells"]
    lines = []
    groups = sorted({(c["model"], c["n"]) for c in cells})
    for model, n in groups:
        mine = [c for c in cells if c["model"] == model and c["n"] == n]
        rates = [
            r
            for r in ("loopback", "1gbit", "100mbit", "10mbit")
            if any(c["rate"] == r for c in mine)
        ]
        methods = list(dict.fromkeys(c["method"] for c in mine))
        get = {(c["rate"], c["method"]): c for c in mine}
        lines += [
            f"**{model}, {n} processes** — time to {100 * results['targets'][model]:.1f}% test "
            "accuracy, measured seconds of training (* extrapolated from measured steps), and "
            "final test accuracy. One seed per cell and a target dense can meet at its first "
            "evaluation, so these runs do not meet the verdict rules of "
            "`experiments/studies/verdict.py`: no speed-up is claimed from them (the LM study "
            "is the one that does).",
            "",
            "| method | " + " | ".join(f"{r}: time / final acc" for r in rates) + " |",
            "|---|" + "---|" * len(rates),
        ]
        for m in methods:
            row = []
            for r in rates:
                c = get.get((r, m))
                if c is None:
                    row.append("")
                    continue
                t = "not reached" if c["tta_s"] is None else _fmt_s(c["tta_s"])
                t += "*" if c["tta_s"] is not None and c["extrapolated"] else ""
                row.append(f"{t} / {c['final_accuracy']:.4f}")
            lines.append(f"| {m} | " + " | ".join(row) + " |")
        lines += [
            "",
            f"Step time, measured vs `jaxcomm.netsim` (calibrated on loopback), {model}, "
            f"{n} processes:",
            "",
            "| method | " + " | ".join(f"{r} meas / pred" for r in rates[1:]) + " |",
            "|---|" + "---|" * (len(rates) - 1),
        ]
        for m in methods:
            row = []
            for r in rates[1:]:
                c = get.get((r, m))
                if c is None or "predicted_step_s" not in c:
                    row.append("")
                    continue
                err = c["step_s"] / c["predicted_step_s"] - 1
                row.append(
                    f"{c['step_s'] * 1e3:.1f} / {c['predicted_step_s'] * 1e3:.1f} ms ({err:+.0%})"
                )
            lines.append(f"| {m} | " + " | ".join(row) + " |")
        lines.append("")
    if plot_path:
        # lazy: the tables (studies.tables imports this module) render without matplotlib
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rates = [
            r
            for r in ("loopback", "1gbit", "100mbit", "10mbit")
            if any(c["rate"] == r for c in cells)
        ]
        fig, axes = plt.subplots(
            len(groups), len(rates), figsize=(3.4 * len(rates), 3 * len(groups)), squeeze=False
        )
        for gi, (model, n) in enumerate(groups):
            for ri, r in enumerate(rates):
                ax = axes[gi][ri]
                for c in cells:
                    if (c["model"], c["n"], c["rate"]) == (model, n, r) and not c["extrapolated"]:
                        xs = [p["train_s"] for p in c["curve"]]
                        ax.plot(xs, [100 * p["accuracy"] for p in c["curve"]], label=c["method"])
                ax.axhline(100 * results["targets"][model], color="gray", lw=0.8, ls="--")
                ax.set_xscale("log")
                ax.set_title(f"{model}, n={n}, {r}", fontsize=9)
                ax.set_xlabel("measured training time (s)")
                ax.set_ylim(80, 100)
                ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy (%)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=90)
        plt.close(fig)
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.alpha_worker:
        alpha_worker()
        return
    if FLAGS.report:
        with open(FLAGS.out) as f:
            print(report(json.load(f), FLAGS.out.removesuffix(".json") + ".png"))
        return
    results = {"cells": [], "targets": {}, "note": __doc__.split("\n\n")[1]}
    if os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            results = json.load(f)
    done = {(c["model"], c["n"], c["rate"], c["method"]): c for c in results["cells"]}
    for pattern in FLAGS.rerun:
        model, n, method = pattern.split("/")
        done = {k: c for k, c in done.items() if (k[0], str(k[1]), k[3]) != (model, n, method)}
    if FLAGS.repredict:
        for (model, n, rate, method), c in done.items():
            if rate != "loopback":
                steps = c["steps"] if c["extrapolated"] else MODELS[model]["steps"]
                c.update(
                    predict(c, done[(model, n, "loopback", method)], results["alpha_s"], steps)
                )
        results["cells"] = list(done.values())
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=1)
        print(report(results, FLAGS.out.removesuffix(".json") + ".png"))
        return

    def save():
        results["cells"] = sorted(done.values(), key=lambda c: tuple(map(str, c.values()))[:4])
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=1)

    rates = ["loopback"] + [r for r in FLAGS.rates if r != "loopback"]
    alphas = results.setdefault("alpha_s", {})
    for n in map(int, FLAGS.processes):
        for rate in rates:
            if f"{n}/{rate}" not in alphas:
                alphas[f"{n}/{rate}"] = measure_alpha(n, rate)
                print(f"alpha n={n} {rate}: {alphas[f'{n}/{rate}'] * 1e3:.3f} ms", flush=True)
    for model in FLAGS.models:
        steps = MODELS[model]["steps"]
        for n in map(int, FLAGS.processes):
            for rate in rates:
                for method in FLAGS.methods:
                    key = (model, n, rate, method)
                    if key in done:
                        continue
                    base = done.get((model, n, "loopback", method))
                    cell = {"model": model, "n": n, "rate": rate, "method": method}
                    full_steps, extrapolated = steps, False
                    if rate != "loopback":
                        cell.update(predict(cell, base, alphas, steps))
                        if cell["predicted_step_s"] * steps > FLAGS.max_run_s:
                            full_steps, extrapolated = FLAGS.probe_steps, True
                            # price the steps the probe runs (DGC: its densest warm-up)
                            cell.update(predict(cell, base, alphas, full_steps))
                    run = _run_cell(model, n, rate, method, full_steps)
                    last = run["curve"][-1]
                    cell.update(run, steps=last["step"], train_s=last["train_s"])
                    cell["step_s"] = last["train_s"] / last["step"]
                    cell["final_accuracy"] = last["accuracy"]
                    cell["extrapolated"] = extrapolated
                    if rate == "loopback" and method == "dense":
                        results["targets"][model] = round(last["accuracy"] - 0.01, 4)
                    target = results["targets"][model]
                    if extrapolated:
                        _, lb_steps = time_to(base["curve"], target)
                        cell["tta_steps"] = lb_steps
                        cell["tta_s"] = None if lb_steps is None else lb_steps * cell["step_s"]
                    else:
                        cell["tta_s"], cell["tta_steps"] = time_to(run["curve"], target)
                    done[key] = cell
                    save()
                    pred = cell.get("predicted_step_s")
                    print(
                        f"{model:10s} n={n} {rate:8s} {method:9s} "
                        + f"step {cell['step_s'] * 1e3:8.1f} ms"
                        + (f" (netsim {pred * 1e3:8.1f} ms)" if pred else "")
                        + f"  acc {cell['final_accuracy']:.4f}  tta "
                        + (f"{cell['tta_s']:.2f} s" if cell["tta_s"] is not None else "not reached")
                        + (" (extrapolated)" if extrapolated else ""),
                        flush=True,
                    )
    save()
    print(report(results, FLAGS.out.removesuffix(".json") + ".png"))


if __name__ == "__main__":
    define_flags()
    app.run(main)
