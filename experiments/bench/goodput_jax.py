"""The goodput bench's jaxcomm replica: the LM's inner steps in JAX, outer syncs through torchft.

One replica is one JAX program (:mod:`experiments.bench.goodput` starts it with
``--role=replica --side=jaxcomm``): the study's GPT and inner AdamW on its
schedule, ``H / fragments`` inner steps per jitted ``lax.scan`` (batches drawn
on device as the harness's worker of this index draws them), then
the outer sync. A restarted replica heals at its
:meth:`~jaxcomm.ElasticDiLoCo.join`. Streaming DiLoCo runs as torchft's does
(:func:`experiments.bench.goodput_workload.overlap`: the study's ``delay=1,
mix=0.5`` unless ``--streaming=no_overlap``): fragment ``r % F`` every ``H / F``
steps, its all-reduce started ``delay`` steps before the round's end
(:meth:`~jaxcomm.ElasticDiLoCo.start`) and finished at it
(:meth:`~jaxcomm.ElasticDiLoCo.finish`), mixing ``mix`` of the local fragment in.
"""

from __future__ import annotations

import os
import time

from experiments.bench import goodput_workload as workload
from experiments.elastic_launch import mark_ready, sha256, wait_ready


def inner_steps_fn(model, inner, ds, config, replica: int, steps: int):
    """jit((params, inner_state, start) -> (params, inner_state, mean loss)): ``steps`` steps.

    Step ``start + t`` draws the batch the harness's worker ``replica`` draws at
    that step (``data.sample_batch`` with ``data.worker_key(seed, replica)``).
    """
    import jax
    import jax.numpy as jnp
    import optax

    from experiments import data as data_lib

    x = jnp.asarray(ds.x_train[replica])
    key = data_lib.worker_key(config.seed, replica)
    batch, seq_len = config.data.batch_size, ds.seq_len

    def loss_fn(p, bx, by):
        logits = model.apply({"params": p}, bx, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, by).mean()

    @jax.jit
    def run(p, s, start, x):  # the stream an argument: as a closed-over constant XLA folds it
        def body(carry, t):
            p, s = carry
            bx, by = data_lib.sample_batch(x, None, key, start + t, batch, seq_len)
            loss, g = jax.value_and_grad(loss_fn)(p, bx, by)
            u, s = inner.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss

        (p, s), losses = jax.lax.scan(body, (p, s), jnp.arange(steps))
        return p, s, losses.mean()

    return lambda p, s, start: run(p, s, start, x)


def replica(args) -> None:
    """Train as replica ``args.replica`` until the data position reaches the schedule's end."""
    import jax
    import optax
    import torch

    import jaxcomm
    from experiments import models, optimizers, train
    from jaxcomm import elastic

    torch.set_num_threads(1)
    config = workload.config(args)
    every, fragments = workload.sync_period(config)
    per_sync = every // fragments
    delay, mix = workload.overlap(config, args.streaming)
    ds = workload.dataset(config, args.replicas)
    model = models.build(config.model.name, **config.model.kwargs)
    # train.build_model's initialisation, compiled as one program (op by op it compiles
    # dozens: minutes on busy cores, and a restarted replica pays them again)
    init = jax.jit(lambda k: model.init(k, ds.example_input(), train=False)["params"])
    # committed to the device, as a healed replica's (ElasticDiLoCo puts them on the same
    # sharding): the inner steps compile once, not again after a heal
    params = jax.device_put(init(jax.random.key(config.seed)), jax.devices()[0])
    inner = optax.adamw(optimizers.learning_rate(config), **config.optimizer.kwargs)
    # per round: per_sync - delay steps, the all-reduce started, delay steps beside it
    run = inner_steps_fn(model, inner, ds, config, args.replica, per_sync - delay)
    tail = inner_steps_fn(model, inner, ds, config, args.replica, delay) if delay else None
    state = jax.device_put(inner.init(params), jax.devices()[0])
    for f in filter(None, (run, tail)):
        jax.block_until_ready(f(params, state, 0))  # compiled before joining
    if args.inner_out:  # the inner steps alone (goodput.inner_steps): no manager, no sync
        times, p, s = [], params, state
        for k in range(args.inner_calls):
            t = time.perf_counter()
            p, s, loss = run(p, s, k * (per_sync - delay))
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t)
        return workload.write_inner(args.inner_out, times, per_sync - delay)
    manager = elastic.gloo_manager(
        f"replica_{args.replica}", args.lighthouse, min_replicas=1,
        timeout_s=args.timeout_s, quorum_timeout_s=args.deadline_s,
    )  # fmt: skip
    log = workload.Log(args.run_dir, args.replica, args.incarnation)
    log.write(event="ready")
    if args.incarnation == 0:  # the job starts with every replica up (a restart joins alone)
        mark_ready(log.dir, args.replica)
        wait_ready(log.dir, args.replicas)
    lr = config.wrapper.get("outer_learning_rate", 0.7)
    outer = optax.sgd(lr, momentum=0.9, nesterov=True)
    loop = jaxcomm.ElasticDiLoCo(manager, params, state, outer=outer, fragments=fragments,
                                 mix=mix, delay=delay)  # fmt: skip

    # the compiled steps by length (when per_sync == 2 delay, both are the same length)
    by_length = {per_sync - delay: run, **({delay: tail} if delay else {})}

    def take(p, s, position, n):
        t = time.perf_counter()
        p, s, loss = by_length[n](p, s, position)
        time.sleep(max(0.0, n * args.step_s - (time.perf_counter() - t)))
        return p, s, float(loss) * n

    def log_sync(before, committed, n, sync_s, loss):
        log.sync(round=before, rounds=loop.rounds, committed=committed, healed=loop.healed,
                 participants=loop.participants, steps=n, position=loop.inner_steps,
                 sync_s=sync_s, loss=loss)  # fmt: skip

    t = time.perf_counter()
    params, state = loop.join()  # a restarted replica heals here
    log_sync(0, loop.committed, 0, time.perf_counter() - t, None)
    while loop.inner_steps < config.num_train_steps:
        before = loop.rounds
        params, state, committed, losses = loop.round(params, state, take, steps=per_sync)
        log_sync(before, committed, per_sync, loop.wait_s, sum(losses) / per_sync)
    ev = train.make_eval(model, ds, config.eval_batch_size)(loop.params, {})
    log.final(position=loop.inner_steps, rounds=loop.rounds, params=sha256(loop.params),
              anchor=sha256(loop.anchor), eval_loss=ev["eval_loss"],
              eval_loss_se=ev["eval_loss_se"])  # fmt: skip
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads would hold the interpreter
