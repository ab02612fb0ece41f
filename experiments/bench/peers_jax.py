"""The jaxcomm side of the peers bench: each configuration's transform, the models, the step.

Split from :mod:`experiments.bench.peers` (which launches the processes and
writes the JSON): :func:`jaxcomm_tx` builds ``JAX_CONFIGS[cfg]``
(:mod:`experiments.bench.peers_report`), :func:`build_model` the Flax model of
``peers_setup.MODELS[name]``, :func:`build_step` one configuration's
``jit(shard_map(step))``; the ``overhead`` part (:func:`overhead_part`, 8 fake
CPU devices in this process) and the launched jaxcomm processes of the
``peers`` and ``castcost`` parts (:func:`jax_worker`, :func:`castcost_worker`:
``python -m experiments.bench.peers --worker=jax|castcost``). No torch.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments import models
from experiments.bench.peers_report import JAX_CONFIGS
from experiments.bench.peers_setup import MODELS, POWERSGD, spread
from experiments.bench.peers_setup import batch as make_batch


def jaxcomm_tx(cfg: str, *, axis_name="data", steady: bool = False):
    """The transform of ``JAX_CONFIGS[cfg]`` (None for ``nocomm``); ``steady``: PowerSGD
    from step 0, for its steady-state wire bytes."""
    if cfg not in JAX_CONFIGS:
        raise ValueError(f"unknown configuration {cfg!r}; choose from {list(JAX_CONFIGS)}")
    if cfg == "nocomm":
        return None
    if cfg == "allreduce":
        return jaxcomm.allreduce(axis_name=axis_name)
    if cfg in ("fp16", "bf16"):
        # the psum, as the committed tables measured (the CPU default since is the
        # uint16 words: accumulate="auto", the *_default configurations)
        dtype = jnp.float16 if cfg == "fp16" else jnp.bfloat16
        return jaxcomm.cast(dtype, axis_name=axis_name, accumulate="psum")
    if cfg in ("fp16_default", "bf16_default"):
        return jaxcomm.cast(
            jnp.float16 if cfg == "fp16_default" else jnp.bfloat16, axis_name=axis_name
        )
    if cfg == "ef_sign":
        return jaxcomm.ef_sign(axis_name=axis_name)
    if cfg == "topk":
        return jaxcomm.topk(0.01, axis_name=axis_name)
    if cfg == "threshold":
        return jaxcomm.threshold(0.01, axis_name=axis_name)
    return jaxcomm.powersgd(
        POWERSGD["rank"],
        key=jax.random.key(0),
        axis_name=axis_name,
        start_iter=0 if steady else POWERSGD["start_iter"],
        min_compression_rate=POWERSGD["min_compression_rate"],
    )


def build_model(name: str):
    kw, shape = MODELS[name]
    model = models.build(**kw)
    v = model.init(jax.random.key(0), jnp.zeros((1,) + shape), train=False)
    return model, v["params"], v.get("batch_stats", {})


def _train_step(
    model,
    tx,
    mesh,
    has_bn: bool,
    *,
    hand_pmean: bool = False,
    donate=True,
    per_worker: bool = False,
):
    """jit(shard_map(step)): per-worker grads (pcast), exchange by ``tx`` (or a hand pmean).

    ``per_worker``: params enter and leave per worker (a leading worker axis, like the
    optimizer state), for a ``tx`` with no exchange (``nocomm``): each worker applies its
    own gradient and the step has no collective.
    """
    sgd = optax.sgd(0.01)

    def step(params, bstats, opt_state, x, y):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        bstats, opt_state, x, y = first(bstats), first(opt_state), x[0], y[0]
        if per_worker:
            params = local = first(params)
        else:
            local = jax.lax.pcast(params, "data", to="varying")

        def loss_fn(p):
            if has_bn:
                logits, upd = model.apply(
                    {"params": p, "batch_stats": bstats}, x, train=True, mutable=["batch_stats"]
                )
                bs = upd["batch_stats"]
            else:
                logits, bs = model.apply({"params": p}, x), bstats
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), bs

        (_, bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(local)
        if hand_pmean:
            updates, opt_state = sgd.update(jax.lax.pmean(grads, "data"), opt_state, params)
        else:
            updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        add = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        return (add(params) if per_worker else params), add(bs), add(opt_state)

    p_spec = P("data") if per_worker else P()
    specs = (p_spec, P("data"), P("data"), P("data"), P("data"))
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(p_spec, P("data"), P("data"))),
        donate_argnums=(0, 1, 2) if donate else (),
    )


def build_step(cfg: str, model, params0, bstats0, mesh, glob, replicate):
    """The step of ``JAX_CONFIGS[cfg]`` and its initial ``[params, batch_stats, opt_state]``.

    ``glob(tree)`` places this process's per-worker values (a leading worker axis,
    sharded over "data"); ``replicate(tree)`` places replicated ones. ``nocomm`` keeps
    params per worker (``glob``), every other configuration replicated.
    """
    inner = jaxcomm_tx(cfg)
    tx = optax.sgd(0.01) if inner is None else optax.chain(inner, optax.sgd(0.01))
    fn = _train_step(model, tx, mesh, bool(bstats0), per_worker=inner is None)
    params = glob(params0) if inner is None else replicate(params0)
    return fn, [params, glob(bstats0), glob(tx.init(params0))]


# --- the overhead part: library overhead on 8 fake devices ---------------------------


def overhead_part(model_names, reps: int, batch: int) -> list[dict]:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sh = NamedSharding(mesh, P("data"))
    rows = []
    for name in model_names:
        model, params0, bstats0 = build_model(name)
        has_bn = bool(bstats0)
        xs, ys = zip(*[make_batch(name, w, batch) for w in range(n)])
        x, y = jax.device_put(np.stack(xs), sh), jax.device_put(np.stack(ys), sh)

        def per(t):
            return jax.device_put(
                jax.tree.map(lambda z: jnp.broadcast_to(z, (n,) + z.shape), t), sh
            )

        tx_lib = optax.chain(jaxcomm.allreduce(axis_name="data"), optax.sgd(0.01))
        cases = {
            "jaxcomm": (_train_step(model, tx_lib, mesh, has_bn, donate=False), tx_lib),
            "hand_pmean": (
                _train_step(model, None, mesh, has_bn, hand_pmean=True, donate=False),
                optax.sgd(0.01),
            ),
        }
        state = {
            k: [
                jax.device_put(params0, NamedSharding(mesh, P())),
                per(bstats0),
                per(tx.init(params0)),
            ]
            for k, (_, tx) in cases.items()
        }
        times = {k: [] for k in cases}
        for rep in range(reps + 1):  # interleaved; the first round compiles and warms up
            for k, (fn, _) in cases.items():
                t0 = time.perf_counter()
                state[k] = list(jax.block_until_ready(fn(*state[k], x, y)))
                if rep:
                    times[k].append(time.perf_counter() - t0)
        diff = max(
            float(jnp.abs(u - v).max())
            for u, v in zip(
                jax.tree.leaves(state["jaxcomm"][0]), jax.tree.leaves(state["hand_pmean"][0])
            )
        )
        ratios = [a / b for a, b in zip(times["jaxcomm"], times["hand_pmean"])]
        row = dict(
            model=name,
            devices=n,
            steps=reps + 1,
            jaxcomm_step_s=spread(times["jaxcomm"]),
            hand_step_s=spread(times["hand_pmean"]),
            ratio=spread(ratios),
            params_max_abs_diff=diff,
        )
        r = row["ratio"]
        print(
            f"overhead {name:9s} jaxcomm.allreduce+sgd / lax.pmean+sgd step time: median "
            f"{r['median']:.3f}x (min {r['min']:.3f}, max {r['max']:.3f}, {r['n']} reps); "
            f"params max |diff| after {reps + 1} steps: {diff:.2e}",
            flush=True,
        )
        rows.append(row)
    return rows


# --- the launched jaxcomm processes (the peers and castcost parts) ----------------------


def jax_worker(model_name: str, configs: list[str], batch: int, warmup: int, reps: int, out: str):
    """One process of the jaxcomm side (started by ``experiments.launch``)."""
    jaxcomm.distributed.initialize()
    mesh = jaxcomm.distributed.global_mesh("data")
    n = mesh.size
    model, params0, bstats0 = build_model(model_name)
    sh, rep_sh = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    glob = lambda t: jax.tree.map(  # noqa: E731
        lambda a: jax.make_array_from_process_local_data(sh, np.asarray(a)[None]), t
    )
    replicate = lambda t: jax.tree.map(  # noqa: E731
        lambda a: jax.make_array_from_process_local_data(rep_sh, np.asarray(a)), t
    )
    x, y = make_batch(model_name, jax.process_index(), batch)
    x, y = glob(x), glob(y)
    result = {"model": model_name, "world": n, "configs": {}}
    result["params"] = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params0))
    result["what"] = {cfg: JAX_CONFIGS[cfg] for cfg in configs}
    for cfg in configs:
        fn, st = build_step(cfg, model, params0, bstats0, mesh, glob, replicate)
        compiled = fn.lower(*st, x, y).compile()
        hlo_bytes = jaxcomm.accounting.collective_bytes(compiled)
        hlo_count = jaxcomm.accounting.collective_count(compiled)
        times = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            st = list(jax.block_until_ready(compiled(*st, x, y)))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        steady = jaxcomm_tx(cfg, steady=True)
        p = jax.tree.map(jnp.asarray, params0)
        result["configs"][cfg] = dict(
            step_s=spread(times),
            wire_bytes=0 if steady is None else jaxcomm.wire_bytes(steady, p, n),
            hlo_collective_bytes=hlo_bytes,
            hlo_collectives=hlo_count,
        )
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    jax.distributed.shutdown()


def castcost_worker(d: int, reps: int, out: str) -> None:
    """Bare all-reduces of d entries in XLA (one process of ``experiments.launch``)."""
    jaxcomm.distributed.initialize()
    mesh = jaxcomm.distributed.global_mesh("data")
    n = mesh.size
    sh = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(jax.process_index())
    g = jax.make_array_from_process_local_data(sh, rng.normal(size=(1, d)).astype(np.float32))

    def ring_f16(v):  # ring by ppermute: fp16 words on the wire, fp32 accumulation
        c, me = -(-d // n), lax.axis_index("data")
        ch = jnp.pad(v / n, (0, n * c - d)).reshape(n, c)
        right = [(i, (i + 1) % n) for i in range(n)]

        def send(i):
            w = lax.bitcast_convert_type(
                lax.dynamic_index_in_dim(ch, i % n, keepdims=False).astype(jnp.float16), jnp.uint16
            )
            return lax.bitcast_convert_type(lax.ppermute(w, "data", right), jnp.float16).astype(
                jnp.float32
            )

        for s in range(n - 1):
            i = (me - s - 1) % n
            ch = lax.dynamic_update_index_in_dim(
                ch, lax.dynamic_index_in_dim(ch, i, keepdims=False) + send(me - s), i, 0
            )
        for s in range(n - 1):
            ch = lax.dynamic_update_index_in_dim(ch, send(me + 1 - s), (me - s) % n, 0)
        return ch.reshape(-1)[:d]

    mean16 = lambda v, dt: lax.psum((v / n).astype(dt), "data").astype(jnp.float32)  # noqa: E731
    u16 = lambda v: lax.bitcast_convert_type((v / n).astype(jnp.float16), jnp.uint16)  # noqa: E731
    cases = {
        "psum_f32": lambda v: lax.psum(v, "data") / n,
        "psum_f16": lambda v: mean16(v, jnp.float16),
        "psum_bf16": lambda v: mean16(v, jnp.bfloat16),
        "psum_u16_bits": lambda v: lax.psum(u16(v), "data").astype(jnp.float32),
        "ring_ppermute_f16_wire_f32_sum": ring_f16,
        "cast_f16_local_only": lambda v: (v / n).astype(jnp.float16).astype(jnp.float32) * n,
    }
    # jaxcomm's own fp16 paths: the psum (the default on GPU/TPU) and the two-phase exchange of
    # uint16 words summed in fp32 (README "Two-phase exchange")
    for label, kw in (
        ("jaxcomm_cast_f16_psum", {"accumulate": "psum"}),
        ("jaxcomm_cast_f16_two_phase", {"accumulate": "all_gather", "exchange": "two_phase"}),
    ):
        tx = jaxcomm.cast(jnp.float16, axis_name="data", min_size=0, **kw)
        state0 = tx.init({"w": jnp.zeros((d,), jnp.float32)})
        cases[label] = lambda v, tx=tx, s=state0: tx.update({"w": v}, s)[0]["w"]
    fns = {
        k: jax.jit(
            jax.shard_map(
                lambda x, f=f: f(x[0])[None],
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,
            )
        )
        for k, f in cases.items()
    }
    res = {}
    for _ in range(2):  # interleaved twice, the better median of each
        for k, fn in fns.items():
            jax.block_until_ready(fn(g))
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(g))
                ts.append(time.perf_counter() - t0)
            res[k] = min(res.get(k, 1e9), float(np.median(ts)))
    outs = {k: np.asarray(fn(g).addressable_data(0)) for k, fn in fns.items()}
    ref = outs["psum_f32"]
    err = {k: float(np.abs(v - ref).max()) for k, v in outs.items() if k != "psum_u16_bits"}
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"d": d, "world": n, "median_s": res, "max_abs_err_vs_f32": err}, f, indent=1)
    jax.distributed.shutdown()
