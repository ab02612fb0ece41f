r"""Sparsifiers at the floor: a step's time over a gradient copy, the old code beside.

One process per layout of ``N`` fake CPU devices x ``d`` float32 entries
per device (``--layouts``, default the issue's ``8x4000000`` and
``2x16000000``: the same 32M entries with one device per core of a 2-core
machine; real devices where present), ``--ratio`` (default 0.001). Each
case is one jitted ``shard_map`` step of the transform (memory add, encode,
exchange, decode, residual update), its state carried from call to call; the
baseline is a step that only doubles the gradient (a copy). Rounds time every
case once each (interleaved, so the machine's load drifts over all alike; each round in
its own seeded random order, the same on every process),
``--reps`` rounds; a case's figure is its least time over the copy's least
time, in one run. With 8 fake devices on 2 cores, four device programs share
a core, and every per-operation cost (a loop iteration, a collective's
rendezvous) is paid four times over; the per-core layout is the one that
measures the work.

Cases:

* ``copy``: ``x * 2`` (the unit);
* ``allreduce``: dense psum;
* ``topk`` / ``topk_noef``: exact ``lax.top_k``, with and without error
  feedback;
* ``threshold`` / ``threshold_noef`` / ``threshold_per_leaf``: today's
  selection, with and without error feedback, and with ``bucket_bytes=None``;
* ``threshold_rev`` / ``threshold_noef_rev``: the whole library at git
  revision ``--rev`` (``experiments.bench.revision``), timed in the same rounds;
* ``threshold_before``: the two-period selection (the library's
  ``Threshold`` at ``experiments.bench.threshold_fill.BEFORE``);
* ``passes_ef`` / ``passes_noef``: no selection at all, only the passes
  over ``d`` of a sparsifier's step as jaxcomm makes them (no data-dependent
  control flow): with error feedback, read ``g`` and ``e`` to choose, read
  them again to write the residual, write the update; without, read ``g``,
  write the update. What the targets leave to everything else;
* ``passes_write_p``: the other order of those passes, fewer bytes: write
  ``p = g + e`` (the residual before the sent entries are zeroed in place),
  read ``p`` back to choose, write the update (and no guard for a void step,
  which this order would need besides). Whether writing ``p`` once beats
  reading ``g`` and ``e`` twice.

The ``rev`` and ``before`` cases are left out where there is no git history.
And a tree (first layout only): the ResNet-18 parameter shapes
(``experiments.bench.compressors``, 62 leaves, 11.7M) with ``threshold``,
bucketed (25 MiB) and per leaf.

Targets (issue "Compressors at the floor"): threshold's whole step with error
feedback <= 3x the copy and >= 4x faster than exact top-k; encode + exchange +
decode (no error feedback) <= 2x; bucketing a tree adds <= 10% over per leaf.

  python -m experiments.bench.floor --out=experiments/results/floor.json
  python -m experiments.bench.floor --layouts=8x100000 --reps=3 --out=/tmp/floor.json   # quick

The table (``report``) is generated into ``experiments/results/floor.md`` by
``python -m experiments.studies.tables``.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import launch
from experiments.bench import compressors, revision, threshold_fill, timing
from experiments.studies import runs

AXIS = "data"
# The library before this last change to the sparse step (the residual's
# select fused with p = g + e): the default of --rev.
REV = "1d3d5b8"
LAYOUTS = "8x4000000,2x16000000"


def _rev(make: Callable[[object], object]) -> Callable[[float, str], object]:
    """A factory of the library at ``rev`` (None where there is no history)."""

    def factory(r: float, rev: str):
        lib = revision.jaxcomm_at(rev)
        return None if lib is None else make(lib)(r)

    return factory


def _case(method: str, **options) -> Callable[[float, str], object]:
    """Method ``method`` of :mod:`jaxcomm.methods` with ``options``, at the bench's ratio."""
    return lambda r, rev: compressors.build_method(method, options, r)


# (name, what, factory(ratio, rev)); a factory returns None where its case cannot be built here
VECTOR_CASES: list[tuple[str, str, Callable[[float, str], object]]] = [
    ("allreduce", "dense psum", _case("allreduce")),
    ("topk", "exact top-k + EF", _case("topk")),
    ("topk_noef", "exact top-k, no EF", _case("topk", error_feedback=False)),
    ("threshold", "threshold + EF", _case("threshold")),
    ("threshold_noef", "threshold, no EF", _case("threshold", error_feedback=False)),
    ("threshold_per_leaf", "threshold + EF, bucket_bytes=None",
     _case("threshold", bucket_bytes=None)),
    ("threshold_rev", "threshold + EF, the library at --rev",
     _rev(lambda lib: lambda r: lib.threshold(r, axis_name=AXIS))),
    ("threshold_noef_rev", "threshold, no EF, the library at --rev",
     _rev(lambda lib: lambda r: lib.threshold(r, axis_name=AXIS, error_feedback=False))),
    ("threshold_before", "two-period threshold + EF (old selection)",
     lambda r, rev: threshold_fill.transform_before(r, AXIS)),
]  # fmt: skip
TREE_CASES = [
    ("threshold", "threshold + EF, 25 MiB buckets", _case("threshold")),
    ("threshold_per_leaf", "threshold + EF, per leaf", _case("threshold", bucket_bytes=None)),
]


def _passes_ef(g: jax.Array, e: jax.Array):
    """The passes an error-feedback sparsifier's step cannot avoid: read ``g + e`` to choose
    (here its largest magnitude), read them again for the residual, write the update."""
    top = jnp.max(jnp.abs(g + e))
    residual = jnp.where(top >= 0, e - (-g), e)
    return jnp.zeros_like(g) + top * 0, residual


def _passes_write_p(g: jax.Array, e: jax.Array):
    """The fewer-bytes order: write ``p = g + e`` as the residual, read it back to choose, write
    the update. XLA:CPU does not fuse a reduction with an elementwise write of another shape,
    so ``p`` is written and read back rather than chosen from as it is made."""
    p = g + e
    top = jnp.max(jnp.abs(p))
    return jnp.zeros_like(g) + top * 0, p.at[0].set(top * 0)


def _passes_noef(g: jax.Array, e: jax.Array):
    """Without error feedback: read ``g`` to choose, write the update."""
    del e
    return jnp.zeros_like(g) + jnp.max(jnp.abs(g)) * 0


KERNELS = [
    ("passes_ef", "no selection: read g+e, read g+e and write the residual, write the update",
     _passes_ef),
    ("passes_noef", "no selection: read g, write the update", _passes_noef),
    ("passes_write_p", "no selection: write p = g+e, read p, write the update", _passes_write_p),
]  # fmt: skip


def define_flags() -> None:
    """The command-line flags (only when run as a program: importing defines none)."""
    flags.DEFINE_string("layouts", LAYOUTS, "comma-separated DEVICESxD layouts, one process each")
    flags.DEFINE_float("ratio", 0.001, "fraction of entries kept")
    flags.DEFINE_integer("reps", 7, "timed rounds (each case's least time counts)")
    flags.DEFINE_bool("tree", True, "also time the ResNet-18 tree (first layout)")
    flags.DEFINE_string("rev", REV, "git revision of the library timed beside today's")
    flags.DEFINE_string("out", "experiments/results/floor.json", "JSON written")
    flags.DEFINE_string("part", None, "(internal) measure this process's layout into this file")


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


def measure(
    shapes: dict[str, tuple[int, ...]], cases, ratio: float, reps: int, rev: str = REV,
    kernels: bool = False,
) -> list[dict]:  # fmt: skip
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
        tx = make(ratio, rev)
        if tx is None:
            print(f"{name}: left out (no git history to load the old code from)")
            continue
        step, state = compressors.sharded_update(tx, params, mesh)
        calls[name] = compressors.Evolving(step, grads, state)
        what[name] = text.replace("--rev", f"`{rev}`")
    if kernels:
        residual = jax.device_put(jax.tree.map(lambda x: 0.1 * x[::-1], draws), sh)
        for name, text, fn in KERNELS:
            body = jax.shard_map(lambda g, e, fn=fn: jax.tree.map(fn, g, e), mesh=mesh,
                                 in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))  # fmt: skip
            jitted = jax.jit(body)
            calls[name] = lambda f=jitted: f(grads, residual)
            what[name] = text
    best = interleaved_min(calls, reps)
    return [
        {"case": k, "what": what[k], "time_over_copy": best[k] / best["copy"], "step_s": best[k]}
        for k in calls
    ]


def run(d: int, ratio: float, reps: int, tree: bool, rev: str = REV) -> dict:
    """One layout: this process's devices, ``d`` entries each."""
    out = {
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "d": d,
        "vector": measure({"g": (d,)}, VECTOR_CASES, ratio, reps, rev, kernels=True),
    }
    if tree:
        out["tree"] = measure(compressors.resnet18_shapes(), TREE_CASES, ratio, reps, rev)
    return out


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"8x4000000,2x16000000"`` -> ``[(8, 4000000), (2, 16000000)]``."""
    out = []
    for part in text.split(","):
        try:
            n, d = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"layouts: expected DEVICESxD items, got {part!r}") from None
        if n < 1 or d < 1:
            raise ValueError(f"layouts: devices and d must be >= 1, got {part!r}")
        out.append((n, d))
    return out


def _run_layout(n: int, d: int, tree: bool) -> dict:
    """One layout in a process of its own (the device count is fixed when jax starts)."""
    f = flags.FLAGS
    with tempfile.TemporaryDirectory() as tmp:
        part = os.path.join(tmp, "part.json")
        xla = launch.device_count_flags(os.environ.get("XLA_FLAGS", ""), n)
        env = dict(os.environ, XLA_FLAGS=xla)
        subprocess.run(
            [sys.executable, "-m", "experiments.bench.floor", f"--part={part}",
             f"--layouts={n}x{d}", f"--ratio={f.ratio}", f"--reps={f.reps}", f"--tree={tree}",
             f"--rev={f.rev}"],
            env=env, check=True,
        )  # fmt: skip
        with open(part) as fh:
            return json.load(fh)


def _row(rows: list[dict], case: str) -> dict | None:
    return next((r for r in rows if r["case"] == case), None)


def _table(rows: list[dict]) -> list[str]:
    return ["| case | what | time / copy |", "|---|---|---|"] + [
        f"| `{r['case']}` | {r['what']} | {r['time_over_copy']:.2f} |" for r in rows
    ]


def checks(layout: dict) -> list[tuple[str, str, bool]]:
    """``(target, measured, met)`` of the issue's targets on one layout."""
    vec = layout["vector"]
    thr, topk, noef = _row(vec, "threshold"), _row(vec, "topk"), _row(vec, "threshold_noef")
    out = []
    if thr:
        out.append(("threshold + EF <= 3x the copy", f"{thr['time_over_copy']:.2f}x",
                    thr["time_over_copy"] <= 3))  # fmt: skip
    if thr and topk:
        speed = topk["step_s"] / thr["step_s"]
        out.append(("threshold >= 4x faster than exact top-k (both + EF)", f"{speed:.2f}x",
                    speed >= 4))  # fmt: skip
    if noef:
        out.append(("encode + exchange + decode (no EF) <= 2x the copy",
                    f"{noef['time_over_copy']:.2f}x", noef["time_over_copy"] <= 2))  # fmt: skip
    if "tree" in layout:
        tb, tl = _row(layout["tree"], "threshold"), _row(layout["tree"], "threshold_per_leaf")
        if tb and tl:
            extra = tb["step_s"] / tl["step_s"] - 1
            out.append(("bucketing the tree adds <= 10% over per leaf", f"{extra:+.0%}",
                        extra <= 0.10))  # fmt: skip
    return out


def report(results: dict) -> str:
    """Markdown: per layout, each case's time over the copy and the issue's targets, met or not.

    A file of one layout at its top level (as this benchmark wrote before ``--layouts``) is
    read as that layout."""
    lines = []
    for layout in results.get("layouts", [results]):
        n, d = layout["devices"], layout["d"]
        lines += [
            f"### {n} {layout['platform']} devices x {d:,} float32 entries",
            "",
            f"One process, ratio {results['ratio']}; least time of {results['reps']} "
            "interleaved rounds over the copy's, one run.",
            "",
            *_table(layout["vector"]),
        ]
        if "tree" in layout:
            lines += ["", "ResNet-18 shapes (62 leaves, 11.7M per device):", ""]
            lines += _table(layout["tree"])
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in checks(layout)]
        vec = layout["vector"]
        floor_ef, topk = _row(vec, "passes_ef"), _row(vec, "topk")
        if floor_ef and topk:
            lines += [
                "",
                f"A step 4x faster than exact top-k ({topk['time_over_copy']:.2f}x) would take "
                f"{topk['time_over_copy'] / 4:.2f}x the copy. A step with error feedback moves "
                "at least twice the copy's bytes (it reads g and e and writes the residual and "
                "the update), and it must read g and e once before it knows what to send: the "
                "passes without any selection (`passes_ef`) took "
                f"{floor_ef['time_over_copy']:.2f}x.",
            ]
        write_p = _row(vec, "passes_write_p")
        if floor_ef and write_p:
            lines += [
                "",
                "Writing p = g + e once and reading it back instead (`passes_write_p`: 5 "
                "gradients' worth of bytes against 6, and still without the guard a void step "
                f"needs) took {write_p['time_over_copy']:.2f}x against `passes_ef`'s "
                f"{floor_ef['time_over_copy']:.2f}x. XLA:CPU does not fuse the choice's "
                "reduction with the write, so p goes out and comes back.",
            ]
        before, thr = _row(vec, "threshold_before"), _row(vec, "threshold")
        if before and thr:
            lines += [
                "",
                f"The two-period selection (`{results['before']}`) took "
                f"{before['time_over_copy']:.2f}x the copy; today's {thr['time_over_copy']:.2f}x.",
            ]
        for case, old in (("threshold", "threshold_rev"), ("threshold_noef", "threshold_noef_rev")):
            now, then = _row(vec, case), _row(vec, old)
            if now and then and "rev" in results:
                lines += [
                    "",
                    f"`{case}` at `{results['rev']}`: {then['time_over_copy']:.2f}x; "
                    f"today {now['time_over_copy']:.2f}x.",
                ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    layouts = parse_layouts(f.layouts)
    if f.part:  # a child: this process's layout
        ((n, d),) = layouts
        if jax.device_count() != n:
            raise ValueError(f"layouts: {n} devices asked, this process has {jax.device_count()}")
        runs.save_json(f.part, run(d, f.ratio, f.reps, f.tree, f.rev))
        return
    results = {
        "ratio": f.ratio,
        "reps": f.reps,
        "rev": f.rev,
        "before": threshold_fill.BEFORE,
        "layouts": [_run_layout(n, d, f.tree and i == 0) for i, (n, d) in enumerate(layouts)],
        "note": __doc__.split("\n\n")[1],
    }
    runs.save_json(f.out, results)
    print(report(results))


if __name__ == "__main__":
    define_flags()
    app.run(main)
