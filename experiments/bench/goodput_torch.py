"""The goodput bench's torchft replica: torchft's DiLoCo on the LM's GPT twin, one process a group.

What a PyTorch user would run: the twin model, AdamW and schedule of
:mod:`experiments.bench.torch_lm`, the batches the harness's worker of this
index draws, and ``torchft.local_sgd.DiLoCo`` at the study's settings
(:func:`experiments.bench.torch_lm_ft.settings`; fragments as
:func:`~experiments.bench.torch_lm_ft.fragments`: Streaming DiLoCo with
``delay=1, mix=0.5``, or none with ``--streaming=no_overlap``) over a one-process replica group
(:func:`jaxcomm.elastic.gloo_manager`, ``min_replicas=1``) and the launcher's
lighthouse, as :mod:`experiments.bench.goodput` starts it
(``--role=replica --side=torchft``). Unlike
:func:`experiments.bench.torch_lm_ft.diloco`, no ``torch.distributed`` default
group spans the replicas (a killed replica would break it).

Healing: the model, AdamW, its scheduler and the data position are
registered with the manager (DiLoCo registers the global copy and the outer
optimizers itself), so a restarted replica loads them from a live peer at its
first quorum, which comes after its first ``H / F - delay`` inner steps (torchft's
DiLoCo has no join: those steps are overwritten by the heal).
"""

from __future__ import annotations

import os
import time

from experiments.bench import goodput_workload as workload
from experiments.elastic_launch import mark_ready, sha256, wait_ready


class _Recorder:
    """Wraps a manager's ``start_quorum`` / ``should_commit``: each sync's outcome and time."""

    def __init__(self, manager) -> None:
        self.manager, self.outcomes, self._t = manager, [], None
        start, commit = manager.start_quorum, manager.should_commit

        def start_quorum(*a, **kw):
            self._t = time.perf_counter()
            return start(*a, **kw)

        def should_commit(*a, **kw):
            before = manager.current_step()
            ok = commit(*a, **kw)
            self.outcomes.append((before, ok, time.perf_counter() - self._t))
            return ok

        manager.start_quorum, manager.should_commit = start_quorum, should_commit


def settings(args) -> dict:
    """torch_lm_ft's settings of ``args.method``, its overlap as ``args.streaming`` says."""
    from experiments.bench import torch_lm_ft

    s = torch_lm_ft.settings("ft_" + args.method)
    if args.streaming == "no_overlap":
        s.update(delay=0, mix=0.0)
    return s


def _build(args):
    """``(config, settings, model, opt, sched, stream, starts, x_test)`` of this replica."""
    import numpy as np
    import torch

    from experiments.bench import torch_lm

    config = workload.config(args)
    s = settings(args)
    ds = workload.dataset(config, args.replicas)
    stream = np.asarray(ds.x_train[args.replica])
    seq, per, total = config.data.seq_len, config.data.batch_size, config.num_train_steps
    starts = torch_lm.batch_starts(config.seed, args.replica, range(total), len(stream), per, seq)
    torch.manual_seed(config.seed)
    model = torch_lm.from_config(config)
    opt, sched = torch_lm.adamw(model, config)
    return config, s, model, opt, sched, stream, starts, ds.x_test


def replica(args) -> None:
    """Train as replica ``args.replica`` until the data position reaches the schedule's end."""
    import torch

    from experiments.bench import torch_lm, torch_lm_ft
    from jaxcomm.elastic import gloo_manager

    torch.set_num_threads(1)
    config, s, model, opt, sched, stream, starts, x_test = _build(args)
    if args.inner_out:  # the inner steps alone (goodput.inner_steps): no manager, no sync
        every = s["every"] // s["fragments"]  # a call: the steps between two syncs
        times = []
        for k in range(args.inner_calls + 1):  # the first (AdamW's state made): untimed
            t = time.perf_counter()
            for i in range(k * every, (k + 1) * every):
                x, y = torch_lm.windows(stream, starts[i % len(starts)], config.data.seq_len)
                loss = torch_lm.lm_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                loss.item()
                opt.step()
                sched.step()
            times.append(time.perf_counter() - t)
        times = times[1:]
        return workload.write_inner(args.inner_out, times, every)
    manager = gloo_manager(
        f"replica_{args.replica}", args.lighthouse, min_replicas=1, timeout_s=args.timeout_s,
        quorum_timeout_s=args.deadline_s, init_sync=False,  # every replica starts from the seed
    )  # fmt: skip
    pos = {"position": 0, "healed": False}

    def save() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "position": pos["position"]}  # fmt: skip

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        pos.update(position=state["position"], healed=True)

    manager.register_state_dict_fn("train", load, save)
    rec = _Recorder(manager)
    loop = torch_lm_ft.outer_loop(model, opt, manager, s)
    log = workload.Log(args.run_dir, args.replica, args.incarnation)
    log.write(event="ready")
    if args.incarnation == 0:  # the job starts with every replica up (a restart joins alone)
        mark_ready(log.dir, args.replica)
        wait_ready(log.dir, args.replicas)
    own, since, losses = 0, 0, []
    with loop:
        while pos["position"] < config.num_train_steps:
            t = time.perf_counter()
            x, y = torch_lm.windows(stream, starts[pos["position"]], config.data.seq_len)
            loss = torch_lm.lm_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            time.sleep(max(0.0, args.step_s - (time.perf_counter() - t)))
            pos["position"] += 1
            own += 1
            opt.step()  # DiLoCo's hooks: the quorum (a heal), the sync, every H / F steps
            sched.step()
            for before, committed, sync_s in rec.outcomes:
                log.sync(round=before, rounds=manager.current_step(), committed=committed,
                         healed=pos["healed"], participants=manager.num_participants(),
                         steps=own - since, position=pos["position"], sync_s=sync_s,
                         loss=sum(losses) / len(losses))  # fmt: skip
                since, losses, pos["healed"] = own, [], False
            rec.outcomes.clear()
    ev = torch_lm.evaluate(model, x_test)
    log.final(position=pos["position"], rounds=manager.current_step(),
              params=sha256(list(model.parameters())), eval_loss=ev["eval_loss"],
              eval_loss_se=ev["eval_loss_se"])  # fmt: skip
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads would hold the interpreter
