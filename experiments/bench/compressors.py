r"""Benchmark: compressor cost relative to a gradient copy, and bytes relative to dense.

For each gradient size d (entries per device) and each compressor, on n fake
CPU devices (real devices where present), this times one jitted
``tx.update`` under ``jax.shard_map`` — memory add, encode, exchange, decode,
residual update — and divides by the time of one gradient copy on the same
devices (``x * 2.0``; XLA elides ``x * 1.0``). Both are measured in the same
run, so the ratio is meaningful on a shared, noisy machine where absolute
seconds are not. The state is carried from one repetition to the next (the
warm-up call included), so residuals and keys evolve as in training.
Bytes: the payload a worker contributes (``wire_bytes``) and
the traffic it sends with bandwidth-optimal collectives, both divided by a
dense fp32 ring all-reduce.

Command (about 6 minutes on 2 CPU cores):
  python -m experiments.bench.compressors --out bench_out/compressors.json
Quick check:
  python -m experiments.bench.compressors --sizes 100000 --reps 3
Model-shaped trees (shapes only, random values), e.g.:
  python -m experiments.bench.compressors --tree resnet18 --reps 3 \
      --cases allreduce,cast_bf16,threshold,dgc,powersgd_r2,powersgd_r2_batched
  python -m experiments.bench.compressors --tree gpt2 --gpt2_layers 2 --reps 3
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import inspect
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments.bench.timing import median_time
from jaxcomm import methods

AXIS = "data"

# case -> (method of jaxcomm.methods, its keyword arguments), built over AXIS by build(); a
# method's name is a case too (its defaults), so a codec added under jaxcomm/compressors/ runs
# with --cases NAME and no edit here. A method taking ``ratio`` gets --ratio unless given.
# The all-gather codecs are pinned to exchange="gather" (the path the README table measured;
# their two-phase exchange is benchmarked by experiments.bench.two_phase).
G = {"exchange": "gather"}
CASES: dict[str, tuple[str, dict]] = {
    "allreduce": ("allreduce", {}),
    # the committed table measured the psum and the uint16 all-gather (not the
    # default accumulate="auto", which is the uint16 words, two-phase, on CPU)
    "cast_bf16": ("cast", {"dtype": "bfloat16", "accumulate": "psum"}),
    "cast_bf16_gather": ("cast", {"dtype": "bfloat16", "accumulate": "all_gather", **G}),
    "topk": ("topk", {}),
    "threshold": ("threshold", {}),
    "threshold_nosample": ("threshold", {"sample_ratio": None}),
    # encode + exchange + decode only: no error-feedback memory (p = g + e, the residual)
    "threshold_noef": ("threshold", {"error_feedback": False}),
    "topk_noef": ("topk", {"error_feedback": False}),
    "randomk": ("randomk", {}),
    "randomk_stratified": ("randomk", {"sampling": "stratified"}),
    "int8": ("int8", G),
    "qsgd16": ("qsgd", {"levels": 16, **G}),
    "terngrad": ("terngrad", {}),
    "terngrad_gather": ("terngrad", {"share_scale": False, **G}),
    "onebit": ("onebit", G),
    "ef_sign": ("ef_sign", G),
    "sign_majority": ("sign_majority", {}),
    "twobit": ("twobit", G),
    "dgc": ("dgc", {}),
    **{f"powersgd_r{r}": ("powersgd", {"rank": r}) for r in (1, 2, 4)},
    **{f"powersgd_r{r}_batched": ("powersgd", {"rank": r, "batch_same_shape": True})
       for r in (1, 2, 4)},
}  # fmt: skip
# cases that are not a method's options: the two-period selection threshold replaced, loaded
# from git (experiments.bench.threshold_fill)
LOADED = ("threshold_before",)


def _by_default(method: str) -> bool:
    """Whether ``method`` builds from keywords this bench gives (axis, key, ratio) alone."""
    params = inspect.signature(methods.get(method)).parameters.values()
    required = {p.name for p in params if p.default is p.empty and p.kind != p.VAR_KEYWORD}
    return required <= {"axis_name", "key", "ratio"}


def case_names() -> list[str]:
    """Every case --cases may name: the table's, the loaded ones and every compressor method
    that builds with its defaults (``dgc_sgd`` needs a learning rate: its case is ``dgc``)."""
    more = [m for m in methods.compressors() if m not in CASES and _by_default(m)]
    return [*CASES, *LOADED, *more]


def build(name: str, ratio: float) -> Any:
    """Case ``name``'s transform over AXIS (``ratio`` for a method taking one)."""
    if name == "threshold_before":
        return _threshold_before(ratio)
    return build_method(*CASES.get(name, (name, {})), ratio)


def build_method(method: str, kwargs: dict, ratio: float) -> Any:
    """Method ``method`` of :mod:`jaxcomm.methods` with ``kwargs`` over AXIS, given ``ratio``
    where it takes one and ``kwargs`` do not set it."""
    if "ratio" in inspect.signature(methods.get(method)).parameters:
        kwargs = {"ratio": ratio, **kwargs}
    return methods.make(method, axis_name=AXIS, **kwargs)


def is_matrix_case(name: str) -> bool:
    """Cases that need matrix-shaped leaves: with --sizes their gradient is a near-square
    (a, d/a) matrix instead of a vector (a 1-D leaf would go dense)."""
    return CASES.get(name, (name,))[0] == "powersgd"


def _threshold_before(ratio: float):
    from experiments.bench import threshold_fill

    tx = threshold_fill.transform_before(ratio, AXIS)
    if tx is None:
        raise RuntimeError("threshold_before: no git history here to load the old selection from")
    return tx


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags; defined only when run as a program, so that importing this
    module (tests) does not clash with other experiments' flags of the same name."""
    flags.DEFINE_list("sizes", ["100000", "1000000", "4000000", "10000000"], "entries per device")
    flags.DEFINE_float("ratio", 0.001, "sparsification ratio for sparsifiers")
    flags.DEFINE_list("cases", [*CASES, *LOADED], "which compressors to run")
    flags.DEFINE_integer("reps", 9, "timed repetitions (median is reported)")
    flags.DEFINE_string("out", "bench_out/compressors.json", "JSON output path")
    flags.DEFINE_enum(
        "tree",
        None,
        ["resnet18", "gpt2"],
        "benchmark on a parameter tree shaped like ResNet-18 (ImageNet, torch layout) or a "
        "GPT-2-small block stack instead of --sizes",
    )
    flags.DEFINE_integer("gpt2_layers", 12, "blocks in the --tree gpt2 stack (7.1M params each)")


def sharded_update(tx, params, mesh):
    """(jitted shard_map'd ``tx.update``, per-worker initial state placed on the mesh)."""
    n = mesh.size
    state = jax.device_put(
        jax.tree.map(
            lambda a: jnp.broadcast_to(a[None], (n,) + a.shape),
            tx.init(jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)),
        ),
        NamedSharding(mesh, P(AXIS)),
    )

    def f(g, s):
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a[0], s))
        return u, jax.tree.map(lambda a: a[None], s)

    step = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(), P(AXIS)))
    )
    return step, state


class Evolving:
    """``step(grads, state)`` as a no-argument call that carries the state along.

    Each call feeds the state the previous call returned, so the timed
    repetitions run on an evolving residual / momentum / key (as in training)
    instead of the initial zeros every time, and residual-dependent costs
    (e.g. a full residual's effect on a threshold, PowerSGD's warm start) are
    measured. Returns the updates and keeps the new state.
    """

    def __init__(self, step, grads, state):
        self.step, self.grads, self.state = step, grads, state
        self.calls = 0

    def __call__(self):
        updates, self.state = self.step(self.grads, self.state)
        self.calls += 1
        return updates


def _median_ratio(fn: Callable[[], object], base: Callable[[], object], reps: int) -> float:
    """Median over reps of time(fn) / time(base), the two timed back to back.

    Interleaving makes the ratio robust to the machine's load drifting during
    the run (8 fake devices share 2 cores here): each rep compares the two
    under the same conditions.
    """
    jax.block_until_ready(fn())
    jax.block_until_ready(base())
    ratios = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(base())
        t1 = time.perf_counter()
        jax.block_until_ready(fn())
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ratios)


def _over(traffic: float, ring: float) -> float | None:
    """traffic / ring; None on one device (nothing crosses a link: the time is the codec's)."""
    return traffic / ring if ring else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.5f}"


def bench_size(d: int, names: list[str], ratio: float, reps: int) -> list[dict]:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    sh = NamedSharding(mesh, P(AXIS))
    grads = jax.device_put({"g": jax.random.normal(jax.random.key(1), (n, d), jnp.float32)}, sh)
    params = {"g": jax.ShapeDtypeStruct((d,), jnp.float32)}
    shape = _matrix_shape(d)
    grads_m = jax.device_put({"g": grads["g"].reshape((n,) + shape)}, sh)
    params_m = {"g": jax.ShapeDtypeStruct(shape, jnp.float32)}

    copy = jax.jit(jax.shard_map(lambda x: x * 2.0, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))

    dense_payload = 4 * d
    dense_traffic = 2 * (n - 1) / n * dense_payload
    rows = []
    for name in names:
        tx = build(name, ratio)
        g_in, p_in = (grads_m, params_m) if is_matrix_case(name) else (grads, params)
        step, state = sharded_update(tx, p_in, mesh)
        r = _median_ratio(Evolving(step, g_in, state), lambda: copy(grads["g"]), reps)
        report = jaxcomm.accounting.wire_report(tx, p_in, n)
        payload = sum(c.nbytes for c in report)
        traffic = jaxcomm.accounting.traffic_bytes(report, n)
        rows.append(
            {
                "d": d,
                "compressor": name,
                "n_workers": n,
                "ratio": ratio,
                "time_over_copy": r,
                "payload_over_dense": payload / dense_payload,
                "traffic_over_dense_ring": _over(traffic, dense_traffic),
                "wire_bytes": payload,
            }
        )
        print(
            f"{d:>10}  {name:<20} {r:>8.2f}x  {payload / dense_payload:>10.5f}"
            f"  {_fmt(_over(traffic, dense_traffic)):>10}",
            flush=True,
        )
    return rows


def _matrix_shape(d: int) -> tuple[int, int]:
    """(a, d // a) with a the largest divisor of d not above sqrt(d)."""
    a = max(x for x in range(1, math.isqrt(d) + 1) if d % x == 0)
    return a, d // a


def resnet18_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-18 (ImageNet): 11.69M, torch layout.

    Conv kernels are ``(out, in, kh, kw)`` and the classifier ``(1000, 512)``,
    so PowerSGD's ``(shape[0], rest)`` view is torch's. Batch-norm scale and
    bias are included (running statistics are not parameters).
    """
    shapes: dict[str, tuple[int, ...]] = {"conv1": (64, 3, 7, 7), "bn1.w": (64,), "bn1.b": (64,)}
    c_in = 64
    for stage, c in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{stage}.{block}"
            first_in = c_in if block == 0 else c
            shapes[f"{p}.conv1"] = (c, first_in, 3, 3)
            shapes[f"{p}.conv2"] = (c, c, 3, 3)
            for bn in ("bn1", "bn2"):
                shapes[f"{p}.{bn}.w"] = shapes[f"{p}.{bn}.b"] = (c,)
            if block == 0 and first_in != c:
                shapes[f"{p}.downsample.conv"] = (c, first_in, 1, 1)
                shapes[f"{p}.downsample.bn.w"] = shapes[f"{p}.downsample.bn.b"] = (c,)
        c_in = c
    shapes["fc.w"], shapes["fc.b"] = (1000, 512), (1000,)
    return shapes


def gpt2_shapes(layers: int = 12) -> dict[str, tuple[int, ...]]:
    """A GPT-2-small block stack (d=768, MLP 3072): 7.09M per block, 85.1M for 12.

    Weights in Hugging Face's Conv1D layout ``(in, out)``; token and position
    embeddings (39.4M, usually updated sparsely or tied) are left out.
    """
    d, h = 768, 3072
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"h{i:02d}"
        shapes.update(
            {
                f"{p}.ln_1.w": (d,), f"{p}.ln_1.b": (d,),
                f"{p}.attn.c_attn.w": (d, 3 * d), f"{p}.attn.c_attn.b": (3 * d,),
                f"{p}.attn.c_proj.w": (d, d), f"{p}.attn.c_proj.b": (d,),
                f"{p}.ln_2.w": (d,), f"{p}.ln_2.b": (d,),
                f"{p}.mlp.c_fc.w": (d, h), f"{p}.mlp.c_fc.b": (h,),
                f"{p}.mlp.c_proj.w": (h, d), f"{p}.mlp.c_proj.b": (d,),
            }
        )  # fmt: skip
    return shapes


def bench_tree(tree: str, names: list[str], ratio: float, reps: int) -> list[dict]:
    """Each case on a model-shaped tree of random gradients: time / copy, bytes / dense.

    Bytes are the payload a worker contributes (``wire_bytes``), divided by a
    dense fp32 all-reduce payload (4 bytes a parameter) and by a bf16 one (2
    bytes; what mixed-precision training usually all-reduces), and the traffic
    with bandwidth-optimal collectives divided by a dense fp32 ring's.
    """
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    sh = NamedSharding(mesh, P(AXIS))
    shapes = resnet18_shapes() if tree == "resnet18" else gpt2_shapes(FLAGS.gpt2_layers)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    size = sum(math.prod(s) for s in shapes.values())
    keys = jax.random.split(jax.random.key(1), len(shapes))
    grads = jax.device_put(
        {
            k: jax.random.normal(kk, (n,) + s, jnp.float32)
            for kk, (k, s) in zip(keys, shapes.items())
        },
        sh,
    )
    copy = jax.jit(
        jax.shard_map(
            lambda t: jax.tree.map(lambda x: x * 2.0, t),
            mesh=mesh,
            in_specs=P(AXIS),
            out_specs=P(AXIS),
        )
    )
    t_copy = median_time(lambda: copy(grads), reps)
    dense32, dense16 = 4 * size, 2 * size
    print(f"{tree}: {len(shapes)} leaves, {size / 1e6:.2f}M params, copy {t_copy * 1e3:.1f} ms")
    print(
        f"{'compressor':<22} {'t/copy':>8}  {'/fp32':>9}  {'/bf16':>9}  {'traffic/fp32 ring':>18}"
    )
    rows = []
    for name in names:
        tx = build(name, ratio)
        step, state = sharded_update(tx, params, mesh)
        r = _median_ratio(Evolving(step, grads, state), lambda: copy(grads), reps)
        del state
        report = jaxcomm.accounting.wire_report(tx, params, n)
        payload = sum(c.nbytes for c in report)
        traffic = jaxcomm.accounting.traffic_bytes(report, n)
        ring = 2 * (n - 1) / n * dense32
        rows.append(
            {
                "tree": tree,
                "params": size,
                "compressor": name,
                "n_workers": n,
                "ratio": ratio,
                "time_over_copy": r,
                "payload_over_dense_fp32": payload / dense32,
                "payload_over_dense_bf16": payload / dense16,
                "traffic_over_dense_ring": _over(traffic, ring),
                "wire_bytes": payload,
            }
        )
        print(
            f"{name:<22} {r:>7.2f}x  {payload / dense32:>9.5f}  {payload / dense16:>9.5f}"
            f"  {_fmt(_over(traffic, ring)):>18}",
            flush=True,
        )
    return rows


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.cases) - set(case_names()))
    if unknown:
        raise app.UsageError(f"--cases: unknown {unknown}; choose from {case_names()}")
    print(f"{jax.device_count()} devices ({jax.devices()[0].platform}), ratio {FLAGS.ratio}")
    rows = []
    if FLAGS.tree:
        rows += bench_tree(FLAGS.tree, FLAGS.cases, FLAGS.ratio, FLAGS.reps)
    else:
        print(f"{'d':>10}  {'compressor':<20} {'t/copy':>9}  {'payload/d':>10}  {'traffic/d':>10}")
        for d in (int(float(s)) for s in FLAGS.sizes):
            rows += bench_size(d, FLAGS.cases, FLAGS.ratio, FLAGS.reps)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"platform": jax.devices()[0].platform, "rows": rows}, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
