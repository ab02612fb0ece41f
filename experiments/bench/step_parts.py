r"""Where a compressed step goes: no exchange, codec, collectives, the rest.

Command (root, iproute2; ~4 min on 2 CPU cores):
  python -m experiments.bench.step_parts --out=experiments/results/step_parts.json
The LM study's GPT (issue 42's profile of jaxcomm's step over its floor; ~15 min):
  python -m experiments.bench.step_parts --config=lm_shakespeare --steps_per_call=10 \
      --rounds=5 --rates=loopback,100mbit,10mbit --out=experiments/results/step_parts_lm.json
Tables from the JSON (no runs): ``python -m experiments.studies.tables``.

For the digits MLP (``experiments/configs/digits_mlp.py``; ``--hidden`` units,
default 256: the 19.2k parameters of ``experiments.bench.peers``'s MLP; the
config's own 128 is 9.6k), or with ``--config=lm_shakespeare`` the LM study's
GPT and its dense, bf16 and PowerSGD exchanges, on each link of ``--rates`` (2 processes,
``experiments.launch``, each egress shaped by ``tc ... tbf``), one session
per link times, round by round (interleaved, so the machine's load drifts
over all alike; each round in its own seeded random order, the same on every
process):

* ``step``: the config's training call (``--steps_per_call`` steps:
  gradient, exchange, optimizer, as ``experiments.main`` trains) with each
  method's exchange, and with **none** (the optimizer alone, each worker on
  its own batch); per step, the median call over ``--rounds`` rounds;
* ``exchange``: the method's transform alone on a gradient shaped like the
  params (:func:`jaxcomm.policy.measure`: its program's median sample minus
  that of a program that only draws the gradient);
* ``codec``: the same transform built without an axis (compress, decompress
  and error feedback on each worker; nothing sent), measured alike.

A step's parts: ``codec``; ``collectives`` = exchange - codec (their fixed
cost and the bytes on the link); ``rest`` = step - none - exchange (what the
real step adds: waiting for the other process, scheduling beside the
gradient's compute). The digits MLP's target (issue "Compressors at the floor"):
a compressed step within 1.5 ms of the step with no exchange at 100 Mbit/s.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from absl import app, flags

from experiments import advise, optimizers, train
from experiments import data as data_lib
from experiments.bench import timing
from experiments.bench.step_parts_report import report
from experiments.configs import digits_mlp, lm_shakespeare
from experiments.studies import runs, tables
from jaxcomm import accounting, calibrate, distributed, policy

FLAGS = flags.FLAGS
CONFIG = "experiments/configs/digits_mlp.py"
#: The methods timed beside the step with no exchange (digits_mlp.py's variants).
METHODS = ("dense", "bf16_words", "powersgd", "ef_sign", "topk", "threshold")
#: --config -> its module and the methods timed by default (the LM: those set against DDP).
CONFIGS = {"digits_mlp": (digits_mlp, METHODS),
           "lm_shakespeare": (lm_shakespeare, ("dense", "bf16", "powersgd"))}  # fmt: skip


def define_flags() -> None:
    flags.DEFINE_list("rates", ["loopback", "100mbit"], "links (2 processes each)")
    flags.DEFINE_enum("config", "digits_mlp", list(CONFIGS), "the workload")
    flags.DEFINE_list("methods", [], "the config's variants (default: CONFIGS's)")
    flags.DEFINE_integer("hidden", 256, "the MLP's hidden units (the config's own: 128)")
    flags.DEFINE_integer("steps_per_call", 25, "training steps per call")
    flags.DEFINE_integer("rounds", 12, "timed calls of each method (x steps_per_call steps)")
    flags.DEFINE_integer("repeats", 7, "timed samples of each part (policy.measure)")
    flags.DEFINE_string("out", "experiments/results/step_parts.json", "JSON written")
    flags.DEFINE_string("session_out", "", "(internal) one session's JSON, under launch")
    flags.DEFINE_bool("report", False, "only write the tables from --out")


def session(
    methods: list[str], steps_per_call: int, rounds: int, repeats: int, hidden: int = 256,
    config: str = "digits_mlp",
) -> dict:  # fmt: skip
    """One link's measurements; every process of the launch runs it."""
    distributed.initialize()
    module = CONFIGS[config][0]
    configs = {m: module.get_config(m) for m in methods}
    base = module.get_config("dense")
    for c in (base, *configs.values()):
        c.steps_per_call = steps_per_call
        if config == "digits_mlp":
            c.model.kwargs = {**c.model.kwargs, "hidden": hidden}
    n = train.n_workers_of(base)
    ds = data_lib.load(base.data, n, seed=base.seed)
    model, params, stats = train.build_model(base, ds)
    mesh = distributed.global_mesh(optimizers.AXIS, n)
    txs = {"none": advise.base_optimizer(base)}
    txs.update({m: optimizers.make_optimizer(c) for m, c in configs.items()})
    runs = {k: advise.train_call(base, model, params, stats, mesh, ds, tx) for k, tx in txs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for names in timing.shuffled_rounds(runs, rounds):
        got = []
        for k in names:
            start = time.perf_counter()
            runs[k]()
            got.append(time.perf_counter() - start)
        for k, t in zip(names, calibrate.slowest_process(got)):
            times[k].append(t / steps_per_call)

    # measure builds each candidate on optimizers.AXIS; the "@local" ones ignore it (no exchange)
    cands = [policy.Candidate(m, functools.partial(optimizers.make_compressor, configs[m]))
             for m in methods]  # fmt: skip
    cands += [policy.Candidate(f"{m}@local",
                               lambda _, c=configs[m]: optimizers.make_compressor(c, None))
              for m in methods]  # fmt: skip
    parts = policy.measure(params, mesh, optimizers.AXIS, candidates=cands, repeats=repeats,
                           drop=False, statistic="median")  # fmt: skip
    out = {"n": n, "steps_per_call": steps_per_call, "rounds": rounds, "config": config,
           **({"hidden": hidden} if config == "digits_mlp" else {}),
           "params": sum(x.size for x in jax.tree.leaves(params)), "methods": {}}  # fmt: skip
    for k in runs:
        row = {"step_s": statistics.median(times[k]), "mean_step_s": statistics.fmean(times[k])}
        if k != "none":
            comm = optimizers.make_compressor(configs[k])
            row.update(
                exchange_s=parts[k],
                codec_s=parts[f"{k}@local"],
                wire_bytes=sum(c.nbytes for c in accounting.wire_report(comm, params, n)),
            )
        out["methods"][k] = row
    return out


def methods() -> list[str]:
    """--methods, or the config's default ones (:data:`CONFIGS`)."""
    return FLAGS.methods or list(CONFIGS[FLAGS.config][1])


def run_link(rate: str) -> dict:
    """One launched session on ``rate``; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "session.json")
        argv = [sys.executable, "-m", "experiments.launch", "--processes=2",
                "--devices_per_process=1", *([] if rate == "loopback" else [f"--rate={rate}"]),
                "--", sys.executable, "-m", "experiments.bench.step_parts",
                f"--session_out={path}", f"--methods={','.join(methods())}",
                f"--config={FLAGS.config}",
                f"--steps_per_call={FLAGS.steps_per_call}", f"--rounds={FLAGS.rounds}",
                f"--hidden={FLAGS.hidden}",
                f"--repeats={FLAGS.repeats}"]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
            )
        with open(path) as f:
            return json.load(f)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.session_out:
        res = session(
            methods(), FLAGS.steps_per_call, FLAGS.rounds, FLAGS.repeats, FLAGS.hidden,
            FLAGS.config,
        )  # fmt: skip
        if jax.process_index() == 0:
            with open(FLAGS.session_out, "w") as f:
                json.dump(res, f, indent=1)
        return
    if not FLAGS.report:
        results = {"note": "\n\n".join(__doc__.split("\n\n")[2:]), "links": {}}
        for rate in FLAGS.rates:
            results["links"][rate] = run_link(rate)
            print(f"{rate}: done", flush=True)
        runs.save_json(FLAGS.out, results)
    with open(FLAGS.out) as f:
        text = report(json.load(f))
    print(text)
    registered = {os.path.join(tables.RESULTS, doc[1]) for doc in tables.DOCUMENTS.values()}
    if os.path.abspath(FLAGS.out) in registered:  # its .md, and the README's blocks
        tables.main([])
    else:
        with open(os.path.splitext(FLAGS.out)[0] + ".md", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    define_flags()
    app.run(main)
