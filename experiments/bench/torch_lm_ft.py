"""torchft's DiLoCo and Streaming DiLoCo on the LM study's GPT twin, at the study's settings.

What a PyTorch user would run instead of :func:`jaxcomm.diloco` /
:func:`jaxcomm.streaming_diloco`: ``torchft.local_sgd.DiLoCo`` over the twin
of :mod:`experiments.bench.torch_lm`, each rank its own one-process replica
group (a torchft ``Manager`` over gloo, :func:`jaxcomm.elastic.gloo_manager`),
rank 0 holding the lighthouse. :mod:`experiments.bench.torch_lm_train` runs it
with ``--hook=ft_diloco`` or ``--hook=ft_streaming``.

The settings are the study's variants' (:mod:`experiments.configs.lm_shakespeare`
``diloco`` and ``streaming``): ``every`` inner AdamW steps a round, the outer
step Nesterov SGD (momentum 0.9) at the wrapper's outer rate (0.7 unless the
variant names one), one outer optimizer per fragment (jaxcomm keeps one outer
state per fragment), ``fragments``, ``delay`` (torchft's
``fragment_sync_delay``) and ``mix`` (torchft's ``fragment_update_alpha``:
the weight of the local params at the merge in both). The fragments hold the
same tensors as jaxcomm's (:func:`fragments`: :func:`jaxcomm.loco.fragment_of`
over the Flax leaves, mapped through :func:`experiments.bench.torch_lm.param_pairs`).

The schedules differ by ``delay`` steps: torchft starts fragment ``f``'s
all-reduce ``delay`` steps before its round boundary and merges at the
boundary; jaxcomm sends at the boundary and merges ``delay`` steps later. The
fragment order, the rule and the bytes are the same (fp32 pseudo-gradients,
``4 x`` the fragment's entries per sync per rank, counted at
``Manager.allreduce``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import torch
import torch.distributed as dist

from experiments.bench import torch_lm
from experiments.configs import lm_shakespeare
from jaxcomm.loco.streaming import fragment_of

#: torch_lm_train's ``--hook`` -> the study's variant whose wrapper it runs.
VARIANT = {"ft_diloco": "diloco", "ft_streaming": "streaming"}


def settings(hook: str) -> dict:
    """The variant's wrapper settings: every, fragments, delay, mix, outer_learning_rate."""
    w = lm_shakespeare.get_config(VARIANT[hook]).wrapper
    return {
        "every": int(w.every),
        "fragments": int(w.get("fragments", 1)),
        "delay": int(w.get("delay", 0)),
        "mix": float(w.get("mix", 0.0)),
        "outer_learning_rate": float(w.get("outer_learning_rate", 0.7)),
    }


def fragments(model: torch_lm.GPT, n: int) -> list[torch.nn.ParameterList]:
    """The model's parameters in jaxcomm's ``n`` fragments (the same tensors, not copies)."""
    named = dict(model.named_parameters())
    pairs = sorted(torch_lm.param_pairs(model), key=lambda p: p[1])  # the Flax leaves' order
    shapes = [jax.ShapeDtypeStruct(tuple(named[t].shape), "float32") for t, _, _ in pairs]
    of = fragment_of(shapes, n)
    return [
        torch.nn.ParameterList([named[t] for (t, _, _), g in zip(pairs, of) if g == f])
        for f in range(n)
    ]


def diloco(model: torch_lm.GPT, inner: torch.optim.Optimizer, hook: str, counter: Any) -> tuple:
    """``(DiLoCo, manager, lighthouse or None)`` for this rank; the default group must exist.

    ``counter.bytes`` grows by the bytes of every tensor the manager all-reduces.
    """
    os.environ.setdefault("RUST_LOG", "error")  # torchft's servers log every quorum at info
    logging.getLogger("torchft").setLevel(logging.WARNING)
    from torchft.coordination import LighthouseServer

    from jaxcomm.elastic import gloo_manager, route_address

    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ["MASTER_ADDR"]
    port, server = torch.zeros(1, dtype=torch.int64), None
    if rank == 0:  # every sync needs every rank: min_replicas = world
        server = LighthouseServer(bind=f"{host}:0", min_replicas=world, join_timeout_ms=60_000)
        port[0] = int(server.address().rsplit(":", 1)[1])
    dist.broadcast(port, 0)
    manager = gloo_manager(
        f"replica_{rank}", f"http://{host}:{int(port[0])}", min_replicas=world,
        host=route_address(host), init_sync=False,  # every rank starts from the same seed
    )  # fmt: skip
    sent = manager.allreduce

    def counted(tensor, *args, **kwargs):
        counter.bytes += tensor.numel() * tensor.element_size()
        return sent(tensor, *args, **kwargs)

    manager.allreduce = counted
    return outer_loop(model, inner, manager, settings(hook)), manager, server


def outer_loop(model: torch_lm.GPT, inner: torch.optim.Optimizer, manager: Any, s: dict) -> Any:
    """torchft's ``DiLoCo`` over ``model`` at the settings ``s`` (:func:`settings`): jaxcomm's
    fragments, one outer Nesterov SGD (momentum 0.9) per fragment."""
    from torchft.local_sgd import DiLoCo

    parts = fragments(model, s["fragments"])
    outer = [
        torch.optim.SGD(p.parameters(), lr=s["outer_learning_rate"], momentum=0.9, nesterov=True)
        for p in parts
    ]
    return DiLoCo(
        manager, parts, inner, outer, sync_every=s["every"],
        fragment_sync_delay=s["delay"], fragment_update_alpha=s["mix"],
    )  # fmt: skip
