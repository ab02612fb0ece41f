r"""How fast each bare collective moves bytes between real processes (gloo on CPU).

Command (one shaped cell; the launcher starts the processes, this script runs in each):
  python -m experiments.launch --processes=2 --rate=100mbit -- \
      python -m experiments.bench.collectives --label=100mbit \
      --out=experiments/results/collectives.json

Each collective runs on its own compiled program, ``--reps`` times after a warm-up
(median reported), over ``--entries`` entries per process:

* ``psum_f32``: an all-reduce of float32 (what dense fp32 and ``cast(...,
  accumulate="psum")`` on XLA:CPU run);
* ``all_gather_u16`` / ``all_gather_f32``: every process's piece to everyone (the
  gather exchange; 16-bit casts and sparse payloads);
* ``all_to_all_u16``: row j to process j (phase one of the two-phase exchange).

Per collective: the bytes one process *sends* with the bandwidth-optimal
algorithm (:func:`jaxcomm.accounting.traffic_bytes`: all-reduce
``2(n-1)/n·S``, all-gather ``(n-1)·s``, all-to-all ``(n-1)/n·S``), the time,
and the rate that makes (MB/s), also as a fraction of the all-reduce's rate.
If a collective reaches a lower fraction, halving its bytes saves less than
half its time: the measured answer to "does the payload's size predict the
step time on this transport". Rows are appended to ``--out`` (JSON, keyed by
processes and ``--label``, e.g. the rate).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

flags.DEFINE_integer("entries", 1_126_400, "entries per process (the wide MLP's gradient)")
flags.DEFINE_integer("reps", 7, "timed repetitions (median)")
flags.DEFINE_string("label", "loopback", "cell label in the JSON, e.g. the --rate of the launch")
flags.DEFINE_string("out", None, "append the results to this JSON file")
FLAGS = flags.FLAGS


def measure(entries: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from experiments.bench.timing import median_time
    from jaxcomm.accounting import traffic_bytes
    from jaxcomm.ledger import Collective

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    n = jax.device_count()
    entries -= entries % n  # all-to-all splits the operand in n rows
    gather = lambda x: lax.all_gather(x, "d", tiled=True)[: x.shape[0]]  # noqa: E731
    cases = {
        "psum_f32": ("all_reduce", lambda x: lax.psum(x, "d"), jnp.float32),
        "all_gather_u16": ("all_gather", gather, jnp.uint16),
        "all_gather_f32": ("all_gather", gather, jnp.float32),
        "all_to_all_u16": (
            "all_to_all",
            lambda x: lax.all_to_all(x.reshape(n, -1), "d", 0, 0, tiled=True).reshape(-1),
            jnp.uint16,
        ),
    }
    sharding = NamedSharding(mesh, P("d"))
    rows = {}
    for name, (kind, f, dtype) in cases.items():
        fn = jax.jit(
            jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
        )
        local = jnp.ones((entries * jax.local_device_count(),), dtype)
        x = jax.make_array_from_process_local_data(sharding, local)
        seconds = median_time(lambda fn=fn, x=x: fn(x), reps)
        operand = entries * jnp.dtype(dtype).itemsize
        sent = traffic_bytes([Collective(kind, "d", operand, jnp.dtype(dtype).name, ())], n)
        rows[name] = {
            "kind": kind,
            "operand_bytes": operand,
            "sent_bytes": sent,
            "seconds": seconds,
            "mb_per_s": sent / seconds / 1e6,
        }
    base = rows["psum_f32"]["mb_per_s"]
    for r in rows.values():
        r["of_all_reduce_rate"] = r["mb_per_s"] / base
    return {"processes": n, "entries": entries, "reps": reps, "rows": rows}


def main(argv: list[str]) -> None:
    del argv
    import jaxcomm.distributed

    jaxcomm.distributed.initialize()
    import jax

    result = measure(FLAGS.entries, FLAGS.reps)
    if jax.process_index() != 0:
        return
    label = FLAGS.label
    print(f"{result['processes']} processes, {label}, {result['entries']:,} entries each")
    print(f"{'collective':<16} {'sent MB':>8} {'ms':>8} {'MB/s':>7} {'of psum':>8}")
    for name, r in result["rows"].items():
        print(
            f"{name:<16} {r['sent_bytes'] / 1e6:>8.2f} {1e3 * r['seconds']:>8.1f} "
            f"{r['mb_per_s']:>7.2f} {r['of_all_reduce_rate']:>8.2f}"
        )
    if FLAGS.out:
        data = {}
        if os.path.exists(FLAGS.out):
            with open(FLAGS.out) as f:
                data = json.load(f)
        data[f"{result['processes']}p/{label}"] = result
        with open(FLAGS.out, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    app.run(main)
