r"""PyTorch twins of ``experiments.models`` and a DDP worker, for ``experiments.bench.peers``.

The models are built the same way as the Flax ones: :class:`TorchMLP` is
``models.MLP`` (flatten, tanh hidden layers, linear head) and
:class:`TorchResNet` is ``models.ResNet`` (3x3 stem, BatchNorm, stages of
residual blocks with 1x1 projection shortcuts, global mean pool, linear head).
Flax's ``SAME`` padding of a stride-2 3x3 conv on an even input pads one
row/column at the end only (torch's ``padding=1`` pads both sides); the twin
pads ``(0, 1, 0, 1)`` by hand, so the two compute the same function.
:func:`load_flax` copies Flax params into a twin (Dense ``(in, out)`` ->
``(out, in)``, conv HWIO ``(kh, kw, in, out)`` -> OIHW ``(out, in, kh, kw)``).

The worker (``python -m experiments.bench.torch_peers --model=mlp --out=r.json``)
is one rank of ``torch.distributed`` (gloo, ``env://``). It reads the
variables ``experiments.launch`` sets for JAX (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) when ``MASTER_ADDR`` & co. are not
set, so the same launcher (loopback or the network lab) starts both
frameworks. It times the training steps of :data:`CONFIGS`: the plain module
with no exchange (``nocomm``), DDP with its default all-reduce and with the
``fp16_compress_hook``, ``bf16_compress_hook`` and ``powerSGD_hook`` comm
hooks, and counts the bytes each hook hands to ``dist.all_reduce``. Rank 0
writes the result JSON. With ``--hook_group=SPEC --rank=i`` it is one rank of
the PowerSGD agreement's gloo group (:func:`hook_group_worker`, started by
``experiments.bench.peers_agree.torch_powersgd_group``).

What both frameworks share (the models by name, each rank's batch, PowerSGD's
settings) is in ``experiments.bench.peers_setup``, which needs no torch.

Install torch's CPU build: ``pip install -e ".[peers]" --extra-index-url
https://download.pytorch.org/whl/cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
from torch.nn.parallel import DistributedDataParallel as DDP

from experiments.bench.peers_setup import MODELS, POWERSGD, batch, spread, worker_grads

# --- models ---------------------------------------------------------------------------


class TorchMLP(nn.Module):
    """``experiments.models.MLP``: flatten, ``depth`` tanh layers of ``hidden``, linear head."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 128, depth: int = 1):
        super().__init__()
        dims = [in_features] + [hidden] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(x)


def _bn(c: int) -> nn.BatchNorm2d:
    # flax: epsilon 1e-5, running average x·0.9 + new·0.1 (torch's momentum is the other side)
    return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)


class _Conv(nn.Module):
    """A bias-free conv with Flax's ``SAME`` padding (stride 2: pad the end only)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1):
        super().__init__()
        self.k, self.stride = k, stride
        pad = 0 if (stride == 2 or k == 1) else k // 2
        self.conv = nn.Conv2d(cin, cout, k, stride, padding=pad, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 2 and self.k == 3:
            x = F.pad(x, (0, 1, 0, 1))  # SAME on an even input: total pad 1, at the end
        return self.conv(x)


class TorchBlock(nn.Module):
    """``models.ResidualBlock``: two 3x3 convs + BN, 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _Conv(cin, cout, 3, stride), _bn(cout)
        self.conv2, self.bn2 = _Conv(cout, cout, 3), _bn(cout)
        self.proj = None
        if cin != cout or stride != 1:
            self.proj, self.bnp = _Conv(cin, cout, 1, stride), _bn(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.proj is not None:
            x = self.bnp(self.proj(x))
        return F.relu(x + y)


class TorchResNet(nn.Module):
    """``models.ResNet``; ``stages=(64, 128, 256, 512), blocks=2`` is ResNet-18. Input NCHW."""

    def __init__(self, num_classes: int, stages=(16, 32, 64), blocks: int = 1, in_ch: int = 3):
        super().__init__()
        self.stem, self.bn = _Conv(in_ch, stages[0], 3), _bn(stages[0])
        layers, cin = [], stages[0]
        for i, c in enumerate(stages):
            for j in range(blocks):
                layers.append(TorchBlock(cin, c, 2 if i > 0 and j == 0 else 1))
                cin = c
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


def load_flax(model: nn.Module, params: dict) -> nn.Module:
    """Copies Flax ``params`` of ``models.MLP`` / ``models.ResNet`` into its twin, in place.

    Dense kernels ``(in, out)`` become ``(out, in)`` weights; conv kernels
    HWIO ``(kh, kw, in, out)`` become OIHW ``(out, in, kh, kw)``; BatchNorm
    ``scale`` / ``bias`` become ``weight`` / ``bias``.
    """

    def t(x):
        return torch.from_numpy(np.array(x, np.float32))

    def dense(lin: nn.Linear, p):
        lin.weight.data.copy_(t(p["kernel"]).T)
        lin.bias.data.copy_(t(p["bias"]))

    def conv(c: _Conv, p):
        c.conv.weight.data.copy_(t(p["kernel"]).permute(3, 2, 0, 1))

    def bn(b: nn.BatchNorm2d, p):
        b.weight.data.copy_(t(p["scale"]))
        b.bias.data.copy_(t(p["bias"]))

    if isinstance(model, TorchMLP):
        for i, layer in enumerate(model.hidden):
            dense(layer, params[f"Dense_{i}"])
        dense(model.head, params[f"Dense_{len(model.hidden)}"])
        return model
    conv(model.stem, params["Conv_0"])
    bn(model.bn, params["BatchNorm_0"])
    for i, b in enumerate(model.blocks):
        p = params[f"ResidualBlock_{i}"]
        conv(b.conv1, p["Conv_0"])
        bn(b.bn1, p["BatchNorm_0"])
        conv(b.conv2, p["Conv_1"])
        bn(b.bn2, p["BatchNorm_1"])
        if b.proj is not None:
            conv(b.proj, p["Conv_2"])
            bn(b.bnp, p["BatchNorm_2"])
    dense(model.head, params["Dense_0"])
    return model


# --- the torch side's configurations, and its models by name ------------------------------

# the torch side's configurations (name -> what the step is); the jaxcomm side's are
# experiments.bench.peers_report.JAX_CONFIGS, paired by name
CONFIGS = {
    "nocomm": "the plain module, no DDP wrapper: each rank applies its own gradient (no "
    "all-reduce, no reducer hooks); the same SGD",
    "allreduce": "DDP's default: fp32 all-reduce of its gradient buckets (25 MB cap)",
    "fp16": "DDP + fp16_compress_hook: g/n in fp16, one all-reduce per bucket",
    "bf16": "DDP + bf16_compress_hook (registered under another name: DDP refuses that "
    "name without NCCL): g/n in bf16, one all-reduce per bucket",
    "powersgd": "DDP + powerSGD_hook: rank 2, start_powerSGD_iter 2, min_compression_rate "
    "2, error feedback, warm start; one bucket (bucket_cap_mb=1000)",
}


def torch_model(name: str) -> nn.Module:
    kw, shape = MODELS[name]
    if kw["name"] == "mlp":
        return TorchMLP(int(np.prod(shape)), kw["num_classes"], kw["hidden"], kw["depth"])
    return TorchResNet(kw["num_classes"], kw["stages"], kw["blocks"], in_ch=shape[-1])


def to_torch_input(x: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(x)
    return t.permute(0, 3, 1, 2).contiguous() if t.ndim == 4 else t


# --- PowerSGD: torch's hook outside DDP (experiments.bench.peers_agree runs it beside jaxcomm) ---


class HookBucket:
    """The part of a DDP ``GradBucket`` that ``powerSGD_hook`` reads: one flat buffer whose
    views are the gradients (in the given order), bucket index 0, always the last bucket."""

    def __init__(self, tensors: list[np.ndarray]):
        self._buf = torch.cat(
            [torch.from_numpy(np.asarray(t, np.float32)).reshape(-1) for t in tensors]
        )
        self._grads, off = [], 0
        for t in tensors:
            size = int(np.prod(t.shape))
            self._grads.append(self._buf[off : off + size].view(tuple(t.shape)))
            off += size

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return 0

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        return True


def hook_q_layout(shapes: list[tuple[int, ...]], rank: int, min_rate: float) -> dict[int, tuple]:
    """Where each compressed tensor's Q lies in the hook's flat ``q_memory_dict`` buffer.

    The hook views tensor ``i`` as ``(shape[0], rest)`` and lays the Q's of the
    compressed ones out grouped by matrix shape (in order of first appearance),
    then in tensor order. Returns ``{i: (offset, m, r)}``.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, rank)
        if len(shape) >= 2 and _should_compress(n, m, r, min_rate)[0]:
            groups.setdefault((n, m), []).append(i)
    out, off = {}, 0
    for (n, m), idx in groups.items():
        r = min(n, m, rank)
        for i in idx:
            out[i] = (off, m, r)
            off += m * r
    return out


# --- one rank of the hook's gloo group (peers_agree.torch_powersgd_group starts them) -------


def hook_group_worker(spec_path: str, rank: int) -> None:
    """One rank of ``peers_agree.torch_powersgd_group`` (``python -m experiments.bench.torch_peers
    --hook_group=SPEC --rank=i``): runs ``powerSGD_hook`` on its own gradients."""
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    shapes = [tuple(s) for s in spec["shapes"]]
    world, start = spec["world"], spec["start_iter"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world
    )
    hs = ph.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=spec["rank"],
        start_powerSGD_iter=start,
        min_compression_rate=spec["min_rate"],
        use_error_feedback=True,
        warm_start=True,
    )
    layout = hook_q_layout(shapes, spec["rank"], spec["min_rate"])
    total_p = sum(shapes[i][0] * r for i, (_, _, r) in layout.items())
    q_buf = torch.from_numpy(np.load(spec["q_path"]))
    outputs, sent, calls = [], [], []
    for t in range(spec["steps"]):
        if t == start:  # the hook's first PowerSGD step: give it jaxcomm's Q
            hs.p_memory_dict[0] = torch.zeros(total_p)
            hs.q_memory_dict[0] = q_buf.clone()
        bucket = HookBucket(worker_grads(shapes, t, spec["grads_of"][rank], spec["seed"]))
        with ByteCounter() as counter:
            out = ph.powerSGD_hook(hs, bucket).wait()
        out = out[0] if isinstance(out, list) else out
        outputs.append(out.numpy().copy())
        sent.append(counter.bytes)
        calls.append(counter.calls)
    res = dict(
        residual=hs.error_dict[0].numpy(),
        q=hs.q_memory_dict[0].numpy(),
        bytes=np.asarray(sent),
        calls=np.asarray(calls),
    )
    if rank == 0 or spec["all_outputs"]:
        res["outputs"] = np.stack(outputs)
    np.savez(os.path.join(spec["dir"], f"rank{rank}.npz"), **res)
    # every rank has written its file; then leave without tearing the group down: torch's
    # gloo teardown at exit sometimes aborts ("Resource deadlock avoided", 1 run in ~6)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the DDP worker ---------------------------------------------------------------------


class ByteCounter:
    """Counts the bytes of every tensor handed to ``dist.all_reduce`` (what the hooks send)."""

    def __init__(self):
        self.dist, self.orig, self.bytes, self.calls = dist, dist.all_reduce, 0, 0

    def __enter__(self):
        def counted(tensor, *a, **kw):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return self.orig(tensor, *a, **kw)

        self.dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.orig


def init_env() -> tuple[int, int]:
    if "MASTER_ADDR" not in os.environ:  # started by experiments.launch: reuse its variables
        host, port = os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
        os.environ["WORLD_SIZE"] = os.environ["JAX_NUM_PROCESSES"]
        os.environ["RANK"] = os.environ["JAX_PROCESS_ID"]
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run_worker(model_name: str, configs: list[str], batch_size: int, warmup: int, reps: int):
    rank, world = init_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    x, y = batch(model_name, rank, batch_size)
    xt, yt = to_torch_input(x), torch.from_numpy(y).long()
    n_params = sum(p.numel() for p in torch_model(model_name).parameters())
    out = {"model": model_name, "world": world, "params": n_params, "configs": {}}
    out["what"] = {cfg: CONFIGS[cfg] for cfg in configs}
    for cfg in configs:
        torch.manual_seed(0)
        net = torch_model(model_name)
        if cfg == "nocomm":  # the same step with no exchange: the plain module
            out["configs"][cfg] = _time_steps(net, xt, yt, warmup, reps, dist)
            out["configs"][cfg].update(wire_bytes=0, all_reduce_calls=0, buckets=None)
            continue
        kw = {}
        if cfg == "powersgd":  # torch's hook fails on gloo with more than one bucket
            kw["bucket_cap_mb"] = 1000
        # BatchNorm statistics stay per worker in both frameworks (no buffer broadcast)
        ddp = DDP(net, broadcast_buffers=False, **kw)
        state = None
        if cfg == "fp16":
            ddp.register_comm_hook(None, dh.fp16_compress_hook)
        elif cfg == "bf16":
            # DDP refuses a hook *named* bf16_compress_hook without CUDA/NCCL; gloo reduces
            # bf16 on CPU, so the same function goes in under another name
            def bf16_hook_cpu(state, bucket):
                return dh.bf16_compress_hook(state, bucket)

            ddp.register_comm_hook(None, bf16_hook_cpu)
        elif cfg == "powersgd":
            state = ph.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=POWERSGD["rank"],
                start_powerSGD_iter=POWERSGD["start_iter"],
                min_compression_rate=POWERSGD["min_compression_rate"],
                use_error_feedback=True,
                warm_start=True,
            )
            ddp.register_comm_hook(state, ph.powerSGD_hook)
        counter = ByteCounter()
        with counter:
            res = _time_steps(ddp, xt, yt, warmup, reps, dist, counter)
        # the default path all-reduces the fp32 buckets inside the reducer (no hook to count)
        res.update(
            wire_bytes=counter.bytes / reps if cfg != "allreduce" else 4 * n_params,
            all_reduce_calls=counter.calls / reps if cfg != "allreduce" else None,
            buckets=len(state.q_memory_dict) if state is not None else None,
        )
        out["configs"][cfg] = res
    dist.destroy_process_group()
    return rank, out


def _time_steps(net, xt, yt, warmup: int, reps: int, dist, counter=None) -> dict:
    """SGD steps of ``net`` (a module or its DDP wrapper): ``warmup`` untimed, then ``reps``
    timed, each after a barrier (not timed); ``counter`` counts only the timed steps."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(net(xt), yt)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    if counter is not None:
        counter.bytes = counter.calls = 0
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(step_s=spread(times))


def time_collectives(d: int, reps: int) -> dict:
    """Median seconds of ``dist.all_reduce`` of d entries: fp32, fp16 (as the fp16 hook sends:
    g/n in float16) and uint8 (the same bytes, integer sum: the wire without fp16 arithmetic)."""
    rank, world = init_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    g = torch.from_numpy(np.random.default_rng(rank).normal(size=d).astype(np.float32))
    make = {
        "psum_f32": lambda: g.clone(),
        "psum_f16": lambda: g.to(torch.float16).div_(world),
        "psum_bf16": lambda: g.to(torch.bfloat16),
        "psum_u8_bits": lambda: g.to(torch.float16).view(torch.uint8),
    }
    out = {}
    for _ in range(2):
        for k, f in make.items():
            ts = []
            for _ in range(reps):
                x = f()
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                ts.append(time.perf_counter() - t0)
            out[k] = min(out.get(k, 1e9), float(np.median(ts)))
    dist.destroy_process_group()
    return rank, {"d": d, "world": world, "median_s": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=sorted(MODELS))
    ap.add_argument("--configs", default="nocomm,allreduce,fp16,bf16,powersgd")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="rank 0 writes its JSON here")
    ap.add_argument("--collectives", type=int, default=0, help="time bare all-reduces of d")
    ap.add_argument("--hook_group", default=None, help="internal: torch_powersgd_group's spec")
    ap.add_argument("--rank", type=int, default=0, help="internal: rank for --hook_group")
    a = ap.parse_args()
    if a.hook_group:
        hook_group_worker(a.hook_group, a.rank)
        return
    if not a.out:
        ap.error("--out is required")
    if a.collectives:
        rank, out = time_collectives(a.collectives, a.reps)
    else:
        configs = a.configs.split(",")
        if set(configs) - set(CONFIGS):
            ap.error(f"--configs: unknown {sorted(set(configs) - set(CONFIGS))}; {list(CONFIGS)}")
        rank, out = run_worker(a.model, configs, a.batch, a.warmup, a.reps)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
