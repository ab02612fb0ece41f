r"""The peers bench's ``agree`` part: torch's ``powerSGD_hook`` beside ``jaxcomm.powersgd``.

Both from the same Q on the same gradients, in torch's matrix view
(``matrix_view="first"``), error feedback and warm start on.
:func:`powersgd_side_by_side`: one process, the hook in a ``world_size=1``
gloo group and jaxcomm with no axis. At world size > 1:
:func:`torch_powersgd_group` runs the hook in a real gloo group on loopback
(each rank ``python -m experiments.bench.torch_peers --hook_group=...``),
:func:`jaxcomm_powersgd_group` runs ``jaxcomm.powersgd`` under ``jax.shard_map``
over as many devices, each worker on its own gradients, and
:func:`compare_powersgd_group` gives the differences.

Split from :mod:`experiments.bench.torch_peers`; needs torch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

import jaxcomm
from experiments.bench.peers_setup import worker_grads
from experiments.bench.torch_peers import HookBucket, hook_q_layout


def init_gloo_single(port: int) -> None:
    """A ``world_size=1`` gloo process group in this process (the hook needs one)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def powersgd_side_by_side(
    grads: list[list[np.ndarray]],
    *,
    rank: int = 2,
    start_iter: int = 2,
    min_rate: float = 2.0,
    seed: int = 0,
    q_override=None,
) -> dict:
    """Runs torch's ``powerSGD_hook`` and ``jaxcomm.powersgd`` over the same gradients.

    ``grads[t]`` are step ``t``'s tensors in torch layout (one bucket, in this
    order); the hook runs with a ``world_size=1`` group (:func:`init_gloo_single`
    first), jaxcomm locally (``axis_name=None``) with ``matrix_view="first"``,
    torch's view. Both keep error feedback and warm start on. The initial Q is
    jaxcomm's (drawn from ``seed``), written into the hook's ``q_memory_dict``
    before its first PowerSGD step (the hook then orthogonalises it, which
    changes P's columns by an upper-triangular factor and so not P̂).
    ``q_override`` (tests only) replaces the Q handed to jaxcomm.

    Returns per step the max |torch − jaxcomm| of the outputs, and after the
    last step that of Q and of the residual, plus the output scale.
    """
    shapes = [tuple(g.shape) for g in grads[0]]
    names = [f"t{i:03d}" for i in range(len(shapes))]
    tx = jaxcomm.powersgd(
        rank,
        key=jax.random.key(seed),
        start_iter=start_iter,
        min_compression_rate=min_rate,
        matrix_view="first",
    )
    state = tx.init({k: jnp.zeros(s, jnp.float32) for k, s in zip(names, shapes)})
    layout = hook_q_layout(shapes, rank, min_rate)
    comp = sorted(layout)  # jaxcomm's state.q: compressed leaves in tree order = this order
    hs = ph.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=start_iter,
        min_compression_rate=min_rate,
        use_error_feedback=True,
        warm_start=True,
    )
    q_jax = [np.asarray(q) for q in state.q]
    total_q = sum(m * r for _, m, r in layout.values())
    total_p = sum(s[0] * layout[i][2] for i, s in enumerate(shapes) if i in layout)
    q_buf = torch.zeros(total_q)
    for i, q in zip(comp, q_jax):
        off, m, r = layout[i]
        q_buf[off : off + m * r] = torch.from_numpy(np.array(q)).reshape(-1)
    if q_override is not None:
        state = state._replace(q=tuple(jnp.asarray(q) for q in q_override))
    update = jax.jit(tx.update)
    steps = []
    for t, step_grads in enumerate(grads):
        if t == start_iter:  # the hook's first PowerSGD step: give it jaxcomm's Q
            hs.p_memory_dict[0] = torch.zeros(total_p)
            hs.q_memory_dict[0] = q_buf.clone()
        bucket = HookBucket(step_grads)
        torch_out = ph.powerSGD_hook(hs, bucket).wait()
        if isinstance(torch_out, list):
            torch_out = torch_out[0]
        upd, state = update(dict(zip(names, (jnp.asarray(g) for g in step_grads))), state)
        jax_out = np.concatenate([np.asarray(upd[k]).reshape(-1) for k in names])
        steps.append(float(np.abs(torch_out.numpy() - jax_out).max()))
    q_t = hs.q_memory_dict[0].numpy()
    q_diff = max(
        float(
            np.abs(
                q_t[layout[i][0] : layout[i][0] + layout[i][1] * layout[i][2]]
                - np.asarray(q).reshape(-1)
            ).max()
        )
        for i, q in zip(comp, state.q)
    )
    res_j = np.concatenate([np.asarray(state.residual[k]).reshape(-1) for k in names])
    return dict(
        output_max_abs_diff=steps,
        q_max_abs_diff=q_diff,
        residual_max_abs_diff=float(np.abs(hs.error_dict[0].numpy() - res_j).max()),
        output_scale=float(np.abs(jax_out).max()),
        compressed=len(comp),
        tensors=len(shapes),
        floats_per_step=total_p
        + total_q
        + sum(int(np.prod(s)) for i, s in enumerate(shapes) if i not in layout),
    )


def initial_q(shapes, *, rank: int, min_rate: float, seed: int = 0) -> list[np.ndarray]:
    """jaxcomm's initial Q for these shapes (``matrix_view="first"``), one ``(b, r)`` per
    compressed tensor in tensor order; both sides of :func:`powersgd_group` start from it."""
    tx = jaxcomm.powersgd(
        rank, key=jax.random.key(seed), min_compression_rate=min_rate, matrix_view="first"
    )
    tree = {f"t{i:03d}": jnp.zeros(s, jnp.float32) for i, s in enumerate(shapes)}
    return [np.asarray(q) for q in tx.init(tree).q]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_powersgd_group(
    shapes,
    q0: list[np.ndarray],
    *,
    world: int = 2,
    steps: int = 5,
    rank: int = 2,
    start_iter: int = 2,
    min_rate: float = 2.0,
    seed: int = 0,
    all_outputs: bool = False,
    timeout_s: float = 300.0,
) -> dict:
    """torch's ``powerSGD_hook`` in a real ``world``-process gloo group on loopback.

    Each rank is a fresh Python process (``subprocess``, a free port) that runs
    the hook ``steps`` times on one bucket holding its own gradients
    (:func:`worker_grads` of its rank), with error feedback and warm start; the
    initial Q ``q0`` (jaxcomm's, :func:`initial_q`) goes into the hook's
    ``q_memory_dict`` before its first PowerSGD step.

    Returns ``outputs`` (steps, total) of rank 0 (every rank's when
    ``all_outputs``: ``outputs_per_rank``), ``residual`` (world, total), the
    final ``q`` buffer (hook layout), ``bytes`` and ``calls`` per step handed to
    ``dist.all_reduce`` (rank 0).
    """
    layout = hook_q_layout([tuple(s) for s in shapes], rank, min_rate)
    q_buf = np.zeros(sum(m * r for _, m, r in layout.values()), np.float32)
    for i, q in zip(sorted(layout), q0):
        off, m, r = layout[i]
        q_buf[off : off + m * r] = np.asarray(q, np.float32).reshape(-1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    if "GLOO_SOCKET_IFNAME" not in env and "lo" in _interfaces():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    with tempfile.TemporaryDirectory() as d:
        spec = dict(
            shapes=[list(s) for s in shapes],
            world=world,
            steps=steps,
            rank=rank,
            start_iter=start_iter,
            min_rate=min_rate,
            seed=seed,
            grads_of=list(range(world)),
            port=_free_port(),
            q_path=os.path.join(d, "q.npy"),
            dir=d,
            all_outputs=all_outputs,
        )
        np.save(spec["q_path"], q_buf)
        spec_path = os.path.join(d, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "experiments.bench.torch_peers", f"--hook_group={spec_path}"]
        procs = [subprocess.Popen(cmd + [f"--rank={i}"], cwd=root, env=env) for i in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code:
                    raise RuntimeError(f"torch hook rank exited with {code}: {cmd}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        ranks = [dict(np.load(os.path.join(d, f"rank{i}.npz"))) for i in range(world)]
    out = dict(
        outputs=ranks[0]["outputs"],
        residual=np.stack([r["residual"] for r in ranks]),
        q=ranks[0]["q"],
        q_per_rank=np.stack([r["q"] for r in ranks]),
        bytes=ranks[0]["bytes"],
        calls=ranks[0]["calls"],
        layout=layout,
    )
    if all_outputs:
        out["outputs_per_rank"] = np.stack([r["outputs"] for r in ranks])
    return out


def _interfaces() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


_GROUP_STEPS: dict = {}


def jaxcomm_powersgd_group(
    shapes,
    *,
    world: int = 2,
    steps: int = 5,
    rank: int = 2,
    start_iter: int = 2,
    min_rate: float = 2.0,
    seed: int = 0,
    grads_of=None,
    q_override=None,
    error_feedback: bool = True,
) -> dict:
    """``jaxcomm.powersgd(matrix_view="first")`` under ``jax.shard_map`` over ``world`` devices.

    Worker ``w`` gets :func:`worker_grads` of worker ``grads_of[w]`` (default
    its own) at every step; the initial Q is drawn from ``seed`` as
    :func:`initial_q` draws it (``q_override`` replaces it, tests only).
    Returns ``outputs`` (steps, total) of worker 0, ``outputs_spread`` (max
    |worker − worker 0| over all steps and workers), ``residual`` (world,
    total), ``q`` (worker 0's, one ``(b, r)`` per compressed tensor),
    ``q_spread`` and ``wire_bytes`` (``jaxcomm.wire_bytes`` of the steady
    PowerSGD step).
    """
    if jax.device_count() < world:
        raise ValueError(f"needs {world} devices, has {jax.device_count()}")
    grads_of = list(range(world)) if grads_of is None else list(grads_of)
    names = [f"t{i:03d}" for i in range(len(shapes))]

    def make(start):
        return jaxcomm.powersgd(
            rank,
            key=jax.random.key(seed),
            axis_name="data",
            start_iter=start,
            min_compression_rate=min_rate,
            error_feedback=error_feedback,
            matrix_view="first",
        )

    tx = make(start_iter)
    tree = {k: jnp.zeros(s, jnp.float32) for k, s in zip(names, shapes)}
    state = tx.init(tree)
    if q_override is not None:
        state = state._replace(q=tuple(jnp.asarray(q) for q in q_override))
    mesh = Mesh(np.array(jax.devices()[:world]), ("data",))
    sh = NamedSharding(mesh, P("data"))
    state = jax.device_put(
        jax.tree.map(lambda a: jnp.broadcast_to(a, (world,) + a.shape), state), sh
    )
    # one compiled step per program (grads and the initial Q are data: reused across calls)
    prog = (tuple(map(tuple, shapes)), world, rank, start_iter, min_rate, seed, error_feedback)
    if prog not in _GROUP_STEPS:

        def step(g, s):
            g, s = jax.tree.map(lambda a: a[0], (g, s))
            u, s = tx.update(g, s)
            return jax.tree.map(lambda a: a[None], (u, s))

        _GROUP_STEPS[prog] = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data"))
        )
    fn = _GROUP_STEPS[prog]
    outputs, spread = [], 0.0
    for t in range(steps):
        per = [worker_grads(shapes, t, w, seed) for w in grads_of]
        g = {k: jax.device_put(np.stack([p[i] for p in per]), sh) for i, k in enumerate(names)}
        upd, state = fn(g, state)
        flat = np.concatenate([np.asarray(upd[k]).reshape(world, -1) for k in names], axis=1)
        spread = max(spread, float(np.abs(flat - flat[:1]).max()))
        outputs.append(flat[0])
    if error_feedback:
        residual = np.concatenate(
            [np.asarray(state.residual[k]).reshape(world, -1) for k in names], axis=1
        )
    else:
        residual = np.zeros((world, sum(int(np.prod(s)) for s in shapes)), np.float32)
    qs = [np.asarray(q) for q in state.q]
    return dict(
        outputs=np.stack(outputs),
        outputs_spread=spread,
        residual=residual,
        q=[q[0] for q in qs],
        q_spread=max(float(np.abs(q - q[:1]).max()) for q in qs),
        wire_bytes=jaxcomm.wire_bytes(make(0), tree, world),
    )


def compare_powersgd_group(t: dict, j: dict) -> dict:
    """Max |torch − jaxcomm| of :func:`torch_powersgd_group` and :func:`jaxcomm_powersgd_group`.

    Outputs per step and Q compare directly. Residuals: torch's hook keeps
    ``M_w − P̂ Q̄ᵀ`` on compressed tensors and ``M_w − mean_w M_w`` on the
    others, jaxcomm ``M_w − P̂ Q_wᵀ`` and 0 (its docstring): the same mean
    over workers (the only thing the next step's output depends on), not the
    same per worker. ``residual_mean_max_abs_diff`` compares the worker mean;
    ``residual_per_worker_max_abs_diff`` shows how far the two conventions
    are apart per worker.
    """
    layout = t["layout"]
    q_diff = max(
        float(np.abs(t["q"][off : off + m * r] - q.reshape(-1)).max())
        for (off, m, r), q in zip((layout[i] for i in sorted(layout)), j["q"])
    )
    out = np.abs(t["outputs"] - j["outputs"]).max(axis=1)
    return dict(
        output_max_abs_diff=[float(x) for x in out],
        output_scale=float(np.abs(j["outputs"]).max()),
        q_max_abs_diff=q_diff,
        residual_mean_max_abs_diff=float(
            np.abs(t["residual"].mean(0) - j["residual"].mean(0)).max()
        ),
        residual_per_worker_max_abs_diff=float(np.abs(t["residual"] - j["residual"]).max()),
        residual_scale=float(np.abs(j["residual"]).max()),
        torch_bytes_per_step=[int(b) for b in t["bytes"]],
        torch_all_reduce_calls_per_step=[int(c) for c in t["calls"]],
        jaxcomm_wire_bytes=int(j["wire_bytes"]),
        jaxcomm_outputs_spread_over_workers=j["outputs_spread"],
        jaxcomm_q_spread_over_workers=j["q_spread"],
    )
