r"""Fault-tolerant DiLoCo on local processes: kill a replica, restart it, check they agree.

Command (3 replicas, replica 2 SIGKILLed after its inner steps of the first
round from round 2 on that all three took part in, restarted 1 s later; a few
seconds to a minute on two CPU cores, mostly JAX's start-up):
  python -m experiments.elastic_demo --replicas=3 --rounds=6 --kill=2@2 \
      --restart_after=1 --out=/tmp/elastic

Expected: every replica prints the same params and anchor SHA-256 and the
same number of committed rounds (with ``--fragments`` > 1 the anchors agree;
the params differ in the fragment each replica keeps local); replica 2's
second incarnation reports ``healed`` at its join. ``--kill_in=allreduce``
kills the replica inside the outer all-reduce instead (fault injection: it
SIGKILLs itself after joining the round's quorum, before sending its
pseudo-gradient): the survivors' round is rolled back to the anchor and the
next one commits without it.

The launcher (:mod:`experiments.elastic_launch`) holds torchft's lighthouse
(in process; ``torchft_lighthouse`` is the same server as a command) and starts
each replica as its own JAX program (``--role=replica``): a tanh MLP regressing
a fixed random teacher, ``--inner_steps`` AdamW steps per round in one jitted ``lax.scan`` (each
replica draws its own batches), then the outer round:
:meth:`jaxcomm.ElasticDiLoCo.start`, ``--delay`` more inner steps while the
all-reduce travels (Streaming DiLoCo's overlap; ``--mix`` its alpha), and
:meth:`~jaxcomm.ElasticDiLoCo.finish`.
A replica stops once ``--rounds`` rounds are committed and its last round
had every expected replica in it (the survivors go on until a restarted
replica is back). Each incarnation appends one JSON line per sync to
``OUT/replica_<i>.jsonl`` (committed, healed, participants, SHA-256 of the
anchor before and of the params and anchor after) and a final line; the
launcher prints a table and writes ``OUT/summary.json``. Needs ``pip install "jaxcomm[ft]"``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import signal
import sys
import time

from experiments.elastic_launch import (
    CHILD_ENV,
    Replicas,
    lighthouse,
    mark_ready,
    sha256,
    supervise,
    wait_ready,
)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6, help="outer rounds to commit")
    p.add_argument("--inner_steps", type=int, default=10, help="inner steps per round (H)")
    p.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo fragments")
    p.add_argument(
        "--delay",
        type=int,
        default=0,
        help="inner steps beside each round's all-reduce (start ... finish)",
    )
    p.add_argument("--mix", type=float, default=0.0, help="Streaming DiLoCo's alpha")
    p.add_argument(
        "--kill",
        default="",
        help="REPLICA@ROUND: SIGKILL it at that round "
        "(the first from ROUND on whose quorum holds every replica)",
    )
    p.add_argument("--kill_in", choices=["inner", "allreduce"], default="inner")
    p.add_argument("--restart_after", type=float, default=-1.0, help="seconds; < 0: never")
    p.add_argument("--min_replicas", type=int, default=0, help="0: replicas - 1 with --kill")
    p.add_argument("--round_s", type=float, default=0.25, help="least wall time of a round")
    p.add_argument("--timeout_s", type=float, default=10.0, help="all-reduce/commit timeout")
    p.add_argument("--heartbeat_timeout_ms", type=int, default=1000)
    p.add_argument("--join_timeout_ms", type=int, default=5000)
    p.add_argument("--deadline_s", type=float, default=300.0, help="the launcher gives up")
    p.add_argument("--out", default="runs/elastic_demo")
    # a replica's own flags (set by the launcher)
    p.add_argument("--role", choices=["launcher", "replica"], default="launcher")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--die_at", type=int, default=-1)
    p.add_argument("--finish_with", type=int, default=1)
    args = p.parse_args(argv)
    if not 0 <= args.delay < args.inner_steps:
        p.error(f"--delay: {args.delay} must be in [0, --inner_steps={args.inner_steps})")
    return args


def _workload(args: argparse.Namespace) -> tuple:
    """``(params, inner, inner_steps)``: the MLP, AdamW, and H jitted steps on own batches."""
    import jax
    import jax.numpy as jnp
    import optax

    d_in, d_hidden, batch, h = 8, 32, 32, args.inner_steps
    k_teacher, k_init = jax.random.split(jax.random.key(0))
    teacher = jax.random.normal(k_teacher, (d_in,))
    k1, k2 = jax.random.split(k_init)
    params = {
        "w1": jax.random.normal(k1, (d_in, d_hidden)) / jnp.sqrt(d_in),
        "b1": jnp.zeros(d_hidden),
        "w2": jax.random.normal(k2, (d_hidden, 1)) / jnp.sqrt(d_hidden),
        "b2": jnp.zeros(1),
    }
    inner = optax.adamw(1e-2)
    data_key = jax.random.fold_in(jax.random.key(1), args.replica)  # each replica its own

    def loss_fn(p, x, y):
        out = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.mean((out[:, 0] - y) ** 2)

    @functools.partial(jax.jit, static_argnums=3)
    def inner_steps(p, s, start, steps=h):
        def body(carry, t):
            p, s = carry
            x = jax.random.normal(jax.random.fold_in(data_key, start + t), (batch, d_in))
            loss, g = jax.value_and_grad(loss_fn)(p, x, jnp.sin(x @ teacher))
            u, s = inner.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss

        (p, s), losses = jax.lax.scan(body, (p, s), jnp.arange(steps))
        return p, s, losses[-1]

    return params, inner, inner_steps


def _die_in_allreduce(manager, args: argparse.Namespace) -> None:
    """Fault injection: SIGKILL this replica on entering the outer all-reduce of round
    ``--die_at`` or later whose quorum holds every replica (it joined, it sends nothing)."""
    allreduce = manager.allreduce

    def dying_allreduce(tensor, **kw):
        everyone = manager.num_participants() == args.replicas  # the quorum just formed
        if 0 <= args.die_at <= manager.current_step() and everyone:
            os.kill(os.getpid(), signal.SIGKILL)
        return allreduce(tensor, **kw)

    manager.allreduce = dying_allreduce


def replica(args: argparse.Namespace) -> None:
    """One replica: its own JAX program, meeting the others at each outer sync."""
    import torch

    import jaxcomm
    from jaxcomm import elastic

    torch.set_num_threads(1)
    h = args.inner_steps
    params, inner, inner_steps = _workload(args)
    state = inner.init(params)
    d = args.delay
    for n in {h - d, d} - {0}:  # compiled before joining: a joiner is not a straggler
        inner_steps(params, state, 0, n)
    manager = elastic.gloo_manager(
        f"replica_{args.replica}",
        args.lighthouse,
        min_replicas=args.min_replicas,
        timeout_s=args.timeout_s,
        quorum_timeout_s=args.deadline_s,
    )
    out = pathlib.Path(args.out)
    if args.incarnation == 0:  # the job starts with every replica up (a restart joins alone)
        mark_ready(out, args.replica)
        wait_ready(out, args.replicas)
    if args.die_at >= 0 and args.kill_in == "allreduce":
        _die_in_allreduce(manager, args)
    loop = jaxcomm.ElasticDiLoCo(manager, params, state, fragments=args.fragments,
                                 mix=args.mix, delay=d)  # fmt: skip
    log = open(out / f"replica_{args.replica}.jsonl", "a")  # noqa: SIM115

    def record(committed, anchor_before, loss):
        line = {
            "incarnation": args.incarnation,
            "round": loop.rounds,
            "committed": committed,
            "healed": loop.healed,
            "participants": loop.participants,
            "inner_steps": loop.inner_steps,
            "anchor_before": sha256(anchor_before),
            "params_after": sha256(loop.params),
            "anchor_after": sha256(loop.anchor),
            "loss": loss,
        }
        log.write(json.dumps(line) + "\n")
        log.flush()

    # all replicas in the last sync; the round's first inner step (its first call of take:
    # the steps before start, not the ones beside the all-reduce, which start later)
    everyone, first = False, -1

    def take(p, s, position, n):  # n inner steps, padded to their share of round_s
        t0 = time.monotonic()
        p, s, loss = inner_steps(p, s, position, n)
        loss = float(loss)
        time.sleep(max(0.0, args.round_s * n / h - (time.monotonic() - t0)))
        due = args.kill_in == "inner" and 0 <= args.die_at <= loop.rounds and everyone
        if due and position == first:
            os.kill(os.getpid(), signal.SIGKILL)  # between syncs: after its inner steps
        return p, s, loss

    anchor = loop.anchor
    params, state = loop.join()  # a restarted replica heals here
    record(True, anchor, None)
    while loop.rounds < args.rounds or loop.participants < args.finish_with:
        everyone, first = loop.participants == args.replicas, loop.inner_steps
        anchor = loop.anchor
        params, state, committed, losses = loop.round(params, state, take, steps=h)
        record(committed, anchor, losses[0])
    final = {"final": True, "incarnation": args.incarnation, "rounds": loop.rounds,
             "inner_steps": loop.inner_steps, "params": sha256(loop.params),
             "anchor": sha256(loop.anchor)}  # fmt: skip
    log.write(json.dumps(final) + "\n")
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads would hold the interpreter


def launch(args: argparse.Namespace) -> dict:
    """Start the lighthouse and the replicas, kill and restart as asked; the summary."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in [*out.glob("replica_*.jsonl"), *out.glob("ready_*")]:
        f.unlink()
    victim, die_at = (-1, -1)
    if args.kill:
        victim, die_at = (int(v) for v in args.kill.split("@"))
        if not 0 <= victim < args.replicas or not 0 <= die_at < args.rounds:
            raise ValueError(f"--kill: replica {victim} of {args.replicas}, round {die_at} "
                             f"before --rounds={args.rounds}")  # fmt: skip
    restart = victim >= 0 and args.restart_after >= 0
    min_replicas = args.min_replicas or (args.replicas - (victim >= 0))
    finish_with = args.replicas - (victim >= 0 and not restart)
    env = {**os.environ, **CHILD_ENV}
    with lighthouse(min_replicas, join_timeout_ms=args.join_timeout_ms,
                    heartbeat_timeout_ms=args.heartbeat_timeout_ms) as address:  # fmt: skip

        def command(i: int, incarnation: int) -> list[str]:
            die = die_at if i == victim and incarnation == 0 else -1
            return [sys.executable, "-m", "experiments.elastic_demo", "--role=replica",
                    f"--replica={i}", f"--incarnation={incarnation}", f"--die_at={die}",
                    f"--lighthouse={address}", f"--out={out}",
                    f"--finish_with={finish_with}", f"--min_replicas={min_replicas}",
                    f"--rounds={args.rounds}", f"--inner_steps={args.inner_steps}",
                    f"--fragments={args.fragments}", f"--kill_in={args.kill_in}",
                    f"--replicas={args.replicas}", f"--deadline_s={args.deadline_s}",
                    f"--timeout_s={args.timeout_s}", f"--round_s={args.round_s}",
                    f"--delay={args.delay}", f"--mix={args.mix}"]  # fmt: skip

        replicas = Replicas(command, args.replicas, env)
        due: dict[int, float] = {}  # replica -> when to restart it

        def policy(now: float, ended: list[int]) -> None:
            for i in ended:  # the victim's first exit: restart it once, restart_after later
                if i == victim and restart and replicas.incarnation(i) == 1:
                    due[i] = now + args.restart_after
            for i, t in list(due.items()):
                if now >= t:
                    replicas.start(i)
                    del due[i]

        for i in range(args.replicas):
            replicas.start(i)
        supervise(replicas, policy, deadline_s=args.deadline_s)
    codes = replicas.codes
    summary = {"codes": codes, "lost": victim if victim >= 0 and not restart else None,
               "replicas": {}}  # fmt: skip
    for i in range(args.replicas):
        lines = [json.loads(s) for s in (out / f"replica_{i}.jsonl").read_text().splitlines()]
        final = [x for x in lines if x.get("final")]
        summary["replicas"][i] = {"syncs": [x for x in lines if not x.get("final")],
                                  "final": final[-1] if final else None}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    args = parse(argv)
    if args.role == "replica":
        replica(args)
        return 0
    summary = launch(args)
    print(f"{'replica':>7} {'exits':>10} {'rounds':>6}  {'params SHA-256':<16}  anchor SHA-256")
    ok = True
    for i, r in summary["replicas"].items():
        f = r["final"] or {}
        ok &= bool(f) or i == summary["lost"]
        print(f"{i:>7} {str(summary['codes'][i]):>10} {f.get('rounds', '-')!s:>6}  "
              f"{f.get('params', '-')[:16]:<16}  {f.get('anchor', '-')[:16]}")  # fmt: skip
    finals = [r["final"] for r in summary["replicas"].values() if r["final"]]
    # the anchors agree; so do the params, but with fragments (the fragment not synced in
    # the last round is each replica's own)
    agree = ["anchor"] + (["params"] if args.fragments == 1 else [])
    same = all(len({f[k] for f in finals}) == 1 for k in agree)
    print(f"finished replicas' {' and '.join(agree)} bit-equal" if same else "replicas DIFFER")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
