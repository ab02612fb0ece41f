r"""The LM study: time to a validation-loss target on real, shaped links, several seeds.

Command (root, iproute2):
  python -m experiments.studies.lm --validate=100mbit:dense,100mbit:BEST,10mbit:BEST
The trajectories alone (may share the cores), then the timed phases (must not):
  python -m experiments.studies.lm --phases=runs
  python -m experiments.studies.lm --phases=probes,validate --validate=...
Tables and plot from the JSON (no runs):
  python -m experiments.studies.lm --report
The study's running time is measured, not guessed: the report sums every
launched command's wall time from the JSON (``report.running_time``).

What runs, in four phases (``--phases``; each resumes where it stopped).

*runs*: every method of ``experiments/configs/lm_shakespeare.py`` (AdamW with
one warm-up + cosine schedule for all; DiLoCo's inner optimizer is the same;
the optimizer methods have their dense counterparts) trains for the config's
schedule (2,000 steps) with ``--processes`` real processes
(``experiments.launch``, gloo, one CPU device each) for every seed of
``--seeds``, on loopback, evaluating the validation loss every 100 steps (20
evaluations). Those runs give each (method, seed) its trajectory: validation
loss against step. They are not what the study times (their wall clock is
kept, but other work may share the cores while they run), so this phase can
run beside other work. The JSON also holds byte n-gram counting models fitted
on the same training split and scored on the same windows
(:mod:`experiments.studies.ngram`): the lines a model must pass to have
learned more than n-gram statistics.

*recheck* (may share the cores): each method's seed 0 trajectory, perhaps run
on older code, is run again on today's to its first evaluation (loopback,
step 100); the JSON's ``recheck`` says whether the two validation losses are
equal to the last digit, and the report names the methods whose trajectories
are not today's arithmetic. ``--rerun=METHODS --rerun_why=...`` (with the
runs phase) sets those methods' trajectories of ``--seeds`` aside (kept in the
JSON as ``superseded_runs``, each with its recheck, their finals shown beside
today's, never used) and runs them again; a run is stamped with the commit it
ran on, and only unstamped runs are set aside (rerunning the command keeps the
new ones).

The PyTorch peers (``TORCH``: DDP dense, with the fp16 hook, with the PowerSGD
hook at jaxcomm's rank; torchft's DiLoCo and Streaming DiLoCo at the study's
settings) run as methods of the study, through the same phases and verdict
rules (:mod:`experiments.bench.torch_lm_train`; torch is the ``peers`` extra,
torchft the ``ft`` extra; :mod:`experiments.studies.lm_methods`). Streaming
DiLoCo runs twice: in the harness (its fragment exchange inside the step that
sends it) and as users run it, each exchange overlapped with the inner steps
that follow (``*_overlap``: :mod:`experiments.bench.overlap_lm_train`, the same
arithmetic; only the step times differ). Each framework's compute floor
(``FLOORS``: ``nocomm``, ``torch_nocomm``, the step with nothing exchanged) is
probed on loopback only, without trajectories (in the default ``--methods``;
``--methods=nocomm,torch_nocomm`` probes just them). So is, on every link, DDP's
exchange without its overlap (``UNOVERLAPPED``: ``torch_after``,
``torch_after_fp16``: one all-reduce of the flat gradient after the backward pass),
the diagnostic of where DDP's step over its floor differs from jaxcomm's.

*probes* (quiet cores): on loopback and on each shaped rate (``--rates``:
every process in its own network namespace, each egress shaped by
``tc ... tbf``) every method is probed ``--probes`` times (separate launches,
seed 0's schedule): one call of ``--probe_steps_per_call`` steps (its warm-up,
kept apart) and then at least ``--probe_steps`` steps and two sync periods;
the cell's step time is the median probe's, with the range. A cell's time to
target is *steps to target on the seed's trajectory x that step time*: an
estimate (a JSON without loopback probes times loopback by the runs' own
clocks instead). A probe evaluates after every call, on process 0, and the
other processes wait for that evaluation (:mod:`experiments.train`), so every
timed call runs with all of them. ``--reprobe=METHODS --reprobe_why=...``
sets those methods' probes aside (kept in the JSON as ``superseded_probes``
and shown beside the new ones, never used) and the probes phase takes them
again (only the probes without the ``evaluation_barrier`` stamp: rerunning the
command keeps the new ones). ``--probe_again=METHODS`` probes those methods'
cells again though probed (each run of the command adds ``--probes`` more): a
cell's median and range are over all its probes. The probes taken before the processes waited,
of the methods with no collective for several steps (the floors ``nocomm`` and
``torch_nocomm``, the DiLoCo family, torchft's among them), were deflated:
process 1 computed its next call during the evaluation.

*validate* (quiet cores): ``--validate=RATE:METHOD`` checks the estimate with
whole runs on the shaped link (seed 0, end to end; the report's "Estimates
checked end to end"). The trajectory does not depend on the link (the same
processes run the same arithmetic; each probe's loss is checked against it).

A JSON written for another workload (model, context, batch, schedule) is
refused: ``--out`` names a new file for a new workload.

The verdict rules are :mod:`experiments.studies.verdict`'s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

from experiments.configs import lm_shakespeare
from experiments.studies import lm_figure, ngram, report, runs
from experiments.studies.lm_methods import FLOORS, METHODS, OVERLAP, PROBE_ONLY, TORCH, sync_period

FLAGS = flags.FLAGS
CONFIG = "experiments/configs/lm_shakespeare.py"


def define_flags() -> None:
    flags.DEFINE_list("processes", ["2"], "process counts")
    flags.DEFINE_list("rates", ["100mbit", "10mbit"], "shaped link rates (loopback always runs)")
    flags.DEFINE_list("methods", [*METHODS, *PROBE_ONLY], "lm_shakespeare config variants")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of the loopback trajectories")
    flags.DEFINE_integer("steps", 0, "training steps of a full run (0: the config's schedule)")
    flags.DEFINE_integer("probes", 3, "probes (separate launches) per shaped (method, link) cell")
    flags.DEFINE_integer(
        "probe_steps", 20, "steps timed in a probe after its first call (at least 2 sync periods)"
    )
    flags.DEFINE_integer("probe_steps_per_call", 10, "training steps per call in a probe")
    flags.DEFINE_list(
        "validate", [], "RATE:METHOD whole runs (seed 0) on a shaped link, checking the estimate"
    )
    flags.DEFINE_string(
        "out", "experiments/results/lm_study_learned.json", "JSON written and updated"
    )
    flags.DEFINE_list(
        "reprobe", [], "methods whose probes are set aside (superseded_probes, with "
        "--reprobe_why) and taken again by the probes phase"
    )  # fmt: skip
    flags.DEFINE_string("reprobe_why", "", "why --reprobe's probes are set aside (required)")
    flags.DEFINE_list(
        "probe_again", [], "methods whose cells the probes phase probes again though probed: "
        "the new probes join the cell's (its median and range are over all of them)"
    )  # fmt: skip
    flags.DEFINE_list(
        "rerun", [], "methods whose trajectories (of --seeds) ran on older code: set aside "
        "(superseded_runs, with --rerun_why) and run again by the runs phase"
    )  # fmt: skip
    flags.DEFINE_string("rerun_why", "", "why --rerun's trajectories are set aside (required)")
    flags.DEFINE_string("workroot", "runs/lm_study", "workdirs of the runs")
    flags.DEFINE_bool("report", False, "only write the tables (.md) and plot (.png) from --out")
    flags.DEFINE_list(
        "phases", list(PHASES),
        "what to run: runs (the loopback trajectories, untimed), recheck (each seed 0 "
        "trajectory re-run to its first evaluation on today's code, untimed), probes (every "
        "link's step "
        "time, loopback included: quiet cores), validate (whole shaped runs: quiet cores)",
    )  # fmt: skip


#: The study's phases, in order (``--phases``).
PHASES = ("runs", "recheck", "probes", "validate")

#: The metrics kept of each row of a run.
KEEP = ("step", "loss", "eval_loss", "eval_loss_se", "accuracy", "train_s", "wire_bytes")


def workload() -> dict:
    """What every run of one study shares (a JSON holding another workload is refused)."""
    c = lm_shakespeare.get_config("dense")
    return {
        "model": c.model.name, "model_kwargs": dict(c.model.kwargs),
        "seq_len": c.data.seq_len, "batch_per_worker": c.data.batch_size,
        "steps": FLAGS.steps or c.num_train_steps, "eval_every": c.eval_every,
        "learning_rate": c.optimizer.learning_rate, "schedule": dict(c.optimizer.schedule),
    }  # fmt: skip


def training_argv(
    workdir: str, n: int, rate: str, method: str, seed: int, steps: int, stop: int,
    per_call: int = 0,
) -> list[str]:  # fmt: skip
    """The launched command of one run of the study (``stop``: steps to run, 0 all;
    ``per_call``: a probe's steps per call, evaluated after each; 0: the config's)."""
    launch = [
        sys.executable, "-m", "experiments.launch", f"--processes={n}", "--devices_per_process=1",
        *([] if rate == "loopback" else [f"--rate={rate}"]), "--", sys.executable, "-m",
    ]  # fmt: skip
    # the twins' own trainers take the harness's schedule as flags
    twin = [f"--workdir={workdir}", f"--seed={seed}", f"--steps={steps}", f"--stop_after={stop}",
            *([f"--eval_every={per_call}"] if per_call else [])]  # fmt: skip
    if method in OVERLAP:  # loco.Overlap: one call a step, exchanges in host threads
        variant = f"--variant={OVERLAP[method]}"
        return [*launch, "experiments.bench.overlap_lm_train", variant, *twin]
    if method in TORCH:  # the PyTorch twin: one rank a process, the same schedule
        return [*launch, "experiments.bench.torch_lm_train", f"--hook={TORCH[method]}", *twin]
    return [
        *launch, "experiments.main", f"--config={CONFIG}:{method}",
        f"--workdir={workdir}", f"--config.seed={seed}", f"--config.num_train_steps={steps}",
        f"--config.stop_after={stop}", "--config.progress=False", "--config.plot=False",
        *([f"--config.steps_per_call={per_call}", f"--config.eval_every={per_call}"]
          if per_call else []),
    ]  # fmt: skip


def run_training(
    n: int, rate: str, method: str, seed: int, steps: int, stop: int, per_call: int = 0,
    tag: str = "",
) -> dict:  # fmt: skip
    """One launched run; returns its command, wall time and metrics rows."""
    workdir = os.path.join(FLAGS.workroot, f"n{n}", rate + tag, method, f"s{seed}")
    subprocess.run(["rm", "-rf", workdir], check=True)
    argv = training_argv(workdir, n, rate, method, seed, steps, stop, per_call)
    return runs.launched(argv, workdir, KEEP)


def write_report(path: str) -> None:
    lm_figure.write_lm(path)


def probe_once(results: dict, n: int, rate: str, method: str, steps: int, k: int) -> dict:
    """One probe: a first call (warm-up, timed apart) and then at least ``--probe_steps``
    steps and two sync periods, rounded up to whole calls; seed 0's schedule."""
    per = FLAGS.probe_steps_per_call
    timed = max(FLAGS.probe_steps, 2 * sync_period(method))
    timed = -(-timed // per) * per
    run = run_training(n, rate, method, 0, steps, per + timed, per, tag=f".probe{k}")
    first, last = run["curve"][0], run["curve"][-1]
    # a compute floor has no trajectory to check against (FLOORS: probed only)
    base = next((r for r in results["runs"] if (r["n"], r["method"], r["seed"]) == (n, method, 0)),
                {"curve": []})  # fmt: skip
    ref = next((p for p in base["curve"] if p["step"] == last["step"]), None)
    return {
        "command": run["command"], "process_wall_s": run["process_wall_s"],
        "steps": last["step"] - first["step"],
        "step_s": (last["train_s"] - first["train_s"]) / (last["step"] - first["step"]),
        "first_call": {"steps": first["step"], "train_s": first["train_s"]},
        "probe_check": {"step": last["step"], "probe_eval_loss": last["eval_loss"],
                        "loopback_eval_loss": ref and ref["eval_loss"]},
    }  # fmt: skip


def probe(results: dict, n: int, rate: str, method: str, steps: int) -> dict:
    """``--probes`` probes of one (method, link) cell: the median step and its range.

    The loopback trajectory's evaluation at the probe's last step is stored beside the
    probe's (``probe_check``; the trajectory does not depend on the link) only when the
    study evaluates at that step; otherwise ``loopback_eval_loss`` is null.
    """
    reps = [probe_once(results, n, rate, method, steps, k) for k in range(FLAGS.probes)]
    by_time = sorted(reps, key=lambda r: r["step_s"])
    mid = by_time[(len(reps) - 1) // 2]
    out = {
        "n": n, "rate": rate, "method": method, "seed": 0, "repeats": reps,
        "step_s": statistics.median(r["step_s"] for r in reps),
        "step_s_min": by_time[0]["step_s"], "step_s_max": by_time[-1]["step_s"],
        "first_call": mid["first_call"], "probe_check": reps[0]["probe_check"],
        "evaluation_barrier": True,  # the other processes waited for each evaluation
    }  # fmt: skip
    ms = [f"{1e3 * r['step_s']:.0f}" for r in reps]
    print(f"n={n} {rate:8s} {method:14s}: {1e3 * out['step_s']:.0f} ms/step "
          f"(probes {', '.join(ms)})", flush=True)  # fmt: skip
    return out


def set_aside(results: dict, methods: list[str], why: str, ns: list[int]) -> None:
    """Move the probes of ``methods`` on ``ns`` processes taken before the other processes
    waited for each evaluation (no ``evaluation_barrier`` stamp) to
    ``results["superseded_probes"]``, each with ``why`` (kept, and shown beside the new
    ones, never used), so that the probes phase takes them again."""
    if not methods:
        return
    if not why.strip():
        raise ValueError("--reprobe_why: say why the probes of --reprobe are set aside")
    unknown = sorted(set(methods) - set(METHODS) - set(PROBE_ONLY))
    if unknown:
        raise ValueError(f"--reprobe: unknown methods {unknown}; choose from the study's")
    # only probes taken before the others waited for the evaluation: a second run of the
    # same command keeps the probes the first one took
    stale = lambda p: not p.get("evaluation_barrier")
    old = [p for p in results["probes"] if p["method"] in methods and p["n"] in ns and stale(p)]
    results["probes"] = [p for p in results["probes"] if p not in old]
    results.setdefault("superseded_probes", []).extend({**p, "why": why} for p in old)
    print(f"set aside {len(old)} probed cells of {methods}: {why}", flush=True)


def taken_again(flag: str, asked: list[str], phase: str, phases: set, methods: list[str]) -> None:
    """Refuse ``--reprobe`` / ``--rerun`` whose methods this command would set aside and not
    take again: it needs ``phase`` in ``--phases`` and every one of them in ``--methods``."""
    if asked and (phase not in phases or not set(asked) <= set(methods)):
        raise ValueError(
            f"--{flag}={asked}: needs the {phase} phase and every method in --methods "
            f"(--phases={sorted(phases)}, --methods={methods}): else they are set aside "
            "and not taken again"
        )


def to_probe(
    n: int, rate: str, method: str, probed: set, have: set, again: list[str]
) -> bool:  # fmt: skip
    """Whether the probes phase probes the cell: not probed yet (or the method is in
    ``again``: ``--probe_again``), and seed 0's trajectory run (a probe's loss is checked
    against it) unless the method is only probed; a compute floor on loopback only."""
    if method in FLOORS and rate != "loopback":  # no exchange: the link changes nothing
        return False
    todo = (n, rate, method) not in probed or method in again
    return todo and ((n, method, 0) in have or method in PROBE_ONLY)


def head_commit() -> str | None:
    """The short commit the study's code is at (None outside a git checkout)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def set_aside_runs(
    results: dict, methods: list[str], why: str, ns: list[int], seeds: list[int]
) -> None:  # fmt: skip
    """Move the trajectories of ``methods`` on ``ns`` processes and ``seeds`` that carry no
    ``commit`` stamp (run before runs were stamped: on older code) to
    ``results["superseded_runs"]``, each with ``why`` and its seed 0 ``recheck`` entry
    (which compared today's code with it), so that the runs phase runs them again. They
    are kept, shown beside today's finals and counted in the running time, never used."""
    if not methods:
        return
    if not why.strip():
        raise ValueError("--rerun_why: say why the trajectories of --rerun are set aside")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--rerun: unknown methods {unknown}; choose from the study's runs")
    # only unstamped runs: a second run of the same command keeps the ones the first made
    key = lambda r: (r["n"], r["method"], r["seed"])
    stale = lambda r: r["method"] in methods and r["n"] in ns and r["seed"] in seeds
    old = [r for r in results["runs"] if stale(r) and not r.get("commit")]
    gone = {key(r) for r in old}
    results["runs"] = [r for r in results["runs"] if not (stale(r) and not r.get("commit"))]
    checks = {key(c): c for c in results.get("recheck", []) if key(c) in gone}
    if "recheck" in results:
        results["recheck"] = [c for c in results["recheck"] if key(c) not in gone]
    results.setdefault("superseded_runs", []).extend(
        {**r, "why": why, **({"recheck": checks[key(r)]} if key(r) in checks else {})} for r in old
    )
    print(f"set aside {len(old)} trajectories of {methods}: {why}", flush=True)


def best_method(results: dict, n: int, rate: str) -> str | None:
    """``BEST`` in ``--validate``: the headline method on that link (the verdict's rules:
    fastest to target among those whose every seed ends within 1% of dense's median);
    None, and said, when the JSON has no complete group or no method qualifies."""
    best = report.lm_headline(results).get(n, {}).get(rate)
    if best is None:
        print(f"n={n} {rate}: no method qualifies for the headline yet: BEST not run", flush=True)
        return None
    return best["method"]


def recheck_run(results: dict, n: int, method: str, steps: int) -> dict:
    """Seed 0's trajectory re-run on today's code to its first evaluation (loopback): whether
    the trajectory, perhaps run on older code, is today's arithmetic to the last digit."""
    base = next(r for r in results["runs"] if (r["n"], r["method"], r["seed"]) == (n, method, 0))
    first = base["curve"][0]
    run = run_training(n, "loopback", method, 0, steps, first["step"], 0, tag=".recheck")
    now = next(p for p in run["curve"] if p["step"] == first["step"])
    commit = head_commit()
    print(f"n={n} {method:14s}: step {first['step']} val {now['eval_loss']!r} against the "
          f"trajectory's {first['eval_loss']!r}", flush=True)  # fmt: skip
    return {"n": n, "method": method, "seed": 0, "step": first["step"], "commit": commit,
            "eval_loss": now["eval_loss"], "trajectory_eval_loss": first["eval_loss"],
            "equal": now["eval_loss"] == first["eval_loss"], "command": run["command"],
            "process_wall_s": run["process_wall_s"]}  # fmt: skip


def validate_run(n: int, rate: str, method: str, steps: int) -> dict:
    """A whole run of seed 0 on a shaped link: the time to target measured end to end."""
    run = run_training(n, rate, method, 0, steps, 0, tag=".whole")
    last = run["curve"][-1]
    print(f"n={n} {rate:8s} {method:14s}: whole run, val {last['eval_loss']:.4f} "
          f"in {last['train_s']:.0f} s of training calls", flush=True)  # fmt: skip
    return {"n": n, "rate": rate, "method": method, "seed": 0, **run,
            "estimate_s": None, "measured_s": None}  # fmt: skip


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.report:
        write_report(FLAGS.out)
        return
    work = workload()
    steps = work["steps"]
    results = {"runs": [], "probes": [], "validation": []}
    if os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            results = json.load(f)
        if results.get("workload") != work:
            raise ValueError(
                f"--out={FLAGS.out} holds runs of another workload ({results.get('workload')}); "
                f"this one is {work}: pass a new --out, or move the old file away"
            )
        results.setdefault("validation", [])
    results.update(steps=steps, config=CONFIG, workload=work, note=__doc__.split("\n\n")[1])
    if "ngram" not in results:
        results["ngram"] = ngram.study_baselines(work["seq_len"])

    def save():
        runs.save_json(FLAGS.out, results)

    torch_methods = sorted(set(FLAGS.methods) & set(TORCH))
    ft_methods = [m for m in torch_methods if TORCH[m].startswith("ft_")]
    for missing, want, extra in (("torch", torch_methods, "peers"), ("torchft", ft_methods, "ft")):
        if want and importlib.util.find_spec(missing) is None:
            raise ValueError(
                f"--methods: {want} need {missing}, which is not installed (the {extra} "
                f'extra: pip install -e ".[{extra}]"); or leave them out of --methods'
            )
    phases = set(FLAGS.phases)
    if not phases <= set(PHASES):
        raise ValueError(f"--phases: unknown {sorted(phases - set(PHASES))}; choose from {PHASES}")
    taken_again("reprobe", FLAGS.reprobe, "probes", phases, FLAGS.methods)
    taken_again("rerun", FLAGS.rerun, "runs", phases, FLAGS.methods)
    ns, seeds = list(map(int, FLAGS.processes)), list(map(int, FLAGS.seeds))
    set_aside(results, FLAGS.reprobe, FLAGS.reprobe_why, ns)
    set_aside_runs(results, FLAGS.rerun, FLAGS.rerun_why, ns, seeds)
    have = {(r["n"], r["method"], r["seed"]) for r in results["runs"]}
    probed = {(p["n"], p["rate"], p["method"]) for p in results["probes"]}
    for n in map(int, FLAGS.processes):
        for seed in map(int, FLAGS.seeds) if "runs" in phases else ():
            for method in FLAGS.methods:
                if (n, method, seed) in have or method in PROBE_ONLY:  # probes only
                    continue
                run = run_training(n, "loopback", method, seed, steps, 0)
                results["runs"].append({"n": n, "method": method, "seed": seed,
                                        "commit": head_commit(), **run})  # fmt: skip
                save()
                last = run["curve"][-1]
                print(f"n={n} {method:14s} seed {seed}: val {last['eval_loss']:.4f} "
                      f"in {last['train_s']:.1f} s", flush=True)  # fmt: skip
        have = {(r["n"], r["method"], r["seed"]) for r in results["runs"]}
        rechecked = {(c["n"], c["method"]) for c in results.setdefault("recheck", [])}
        for method in FLAGS.methods if "recheck" in phases else ():
            if (n, method) not in rechecked and (n, method, 0) in have:
                results["recheck"].append(recheck_run(results, n, method, steps))
                save()
        # every link's step time, loopback's too, each cell probed --probes times (a probe
        # checks its loss against seed 0's trajectory, so that run comes first; a compute
        # floor has none)
        for rate in ["loopback", *FLAGS.rates] if "probes" in phases else ():
            for method in FLAGS.methods:
                if to_probe(n, rate, method, probed, have, FLAGS.probe_again):
                    results["probes"].append(probe(results, n, rate, method, steps))
                    save()
        done = {(v["n"], v["rate"], v["method"]) for v in results["validation"]}
        for cell in FLAGS.validate if "validate" in phases else ():
            rate, method = cell.split(":")
            if method == "BEST":
                method = best_method(results, n, rate)
            if method is not None and (n, rate, method) not in done:
                results["validation"].append(validate_run(n, rate, method, steps))
                save()
    save()
    write_report(FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
