r"""Sparsifiers at the floor: a step's time over a gradient copy, the old selection beside.

One process, 8 fake CPU devices (real devices where present), ``--d``
float32 entries per device (default 4M), ``--ratio`` (default 0.001). Each
case is one jitted ``shard_map`` step of the transform (memory add, encode,
exchange, decode, residual update), its state carried from call to call; the
baseline is a step that only doubles the gradient (a copy). Rounds time every
case once each (interleaved, so the machine's load drifts over all alike; each round in
its own seeded random order, the same on every process),
``--reps`` rounds; a case's figure is its least time over the copy's least
time, in one run. Cases:

* ``copy``: ``x * 2`` (the unit);
* ``allreduce``: dense psum;
* ``topk`` / ``topk_noef``: exact ``lax.top_k``, with and without error
  feedback;
* ``threshold`` / ``threshold_noef`` / ``threshold_per_leaf``: today's
  selection, with and without error feedback, and with ``bucket_bytes=None``;
* ``threshold_before``: the two-period selection it replaced (the library's
  ``Threshold`` at git revision ``experiments.bench.threshold_fill.BEFORE``,
  loaded with ``git show``; left out where there is no history).

And a tree: the ResNet-18 parameter shapes (``experiments.bench.compressors``,
62 leaves, 11.7M) with ``threshold``, bucketed (25 MiB) and per leaf.

Targets (issue "Compressors at the floor"): threshold's whole step with error
feedback <= 3x the copy and >= 4x faster than exact top-k; encode + exchange +
decode (no error feedback) <= 2x; bucketing a tree adds <= 10% over per leaf.

  python -m experiments.bench.floor --out=experiments/results/floor.json
  python -m experiments.bench.floor --d=100000 --reps=3 --out=/tmp/floor.json   # quick

The table (``report``) is generated into ``experiments/results/floor.md`` by
``python -m experiments.studies.tables``.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments.bench import compressors, threshold_fill, timing
from experiments.studies import runs

AXIS = "data"
# (name, what, factory(ratio)); factory returns None where the case cannot be built here
VECTOR_CASES: list[tuple[str, str, Callable[[float], object]]] = [
    ("allreduce", "dense psum", lambda r: jaxcomm.allreduce(axis_name=AXIS)),
    ("topk", "exact top-k + EF", lambda r: jaxcomm.topk(r, axis_name=AXIS)),
    ("topk_noef", "exact top-k, no EF",
     lambda r: jaxcomm.topk(r, axis_name=AXIS, error_feedback=False)),
    ("threshold", "threshold + EF", lambda r: jaxcomm.threshold(r, axis_name=AXIS)),
    ("threshold_noef", "threshold, no EF",
     lambda r: jaxcomm.threshold(r, axis_name=AXIS, error_feedback=False)),
    ("threshold_per_leaf", "threshold + EF, bucket_bytes=None",
     lambda r: jaxcomm.threshold(r, axis_name=AXIS, bucket_bytes=None)),
    ("threshold_before", "two-period threshold + EF (old code)",
     lambda r: threshold_fill.transform_before(r, AXIS)),
]  # fmt: skip
TREE_CASES = [
    ("threshold", "threshold + EF, 25 MiB buckets", lambda r: jaxcomm.threshold(r, axis_name=AXIS)),
    ("threshold_per_leaf", "threshold + EF, per leaf",
     lambda r: jaxcomm.threshold(r, axis_name=AXIS, bucket_bytes=None)),
]  # fmt: skip


def define_flags() -> None:
    """The command-line flags (only when run as a program: importing defines none)."""
    flags.DEFINE_integer("d", 4_000_000, "float32 entries per device")
    flags.DEFINE_float("ratio", 0.001, "fraction of entries kept")
    flags.DEFINE_integer("reps", 7, "timed rounds (each case's least time counts)")
    flags.DEFINE_bool("tree", True, "also time the ResNet-18 tree, bucketed and per leaf")
    flags.DEFINE_string("out", "experiments/results/floor.json", "JSON written")


def interleaved_min(calls: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Least seconds of each call over ``reps`` rounds, each calling every one once, in a
    random order of its own (in a fixed order a case's time can depend on the one before)."""
    for fn in calls.values():  # compile and warm
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    best = dict.fromkeys(calls, math.inf)
    for names in timing.shuffled_rounds(calls, reps):
        for name in names:
            fn = calls[name]
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure(shapes: dict[str, tuple[int, ...]], cases, ratio: float, reps: int) -> list[dict]:
    """Rows ``{case, what, time_over_copy, step_s}`` for a tree of ``shapes`` (per device)."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    sh = NamedSharding(mesh, P(AXIS))
    keys = jax.random.split(jax.random.key(1), len(shapes))
    draws = {
        k: jax.random.normal(kk, (n, *s), jnp.float32) for kk, (k, s) in zip(keys, shapes.items())
    }
    grads = jax.device_put(draws, sh)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    copy = jax.jit(jax.shard_map(lambda t: jax.tree.map(lambda x: x * 2.0, t), mesh=mesh,
                                 in_specs=P(AXIS), out_specs=P(AXIS)))  # fmt: skip
    calls: dict[str, Callable[[], object]] = {"copy": lambda: copy(grads)}
    what = {"copy": "x * 2 (the unit)"}
    for name, text, make in cases:
        tx = make(ratio)
        if tx is None:
            print(f"{name}: left out (no git history to load the old selection from)")
            continue
        step, state = compressors._sharded_update(tx, params, mesh)
        calls[name] = compressors._Evolving(step, grads, state)
        what[name] = text
    best = interleaved_min(calls, reps)
    return [
        {"case": k, "what": what[k], "time_over_copy": best[k] / best["copy"], "step_s": best[k]}
        for k in calls
    ]


def run(d: int, ratio: float, reps: int, tree: bool) -> dict:
    out = {
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "d": d,
        "ratio": ratio,
        "reps": reps,
        "before": threshold_fill.BEFORE,
        "vector": measure({"g": (d,)}, VECTOR_CASES, ratio, reps),
    }
    if tree:
        out["tree"] = measure(compressors.resnet18_shapes(), TREE_CASES, ratio, reps)
    return out


def _row(rows: list[dict], case: str) -> dict | None:
    return next((r for r in rows if r["case"] == case), None)


def report(results: dict) -> str:
    """Markdown: each case's time over the copy, and the issue's targets, met or not."""
    vec = results["vector"]
    lines = [
        f"One process, {results['devices']} {results['platform']} devices, "
        f"{results['d']:,} float32 entries per device, ratio {results['ratio']}; least time of "
        f"{results['reps']} interleaved rounds over the copy's, one run.",
        "",
        "| case | what | time / copy |",
        "|---|---|---|",
    ]
    lines += [f"| `{r['case']}` | {r['what']} | {r['time_over_copy']:.2f} |" for r in vec]
    thr, topk, noef = _row(vec, "threshold"), _row(vec, "topk"), _row(vec, "threshold_noef")
    checks = []
    if thr:
        checks.append(("threshold + EF <= 3x the copy", f"{thr['time_over_copy']:.2f}x",
                       thr["time_over_copy"] <= 3))  # fmt: skip
    if thr and topk:
        speed = topk["step_s"] / thr["step_s"]
        checks.append(("threshold >= 4x faster than exact top-k (both + EF)", f"{speed:.2f}x",
                       speed >= 4))  # fmt: skip
    if noef:
        checks.append(("encode + exchange + decode (no EF) <= 2x the copy",
                       f"{noef['time_over_copy']:.2f}x", noef["time_over_copy"] <= 2))  # fmt: skip
    before = _row(vec, "threshold_before")
    if "tree" in results:
        tb, tl = _row(results["tree"], "threshold"), _row(results["tree"], "threshold_per_leaf")
        lines += [
            "",
            "ResNet-18 shapes (62 leaves, 11.7M per device):",
            "",
            "| case | what | time / copy |",
            "|---|---|---|",
        ]
        lines += [
            f"| `{r['case']}` | {r['what']} | {r['time_over_copy']:.2f} |" for r in results["tree"]
        ]
        if tb and tl:
            extra = tb["step_s"] / tl["step_s"] - 1
            checks.append(("bucketing the tree adds <= 10% over per leaf", f"{extra:+.0%}",
                           extra <= 0.10))  # fmt: skip
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in checks]
    if before and thr:
        lines += [
            "",
            f"The old two-period selection (`{results['before']}`) took "
            f"{before['time_over_copy']:.2f}x the copy; today's {thr['time_over_copy']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    results = run(f.d, f.ratio, f.reps, f.tree)
    results["note"] = __doc__.split("\n\n")[1]
    runs.save_json(f.out, results)
    print(report(results))


if __name__ == "__main__":
    define_flags()
    app.run(main)
