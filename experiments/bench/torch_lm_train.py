r"""The LM study's run in PyTorch DDP: the GPT twin, dense or with a comm hook, one process a rank.

What a PyTorch user would run instead of jaxcomm on the LM study's workload
(:mod:`experiments.configs.lm_shakespeare`): the twin model, AdamW and
schedule of :mod:`experiments.bench.torch_lm`, each rank drawing the same byte
windows as the JAX harness's worker of that index, under
``torch.nn.parallel.DistributedDataParallel`` on gloo, with
``--hook``:

- ``none``: DDP's fp32 all-reduce of its buckets (``allreduce_hook``, the same
  operation as DDP's default, registered so that its bytes are counted);
- ``fp16``: ``fp16_compress_hook`` (the buckets sent as float16);
- ``powersgd``: ``PowerSGDState`` + ``powerSGD_hook`` at jaxcomm's setting
  (rank ``--rank``, error feedback, warm start, ``start_powerSGD_iter=2``
  — torch needs >= 2 with error feedback — and min compression rate 2;
  1-D tensors go uncompressed, as with jaxcomm's ``policy="matrices"``);
  one bucket (torch's hook fails on gloo with more than one);
- ``after`` / ``after_fp16``: no DDP; once the whole backward pass is done, one
  ``all_reduce`` of the gradient flattened into one buffer (float32, or float16
  divided by the world size first, as ``fp16_compress_hook`` does): the same
  bytes as ``none`` / ``fp16`` with none of DDP's overlap of its buckets'
  all-reduces with the backward pass, as jaxcomm's harness exchanges (the
  comparison's diagnostic: how much of DDP's step is that overlap);
- ``nocomm``: no DDP and no exchange, each rank training its own copy on its own
  batches: PyTorch's compute floor, the step every other hook's is set against
  (the validation loss is rank 0's own model's, the training loss the mean over
  independent models: not a data-parallel run's);
- ``ft_diloco`` / ``ft_streaming``: no DDP; torchft's DiLoCo / Streaming
  DiLoCo at the study's ``diloco`` / ``streaming`` settings, each rank its own
  replica group (:mod:`experiments.bench.torch_lm_ft`).

It writes ``metrics.jsonl`` in the JAX harness's row format (``step``,
``loss``: the training loss's mean over the steps since the last row and over
the ranks, ``eval_loss`` and its standard error over windows, ``accuracy``,
``train_s``: seconds of training steps, evaluations excluded, ``wire_bytes``:
the bytes this rank handed to ``all_reduce`` so far), every ``--eval_every``
steps, so the LM study (:mod:`experiments.studies.lm`) runs, probes and
judges these runs as it does its own methods. Rank 0 evaluates; the others
wait for it at a barrier, as the JAX harness's processes do, so that every
timed step runs with all the ranks.

Command (2 processes; ``experiments.launch`` sets the rendezvous)::

  python -m experiments.launch --processes=2 -- python -m experiments.bench.torch_lm_train \
      --hook=powersgd --workdir=runs/torch_psgd
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from absl import app, flags
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
from torch.nn.parallel import DistributedDataParallel as DDP

from experiments import data as data_lib
from experiments.bench import torch_lm, torch_lm_ft
from experiments.bench.torch_peers import ByteCounter, init_env
from experiments.configs import lm_shakespeare

FLAGS = flags.FLAGS
HOOKS = ("none", "fp16", "powersgd", "after", "after_fp16", "nocomm", *torch_lm_ft.VARIANT)


def define_flags() -> None:
    flags.DEFINE_enum("hook", "none", HOOKS, "DDP communication hook, or torchft's DiLoCo")
    flags.DEFINE_integer("rank", 4, "PowerSGD's rank (jaxcomm's LM variant: 4)")
    flags.DEFINE_string("workdir", None, "where metrics.jsonl is written")
    flags.DEFINE_integer(
        "seed", 0, "the run's seed (model init: torch's own stream; data: the harness's)"
    )
    flags.DEFINE_integer("steps", 0, "the schedule's steps (0: the config's)")
    flags.DEFINE_integer(
        "stop_after", 0, "stop after this many steps of the same schedule (0: all)"
    )
    flags.DEFINE_integer("eval_every", 0, "steps between evaluations (0: the config's)")


def wrap(model: torch.nn.Module, hook: str, rank: int) -> DDP:
    if hook == "powersgd":
        ddp = DDP(model, bucket_cap_mb=1000)
        state = ph.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
            min_compression_rate=2.0, use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        ddp.register_comm_hook(state, ph.powerSGD_hook)
        return ddp
    ddp = DDP(model)
    # dense: DDP's own all-reduce of its fp32 buckets, as a hook so the bytes are counted
    ddp.register_comm_hook(None, dh.fp16_compress_hook if hook == "fp16" else dh.allreduce_hook)
    return ddp


def exchange_after(model: torch.nn.Module, half: bool, world: int) -> None:
    """Average the gradients over the ranks with one all-reduce of one flat buffer, after
    the backward pass (``--hook=after``; ``half``: in float16, pre-divided, as
    ``fp16_compress_hook``)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if half:
        flat = flat.to(torch.float16).div_(world)
        dist.all_reduce(flat)
        flat = flat.to(torch.float32)
    else:
        dist.all_reduce(flat)
        flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main(argv) -> None:
    del argv
    rank, world = init_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    config = lm_shakespeare.get_config("dense")
    if FLAGS.steps:
        config.num_train_steps = FLAGS.steps
    total = config.num_train_steps
    stop = FLAGS.stop_after or total
    every = FLAGS.eval_every or config.eval_every
    ds = data_lib.shakespeare(
        world, seq_len=config.data.seq_len, test_windows=config.data.test_windows
    )
    stream = np.asarray(ds.x_train[rank])
    seq, per = config.data.seq_len, config.data.batch_size
    starts = torch_lm.batch_starts(FLAGS.seed, rank, range(stop), len(stream), per, seq)
    torch.manual_seed(FLAGS.seed)
    model = torch_lm.from_config(config)
    opt, sched = torch_lm.adamw(model, config)
    counter, outer = ByteCounter(), contextlib.nullcontext()
    if FLAGS.hook in torch_lm_ft.VARIANT:  # torchft: each rank trains its own copy
        ddp = model
        outer, manager, lighthouse = torch_lm_ft.diloco(model, opt, FLAGS.hook, counter)
    elif FLAGS.hook in ("nocomm", "after", "after_fp16"):  # no DDP (the floor: nothing sent)
        ddp = model
    else:
        ddp = wrap(model, FLAGS.hook, FLAGS.rank)
    os.makedirs(FLAGS.workdir, exist_ok=True)
    path = os.path.join(FLAGS.workdir, "metrics.jsonl")
    if rank == 0:
        open(path, "w").close()
    train_s, losses, t0 = 0.0, [], time.perf_counter()
    with counter, outer:
        for step in range(stop):
            t = time.perf_counter()
            x, y = torch_lm.windows(stream, starts[step], seq)
            loss = torch_lm.lm_loss(ddp(x), y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            if FLAGS.hook.startswith("after"):
                exchange_after(model, FLAGS.hook == "after_fp16", world)
            loss = loss.detach()
            opt.step()
            sched.step()
            train_s += time.perf_counter() - t
            losses.append(loss.item())
            done = step + 1
            if done % every != 0 and done != stop:
                continue
            # the harness's "loss": the mean over the steps since the last row and over
            # the ranks (one uncounted all-reduce per evaluation, on every rank)
            mean = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
            counter.orig(mean)
            losses = []
            if rank == 0:
                row = {"step": done, "loss": float(mean[0] / mean[1]),
                       **torch_lm.evaluate(model, ds.x_test), "train_s": train_s,
                       "wire_bytes": int(counter.bytes), "processes": world,
                       "wall_s": time.perf_counter() - t0}  # fmt: skip
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            # the others wait for rank 0's evaluation, as the harness's processes do: else
            # a rank with no collective until its next sync (DiLoCo) computes during it
            dist.barrier()
    if FLAGS.hook in torch_lm_ft.VARIANT:
        manager.shutdown(wait=False)
        dist.barrier()  # every manager is done with the lighthouse
        if lighthouse is not None:
            lighthouse.shutdown()
    # every rank is done; leave without tearing the group down (torch's gloo teardown at
    # exit sometimes aborts: experiments/bench/torch_peers.py)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("workdir")
    app.run(main)
