r"""Benchmark: compressor cost relative to a gradient copy, and bytes relative to dense.

For each gradient size d (entries per device) and each compressor, on n fake
CPU devices (real devices where present), this times one jitted
``tx.update`` under ``jax.shard_map`` — memory add, encode, exchange, decode,
residual update — and divides by the time of one gradient copy on the same
devices (``x * 2.0``; XLA elides ``x * 1.0``). Both are measured in the same
run, so the ratio is meaningful on a shared, noisy machine where absolute
seconds are not. Bytes: the payload a worker contributes (``wire_bytes``) and
the traffic it sends with bandwidth-optimal collectives, both divided by a
dense fp32 ring all-reduce.

Command (about 6 minutes on 2 CPU cores):
  python -m experiments.bench_compressors --out bench_out/compressors.json
Quick check:
  python -m experiments.bench_compressors --sizes 100000 --reps 3
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

AXIS = "data"

# name -> factory(ratio) building the transform over AXIS. Add new compressors here.
CASES: dict[str, Callable[[float], object]] = {
    "allreduce": lambda r: jaxcomm.allreduce(axis_name=AXIS),
    "cast_bf16": lambda r: jaxcomm.cast(jnp.bfloat16, axis_name=AXIS),
    "cast_bf16_gather": lambda r: jaxcomm.cast(
        jnp.bfloat16, axis_name=AXIS, accumulate="all_gather"
    ),
    "topk": lambda r: jaxcomm.topk(r, axis_name=AXIS),
    "threshold": lambda r: jaxcomm.threshold(r, axis_name=AXIS),
    "threshold_nosample": lambda r: jaxcomm.threshold(r, axis_name=AXIS, sample_ratio=None),
    "randomk": lambda r: jaxcomm.randomk(r, key=jax.random.key(0), axis_name=AXIS),
    "randomk_stratified": lambda r: jaxcomm.randomk(
        r, key=jax.random.key(0), axis_name=AXIS, sampling="stratified"
    ),
    "int8": lambda r: jaxcomm.int8(key=jax.random.key(0), axis_name=AXIS),
    "qsgd16": lambda r: jaxcomm.qsgd(16, key=jax.random.key(0), axis_name=AXIS),
    "terngrad": lambda r: jaxcomm.terngrad(key=jax.random.key(0), axis_name=AXIS),
    "terngrad_gather": lambda r: jaxcomm.terngrad(
        key=jax.random.key(0), axis_name=AXIS, share_scale=False
    ),
    "onebit": lambda r: jaxcomm.onebit(axis_name=AXIS),
    "ef_sign": lambda r: jaxcomm.ef_sign(axis_name=AXIS),
    "sign_majority": lambda r: jaxcomm.sign_majority(axis_name=AXIS),
    "twobit": lambda r: jaxcomm.twobit(axis_name=AXIS),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["100000", "1000000", "4000000", "10000000"], "entries per device")
flags.DEFINE_float("ratio", 0.001, "sparsification ratio for sparsifiers")
flags.DEFINE_list("cases", list(CASES), "which compressors to run")
flags.DEFINE_integer("reps", 5, "timed repetitions (median is reported)")
flags.DEFINE_string("out", "bench_out/compressors.json", "JSON output path")


def _median_time(fn: Callable[[], object], reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(d: int, names: list[str], ratio: float, reps: int) -> list[dict]:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    sh = NamedSharding(mesh, P(AXIS))
    grads = jax.device_put({"g": jax.random.normal(jax.random.key(1), (n, d), jnp.float32)}, sh)
    params = {"g": jax.ShapeDtypeStruct((d,), jnp.float32)}

    copy = jax.jit(jax.shard_map(lambda x: x * 2.0, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    t_copy = _median_time(lambda: copy(grads["g"]), reps)

    dense_payload = 4 * d
    dense_traffic = 2 * (n - 1) / n * dense_payload
    rows = []
    for name in names:
        tx = CASES[name](ratio)
        state = jax.device_put(
            jax.tree.map(
                lambda a: jnp.broadcast_to(a[None], (n,) + a.shape),
                tx.init({"g": jnp.zeros((d,), jnp.float32)}),
            ),
            sh,
        )

        def f(g, s, tx=tx):
            u, s = tx.update(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a[0], s))
            return u, jax.tree.map(lambda a: a[None], s)

        step = jax.jit(
            jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(), P(AXIS)))
        )
        t = _median_time(lambda step=step, state=state: step(grads, state), reps)
        report = jaxcomm.accounting.wire_report(tx, params, n)
        payload = sum(c.nbytes for c in report)
        traffic = jaxcomm.accounting.traffic_bytes(report, n)
        rows.append(
            {
                "d": d,
                "compressor": name,
                "n_workers": n,
                "ratio": ratio,
                "time_over_copy": t / t_copy,
                "payload_over_dense": payload / dense_payload,
                "traffic_over_dense_ring": traffic / dense_traffic,
                "wire_bytes": payload,
            }
        )
        print(
            f"{d:>10}  {name:<20} {t / t_copy:>8.2f}x  {payload / dense_payload:>10.5f}"
            f"  {traffic / dense_traffic:>10.5f}",
            flush=True,
        )
    return rows


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.cases) - set(CASES))
    if unknown:
        raise app.UsageError(f"--cases: unknown {unknown}; choose from {sorted(CASES)}")
    print(f"{jax.device_count()} devices ({jax.devices()[0].platform}), ratio {FLAGS.ratio}")
    print(f"{'d':>10}  {'compressor':<20} {'t/copy':>9}  {'payload/d':>10}  {'traffic/d':>10}")
    rows = []
    for d in (int(float(s)) for s in FLAGS.sizes):
        rows += bench_size(d, FLAGS.cases, FLAGS.ratio, FLAGS.reps)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"platform": jax.devices()[0].platform, "rows": rows}, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
