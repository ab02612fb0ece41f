"""Tensor fusion benchmark: collectives per step and step time, buckets off vs on.

Two parts:

* **8 fake CPU devices** (one process): for the digits-MLP tree (hidden 256,
  4 leaves, 19k params) and the Flax ResNet-18 tree (``experiments.models.ResNet``,
  stages 64-512, 2 blocks, 62 leaves, 11.2M params), every transform's
  ``update`` under ``shard_map``: collective instructions and operands in the
  compiled HLO, and the median step time, with ``bucket_bytes=None`` (one
  collective per leaf) and the default buckets (``"auto"``: 1 MiB on CPU).
* **2 real processes on loopback** (gloo, one CPU device each, started here
  as two subprocesses with ``jax.distributed``): the dense step of the MLP
  tree, the study's wide MLP (64-1024-1024-10, 1.12M params) and ResNet-18
  with ``jaxcomm.allreduce()`` bucketed / per leaf vs a hand-written step that
  concatenates the gradients and does one ``pmean``; each transform of
  ``--procs_transforms`` bucketed (the default ``"auto"``: on CPU 1 MiB for
  sums, 25 MiB for all-gathers; and the sizes of ``--procs_bucket_mib``) / per leaf
  (the update from ``init``'s state), each
  case's least time over ``3 * --reps`` interleaved rounds (each in its own
  random order, the same on both processes); and the gloo
  latency α, fitted as the slope of the best step time over k chained
  4-byte all-reduces (k = 1..16).

Quote ratios from one run, not absolute times: the machine is shared.

  python -m experiments.bench.buckets               # both parts, ~10 min on 2 cores
  python -m experiments.bench.buckets --part=procs  # only the 2-process part

Writes ``experiments/results/buckets.json`` and prints a table; the table of
the 2-process part (``report``) is generated into ``experiments/results/buckets.md``
by ``python -m experiments.studies.tables``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (only when run as a program: importing defines none)."""
    flags.DEFINE_enum("part", "all", ["all", "devices", "procs"], "which part to run")
    flags.DEFINE_integer("reps", 5, "timed steps per case (median)")
    flags.DEFINE_integer("runs", 3, "2-process part: runs, each a fresh pair of processes")
    flags.DEFINE_string("out", "experiments/results/buckets.json", "JSON output")
    flags.DEFINE_integer("worker", -1, "internal: process id of a 2-process worker")
    flags.DEFINE_integer("port", 0, "internal: coordinator port")
    flags.DEFINE_string("trees", "mlp,resnet18", "trees for the fake-device part")
    flags.DEFINE_string("procs_trees", "mlp,wide_mlp,resnet18", "trees for the 2-process part")
    flags.DEFINE_string(
        "procs_transforms", "ef_sign,topk,cast,powersgd", "bucketed vs per leaf, 2 processes"
    )
    flags.DEFINE_string("procs_bucket_mib", "1,25", "other bucket sizes (MiB) timed, 2 processes")


# transform -> its case of experiments.bench.compressors (a method of jaxcomm.methods and its
# options; the all-gather codecs on the path the committed table measured, exchange="gather")
TRANSFORMS = {
    "allreduce": "allreduce",
    "cast": "cast_bf16",
    "int8": "int8",
    "qsgd": "qsgd16",
    **{name: name for name in ("terngrad", "onebit", "ef_sign", "sign_majority", "twobit")},
    **{name: name for name in ("topk", "randomk", "threshold")},
    "powersgd": "powersgd_r2",
    "dgc": "dgc",
}
RATIO = 0.01  # the sparsifiers' (top-k, random-k, threshold, DGC)


def _transforms():
    """Name -> ``make(**options)`` building the transform over axis ``"data"``."""
    from experiments.bench import compressors

    def maker(case):
        method, kwargs = compressors.CASES[case]
        return lambda **kw: compressors.build_method(method, {**kwargs, **kw}, RATIO)

    return {name: maker(case) for name, case in TRANSFORMS.items()}


def _trees():
    import jax
    import jax.numpy as jnp

    from experiments import digits, models

    def resnet18():
        model = models.ResNet(num_classes=10, stages=(64, 128, 256, 512), blocks=2)
        v = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
        return v["params"]

    def mlp():
        return jax.eval_shape(lambda: digits.init_params("mlp", jax.random.key(0), hidden=256))

    def wide_mlp():  # the study's communication-bound model: 64-1024-1024-10, 1.12M params
        f32 = jnp.float32
        dims = [(64, 1024), (1024, 1024), (1024, 10)]
        tree = {}
        for i, (a, b) in enumerate(dims):
            tree[f"w{i}"] = jax.ShapeDtypeStruct((a, b), f32)
            tree[f"b{i}"] = jax.ShapeDtypeStruct((b,), f32)
        return tree

    return {"mlp": mlp, "wide_mlp": wide_mlp, "resnet18": resnet18}


def _median_time(fn, args, reps, best=False):
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0] if best else times[len(times) // 2]


def devices_part(reps: int) -> list[dict]:
    """Collectives and step time per transform on 8 fake devices, buckets off / on."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm import accounting

    n = 8
    mesh = jax.make_mesh((n,), ("data",))
    sh = NamedSharding(mesh, P("data"))
    rows = []
    for tree_name in FLAGS.trees.split(","):
        shapes = _trees()[tree_name]()
        leaves = len(jax.tree.leaves(shapes))
        rng = np.random.default_rng(0)
        grads = jax.tree.map(
            lambda s, rng=rng: jax.device_put(
                jnp.asarray(rng.normal(size=(n,) + s.shape), s.dtype), sh
            ),
            shapes,
        )
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        for name, make in _transforms().items():
            row = {"tree": tree_name, "leaves": leaves, "transform": name}
            for label, kw in (("per_leaf", {"bucket_bytes": None}), ("bucketed", {})):
                tx = make(**kw)

                def f(g, s, tx=tx):
                    u, s = tx.update(
                        jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s)
                    )
                    return u, jax.tree.map(lambda x: x[None], s)

                step = jax.jit(
                    jax.shard_map(
                        f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P("data"))
                    )
                )
                state = jax.tree.map(
                    lambda x: jax.device_put(jnp.broadcast_to(x[None], (n,) + x.shape), sh),
                    tx.init(params),
                )
                compiled = step.lower(grads, state).compile()
                hlo = accounting.hlo_collectives(compiled)
                row[f"{label}_ops"] = len(hlo)
                row[f"{label}_operands"] = sum(c.operands for c in hlo)
                row[f"{label}_wire_count"] = accounting.wire_count(tx, shapes, n)
                row[f"{label}_step_s"] = _median_time(compiled, (grads, state), reps)
            row["time_ratio"] = row["bucketed_step_s"] / row["per_leaf_step_s"]
            print(
                f"{tree_name:9s} {name:14s} ops {row['per_leaf_ops']:3d} "
                f"({row['per_leaf_operands']:3d} operands) -> {row['bucketed_ops']:2d} "
                f"({row['bucketed_operands']:2d}); "
                f"step bucketed/per-leaf {row['time_ratio']:.2f}",
                flush=True,
            )
            rows.append(row)
    return rows


# --- two real processes ---------------------------------------------------------------


def _worker(pid: int, port: int, reps: int) -> None:
    """One of two gloo processes: time the dense step of each tree three ways, and α."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from experiments.bench import timing
    from jaxcomm import buckets

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sh = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(pid)

    def put(tree):
        return jax.tree.map(
            lambda s: jax.make_array_from_process_local_data(
                sh, np.asarray(rng.normal(size=(1,) + s.shape), np.float32)
            ),
            tree,
        )

    def sharded(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))

    def fused(g):
        leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x[0], g))
        flat = jax.lax.pmean(jnp.concatenate([x.reshape(-1) for x in leaves]), "data")
        out, off = [], 0
        for x in leaves:
            out.append(flat[off : off + x.size].reshape(x.shape))
            off += x.size
        return treedef.unflatten(out)

    result = {}
    for tree_name in FLAGS.procs_trees.split(","):
        shapes = _trees()[tree_name]()
        grads = put(shapes)

        def jaxcomm_step(tx, shapes=shapes):
            state = tx.init(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
            return sharded(lambda g: tx.update(jax.tree.map(lambda x: x[0], g), state)[0])

        cases = {
            "allreduce_bucketed": jaxcomm_step(jaxcomm.allreduce(axis_name="data")),
            "allreduce_per_leaf": jaxcomm_step(
                jaxcomm.allreduce(axis_name="data", bucket_bytes=None)
            ),
            "hand_fused_pmean": sharded(fused),
        }
        makers = _transforms()
        for name in filter(None, FLAGS.procs_transforms.split(",")):
            cases[f"{name}_bucketed"] = jaxcomm_step(makers[name]())
            cases[f"{name}_per_leaf"] = jaxcomm_step(makers[name](bucket_bytes=None))
        for name in ["allreduce", *filter(None, FLAGS.procs_transforms.split(","))]:
            for mib in map(int, filter(None, FLAGS.procs_bucket_mib.split(","))):
                tx = makers[name](bucket_bytes=mib << 20)
                cases[f"{name}_bucketed_{mib}mib"] = jaxcomm_step(tx)
        times = {}
        for fn in cases.values():  # compile and warm up
            jax.block_until_ready(fn(grads))
        # 3 * reps rounds, every case timed once a round (interleaved) in an order drawn
        # for the round (the same on both processes); a case's least time counts
        for names in timing.shuffled_rounds(cases, 3 * reps):
            for name in names:
                fn = cases[name]
                t0 = time.perf_counter()
                jax.block_until_ready(fn(grads))
                t = time.perf_counter() - t0
                times[name] = min(times.get(name, t), t)
        times["params"] = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
        times["default_bucket_bytes"] = buckets.default_bucket_bytes(kind="all_reduce")
        times["default_gather_bucket_bytes"] = buckets.default_bucket_bytes(kind="all_gather")
        result[tree_name] = times
    # α: k chained 4-byte all-reduces (bucket_bytes=1: one bucket, one all-reduce, each)
    alpha = {}
    for k in (1, 2, 4, 8, 16):
        tiny = {f"x{i:02d}": jax.ShapeDtypeStruct((1,), jnp.float32) for i in range(k)}
        g = put(tiny)
        tx = jaxcomm.allreduce(axis_name="data", bucket_bytes=1)
        fn = sharded(lambda g, tx=tx: tx.update(jax.tree.map(lambda x: x[0], g), tx.init(None))[0])
        alpha[k] = _median_time(fn, (g,), 4 * reps, best=True)
    ks = np.asarray(sorted(alpha), np.float64)
    ts = np.asarray([alpha[k] for k in sorted(alpha)])
    slope, intercept = np.polyfit(ks, ts, 1)
    result["alpha_fit"] = {"k": ks.tolist(), "step_s": ts.tolist(), "per_allreduce_s": slope}
    if pid == 0:
        print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


def procs_part(reps: int) -> dict:
    """Start two worker processes of this module on loopback; return worker 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu"
    )
    cmd = [sys.executable, "-m", "experiments.bench.buckets", f"--port={port}", f"--reps={reps}",
           f"--procs_trees={FLAGS.procs_trees}", f"--procs_transforms={FLAGS.procs_transforms}",
           f"--procs_bucket_mib={FLAGS.procs_bucket_mib}"]  # fmt: skip
    procs = [
        subprocess.Popen(cmd + [f"--worker={pid}"], env=env, stdout=subprocess.PIPE, text=True)
        for pid in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a worker failed: {[p.returncode for p in procs]}\n{outs}")
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    for tree_name in FLAGS.procs_trees.split(","):
        r = result[tree_name]
        base = r["hand_fused_pmean"]
        for name in ("allreduce_bucketed", "allreduce_per_leaf"):
            r[f"{name}_vs_fused"] = r[name] / base
        for name in ["allreduce", *filter(None, FLAGS.procs_transforms.split(","))]:
            r[f"{name}_bucketed_vs_per_leaf"] = r[f"{name}_bucketed"] / r[f"{name}_per_leaf"]
            other = ""
            for mib in map(int, filter(None, FLAGS.procs_bucket_mib.split(","))):
                key = f"{name}_bucketed_{mib}mib"
                r[f"{key}_vs_per_leaf"] = r[key] / r[f"{name}_per_leaf"]
                other += f", {mib} MiB buckets {r[f'{key}_vs_per_leaf']:.2f}"
            print(f"2 processes, {tree_name}, {name}: bucketed (default) / per leaf "
                  f"{r[f'{name}_bucketed_vs_per_leaf']:.2f}{other}", flush=True)  # fmt: skip
        print(
            f"2 processes, gloo loopback, {tree_name} ({r['params']} params): "
            f"jaxcomm.allreduce() bucketed {r['allreduce_bucketed_vs_fused']:.2f}x, per leaf "
            f"{r['allreduce_per_leaf_vs_fused']:.2f}x the hand-fused (concatenate + pmean) step",
            flush=True,
        )
    a = result["alpha_fit"]["per_allreduce_s"]
    # netsim's ring all-reduce charges 2(n-1)·α: n=2 -> 2α per all-reduce
    result["alpha_fit"]["netsim_latency_s"] = a / 2
    print(
        f"one extra all-reduce costs {a * 1e3:.3f} ms (netsim latency_s = {a / 2 * 1e3:.3f} ms)",
        flush=True,
    )
    return result


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def report(results: dict) -> str:
    """Markdown: the 2-process part, each transform's bucketed time over its per-leaf time
    (the median over the runs, and their range)."""
    runs = results.get("two_processes_runs") or [results["two_processes"]]
    two = runs[0]
    trees = [t for t, r in two.items() if isinstance(r, dict) and "params" in r]
    first = two[trees[0]]
    default = first.get("default_bucket_bytes", 25 * 2**20) / 2**20
    gather = first.get("default_gather_bucket_bytes", default * 2**20) / 2**20
    names = [k[: -len("_per_leaf")] for k in first if k.endswith("_per_leaf") and "_vs_" not in k]
    sizes = sorted({int(k.rsplit("_", 1)[1][:-3]) for k in first
                    if k.endswith("mib") and "_bucketed_" in k})  # fmt: skip
    many = len(runs) > 1
    lines = [
        "Two processes on loopback (gloo, one CPU device each). Each case is one jitted",
        "``shard_map`` update of the transform on a gradient shaped like the tree; its",
        f"least time over {3 * results.get('reps', 5)} interleaved rounds (``3 * --reps``),",
        "over the same transform's time with ``bucket_bytes=None`` (one collective per",
        "payload array), in the same run"
        + (f"; {len(runs)} runs (``--runs``), each a fresh pair of processes: the median "
           "ratio, and the runs' range under it." if many else ".")
        + ' The default is ``bucket_bytes="auto"``:',
        f"on this backend {default:g} MiB for the sums and {gather:g} MiB for the "
        "all-gathers (EF-sign, top-k); 25 MiB for both was the default before.",
        "",
        "| tree (params) | transform | default | "
        + " | ".join(f"{m} MiB" for m in sizes)
        + " | default ≤ per leaf |",
        "|---|---|---|" + "---|" * len(sizes) + "---|",
    ]  # fmt: skip

    def cell(tree: str, key: str) -> tuple[float, str]:
        values = [r[tree][key] for r in runs]
        mid = _median(values)
        text = f"{mid:.2f}" + (f" ({min(values):.2f}–{max(values):.2f})" if many else "")
        return mid, text

    worst = 0.0
    for t in trees:
        for name in names:
            ratio, text = cell(t, f"{name}_bucketed_vs_per_leaf")
            worst = max(worst, ratio)
            cells = [cell(t, f"{name}_bucketed_{m}mib_vs_per_leaf")[1] for m in sizes]
            lines.append(
                f"| {t} ({two[t]['params']:,}) | {name} | {text} | "
                + " | ".join(cells)
                + f" | {'yes' if ratio <= 1.0 else '**no**'} |"
            )
    lines += [
        "",
        f"Worst default bucketed / per leaf{' (median)' if many else ''}: {worst:.2f}"
        + (" (never slower)." if worst <= 1.0 else " (slower than per leaf)."),
    ]
    alphas = [r.get("alpha_fit", {}).get("per_allreduce_s") for r in runs]
    alphas = [a for a in alphas if a is not None]
    if alphas:
        lines.append(
            f"One extra 4-byte all-reduce costs {_median(alphas) * 1e3:.3f} ms (gloo, loopback)."
        )
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if FLAGS.worker >= 0:
        _worker(FLAGS.worker, FLAGS.port, FLAGS.reps)
        return
    results = {}
    if os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            results = json.load(f)
    if FLAGS.part in ("all", "procs"):
        runs = [procs_part(FLAGS.reps) for _ in range(FLAGS.runs)]
        results["two_processes"] = runs[0]
        results["two_processes_runs"] = runs
        results["reps"] = FLAGS.reps
    if FLAGS.part in ("all", "devices"):
        results["fake_devices"] = devices_part(FLAGS.reps)
    os.makedirs(os.path.dirname(FLAGS.out), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=1)
    if "two_processes" in results:
        print(report(results))
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    if "--worker" not in " ".join(sys.argv) and "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    define_flags()
    app.run(main)
