r"""
# Less frequent communication

Each wrapper takes an optax optimizer `inner` and decides *when* workers
talk. Decisions use `lax.cond` on int32 counters in the state, so a step
that does not synchronise runs no collective; `state.syncs` counts the
synchronisations that executed. All state is a pytree (checkpointable).

- `jaxcomm.accumulate(inner, every=k)`: sums k micro-batch gradients, runs
  `inner` (and its exchange, residuals, keys) once on their mean.
- `jaxcomm.local_sgd(inner, every=H, axis_name=..., warmup_steps=T0,
  compressor=None)`: H local steps, then `pmean(params + u) - params`; the
  first T0 steps all average (post-local SGD). `compressor=` averages the
  compressed delta since the last sync.
- `jaxcomm.diloco(inner, every=H, axis_name=..., outer=optax.sgd(0.7,
  momentum=0.9, nesterov=True), compressor=None)`: outer step on
  `anchor - pmean(local params)`; optional compressed pseudo-gradient with
  error feedback.
- `jaxcomm.delayed_averaging(inner, delay=D, axis_name=...)`: apply the
  local gradient now, add `mean_{t-D} - g_{t-D}` when the average arrives
  (a D-deep queue in the state).
- `jaxcomm.stale(inner, staleness=s)`: every gradient applied s steps late
  (bounded-staleness asynchronous SGD).

Over T steps local SGD synchronises `min(T, T0) + (T - T0) // H` times (the
sync closes each block of H steps). Use `accumulate` rather than
`optax.MultiSteps` around jaxcomm transforms: MultiSteps (optax 0.2.8) runs
the inner update, exchange included, on every micro-step and fails to trace
under `shard_map` with per-worker state.

`local_sgd` and `diloco` need `params` in `update` and keep params **per
worker**: give params, optimizer state and data a leading worker axis and
use `P("data")` for all of them.

```python
tx = jaxcomm.local_sgd(optax.sgd(0.5), every=8, axis_name="data")


def step(params, opt_state, x, y):  # one worker's slice, leading axis stripped
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)  # params required
    return optax.apply_updates(params, updates), opt_state


step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
```

Replicas drift apart between synchronisations and agree right after one (to
the last bit of float32 rounding of `params + (new - params)`). Workers must
start from the same `init` so their counters agree.

## The DiLoCo family (`jaxcomm.loco`)

- `jaxcomm.streaming_diloco(inner, every=H, fragments=P, delay=tau, mix=alpha,
  axis_name=..., compressor=None)`: the leaves split into P fragments of
  about equal size; fragment f sends at the steps s with
  `s % H == ((f + 1) * H // P) % H` (one sync of 1/P of the model every H/P
  steps), its outer step runs on the fragment's averaged drift, and the
  result is merged tau steps later: `local = alpha * local + (1 - alpha) *
  anchor`. `fragments=1, delay=0` is `diloco`. A `compressor` (e.g. int8 or
  4-bit QSGD with `exchange="two_phase"` and error feedback) quantises the
  outer gradient, each fragment with its own state.
- **Real overlap.** In one compiled step the exchange runs at the send step
  and tau only fixes when its result is used (the delay is simulated).
  `jaxcomm.loco.Overlap` runs each fragment's exchange as a program of its
  own in a host thread while the next tau steps run, with bit-identical
  results (tests/test_streaming.py); build the transform with
  `rule.transform(overlap=True)`:

```python
rule = jaxcomm.loco.StreamingDiLoCo(optax.adamw(4e-4), every=100, fragments=4,
                                    delay=5, axis_name="data")
tx, ov = rule.transform(overlap=True), jaxcomm.loco.Overlap(rule, mesh)
for batch in batches:  # train_step: per-worker params and state, one inner step
    params, opt_state = ov.step(train_step, params, opt_state, batch)
opt_state = ov.drain(opt_state)  # before a checkpoint: exact
```

  A thread, because on XLA:CPU a second program dispatched to the same
  device waits for the first: asynchronous dispatch alone does not overlap
  (both measured in `experiments/results/overlap.json`). `ov.wait_s` is the communication
  the tau steps did not hide. The step itself must run no collective while
  a fragment is in flight.
- `jaxcomm.sparseloco(inner, every=H, axis_name=...)`: no outer momentum;
  each worker's drift goes into a decayed error-feedback buffer whose
  chunked top-k, quantised to 2 bits with a per-chunk scale, is
  all-gathered and averaged (the anchor moves by `outer_learning_rate` times
  the mean).
- `jaxcomm.muloco(learning_rate, every=H, axis_name=..., compressor=None)`:
  `diloco` with `optax.contrib.muon` as the inner optimizer.
- `jaxcomm.demo(learning_rate, ...)` (in `jaxcomm.optim`): DeMo keeps a
  local momentum, sends the top-k coefficients of its chunked DCT (the
  rest stays in the momentum), and steps by the sign of the averaged
  transmitted part.

The parameter-averaging members keep params per worker, like `diloco`.

"""
