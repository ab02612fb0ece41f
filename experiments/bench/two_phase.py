"""Two-phase vs all-gather exchange of quantised payloads: traffic, decode time, accuracy.

Three parts:

* **traffic** (analytic, from :func:`jaxcomm.accounting.wire_report`, no
  devices): bytes a worker sends per step for n = 2 ... 64 workers, for the
  1.12M-parameter wide MLP (64-1024-1024-10), with ``exchange="gather"``
  (a worker receives the n-1 other payloads), ``"two_phase"`` (all-to-all of
  compressed chunks + all-gather of compressed chunk means) and the dense
  fp32 ring all-reduce (``2(n-1)/n·4d``). At n = 8 the compiled program's
  collective bytes (HLO, 8 fake CPU devices) are checked against the figure.
* **decode** (8 fake CPU devices, one process): the update's step time on
  meshes of 2, 4 and 8 devices, gather vs two-phase, as a ratio to the dense
  all-reduce step on the same mesh. The gather exchange decodes n payloads
  on every worker (O(n·d) each); two-phase decodes 2 per chunk.
* **accuracy** (8 fake devices): digits MLP, 300 steps of SGD, dense vs the
  two-phase int8, EF-sign and 1-bit exchanges.

  python -m experiments.bench.two_phase                 # all parts, ~3 min on 2 cores
  python -m experiments.bench.two_phase --part=traffic  # analytic only, seconds

Writes ``experiments/results/two_phase.json`` and prints tables.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
WORKERS = (2, 4, 8, 16, 32, 64)


def define_flags() -> None:
    flags.DEFINE_enum("part", "all", ["all", "traffic", "decode", "accuracy"], "which part")
    flags.DEFINE_integer("reps", 7, "timed steps per case (median)")
    flags.DEFINE_string("out", "experiments/results/two_phase.json", "JSON output")


def _methods(mode: str, ax: str = "data") -> dict:
    import jax
    import jax.numpy as jnp

    import jaxcomm

    key = jax.random.key(0)
    return {
        "int8": jaxcomm.int8(key=key, axis_name=ax, error_feedback=True, exchange=mode),
        "ef_sign": jaxcomm.ef_sign(axis_name=ax, exchange=mode),
        "onebit": jaxcomm.onebit(axis_name=ax, exchange=mode),
        "twobit": jaxcomm.twobit(0.5, axis_name=ax, exchange=mode),
        "qsgd16": jaxcomm.qsgd(16, key=key, axis_name=ax, exchange=mode),
        "cast_bf16": jaxcomm.cast(
            jnp.bfloat16, axis_name=ax, accumulate="all_gather", exchange=mode
        ),
    }


def _wide_mlp():
    import jax
    import jax.numpy as jnp

    sizes = [(64, 1024), (1024, 1024), (1024, 10)]
    params = {}
    for i, (a, b) in enumerate(sizes):
        params[f"l{i}"] = {"w": jnp.zeros((a, b), jnp.float32), "b": jnp.zeros((b,), jnp.float32)}
    return params, sum(x.size for x in jax.tree.leaves(params))


def traffic() -> dict:
    import jax

    import jaxcomm
    from tests import helpers as H

    params, d = _wide_mlp()
    rows = []
    for name in _methods("gather"):
        for n in WORKERS:
            row = {"method": name, "n": n, "dense_ring": 2 * (n - 1) / n * 4 * d}
            for mode in ("gather", "two_phase"):
                tx = _methods(mode)[name]
                report = jaxcomm.accounting.wire_report(tx, params, n)
                row[mode] = jaxcomm.accounting.traffic_bytes(report, n)
            rows.append(row)
    # HLO check at n = 8 for the two-phase exchange
    checks = {}
    for name, tx in _methods("two_phase").items():
        g = H.per_worker_grads(params, seed=0)
        compiled = H.shard_map_compiled(tx, g, H.stack(tx.init(params)))
        hlo = sum(c.nbytes for c in jaxcomm.accounting.hlo_collectives(compiled))
        checks[name] = {"hlo": hlo, "wire": jaxcomm.wire_bytes(tx, params, 8)}
    print(f"\nTraffic per worker per step, wide MLP ({d / 1e6:.2f}M params), MB sent")
    print(f"{'method':>10} {'n':>3} {'gather':>8} {'2-phase':>8} {'dense':>8} {'2ph/dense':>9}")
    for r in rows:
        print(
            f"{r['method']:>10} {r['n']:>3} {r['gather'] / 1e6:8.3f} {r['two_phase'] / 1e6:8.3f} "
            f"{r['dense_ring'] / 1e6:8.3f} {r['two_phase'] / r['dense_ring']:9.4f}"
        )
    print("\nHLO bytes == wire bytes at n=8 (two-phase):")
    for name, c in checks.items():
        same = "ok" if c["hlo"] == c["wire"] else "DIFF"
        print(f"  {name:>10}: {c['hlo']} vs {c['wire']} {same}")
    del jax
    return {"params": d, "rows": rows, "hlo_check_n8": checks}


def decode(reps: int) -> dict:
    import jax
    import numpy as np

    import jaxcomm
    from tests import helpers as H

    params, _ = _wide_mlp()
    out = []
    for n in (2, 4, 8):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        g = H.per_worker_grads(params, seed=1, n=n)
        row = {"n": n}
        cases = {"dense": jaxcomm.allreduce(axis_name="data")}
        for mode in ("gather", "two_phase"):
            for name in ("int8", "ef_sign"):
                cases[f"{name}/{mode}"] = _methods(mode)[name]
        for label, tx in cases.items():
            fn, sh = H.sharded(tx, mesh)
            gs, st = jax.device_put(g, sh), jax.device_put(H.stack(tx.init(params), n), sh)
            jax.block_until_ready(fn(gs, st))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(gs, st))
                times.append(time.perf_counter() - t0)
            row[label] = float(np.median(times))
        out.append(row)
    print("\nStep time / dense all-reduce step on the same mesh (fake CPU devices)")
    labels = [k for k in out[0] if k not in ("n", "dense")]
    print(f"{'n':>3} " + " ".join(f"{k:>18}" for k in labels))
    for row in out:
        print(f"{row['n']:>3} " + " ".join(f"{row[k] / row['dense']:18.2f}" for k in labels))
    return {"rows": out}


def accuracy() -> dict:
    import optax

    import jaxcomm
    from experiments import digits

    split = digits.load(8)
    res = {}
    runs = {"dense": jaxcomm.allreduce(axis_name="data")}
    two = _methods("two_phase")
    runs.update({k: two[k] for k in ("int8", "ef_sign", "onebit")})
    for name, ex in runs.items():
        tx = optax.chain(ex, optax.sgd(0.5))
        res[name] = digits.train(tx, steps=300, model="mlp", split=split).accuracy
    print("\nDigits MLP, 300 steps SGD(0.5), 8 workers: test accuracy")
    for name, acc in res.items():
        print(f"  {name:>8}: {acc:.4f} ({100 * (acc - res['dense']):+.1f} points vs dense)")
    return res


def main(argv):
    del argv
    result = {"command": " ".join(["python -m experiments.bench.two_phase", *sys.argv[1:]])}
    if FLAGS.part in ("all", "traffic"):
        result["traffic"] = traffic()
    if FLAGS.part in ("all", "decode"):
        result["decode"] = decode(FLAGS.reps)
    if FLAGS.part in ("all", "accuracy"):
        result["accuracy"] = accuracy()
    os.makedirs(os.path.dirname(FLAGS.out), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    define_flags()
    app.run(main)
