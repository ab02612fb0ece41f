r"""Goodput under failures: jaxcomm's ElasticDiLoCo against torchft's DiLoCo on the LM study.

Command (the full measurement, quiet cores; 2 and 4 replicas, DiLoCo H=10 and
Streaming DiLoCo, both sides, each run once without failures and once under
the schedule; it saves after every run and resumes from its JSON):
  python -m experiments.bench.goodput --replicas=2,4 --kill_every=120 --restart_after=30

About 3 hours on two quiet cores: 16 runs of 2,000 inner steps a replica (the
study's DiLoCo ran 2 processes in ~7 minutes; 4 replicas take about twice as
long a step), a few minutes more for each restart's start-up. A smoke run (a
tiny GPT, seconds of training; its numbers say nothing about the study):
  python -m experiments.bench.goodput --replicas=2 --steps=300 --step_s=0.1 \
      --kill_every=10 --restart_after=1 --max_kills=1 --seq_len=32 --batch_size=4 \
      --test_windows=16 --model='{"dim": 32, "depth": 1, "heads": 2, "max_len": 32}' \
      --heartbeat_timeout_ms=1000 --join_timeout_ms=5000 --out=runs/goodput_smoke.json \
      --workdir=runs/goodput_smoke

What it measures, per side (``jaxcomm``: each replica a JAX program whose outer
sync is :meth:`jaxcomm.ElasticDiLoCo.sync`, :mod:`experiments.bench.goodput_jax`;
``torchft``: torchft's ``DiLoCo`` on the GPT twin, one process a replica group,
:mod:`experiments.bench.goodput_torch`), method (``diloco``, ``streaming``) and
replica count: the run's useful inner steps per replica-second (goodput), with
and without failures, and its ratio; rounds committed and rolled back; heal
times; the final validation loss (definitions:
:mod:`experiments.bench.goodput_report`). Both sides train the LM study's
workload (:mod:`experiments.configs.lm_shakespeare`, 2,000 inner steps a
replica) and meet at a lighthouse this launcher holds, with the same timeouts.

The failure schedule (seeded, the same for both sides): every ``--kill_every``
seconds from the run's start (every replica up: torchft's at the start barrier,
jaxcomm's past its join), SIGKILL one replica (drawn from
the seed; if it is down or still healing, the next one up), and start it again
``--restart_after`` seconds after the kill. No kill leaves fewer than one
replica up, nothing is killed or restarted once a replica has finished, and a
restarted replica that had not rejoined when the others finished is stopped.

The jaxcomm replicas share JAX's persistent compilation cache (under
``--workdir``), as a user restarting replicas would set it up: a restarted
replica loads its programs instead of compiling them; its start-up (importing
JAX, loading the data, tracing) is still part of what a failure costs.

Beside the runs, each side's inner step is timed as its replicas run it
(:func:`inner_steps`: one thread a process, DiLoCo's 10 steps a call, a first
call untimed, no manager, no sync), with 1, 2 and 4 copies at once on the
cores (``results["inner_step"][side][copies]``): the compute that explains
the sides' clean goodput, apart from their syncs and failures.

Writes ``--out`` (``experiments/results/goodput.json``; its tables in the
``.md`` beside it, :func:`experiments.bench.goodput_report.report`) and each run's
logs under ``--workdir``. Links: loopback, or ``--rate=100mbit`` (root: each
replica in its own network namespace of a tbf-shaped lab, the lighthouse in one
more, :func:`_network`). Needs torch and torchft.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import sys
import time

from experiments.bench import goodput_report, goodput_workload
from experiments.elastic_launch import (
    CHILD_ENV,
    Replicas,
    lighthouse,
    lighthouse_process,
    supervise,
)
from experiments.studies import runs, tables

SIDES = ("jaxcomm", "torchft")
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
STUDY = RESULTS / "lm_study_learned.json"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="2,4", help="replica counts, comma-separated")
    p.add_argument("--methods", default="diloco,streaming")
    p.add_argument("--sides", default="jaxcomm,torchft")
    p.add_argument("--runs", default="clean,failures", help="without / under the schedule")
    p.add_argument("--steps", type=int, default=0, help="inner steps a replica (0: config's)")
    p.add_argument("--model", default="", help='model kwargs over the study\'s, JSON: {"dim": 32}')
    p.add_argument("--seq_len", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=0)
    p.add_argument("--test_windows", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="the runs' seed (model init, data)")
    p.add_argument("--kill_every", type=float, default=120.0, help="seconds between kills")
    p.add_argument("--restart_after", type=float, default=30.0, help="seconds, kill to restart")
    p.add_argument("--failure_seed", type=int, default=0)
    p.add_argument("--max_kills", type=int, default=0, help="0: no limit")
    p.add_argument(
        "--step_s",
        type=float,
        default=0.0,
        help="least wall time of an inner step (a larger model's compute; 0: none)",
    )
    p.add_argument("--streaming", choices=goodput_workload.STREAMING, default="study",
                   help="Streaming DiLoCo on both sides at the study's overlap (delay 1, "
                   "mix 0.5) or with none (delay 0, mix 0)")  # fmt: skip
    p.add_argument("--heartbeat_timeout_ms", type=int, default=2000)
    p.add_argument("--join_timeout_ms", type=int, default=10000)
    p.add_argument("--timeout_s", type=float, default=60.0, help="all-reduce/commit/heal timeout")
    p.add_argument("--deadline_s", type=float, default=7200.0, help="a run gives up")
    p.add_argument("--rate", default="", help="shaped link rate, e.g. 100mbit (default: loopback)")
    p.add_argument("--out", default=str(RESULTS / "goodput.json"))
    p.add_argument("--workdir", default="runs/goodput")
    p.add_argument("--fresh", action="store_true", help="rerun the runs --out already holds")
    # a replica's own flags (set by the launcher)
    p.add_argument("--role", choices=["launcher", "replica"], default="launcher")
    p.add_argument("--side", choices=SIDES, default="jaxcomm")
    p.add_argument("--method", default="diloco")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--run_dir", default="")
    p.add_argument(
        "--inner_out",
        default="",
        help="(internal) time --inner_calls calls of the "
        "replica's inner steps alone, no sync, and write seconds a step here",
    )
    p.add_argument("--inner_calls", type=int, default=20)
    return p.parse_args(argv)


_WORKLOAD = ("steps", "model", "seq_len", "batch_size", "test_windows", "seed", "timeout_s",
             "deadline_s", "step_s", "streaming")  # fmt: skip


class Schedule:
    """Kill a replica every ``every_s`` seconds, restart it ``restart_after_s`` after the kill.

    Victim ``j`` is drawn from ``seed`` before the run (the same draws on both
    sides); if it is not up and joined, the next one (cyclically) that is; with
    fewer than two up and joined, or ``max_kills`` (> 0) killed already, nobody.
    """

    def __init__(
        self, n: int, every_s: float, restart_after_s: float, seed: int, max_kills: int = 0
    ) -> None:
        import numpy as np

        self.n, self.every_s, self.restart_after_s = n, every_s, restart_after_s
        self.max_kills = max_kills
        self.draws = np.random.default_rng(seed).integers(n, size=10_000).tolist()
        self.kills = 0  # slots passed (a slot with nobody to kill is skipped)
        self.killed = 0  # replicas killed

    def due(self, now: float, t_start: float) -> bool:
        return now >= t_start + self.every_s * (self.kills + 1)

    def victim(self, eligible: set[int]) -> int | None:
        """This slot's victim among ``eligible`` (None: fewer than two up, nobody is killed)."""
        j, self.kills = self.kills, self.kills + 1
        if len(eligible) < 2 or (self.max_kills and self.killed >= self.max_kills):
            return None
        self.killed += 1
        return next(v % self.n for v in range(self.draws[j], self.draws[j] + self.n)
                    if v % self.n in eligible)  # fmt: skip


def _policy(
    replicas: Replicas, run_dir: pathlib.Path, n: int, schedule: Schedule | None, start: str
):
    """The launcher's policy for :func:`supervise`, and the run's start time (a dict).

    The run starts (its wall clock and the schedule's) when every replica is
    past ``start``: ``"ready"`` (the start barrier) or ``"joined"`` (its first sync:
    jaxcomm's join, a sync with no inner steps, where the replicas but one take the
    first's state and compile the outer step).
    """
    clock = {"t_start": None}
    due: dict[int, float] = {}
    joined = lambda i: (run_dir / f"joined_{i}_{replicas.incarnation(i)}").exists()
    marks = [run_dir / (f"ready_{i}" if start == "ready" else f"joined_{i}_0") for i in range(n)]

    def policy(now: float, ended: list[int]) -> None:
        if clock["t_start"] is None:
            if not all(p.exists() for p in marks):
                return
            clock["t_start"] = max(float(p.read_text()) for p in marks)
        if any((run_dir / f"done_{i}").exists() for i in range(n)):  # the run is over
            due.clear()
            for i in list(replicas.procs):
                if not joined(i):  # restarted, not back in time: it would train alone
                    replicas.kill(i)
            return
        for i, t in list(due.items()):
            if now >= t:
                replicas.start(i)
                del due[i]
        if schedule is not None and schedule.due(now, clock["t_start"]):
            v = schedule.victim({i for i in replicas.procs if joined(i)})
            if v is not None:
                replicas.kill(v)
                due[v] = now + schedule.restart_after_s

    return policy, clock


def run(args: argparse.Namespace, side: str, method: str, n: int, failures: bool) -> dict:
    """One run: ``n`` replicas of ``side`` training ``method``, under the schedule or not."""
    kind = "failures" if failures else "clean"
    run_dir = pathlib.Path(args.workdir) / f"{side}_{method}_n{n}_{kind}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in run_dir.iterdir():
        f.unlink()
    # JAX's persistent compilation cache: a restarted replica loads its programs, as a
    # user who restarts replicas would set up (the first run of a side compiles them)
    cache = os.path.abspath(os.path.join(args.workdir, "jax_cache"))
    env = {**os.environ, **CHILD_ENV, "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    flags = [f"--{k}={getattr(args, k)}" for k in _WORKLOAD]
    schedule = None
    if failures:
        schedule = Schedule(
            n, args.kill_every, args.restart_after, args.failure_seed, args.max_kills
        )
    with contextlib.ExitStack() as stack:
        address, wrap, link_env = _network(stack, args, n)

        def command(i: int, incarnation: int) -> list[str]:
            return wrap(i, [sys.executable, "-m", "experiments.bench.goodput", "--role=replica",
                            f"--side={side}", f"--method={method}", f"--replicas={n}",
                            f"--replica={i}", f"--incarnation={incarnation}",
                            f"--lighthouse={address}", f"--run_dir={run_dir}", *flags])  # fmt: skip

        replicas = Replicas(command, n, {**env, **link_env})
        start = "joined" if side == "jaxcomm" else "ready"  # torchft's DiLoCo has no join
        policy, clock = _policy(replicas, run_dir, n, schedule, start)
        for i in range(n):
            replicas.start(i)
        supervise(replicas, policy, deadline_s=args.deadline_s)
    killed = {(e["replica"], e["incarnation"]) for e in replicas.events if e["event"] == "kill"}
    crashed = [e for e in replicas.events if e["event"] == "exit" and e["code"] != 0
               and (e["replica"], e["incarnation"]) not in killed]  # fmt: skip
    if crashed:
        raise RuntimeError(f"{run_dir}: replicas exited on their own with errors: {crashed}")
    out = goodput_report.account(str(run_dir), n, replicas.events, clock["t_start"])
    out.update(side=side, method=method, failures=failures, codes=replicas.codes,
               settings=sync_settings(args, side, method), events=replicas.events)  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1))
    return out


def _network(stack: contextlib.ExitStack, args: argparse.Namespace, n: int):
    """The lighthouse's address, ``wrap(i, argv)`` (replica ``i``'s command on the run's link)
    and the replicas' environment for that link.

    Loopback: the lighthouse in this process, the replicas as they are. A shaped
    ``--rate``: a lab (:class:`experiments.netlab.Lab`) of ``n + 1`` hosts, each
    replica in its own namespace and the lighthouse in the last one (the replicas'
    outer all-reduces and heals cross the shaped links; the lighthouse's quorum
    messages are small), gloo pinned to the lab's interface. The replicas share
    the machine's hostname, so each advertises its own address for heals
    (:func:`jaxcomm.elastic.gloo_manager`'s ``host``, its route to the lighthouse).
    """
    timeouts = {"join_timeout_ms": args.join_timeout_ms,
                "heartbeat_timeout_ms": args.heartbeat_timeout_ms}  # fmt: skip
    if not args.rate:
        return stack.enter_context(lighthouse(1, **timeouts)), lambda i, argv: argv, {}
    from experiments.netlab import Lab

    lab = stack.enter_context(Lab(n + 1, args.rate))
    address = stack.enter_context(
        lighthouse_process(
            lambda argv: lab.command(n, argv), lab.address(n), min_replicas=1, **timeouts
        )  # fmt: skip
    )
    return address, lab.command, {"GLOO_SOCKET_IFNAME": lab.interface(0)}


def sync_settings(args: argparse.Namespace, side: str, method: str) -> dict:
    """The outer loop a side runs: every (H), fragments, delay, mix, outer learning rate."""
    if side == "torchft":
        from experiments.bench import goodput_torch

        return goodput_torch.settings(argparse.Namespace(**{**vars(args), "method": method}))
    c = goodput_workload.config(argparse.Namespace(**{**vars(args), "method": method}))
    every, fragments = goodput_workload.sync_period(c)
    delay, mix = goodput_workload.overlap(c, args.streaming)
    lr = c.wrapper.get("outer_learning_rate", 0.7)
    return {"every": every, "fragments": fragments, "delay": delay, "mix": mix,
            "outer_learning_rate": lr}  # fmt: skip


def inner_steps(args: argparse.Namespace, cells: list[tuple[str, int]]) -> dict[str, dict]:
    """Each (side, copies) cell's inner step as a replica runs it (one thread: CHILD_ENV;
    DiLoCo's H steps a call on both sides, after one untimed call; no manager, no sync,
    no ``--step_s`` padding), ``copies`` processes at once (replicas 0.., each its own
    batches) and nothing else running: alone (1), and as many as a run's replicas share
    the cores. {side: {str(copies): {"step_s": the median over the copies of each one's
    median seconds a step, "calls", "steps", "copies"}}}. What sets the sides' clean
    goodput apart before any exchange or failure."""
    import statistics
    import subprocess
    import tempfile

    out: dict[str, dict] = {}
    for side, copies in cells:
        with tempfile.TemporaryDirectory() as tmp:
            paths = [os.path.join(tmp, f"inner{i}.json") for i in range(copies)]
            procs = []
            for i, path in enumerate(paths):
                argv = [sys.executable, "-m", "experiments.bench.goodput", "--role=replica",
                        f"--side={side}", "--method=diloco", f"--replicas={max(2, copies)}",
                        f"--replica={i}", f"--inner_out={path}",
                        f"--inner_calls={args.inner_calls}",
                        *(f"--{k}={getattr(args, k)}" for k in _WORKLOAD)]  # fmt: skip
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True,
                                              env={**os.environ, **CHILD_ENV}))  # fmt: skip
            for p in procs:
                _, err = p.communicate()
                if p.returncode != 0:
                    raise RuntimeError(f"{' '.join(p.args)} failed:\n{err[-3000:]}")
            got = [json.loads(pathlib.Path(path).read_text()) for path in paths]
        cell = {**got[0], "copies": copies, "step_s": statistics.median(g["step_s"] for g in got)}
        out.setdefault(side, {})[str(copies)] = cell
        print(f"{side}: inner step, {copies} at once: {1e3 * cell['step_s']:.0f} ms", flush=True)
    return out


def _config(args: argparse.Namespace) -> dict:
    c = goodput_workload.config(argparse.Namespace(**{**vars(args), "method": "diloco"}))
    keys = ("kill_every", "restart_after", "failure_seed", "max_kills", "heartbeat_timeout_ms",
            "join_timeout_ms", "timeout_s", "seed", "step_s", "streaming")  # fmt: skip
    return {**{k: getattr(args, k) for k in keys}, "steps": c.num_train_steps,
            "model": dict(c.model.kwargs), "seq_len": c.data.seq_len,
            "batch_size": c.data.batch_size, "test_windows": c.data.test_windows,
            "link": args.rate or "loopback", "cores": os.cpu_count()}  # fmt: skip


def _load(path: str, config: dict, fresh: bool) -> dict:
    if not fresh and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("config") == config:
            return old
    return {"config": config, "runs": {}}


def _save(results: dict, path: str) -> None:
    runs.save_json(path, results)
    if os.path.abspath(path) == str(RESULTS / "goodput.json"):
        tables.main([])  # the .md beside it, and the README's blocks
        return
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(goodput_report.report(results))


def main(argv=None) -> int:
    args = parse(argv)
    if args.role == "replica":
        args.replicas = int(args.replicas)  # the launcher passes this run's count
        if args.side == "jaxcomm":
            from experiments.bench import goodput_jax as side
        else:
            from experiments.bench import goodput_torch as side
        side.replica(args)
        return 0
    # a SIGTERM unwinds (supervise then kills the replicas it started)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    config = _config(args)
    results = _load(args.out, config, args.fresh)
    study = json.loads(STUDY.read_text()) if STUDY.exists() else None
    results["dense_band"] = goodput_report.dense_band(study)
    inner = {} if args.fresh else results.get("inner_step", {})
    copies = sorted({1, *(int(x) for x in args.replicas.split(","))})
    missing = [(side, k) for side in args.sides.split(",") for k in copies
               if str(k) not in inner.get(side, {})]  # fmt: skip
    if missing:  # each cell's once, before the runs
        for side, cells in inner_steps(args, missing).items():
            inner[side] = {**inner.get(side, {}), **cells}
        results["inner_step"] = inner
        _save(results, args.out)
    for n in [int(x) for x in args.replicas.split(",")]:
        for method in args.methods.split(","):
            for side in args.sides.split(","):
                for kind in args.runs.split(","):
                    key = f"{side}/{method}/n{n}/{kind}"
                    if key in results["runs"]:
                        continue
                    t = time.time()
                    results["runs"][key] = run(args, side, method, n, kind == "failures")
                    print(f"{key}: {time.time() - t:.0f} s", flush=True)
                    _save(results, args.out)
    _save(results, args.out)
    print(goodput_report.report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
