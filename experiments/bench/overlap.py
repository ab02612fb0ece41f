r"""Does a fragment's exchange overlap the inner steps on XLA:CPU + gloo? Measured, 2 processes.

Command (root for the shaped link; ~5 min at 10 Mbit/s):
  python -m experiments.bench.overlap --rate=10mbit --out=experiments/results/overlap.json

Two processes (``experiments.launch``, one CPU device each, gloo) on a link
shaped to ``--rate``. Two parts.

**The mechanism** (``--repeats`` rounds of each, interleaved): ``inner``,
``--inner_steps`` steps of a local jitted computation (matmuls, no
collective), each timed to completion; ``exchange``, one all-reduce of a
``--fragment_mb`` fragment, alone; ``async``, the exchange dispatched without
waiting (JAX's asynchronous dispatch), then the inner steps, then the
exchange waited for; ``thread``, the exchange run and waited for in a host
thread while the main thread runs the inner steps.

**Streaming DiLoCo** (``streaming`` in the JSON): a tanh MLP of
``--fragments`` layers of ``--dim`` x ``--dim`` (one fragment each), inner
SGD on a ``--batch``-row batch, one fragment synchronising every
``--inner_steps`` steps with ``delay = inner_steps - 1``; run with no
exchange at all (``no_exchange``: the compute floor), with the exchange in
the step (``in_step``, ``overlap=False``), and with
:class:`jaxcomm.loco.Overlap` (``overlap``: the exchange in a host thread).
Each step is timed to completion, apart from the time ``Overlap`` waited
for a landing exchange (``wait_per_sync_s``), which is added to the period.

The issue's verdict for ``overlap``: the mean inner-step time with a
fragment in flight <= 1.15 x the step with no communication
(``step_ratio``), and one period (``--inner_steps`` steps + one fragment's
sync) <= 1.1 x max(the steps with no communication, the fragment's exchange
alone) (``period_ratio``). Process 0 writes everything to ``--out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("rate", "10mbit", "shaped link rate; 'loopback' for none")
    flags.DEFINE_float("fragment_mb", 1.0, "fragment size in MB (float32)")
    flags.DEFINE_integer("dim", 768, "matmul size of an inner step")
    flags.DEFINE_integer("matmuls", 4, "matmuls per inner step")
    flags.DEFINE_integer("inner_steps", 10, "inner steps per sync (the overlap window)")
    flags.DEFINE_integer("repeats", 5, "repeats of each measurement (medians reported)")
    flags.DEFINE_integer("fragments", 4, "Streaming DiLoCo: fragments (one dim x dim layer each)")
    flags.DEFINE_integer("batch", 512, "Streaming DiLoCo: rows of the MLP's batch per worker")
    flags.DEFINE_string("out", "experiments/results/overlap.json", "JSON written by process 0")
    flags.DEFINE_bool("worker", False, "internal: run as one launched process")


def _programs():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    jaxcomm.distributed.initialize()
    mesh = jaxcomm.distributed.global_mesh("data")
    n = mesh.devices.size
    local = jax.local_devices()[0]
    x = jax.device_put(jnp.full((FLAGS.dim, FLAGS.dim), 1.0 / FLAGS.dim, jnp.float32), local)

    @jax.jit
    def inner(x):
        for _ in range(FLAGS.matmuls):
            x = jnp.tanh(x @ x + 0.5)
        return x

    m = int(FLAGS.fragment_mb * 1e6 // 4)
    frag = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones((1, m), np.float32), (n, m)
    )
    exchange = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )  # fmt: skip
    )
    return inner, x, exchange, frag


def jaxcomm_mesh():
    import jaxcomm

    return jaxcomm.distributed.global_mesh("data")


def _timed_inner(inner, x, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = inner(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


def _round(kind, inner, x, exchange, frag):
    """One measurement: (inner-step times, wall clock)."""
    t0 = time.perf_counter()
    if kind == "inner":
        times = _timed_inner(inner, x, FLAGS.inner_steps)
    elif kind == "exchange":
        exchange(frag).block_until_ready()
        times = []
    elif kind == "async":
        out = exchange(frag)
        times = _timed_inner(inner, x, FLAGS.inner_steps)
        out.block_until_ready()
    else:
        box = []
        th = threading.Thread(target=lambda: box.append(exchange(frag).block_until_ready()))
        th.start()
        times = _timed_inner(inner, x, FLAGS.inner_steps)
        th.join()
    return times, time.perf_counter() - t0


def _mlp_step(tx):
    """One worker's inner step of a tanh MLP on a fixed batch: (params, state, x) -> ..."""
    import jax
    import jax.numpy as jnp
    import optax

    def loss(p, x):
        for k in sorted(p):
            x = jnp.tanh(x @ p[k])
        return jnp.mean(x**2)

    def step(p, s, x):
        u, s = tx.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, u), s

    return step


def _stacked(mesh, tree):
    """Per-worker copies of ``tree`` (leading worker axis), this process's rows from its data."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    sharding = NamedSharding(mesh, P("data"))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x)[None], (n,) + np.shape(x)
        ),
        tree,
    )


def _per_worker(mesh, f):
    """``f`` on one worker's rows of stacked arguments, under shard_map over ``data``."""
    import jax
    from jax.sharding import PartitionSpec as P

    def g(*args):
        out = f(*jax.tree.map(lambda y: y[0], args))
        return jax.tree.map(lambda y: y[None], out)

    return jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("data"), out_specs=P("data")))


def _timed_steps(run, p, s, steps):
    """Per-step wall times of ``run`` and whether a fragment was in flight when it started."""
    import jax

    times, waits, flight = [], [], []
    for _ in range(steps):
        busy, waited = bool(run.in_flight()), run.wait_s()
        t0 = time.perf_counter()
        p, s = jax.block_until_ready(run(p, s))
        # a step's own time, and apart the wait for a landing exchange (in period_s)
        waits.append(run.wait_s() - waited)
        times.append(time.perf_counter() - t0 - waits[-1])
        flight.append(busy)
    return times, waits, flight, s


def streaming_rows(mesh) -> dict:
    """Streaming DiLoCo through :class:`jaxcomm.loco.Overlap` vs the exchange in the step."""
    import jax
    import numpy as np
    import optax

    from jaxcomm.loco import Overlap, StreamingDiLoCo

    d, window, rounds = FLAGS.dim, FLAGS.inner_steps, FLAGS.repeats + 1
    rng = np.random.default_rng(0)
    w0 = {f"l{i}": (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32)
          for i in range(FLAGS.fragments)}  # fmt: skip
    every = window * FLAGS.fragments  # one fragment syncs every `window` steps
    rule = StreamingDiLoCo(
        optax.sgd(0.01), every=every, fragments=FLAGS.fragments, delay=window - 1, axis_name="data"
    )
    x = _stacked(mesh, rng.normal(size=(FLAGS.batch, d)).astype(np.float32))
    out = {}
    for kind in ("no_exchange", "in_step", "overlap"):
        tx = {"no_exchange": optax.sgd(0.01), "in_step": rule.transform(),
              "overlap": rule.transform(overlap=True)}[kind]  # fmt: skip
        fn, ov = _per_worker(mesh, _mlp_step(tx)), Overlap(rule, mesh)

        def run(p, s, fn=fn, ov=ov, kind=kind):
            return ov.step(fn, p, s, x) if kind == "overlap" else fn(p, s, x)

        run.in_flight = lambda ov=ov: ov.in_flight
        run.wait_s = lambda ov=ov: ov.wait_s
        steps = window * FLAGS.fragments * rounds
        times, waits, flight, s = _timed_steps(
            run, _stacked(mesh, w0), _stacked(mesh, tx.init(w0)), steps
        )
        if kind == "overlap":
            ov.drain(s)
        skip = window * FLAGS.fragments  # the first round compiles
        times, waits, flight = times[skip:], waits[skip:], flight[skip:]
        busy = [t for t, b in zip(times, flight) if b]
        total = [t + w for t, w in zip(times, waits)]
        periods = [sum(total[i : i + window]) for i in range(0, len(total), window)]
        out[kind] = {
            "step_s": float(np.mean(times)),
            "step_in_flight_s": float(np.mean(busy)) if busy else None,
            "period_s": float(np.median(periods)),
            "wait_per_sync_s": sum(waits) / (len(times) / window),
        }
    send = Overlap(rule, mesh).program(0)
    st = _stacked(mesh, rule.init(w0))
    first = [_stacked(mesh, w0["l0"])]
    args = (first, first, st.outer_state[0], st.compressor_state[0])
    jax.block_until_ready(send(*args))
    t0 = time.perf_counter()
    for _ in range(FLAGS.repeats):
        jax.block_until_ready(send(*args))
    comm = (time.perf_counter() - t0) / FLAGS.repeats
    out.update(fragment_exchange_s=comm, fragment_mb=d * d * 4 / 1e6)
    base, over = out["no_exchange"], out["overlap"]
    over["step_ratio"] = over["step_in_flight_s"] / base["step_s"]
    for kind in ("in_step", "overlap"):
        out[kind]["period_ratio"] = out[kind]["period_s"] / max(base["period_s"], comm)
    over["overlaps"] = over["step_ratio"] <= 1.15 and over["period_ratio"] <= 1.1
    return out


def worker() -> None:
    import jax
    import numpy as np

    from jaxcomm import distributed

    inner, x, exchange, frag = _programs()
    inner(x).block_until_ready()
    exchange(frag).block_until_ready()
    kinds = ("inner", "exchange", "async", "thread")
    rows = {k: {"step_s": [], "wall_s": []} for k in kinds}
    for _ in range(FLAGS.repeats):
        for kind in kinds:  # interleaved, so drift on a shared machine hits every kind alike
            distributed.barrier("overlap " + kind)
            times, wall = _round(kind, inner, x, exchange, frag)
            rows[kind]["step_s"] += times
            rows[kind]["wall_s"].append(wall)
    result_streaming = streaming_rows(jaxcomm_mesh())
    if jax.process_index() != 0:
        return
    mean = lambda v: float(np.mean(v)) if v else None
    result = {
        k: {"step_s": mean(r["step_s"]), "max_step_s": max(r["step_s"], default=None),
            "wall_s": float(np.median(r["wall_s"]))}
        for k, r in rows.items()
    }  # fmt: skip
    base, comm = result["inner"]["step_s"], result["exchange"]["wall_s"]
    window = result["inner"]["wall_s"]
    for kind in ("async", "thread"):
        r = result[kind]
        r["step_ratio"] = r["step_s"] / base
        r["wall_ratio"] = r["wall_s"] / max(window, comm)
        r["overlaps"] = r["step_ratio"] <= 1.15 and r["wall_ratio"] <= 1.1
    result["config"] = {
        k: getattr(FLAGS, k) for k in ("rate", "fragment_mb", "dim", "matmuls", "inner_steps",
                                       "repeats", "fragments", "batch")
    }  # fmt: skip
    result["serial_s"] = window + comm
    result["streaming"] = result_streaming
    result["note"] = "\n\n".join(__doc__.split("\n\n")[2:6])
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1), flush=True)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.worker:
        worker()
        return
    names = (
        "fragment_mb",
        "dim",
        "matmuls",
        "inner_steps",
        "repeats",
        "rate",
        "fragments",
        "batch",
    )
    flags_ = [f"--{k}={getattr(FLAGS, k)}" for k in names]
    out = os.path.abspath(FLAGS.out)
    argv = [
        sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1",
        *([] if FLAGS.rate == "loopback" else [f"--rate={FLAGS.rate}"]), "--",
        sys.executable, "-m", "experiments.bench.overlap", "--worker", f"--out={out}", *flags_,
    ]  # fmt: skip
    subprocess.run(argv, check=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)


def report(result: dict) -> str:
    """Markdown tables of an ``overlap.json`` (``overlap.md``, via studies.tables)."""
    cfg, st = result["config"], result["streaming"]
    ms = lambda s: "—" if s is None else f"{s * 1e3:.0f}"
    rows = [
        f"Two processes, gloo, "
        f"{'loopback' if cfg['rate'] == 'loopback' else cfg['rate'] + ' (tbf)'}. "
        f"Medians of {cfg['repeats']} rounds; "
        "step times are means.",
        "",
        f"**The mechanism**: {cfg['inner_steps']} inner steps ({cfg['matmuls']} matmuls of "
        f"{cfg['dim']}²) beside one all-reduce of {cfg['fragment_mb']:g} MB.",
        "",
        "| run | mean inner step (ms) | wall (ms) | step / no-comm step | wall / max(steps, "
        "exchange) | overlaps |",
        "|---|---|---|---|---|---|",
        f"| inner steps alone | {ms(result['inner']['step_s'])} | {ms(result['inner']['wall_s'])} "
        "| 1 | — | — |",
        f"| exchange alone | — | {ms(result['exchange']['wall_s'])} | — | — | — |",
    ]
    for kind, name in (("async", "asynchronous dispatch"), ("thread", "host thread")):
        r = result[kind]
        rows.append(
            f"| {name} | {ms(r['step_s'])} | {ms(r['wall_s'])} | {r['step_ratio']:.2f} | "
            f"{r['wall_ratio']:.2f} | {'yes' if r['overlaps'] else 'no'} |"
        )
    rows += [
        "",
        f"**Streaming DiLoCo** ({cfg['fragments']} fragments of {st['fragment_mb']:.2f} MB, one "
        f"synchronising every {cfg['inner_steps']} steps, delay {cfg['inner_steps'] - 1}; "
        f"a fragment's exchange alone: {ms(st['fragment_exchange_s'])} ms):",
        "",
        "| run | mean step (ms) | mean step, fragment in flight (ms) | waited per sync (ms) | "
        "period (ms) | period / max(steps, exchange) |",
        "|---|---|---|---|---|---|",
    ]
    names = {"no_exchange": "no exchange (compute floor)", "in_step": "exchange in the step",
             "overlap": "`loco.Overlap` (host thread)"}  # fmt: skip
    for kind, name in names.items():
        r = st[kind]
        ratio = r.get("period_ratio")
        rows.append(
            f"| {name} | {ms(r['step_s'])} | {ms(r['step_in_flight_s'])} | "
            f"{ms(r['wait_per_sync_s'])} | {ms(r['period_s'])} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} |"
        )
    o = st["overlap"]
    rows += [
        "",
        f"Verdict (step in flight ≤ 1.15×, period ≤ 1.1×): step {o['step_ratio']:.2f}×, "
        f"period {o['period_ratio']:.2f}×: **{'met' if o['overlaps'] else 'not met'}**.",
    ]
    return "\n".join(rows) + "\n"
