r"""
# Using a transform in a training step

A jaxcomm transform is an optax `GradientTransformation` that owns its
collective: given an `axis_name`, its `update` runs inside `jax.shard_map`
or `jax.pmap` over that mesh axis, exchanges the compressed gradients, and
returns the worker mean, identical on every worker. Without `axis_name` it
compresses and decompresses locally (useful to study a compressor on one
device). `optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))`
sends each worker's top 1% entries (values + int32 indices) with an
all-gather and returns the worker mean; what was not sent stays in an
error-feedback residual in the optimizer state.

## The helper: `jaxcomm.data_parallel` and `jaxcomm.init_state`

Write the step of one worker as for one device; the helper makes it a
jitted data-parallel step over the mesh:

```python
import jax, optax, jaxcomm

mesh = jax.make_mesh((8,), ("data",))
tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.adam(1e-3))
opt_state = jaxcomm.init_state(tx, params, mesh)


@jaxcomm.data_parallel(mesh, mean_outputs=(2,))
def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
```

The layout rule (`jaxcomm.parallel`): the state of every jaxcomm transform,
wherever it sits in the tree (a chain's tuple, a flax `TrainState`), has a
leading worker axis and is sharded over it; the batch is split over workers;
everything else is replicated, so optimizers after the compressor (momentum,
Adam) keep one replicated state. Inside, each worker gets its own gradients
and the jaxcomm transform does the only exchange. Arrays are placed on the
mesh at every call, so NumPy batches and checkpoints restored onto one
device work; `Explicit` and `Auto` mesh axes both work.

What the helper guesses, it checks, and it refuses when it cannot tell:

- **The batch** is found: the arguments whose arrays share one leading size
  divisible by the workers, that hold no per-worker state and no PRNG key,
  and that the step does not return (params and state come back; data does
  not). Two candidates of different sizes, or none, are an error naming the
  parameters (`batch_argnums=("batch",)` names it, by name or position). A
  step in which nothing would be split is an error.
- **PRNG keys** handed to the step (typed keys, and uint32 `(..., 2)` leaves
  named like `rng`/`key`) are folded with the worker index, so dropout
  differs between workers and a run repeats for its seed; a key returned
  unchanged comes back as handed in (`fold_keys=False` shares them).
- **BatchNorm statistics** (leaves under a `batch_stats` key, as linen
  names them) are averaged over workers after each step, as torch DDP's
  `broadcast_buffers` keeps one copy; `batch_stats="per_worker"` keeps
  them per worker, laid out by `jaxcomm.parallel.per_worker`.
- **Replicated outputs are checked** before the step runs
  (`jaxcomm.divergence` walks its jaxpr): a value returned as replicated
  but computed from the worker's batch without an exchange is an error
  naming the leaf, e.g. the bias that
  `optax.masked(jaxcomm.topk(...), {"w": True, "b": False})` keeps away
  from the compressor (fix: `optax.masked(jaxcomm.allreduce(axis_name=
  "data"), {"w": False, "b": True})` in the chain), or a loss returned
  without `mean_outputs`. So is a collective inside a `lax.cond` whose
  predicate comes from the batch: `optax.apply_if_finite` around a
  compressor (use `jaxcomm.skip_nonfinite`: `jaxcomm.guide.conventions`).
- Setup mistakes name the leaf (by parameter name) and the fix: state built
  with `tx.init` instead of `init_state`, a batch that does not divide over
  the workers, a transform whose `axis_name` is not the mesh's (the error
  lists the mesh's axes), a step without any jaxcomm state (nothing would
  exchange the gradients), and `local_sgd`/`diloco`/`zero_one_adam`, whose
  params are per worker between synchronisations (write their step by
  hand: `jaxcomm.guide.less_communication`).

- **flax linen**: a `TrainState` is a pytree. Build it with
  `opt_state=jaxcomm.init_state(tx, params, mesh)` and decorate
  `train_step(state, batch) -> (state, metrics)` with
  `@jaxcomm.data_parallel(mesh, mean_outputs=(1,))`. A `batch_stats` field is
  averaged over workers after each step.
- **flax nnx**: `jaxcomm.flax` (imports flax; `pip install jaxcomm[flax]`).
  The official Flax nnx MNIST example (a CNN with BatchNorm and Dropout,
  `train_step(model, optimizer, metrics, batch, rngs)`) becomes
  data-parallel with six changed lines:

```diff
+import jaxcomm.flax
+mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
-optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, momentum), wrt=nnx.Param)
+tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.adamw(learning_rate, momentum))
+optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
+jaxcomm.flax.init_optimizer(optimizer, mesh)
-@nnx.jit
+@jaxcomm.flax.data_parallel(mesh)
 def train_step(model, optimizer, metrics, batch, rngs):
```

  With `jax.make_mesh`'s default `Explicit` axes a seventh line,
  `jax.set_mesh(mesh)`, goes after the mesh: eager code after the step
  (`metrics.reset()`, evaluation) needs it, and the step refuses to run
  without it. nnx objects are never the batch; `nnx.BatchStat` variables
  are averaged over workers after each step (`batch_stats="per_worker"`
  with `jaxcomm.flax.init_per_worker` keeps them per worker); the keys of
  `nnx.Rngs` are folded with the worker index inside the step and come
  back unchanged; `nnx.metrics.Average` and `Accuracy` sum their totals and
  counts over workers, so metrics describe the global batch.
- **Checkpoints**: save `{"params": params, "opt_state": opt_state}` with
  orbax as it is; restore into the abstract tree of a fresh
  `init_state(tx, params, mesh)` (`ocp.utils.to_shape_dtype_struct`), and the
  per-worker residuals come back bit-exactly (tested on one and two
  processes).
- **No deadlock on XLA:CPU.** With several devices in one process, XLA:CPU's
  in-process communicator can abort when many collective programs are in
  flight ("Termination timeout for all gather RendezvousKey ... only 7 of
  them arrived"): the devices' threads of one step wait at a rendezvous
  that the others reach only after a later step. The helper waits for the
  previous step before dispatching the next on CPU, so a loop needs no
  `block_until_ready`; GPU/TPU keep asynchronous dispatch.

## Under `jax.shard_map`, by hand

What the helper does, written out. Only the jaxcomm transform's state (the
chain's first) carries the worker axis; the momentum after it is
replicated:

```python
import jax, jax.numpy as jnp, optax, jaxcomm
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("data",))
tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1, momentum=0.9))
n = mesh.size
comp, rest = tx.init(params)
comp = jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), comp)
opt_state = (
    jax.device_put(comp, NamedSharding(mesh, P("data"))),
    jax.device_put(rest, NamedSharding(mesh, P())),
)


def step(params, opt_state, batch):  # runs on one worker
    opt_state = (jax.tree.map(lambda a: a[0], opt_state[0]), opt_state[1])
    local = jax.lax.pcast(params, "data", to="varying")  # per-worker gradients, see below
    grads = jax.grad(loss_fn)(local, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    opt_state = (jax.tree.map(lambda a: a[None], opt_state[0]), opt_state[1])
    return optax.apply_updates(params, updates), opt_state


spec = (P("data"), P())
step = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec))
)
# batch: jax.device_put(batch, NamedSharding(mesh, P("data")))
```

The update comes out identical (and typed invariant) on every worker, so
`out_specs=P()` holds for params and for the momentum.

**Differentiate per-worker params.** Under `shard_map`, JAX's autodiff sums
the gradient of a *replicated* (`P()`) parameter over the axis by itself: a
dense all-reduce you did not ask for, after which compressing is pointless
and averaging again would scale the update by n. `jax.lax.pcast(params,
"data", to="varying")` (moves no data) makes the gradients local, and
jaxcomm does the only exchange. jaxcomm checks this: gradients that arrive
already identical on every worker raise a `ValueError` that says so. (The
helper runs the step with `check_vma=False`, pmap's semantics, where
gradients are local without the `pcast`.)

## Under `jax.pmap`

`pmap` does not sum gradients by itself, so no `pcast` is needed. Give
params, optimizer state and batch a leading device axis:

```python
tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))
n = jax.local_device_count()


def stack(tree):  # one copy per device
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), tree)


def step(params, opt_state, batch):  # one device's slice, leading axis stripped
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


step = jax.pmap(step, axis_name="data")
params, opt_state = stack(params), stack(tx.init(params))
# batch: a leading axis of n, one slice per device
```

## Practical notes

- Written by hand, on XLA:CPU with fake devices, block on each step
  (`jax.block_until_ready`) or run many steps inside one jit: with many
  collective steps in flight the in-process communicator can deadlock (the
  helper does this for you). Real GPUs/TPUs are unaffected.
"""
