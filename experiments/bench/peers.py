r"""jaxcomm side by side with plain optax and with PyTorch DDP comm hooks.

Parts (``--part``, default all):

* ``overhead``: 8 fake CPU devices, ``jax.shard_map`` training step of the
  same model: ``jaxcomm.allreduce()`` + ``optax.sgd`` vs a hand-written
  ``lax.pmean`` + ``optax.sgd``. Step-time ratio (median and spread of
  interleaved repetitions) and the max |difference| of the params after the
  timed steps (must be 0 up to float summation order).
* ``peers``: real processes (gloo on CPU, one CPU device and one intra-op
  thread each), started by ``experiments.launch`` on loopback and, with
  ``--rates`` (as root), on the network lab's shaped links (tbf). Models
  (``experiments.bench.peers_setup.MODELS``), built the same way in both
  frameworks: the MLP 64-1024-1024-10 (1.12M params), the digits MLP
  64-256-10 (tanh, 19,210 params, ``digits``) and ResNet-18 (11.2M params,
  8x8 inputs); the same batch per rank (``--batch``), SGD. Configurations
  are paired by name; what each is, exactly, is :data:`JAX_CONFIGS` (stored
  in every cell's ``what``) and ``torch_peers.CONFIGS``; a name the other side lacks is
  shown as "—":

  ==============  ==========================================  ===========================
  name            jaxcomm (``optax.chain(tx, optax.sgd)``)    torch
  ==============  ==========================================  ===========================
  nocomm          no tx: each worker applies its own          the plain module, no DDP
                  gradient (params kept per worker)           wrapper, no all-reduce
  allreduce       ``allreduce()``                             DDP's default all-reduce
  fp16, bf16      ``cast(dtype, accumulate="psum")`` (what    ``fp16_compress_hook``,
                  the tables before measured; on CPU it       ``bf16_compress_hook``
                  moves 4 bytes per entry)
  fp16_default,   ``cast(dtype)``, every default (CPU: the    —
  bf16_default    uint16 words all-gathered, summed in fp32;
                  leaves below min_size ride along)
  ef_sign         ``ef_sign()``                               —
  topk            ``topk(0.01)``                              —
  threshold       ``threshold(0.01)``                         —
  powersgd        ``powersgd(2, start_iter=2)``               ``powerSGD_hook`` rank 2
  ==============  ==========================================  ===========================

  (every jaxcomm transform with ``axis_name="data"`` and its default
  ``min_size``; PowerSGD in both: start_iter 2, min_compression_rate 2,
  error feedback, warm start; torch's hook runs with one DDP bucket,
  ``bucket_cap_mb=1000``, because it fails on gloo with several.)
  ``--repeats=R`` launches each framework R times per cell, alternating
  torch and jaxcomm, the order of the configurations rotated by one each
  time; a cell reports per configuration the median of the R per-launch
  median step times and their range (min-max), wire bytes per step
  (jaxcomm: ``jaxcomm.wire_bytes``, and the collectives and bytes read from
  the compiled HLO; torch: the bytes its hook hands to ``dist.all_reduce``).
  The step table (``summarise(...)["steps"]``) gives, per (tag, network,
  processes, model) and configuration, the step time in each framework and
  the step minus that framework's ``nocomm`` step (ms), plus the ratios
  jaxcomm ``bf16_default`` / jaxcomm ``allreduce`` and jaxcomm
  ``bf16_default`` / torch ``bf16``. ``--tag`` (e.g. ``before``, ``after``)
  is stored in each cell and keys it, so runs of two code versions sit in
  one JSON and the report prints them side by side.
* ``agree``: torch's ``powerSGD_hook`` and ``jaxcomm.powersgd`` (torch's
  matrix view) from the same Q on the same gradients of both models' torch
  layout, 5 steps (2 dense + 3 PowerSGD): max |difference| of outputs, Q and
  residual; and floats per step. Then at world size 2: torch's hook in a real
  2-process gloo group (loopback) and ``jaxcomm.powersgd`` under
  ``jax.shard_map`` over 2 devices, each worker with its own gradients: outputs,
  Q, the worker mean of the residuals, bytes per step.
* ``castcost``: why ``cast(float16)`` costs more than dense on CPU: bare
  all-reduces of the MLP's 1.13M entries in both frameworks (fp32, fp16,
  bf16, the fp16 words as integers) and alternatives in XLA.

Quote ratios measured in one run, not absolute times: the machine is shared.

  python -m experiments.bench.peers --repeats=1                    # loopback, ~15 min
  python -m experiments.bench.peers --part=peers --rates=100mbit,1gbit   # as root
  python -m experiments.bench.peers --report                       # tables from the JSON

The one-collective comparison (the small dense leaves inside the compressed
payload's all-gather), as root, once per code version: ~20 min per version on 2 busy
cores, nearly all of it start-up and compiles (one torch and one jaxcomm
launch of these nine configurations took 100 s with ``--reps=2``: 3
networks x 3 repeats of that is 15 min), plus ~1 min of steps at
10 Mbit/s (dense fp32 moves 77 KB a step, ~60 ms)::

  python -m experiments.bench.peers --part=peers --models=digits --procs=2 \
      --configs=nocomm,allreduce,bf16,bf16_default,fp16,ef_sign,topk,threshold,powersgd \
      --rates=100mbit,10mbit --repeats=3 --reps=50 --warmup=5 --tag=after \
      --out=experiments/results/peers_one_collective.json
  python -m experiments.bench.peers --report --out=experiments/results/peers_one_collective.json

The library before the change with this bench: a worktree of the merge's
first parent with this bench's files copied in, run from its root (the launched
processes import ``jaxcomm`` from the working directory first), the same
command with ``--tag=before`` and ``--out`` the absolute path of the same JSON::

  git worktree add /tmp/before f8f2e0c^1
  cp experiments/bench/peers*.py experiments/bench/torch_peers.py /tmp/before/experiments/bench/
  cd /tmp/before && python -m experiments.bench.peers ... --tag=before \
      --out="$OLDPWD/experiments/results/peers_one_collective.json"

Writes ``experiments/results/peers.json`` (``--out``); a new cell replaces the
one of the same (tag, model, processes, network). Needs torch (CPU build):
``pip install -e ".[peers]" --extra-index-url https://download.pytorch.org/whl/cpu``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxcomm
from experiments import launch, netlab
from experiments.bench.peers_jax import (
    build_model,
    castcost_worker,
    jax_worker,
    jaxcomm_tx,
    overhead_part,
)
from experiments.bench.peers_report import (
    CONFIGS,
    JAX_CONFIGS,
    add_cell,
    merge_runs,
    print_cell,
    print_summary,
    summarise,
    write_json,
)
from experiments.bench.peers_setup import POWERSGD

DEFAULT_CONFIGS = ("nocomm", "allreduce", "fp16", "bf16", "powersgd")
_TORCH_MISSING = (
    'torch is not installed: pip install -e ".[peers]" '
    "--extra-index-url https://download.pytorch.org/whl/cpu"
)


def have_torch() -> bool:
    try:  # torch is optional: the overhead part and the jaxcomm processes run without it
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# --- part b: real processes, both frameworks ------------------------------------------------


def _launch(argv: list[str], n: int, lab, env: dict | None = None) -> None:
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        rate = f" --rate={lab.rate}" if lab is not None else ""
        shown = ["python"] + argv[1:] if argv[0] == sys.executable else argv
        print(
            f"$ python -m experiments.launch --processes={n}{rate} -- {shlex.join(shown)}",
            flush=True,
        )
        code = launch.run(argv, processes=n, devices_per_process=1, lab=lab)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if code:
        raise RuntimeError(f"{shlex.join(argv)} failed on {n} processes (exit {code})")


def _single_thread_env() -> dict:
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_cpu_multi_thread_eigen=false".strip()}


def peers_part(
    model_names,
    procs,
    rates,
    *,
    batch,
    warmup,
    reps,
    configs=DEFAULT_CONFIGS,
    repeats: int = 1,
    tag: str | None = None,
    on_cell=None,
    loopback: bool = True,
) -> list[dict]:
    """Cells of (network, processes, model); ``on_cell(cell)`` after each (to save as it goes).

    Each framework is launched ``repeats`` times per cell, torch and jaxcomm in turn, the
    configurations rotated by one each time (none always first); :func:`merge_runs` turns
    the launches into the cell's numbers. torch runs the configurations it has
    (``torch_peers.CONFIGS``), jaxcomm all of them.
    """
    # lazy: torch is optional (--part=overhead and the jaxcomm processes run without it)
    from experiments.bench.torch_peers import CONFIGS as TORCH_CONFIGS

    unknown = [c for c in configs if c not in JAX_CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; choose from {list(JAX_CONFIGS)}")
    cells = []
    for rate in ([None] if loopback else []) + list(rates):
        for n in procs:
            lab = netlab.Lab(n, rate) if rate else None
            if lab is not None:
                lab.open()
            try:
                for name in model_names:
                    cell = {"tag": tag, "model": name, "processes": n}
                    cell.update(network=rate or "loopback", repeats=repeats)
                    runs = {"torch": [], "jaxcomm": []}
                    common = [f"--batch={batch}", f"--warmup={warmup}", f"--reps={reps}"]
                    env = {"GLOO_SOCKET_IFNAME": "lab0"} if lab is not None else {}
                    for r in range(repeats):
                        order = list(configs[r % len(configs) :]) + list(
                            configs[: r % len(configs)]
                        )
                        t_cfgs = [c for c in order if c in TORCH_CONFIGS]
                        with tempfile.TemporaryDirectory() as d:
                            t_out, j_out = os.path.join(d, "t.json"), os.path.join(d, "j.json")
                            if t_cfgs:
                                argv = [sys.executable, "-m", "experiments.bench.torch_peers"]
                                argv += [f"--model={name}", *common]
                                argv += [f"--configs={','.join(t_cfgs)}", f"--out={t_out}"]
                                _launch(argv, n, lab, env)
                                runs["torch"].append(json.load(open(t_out)))
                            argv = [sys.executable, "-m", "experiments.bench.peers"]
                            argv += ["--worker=jax", f"--models={name}", *common]
                            argv += [f"--configs={','.join(order)}", f"--worker_out={j_out}"]
                            _launch(argv, n, lab, _single_thread_env())
                            runs["jaxcomm"].append(json.load(open(j_out)))
                    cell["torch"] = merge_runs(runs["torch"])
                    cell["jaxcomm"] = merge_runs(runs["jaxcomm"])
                    cells.append(cell)
                    print_cell(cell)
                    if on_cell is not None:
                        on_cell(cell)
            finally:
                if lab is not None:
                    lab.close()
    return cells


def castcost_part(procs, d: int, reps: int) -> list[dict]:
    rows = []
    for n in procs:
        with tempfile.TemporaryDirectory() as tmp:
            t_out, j_out = os.path.join(tmp, "t.json"), os.path.join(tmp, "j.json")
            _launch(
                [
                    sys.executable,
                    "-m",
                    "experiments.bench.torch_peers",
                    f"--collectives={d}",
                    f"--reps={reps}",
                    f"--out={t_out}",
                ],
                n,
                None,
            )
            _launch(
                [
                    sys.executable,
                    "-m",
                    "experiments.bench.peers",
                    "--worker=castcost",
                    f"--castcost_d={d}",
                    f"--reps={reps}",
                    f"--worker_out={j_out}",
                ],
                n,
                None,
                _single_thread_env(),
            )
            row = {"processes": n, "torch": json.load(open(t_out)), "xla": json.load(open(j_out))}
        for fw in ("torch", "xla"):
            m = row[fw]["median_s"]
            print(
                f"{n} processes, {fw:5s} all-reduce of {d} entries, time / fp32 all-reduce: "
                + ", ".join(f"{k} {v / m['psum_f32']:.2f}x" for k, v in m.items()),
                flush=True,
            )
        rows.append(row)
    return rows


# --- part 2: PowerSGD agreement ---------------------------------------------------------------


def agree_part(model_names) -> list[dict]:
    # lazy: torch is optional (--part=overhead and the jaxcomm processes run without it)
    from experiments.bench import peers_agree, torch_peers

    peers_agree.init_gloo_single(launch.free_port())
    rows = []
    for name in model_names:
        shapes = [tuple(p.shape) for p in torch_peers.torch_model(name).parameters()]
        rng = np.random.default_rng(0)
        grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(5)]
        r = peers_agree.powersgd_side_by_side(
            grads,
            **{
                "rank": POWERSGD["rank"],
                "start_iter": POWERSGD["start_iter"],
                "min_rate": POWERSGD["min_compression_rate"],
            },
        )
        _, params, _ = build_model(name)
        r["jaxcomm_wire_bytes_flax_layout"] = jaxcomm.wire_bytes(
            jaxcomm_tx("powersgd", steady=True), jax.tree.map(jnp.asarray, params), 2
        )
        r["torch_hook_bytes"] = 4 * r["floats_per_step"]
        r["model"] = name
        print(
            f"agree {name:9s} torch powerSGD_hook vs jaxcomm.powersgd(matrix_view='first'), "
            f"{r['compressed']} of {r['tensors']} tensors compressed: output max |diff| per step "
            f"{[f'{x:.1e}' for x in r['output_max_abs_diff']]} (scale {r['output_scale']:.2f}), "
            f"Q {r['q_max_abs_diff']:.1e}, residual {r['residual_max_abs_diff']:.1e}; bytes per "
            f"step torch {r['torch_hook_bytes']} / jaxcomm on the Flax params "
            f"{r['jaxcomm_wire_bytes_flax_layout']}",
            flush=True,
        )
        rows.append(r)
    return rows


def agree_group_part(model_names, world: int = 2) -> list[dict]:
    """PowerSGD agreement at world size > 1: torch's hook in a real ``world``-process gloo
    group (loopback) vs ``jaxcomm.powersgd(matrix_view="first")`` under ``jax.shard_map``
    over ``world`` of this process's devices; each worker has its own gradients."""
    # lazy: torch is optional (--part=overhead and the jaxcomm processes run without it)
    from experiments.bench import peers_agree, torch_peers

    kw = dict(
        world=world,
        steps=5,
        rank=POWERSGD["rank"],
        start_iter=POWERSGD["start_iter"],
        min_rate=POWERSGD["min_compression_rate"],
        seed=0,
    )
    rows = []
    for name in model_names:
        shapes = [tuple(p.shape) for p in torch_peers.torch_model(name).parameters()]
        q0 = peers_agree.initial_q(shapes, rank=kw["rank"], min_rate=kw["min_rate"])
        t = peers_agree.torch_powersgd_group(shapes, q0, **kw)
        r = peers_agree.compare_powersgd_group(t, peers_agree.jaxcomm_powersgd_group(shapes, **kw))
        r.update(model=name, world=world, compressed=len(t["layout"]), tensors=len(shapes))
        print(
            f"agree {name:9s} world {world}: torch powerSGD_hook ({world} gloo processes) vs "
            f"jaxcomm.powersgd under shard_map, {r['compressed']} of {r['tensors']} tensors "
            f"compressed: output max |diff| per step "
            f"{[f'{x:.1e}' for x in r['output_max_abs_diff']]} (scale {r['output_scale']:.2f}), "
            f"Q {r['q_max_abs_diff']:.1e}, residual worker mean "
            f"{r['residual_mean_max_abs_diff']:.1e} (per worker "
            f"{r['residual_per_worker_max_abs_diff']:.2f}: the two error conventions, scale "
            f"{r['residual_scale']:.2f}); bytes per step torch {r['torch_bytes_per_step']} / "
            f"jaxcomm {r['jaxcomm_wire_bytes']}",
            flush=True,
        )
        rows.append(r)
    return rows


# --- main -------------------------------------------------------------------------------------


def define_flags() -> None:
    flags.DEFINE_enum(
        "part", "all", ["all", "overhead", "peers", "agree", "castcost"], "which part"
    )
    flags.DEFINE_list(
        "models", ["mlp", "resnet18"], "models (experiments.bench.peers_setup.MODELS)"
    )
    flags.DEFINE_list("procs", ["2", "4"], "process counts for the multi-process parts")
    flags.DEFINE_list(
        "rates", [], "shaped link rates for the peers part (root), e.g. 100mbit,1gbit"
    )
    flags.DEFINE_list(
        "configs", list(DEFAULT_CONFIGS), f"configurations of the peers part, of {list(CONFIGS)}"
    )
    flags.DEFINE_bool("loopback", True, "peers: loopback cells too (--noloopback: --rates only)")
    flags.DEFINE_integer("repeats", 3, "peers: launches per framework and cell", lower_bound=1)
    flags.DEFINE_string("tag", None, "peers: stored in each cell and keying it (before, after)")
    flags.DEFINE_integer("reps", 10, "timed steps per configuration")
    flags.DEFINE_integer("warmup", 3, "untimed steps first (>= 2: PowerSGD starts at step 2)")
    flags.DEFINE_integer("batch", 32, "examples per worker per step")
    flags.DEFINE_integer("castcost_d", 1126410, "entries of the bare all-reduces (the MLP's)")
    flags.DEFINE_string("out", "experiments/results/peers.json", "JSON output (parts merged in)")
    flags.DEFINE_bool("report", False, "print the tables of --out and exit")
    flags.DEFINE_string("worker", None, "internal: jax | castcost (one launched process)")
    flags.DEFINE_string("worker_out", None, "internal: where rank 0 writes its JSON")


def main(argv) -> None:
    del argv
    F = flags.FLAGS
    if F.worker == "jax":
        jax_worker(F.models[0], F.configs, F.batch, F.warmup, F.reps, F.worker_out)
        return
    if F.worker == "castcost":
        castcost_worker(F.castcost_d, F.reps, F.worker_out)
        return
    results = {}
    if os.path.exists(F.out):
        with open(F.out) as f:
            results = json.load(f)
    if F.report:
        for cell in results.get("peers", []):
            print_cell(cell)
        if results.get("peers"):
            print_summary(summarise(results["peers"]))
        return
    if not have_torch() and F.part != "overhead":
        print(_TORCH_MISSING, flush=True)
        if F.part != "all":
            sys.exit(1)
    procs = [int(p) for p in F.procs]
    results["commands"] = results.get("commands", {})
    # the command as recorded: --out as the repository-relative path it names, so the JSON
    # holds no path of the machine it ran on (a before-run writes from another checkout)
    argv = [f"--out=experiments/results/{os.path.basename(F.out)}" if a.startswith("--out=")
            else a for a in sys.argv[1:]]  # fmt: skip
    cmd = "python -m experiments.bench.peers " + shlex.join(argv)
    if F.part == "peers":  # runs of some cells merge into the JSON: keep every command
        results["commands"].setdefault("peers_runs", []).append(cmd)
    else:
        results["commands"][F.part] = cmd
    if F.part in ("all", "overhead"):
        results["overhead"] = overhead_part(F.models, F.reps, F.batch // 4)
    if have_torch():
        if F.part in ("all", "agree"):
            results["agree"] = agree_part(F.models)
            results["agree_world2"] = agree_group_part(F.models, world=2)
        if F.part in ("all", "castcost"):
            results["castcost"] = castcost_part(procs, F.castcost_d, F.reps)
        if F.part in ("all", "peers"):

            def merge(cell):  # the JSON is written at once
                cell["command"] = cmd
                add_cell(results, cell)
                write_json(F.out, results)

            peers_part(
                F.models,
                procs,
                F.rates,
                batch=F.batch,
                warmup=F.warmup,
                reps=F.reps,
                configs=F.configs,
                repeats=F.repeats,
                tag=F.tag,
                on_cell=merge,
                loopback=F.loopback,
            )
            print_summary(results["peers_summary"])
    write_json(F.out, results)
    print(f"wrote {F.out}")


if __name__ == "__main__":
    if "--worker" not in " ".join(sys.argv) and "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    define_flags()
    app.run(main)
