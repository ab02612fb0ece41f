r"""
# The jaxcomm user guide

How to use each part of jaxcomm, and the contracts it keeps. Read it with
`python -m pydoc jaxcomm.guide`, or as a page of `pdoc jaxcomm`. Every public
function's docstring gives its arguments, its rule and the paper it follows;
this guide shows how the parts fit together.

The guide states what the code does, not how fast it runs on some machine:
measurements are made by commands in `experiments/` and stored as JSON in
`experiments/results/` (each section names the command). Byte counts here
are closed forms.

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
  compressor (use `jaxcomm.skip_nonfinite`, below).
- Setup mistakes name the leaf (by parameter name) and the fix: state built
  with `tx.init` instead of `init_state`, a batch that does not divide over
  the workers, a transform whose `axis_name` is not the mesh's (the error
  lists the mesh's axes), a step without any jaxcomm state (nothing would
  exchange the gradients), and `local_sgd`/`diloco`/`zero_one_adam`, whose
  params are per worker between synchronisations (write their step by
  hand, below).

- **flax linen**: a `TrainState` is a pytree. Build it with
  `opt_state=jaxcomm.init_state(tx, params, mesh)` and decorate
  `train_step(state, batch) -> (state, metrics)` with
  `@jaxcomm.data_parallel(mesh, mean_outputs=(1,))`
  (`experiments/examples/linen_digits.py`). A `batch_stats` field is
  averaged over workers after each step.
- **flax nnx**: `jaxcomm.flax` (imports flax; `pip install jaxcomm[flax]`).
  The official Flax nnx MNIST example (a CNN with BatchNorm and Dropout,
  `train_step(model, optimizer, metrics, batch, rngs)`) becomes
  data-parallel with six changed lines
  (`experiments/examples/nnx_digits.py`):

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

- `experiments/train.py` is the training harness (its step: `make_train_call`,
  a chunk of steps in one compiled `shard_map`); `experiments/digits.py`
  drives that step on digits in a few lines, with any `tx`.
- Written by hand, on XLA:CPU with fake devices, block on each step
  (`jax.block_until_ready`) or run many steps inside one jit: with many
  collective steps in flight the in-process communicator can deadlock (the
  helper does this for you). Real GPUs/TPUs are unaffected.

# The transforms

What goes on the wire per worker per leaf of d entries (fp32 gradients), and
through which collective:

- `allreduce()`: 4d bytes; all-reduce. The dense baseline.
- `cast(dtype=bf16 | fp16)`: 2d bytes; a 16-bit all-reduce on GPU/TPU
  (fp16: each worker sends g/n, so the sum cannot overflow; values below
  ~6e-8·n underflow, as with torch's fp16 hook), uint16 words summed in
  fp32 on CPU (see "Casts choose by backend").
- `topk(ratio)`: k·(4+4) bytes, k = max(1, ⌈ratio·d⌉); all-gather of values
  and int32 indices.
- `randomk(ratio, key=)`: 4k bytes (+8 bytes per step to agree on the key)
  with shared indices, by psum; 8k per worker with per-worker indices, by
  all-gather.
- `threshold(ratio)`: k·(4+4) bytes, as top-k; all-gather (slots left
  empty by the sampled threshold carry value 0).
- `int8(bucket_size=512)`: d + 4·⌈d/b⌉ bytes (int8 codes + a max-abs scale
  per bucket).
- `qsgd(levels=16, key=)`: 4·⌈d(1+⌈log₂(s+1)⌉)/32⌉ + 4·⌈d/b⌉ bytes (sign
  and level bits packed in uint32, a norm per bucket).
- `terngrad(key=)`: 4 bytes (pmax of the scale) + ternary codes packed in
  ⌊32/w⌋ fields of w = bit_length(2n) bits per uint32 (a field sums to at
  most 2n, so it never overflows); psum.
- `onebit()` / `ef_sign()`: 4·⌈d/32⌉ sign bits + 8 / 4 bytes of scales;
  `twobit(threshold=0.5)`: 4·⌈d/16⌉ bytes (16 two-bit codes per uint32;
  on the two-phase exchange the chunk means go with a float32 scale each);
  `sign_majority()`: packed-field psum of sign+1, as terngrad.
- `dgc(ratio=0.001)` / `dgc_sgd(lr)`: k·(4+4) bytes, with warm-up densities
  from 25% down to 0.1%; all-gather.
- `powersgd(rank=2, key=)`: Σ (a+b)·r·4 bytes per matrix (+ dense small
  leaves), in two all-reduces (P, then Q).
- `onebit_adam(lr, warmup_steps=, axis_name=)`: during warm-up Adam with a
  dense all-reduce (4d); then 1-bit momentum on the two-phase exchange,
  about 2(n−1)/n·d/8 bytes; all-reduce, then all-to-all + all-gather.
- `zero_one_adam(lr, axis_name=, ...)`: dense variance steps, 1-bit steps
  and local steps on schedules (see "0/1 Adam").
- `hierarchical(tx, inner_axis=, inner_size=)`: dense on the fast axis,
  `tx` on the slow axis; reduce-scatter / all-gather + `tx`.
- `ring_allreduce(x, axis_name)`: 2(n−1)/n·S bytes by `ppermute`
  (collective-permute); a reference implementation.
- `accumulate`, `local_sgd`, `diloco`, `delayed_averaging`, `stale`: see
  "Less frequent communication".
- `skip_nonfinite(tx)`: skips a step with a non-finite update on every
  worker alike (see the NaN rule below).
- `compress(compressor, ...)`: the generic path every compressor runs on.

The quantisers (`int8`, `qsgd`, `terngrad`, `onebit`, `ef_sign`, `twobit`)
and `cast` take `exchange=`: the default `"auto"` picks the all-gather or the
two-phase exchange by bytes for the number of workers n, the all-gather on a
tie (see "Two-phase exchange").

Every docstring names the rule it implements and the paper: Aji & Heafield
2017 and Stich et al. 2018 (top-k, error feedback); Wangni et al. 2018
(random-k); Strom 2015 (threshold); Alistarh et al. 2017 (QSGD); Wen et al.
2017 (TernGrad); Seide et al. 2014 (1-bit SGD); Karimireddy et al. 2019
(EF-SignSGD); Bernstein et al. 2018 (signSGD with majority vote); MXNet's
2-bit kvstore; Lin et al. 2018 (DGC); Vogels et al. 2019 (PowerSGD); Tang et
al. 2021 (1-bit Adam); Lu et al. 2023 (0/1 Adam); Stich 2019 and Lin et al.
2020 (local SGD); Douillard et al. 2023 (DiLoCo); Zhu et al. 2021 (delayed
averaging); Ho et al. 2013 (stale synchronous parallel). Bit packing is real:
uint8/uint32 words go through the collective, and the HLO shows it.

All are pure functional optax transforms: state is a NamedTuple pytree
(residuals, PRNG keys, int32 counters), so they jit, compose with
`optax.chain` / `optax.partition`, and checkpoint with orbax bit for bit.

## DGC

DGC keeps momentum inside the transform (momentum correction and factor
masking), so follow it with *plain* SGD: `jaxcomm.dgc_sgd(lr, ratio=0.001,
warmup_steps=...)` builds the pair, and
`jaxcomm.compressors.dgc.check_followed_by_plain_sgd(opt_state)` raises if
momentum or Adam state follows it.

## PowerSGD

`powersgd` mirrors torch's `PowerSGDState` (`rank`, `start_iter` (torch's
default is 1000, ours 0), `min_compression_rate=2`, `error_feedback`,
`warm_start`, `orthogonalization_epsilon`, `batch_same_shape`); zero or
rank-deficient gradients give zeros, never NaN. Its matrix view suits
JAX/Flax layouts (out-features last): a leaf is
`(prod(shape[:-1]), shape[-1])`, so an HWIO conv kernel `(3, 3, Cin, Cout)`
is a `(9·Cin, Cout)` matrix. `matrix_view="first"` is torch's
`(shape[0], rest)`, for torch-layout weights; on Flax weights it leaves
every conv kernel with kh ≤ 4 dense (a `(kh, kw·Cin·Cout)` matrix cannot
save 2× at rank 2; on the ResNet-18 of `experiments/models.py`, all 20),
where the default compresses them all.
`jaxcomm.compressors.powersgd.leaf_plan(params, rank)` lists every leaf:
compressed or dense, and why (1-D, or `(a+b)·r·rate >= a·b`).

## Conventions shared by every compressor

These hold for everything built on `jaxcomm.compress`.

- **Error feedback** (`error_feedback=True` for sparsifiers): `p = g + e`,
  send `C(p)`, keep `e = p − C(p)`. The residual is one extra copy of the
  model, in float32 for bf16/fp16 params (`state_dtype=None`), in the
  params' dtype otherwise: a bf16 residual would round `e + g` to a
  neighbour of `e` and lose small gradients. `g + e` is formed in float32,
  rounded to the gradient's dtype only to be encoded, and the residual
  keeps the rest (tested: sent + residual = Σ g). `state_dtype=jnp.bfloat16`
  saves memory. DGC's momentum and velocity and PowerSGD's residual follow
  the same rule (`state_dtype=` on `dgc`, `dgc_sgd`, `powersgd`).
- **Small leaves** (`min_size`, default 1024 entries) are averaged densely
  in their own dtype, as torch's PowerSGD hook does for biases. They travel
  in the payload's collective, so a step is one collective per bucket, as
  torch DDP puts every gradient of a bucket in one: summed payloads (casts'
  psum, PowerSGD's P) share the all-reduce where the dtype matches; an
  all-gathered payload (top-k, threshold, DGC, sign codes, the quantisers,
  casts as uint16 words) carries them as raw words, each worker adding the
  n copies in worker order (as XLA:CPU's all-reduce adds); the two-phase
  exchange carries their chunks in its all-to-all and the chunk sums in its
  all-gather (a ring all-reduce's bytes). Gathering adds
  `(n-1)(n-2)/n` times their bytes on n workers (none on 2), so they go
  apart in an all-reduce of their own where that exceeds 64 KiB
  (`exchange.dense_rides`: one collective's latency times the bandwidth is
  more on every link in view). The wire report and the compiled HLO show
  which (`jaxcomm.accounting.wire_report`, `collective_count`).
- **`scope="global"`** (top-k) selects over all compressible leaves
  together.
- **Randomness**: the factory's `key` lives in the state and is split every
  step; per-worker draws fold in the axis index; shared draws (random-k's
  shared indices) are made identical by one 8-byte all-reduce.
- **Non-finite gradients (the NaN rule)**: if any worker's gradient holds
  NaN/Inf, the update is non-finite on *every* worker, and state that was
  finite stays finite (residuals, DGC's u/v, PowerSGD's Q are left as they
  were that step; `state.nonfinite` counts such steps). A compressor may
  not send the bad entry (random-k, 2-bit, TernGrad, sign majority would
  drop it), so each worker adds a flag to its exchange: one byte in the
  all-gather, or one entry in the psum's dtype, in the first bucket: no
  extra collective, and counted in the wire bytes. Casts and dense means
  carry NaN/Inf by themselves and send no flag.
- **Skipping such steps**: wrap the chain in `jaxcomm.skip_nonfinite(...)`,
  not `optax.apply_if_finite`. The latter decides on each worker from its
  own gradient and runs the exchange inside a `lax.cond`, so with a NaN on
  one worker the others enter a collective alone: a type error under
  `shard_map`, a rendezvous abort under `pmap`, a hang on NCCL.
  `skip_nonfinite` runs the exchange on every worker and decides from the
  update after it, which the NaN rule makes the same everywhere: the step
  is skipped (zero update, inner state kept, counters included) on all
  workers. For `local_sgd`/`diloco`, whose updates are per worker between
  synchronisations, pass `axis_name=` to agree the decision with one 4-byte
  all-reduce, so the sync schedule stays in lock-step.
  `max_consecutive_errors=` works as in optax:

  ```python
  tx = jaxcomm.skip_nonfinite(optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1)))
  ```
- **Bad input** raises a `ValueError`/`TypeError` that names the argument
  and the allowed range: ratio outside (0, 1], non-float cast dtype, an
  axis name not bound by `shard_map`/`pmap`/`vmap`, integer or bool leaves,
  state from another transform (each compressor's state has a class of its
  own, e.g. `TopKState`, `RandomKState`, so top-k refuses random-k's state;
  variants of one factory, e.g. `topk` and `topk(scope="global")`, share a
  layout and may exchange states).
- **dtypes**: updates come out in the dtype they came in (fp32 and bf16 are
  tested).

# Per-leaf policies

Compose with `optax.partition`; byte accounting follows the composition:

```python
tx = optax.chain(
    optax.partition(
        {
            "sparse": jaxcomm.topk(0.01, axis_name="data"),
            "half": jaxcomm.cast(jnp.bfloat16, axis_name="data"),
            "dense": jaxcomm.allreduce(axis_name="data"),
        },
        labels,  # e.g. matrices -> "sparse", embeddings -> "dense", rest -> "half"
    ),
    optax.adam(1e-3),
)
jaxcomm.wire_bytes(tx, params, n_workers=8)
```

# Two-level (hierarchical) exchange

On a 2-D mesh `("node", "local")`, average densely inside a node and send
only the compressed payload between nodes:

```python
tx = jaxcomm.hierarchical(jaxcomm.topk(0.01, axis_name="node"), inner_axis="local", inner_size=8)
jaxcomm.wire_bytes(tx, params, {"node": 4, "local": 8}, axis="node")  # slow-link bytes
```

With `inner_size` each worker of a node reduce-scatters, compresses and
exchanges a 1/`inner_size` shard of every leaf, then all-gathers: a node
puts on the slow links what one worker would send for the whole model.
Without `inner_size`, the node mean is compressed whole on every worker
(keeps leaf shapes, for PowerSGD). Both levels are bucketed.

# Two-phase exchange: a compressed all-reduce that scales

Quantisers whose payloads cannot be summed compressed (int8, QSGD, 1-bit,
EF-sign, 2-bit, TernGrad without a shared scale, the fp16/bf16 cast's
`accumulate="all_gather"`) all-gather every worker's payload: a worker
receives (n−1)·s bytes and decodes n payloads, so the saving shrinks as
workers are added (int8 moves as much as dense fp32 at n = 8). With
`exchange="two_phase"` (on every quantiser factory and `compress`):

1. each worker cuts its `g + e` into n chunks and compresses each; one
   all-to-all (per bucket) gives worker j every worker's chunk j;
2. worker j decodes and averages chunk j once, adds its **server residual**
   for that chunk, compresses the result, and keeps what was not sent
   (error feedback on both sides, DeepSpeed's compressed all-reduce); the
   codec's `server_codec()` compresses it, the codec itself except for
   2-bit, whose fixed τ would leave most chunk means (steps of τ/n) unsent:
   its server rounds to the nearest of {−a, 0, +a}, a = mean |s| of the
   chunk, and sends a as one float32;
3. one all-gather of the compressed chunk means; every worker decodes them.

A worker sends 2(n−1)/n·s: the ring bound at the compressed size, and
decode work no longer grows with n. Two-phase stays at the codec's ratio of
the dense ring for every n (int8 0.252, EF-sign 0.031, bf16 0.500), where
the all-gather passes dense fp32 at n = 8 (int8) and n = 64 (1-bit): byte
counts, tabulated for n = 2 to 64 in `experiments/results/two_phase.json`.

## The default, `exchange="auto"`, is chosen by bytes

On `compress` and every quantiser factory: when the update is traced and
the axis size n is known, jaxcomm prices both exchanges for this codec and
tree (`jaxcomm.accounting.exchange_traffic`: the all-gather receives
(n−1)·s(d), two-phase sends 2(n−1)·s(⌈d/n⌉), each chunk's scales and word
padding included) and takes the smaller; a tie goes to the all-gather (one
compression, no server residual). So: the all-gather on 2 workers, for
every codec; two-phase on more, except where leaves are so small that the
chunks' scales and padding outweigh the saving (EF-sign on a 64-entry
leaf, at any n). Sparse codecs stay on the all-gather under "auto"
(two-phase would change what they select). Summed payloads (dense,
`cast(..., accumulate="psum")`, TernGrad with a shared scale, majority
vote, PowerSGD) keep their one all-reduce: for `cast(float16)` on XLA:CPU
that is the fp16-rounded payload widened to an fp32 all-reduce
(`Cast.widened()`).

The default follows the bytes: jaxcomm is for slow links, where the link
sets the step time. Two-phase encodes and decodes twice; where compute
bounds the step (a fast LAN, few workers sharing cores) try
`exchange="gather"`.

**Casts choose by backend.** `cast`'s default `accumulate="auto"` is the
psum on GPU/TPU (native 16-bit) and the uint16 words on CPU
(`"all_gather"`: the all-gather on 2 workers, two-phase from 3, summed in
fp32), because a 16-bit psum moves 4 bytes per entry on XLA:CPU and so
saves nothing over dense fp32. The choice is made from
`jax.default_backend()` when the transform is first initialised or traced,
not when it is built, so a factory called before
`jax.distributed.initialize` does not start JAX. Benchmarks that compare
against the 16-bit psum pin `accumulate="psum"`.

## The server residual

The server residual is `state.server` (the params' tree; each worker uses
its own chunk; checkpointed with the rest). It exists where two-phase can
run: with `"two_phase"`; with `"auto"` when `init` sees the axis (under
`shard_map`/`pmap`, or in `jaxcomm.wire_bytes`) and two-phase wins at that
n; an `init` outside the axis allocates it when two-phase wins at some n
for the tree. A state without it where two-phase runs (e.g. a checkpoint
written with `"gather"`) is refused with an error: resume it with
`exchange="gather"`. Odd sizes and leaves smaller than n are zero-padded.

`python -m experiments.bench.two_phase` (`--part=traffic|decode|accuracy`)
writes `experiments/results/two_phase.json`; the digits config's variants
`int8` (gather), `int8_2p`, `int8_auto`, `ef_sign_2p` and `bf16_words` run
the exchanges over real processes (below); the cast runs are in
`experiments/results/cast_words.json`.

## Compressed reduce-scatter for sharded (ZeRO/FSDP-style) training

`exchange="reduce_scatter"` stops after phase one: the update of each leaf
is this worker's shard of the worker mean along the leaf's first dimension
(`(shape[0] // n, *shape[1:])`, worker j's rows; the first dimension must
be a multiple of n, else a `ValueError` names the leaf), with error
feedback on the sender; small leaves go through a dense reduce-scatter. A
worker sends (n−1)/n of its compressed gradient. Under `shard_map` with
params sharded `P("data")` on their first dimension: all-gather the shard,
take the local gradient, and the transform hands back the gradient of the
shard (tested against `lax.psum_scatter`).

`jaxcomm.fsdp(loss_fn, tx, mesh, weights=..., gradients=...)` does all of
that for you: parameters and optimizer state sharded as one flat vector
(1/n per worker), the weights all-gathered as float32, bfloat16 or int8
with block scales (ZeRO++'s qwZ), the gradient reduce-scattered densely or
through a transform built with `exchange="reduce_scatter"` (e.g. int8 with
error feedback, qgZ-like); `replica_axis` runs the DiLoCo family across
replica groups whose inner steps are sharded. Its module docstring
(`jaxcomm.parallel.fsdp`) gives the layout, the bytes and what it refuses
(optimizers that reduce over the parameters); `tests/test_fsdp.py` holds it
bit-equal to a hand-written `shard_map` FSDP step, on 8 devices and on 2
processes.

# 1-bit Adam

`jaxcomm.onebit_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8,
warmup_steps=100, axis_name=..., weight_decay=0.0, exchange="auto")`
(Tang et al. 2021, arXiv:2102.02888) is an optax optimizer (it returns the
parameter updates, like `optax.adam`):

- warm-up, `t < warmup_steps`: ḡ = dense mean of the gradients;
  m ← β1·m + (1−β1)·ḡ, v ← β2·v + (1−β2)·ḡ²;
- then v is frozen; each worker forms m_w = β1·m + (1−β1)·g_w and the
  momentum is averaged by the 1-bit exchange, m ← C(m_w): scaled sign
  (mean|x|·sign(x), the least-squares scale; DeepSpeed uses ‖x‖₂/√d) with
  worker and server error feedback on the two-phase exchange;
- update −lr·(m/(√v + ε) + wd·p), without bias correction, as the paper
  and DeepSpeed's `OnebitAdam`.

The paper warms up for about 15–25% of training. After warm-up a step moves
the 1-bit exchange's bytes: 1 bit per entry plus per-chunk scales on the
two-phase exchange, against dense Adam's 32 (`wire_bytes` gives the exact
figure for your tree).
Its update is identical on every worker but typed per worker under
`shard_map` (the frozen v is per-worker state): use `out_specs=P("data")`
for params, as `experiments/train.py` does, or `pmap`.

# 0/1 Adam

`jaxcomm.zero_one_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8,
var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678,
local_step_clipper=16, axis_name=..., weight_decay=0.0, exchange="auto")`
(Lu et al., ICLR 2023, arXiv:2202.06009; the rules of DeepSpeed's
`ZeroOneAdam`) is an optax optimizer. At step s = count + 1, with C̄(x) the
1-bit mean (scaled sign with worker and server error feedback on the
two-phase exchange, as 1-bit Adam), ḡ the dense mean, D = √v + ε:

- s ≤ var_freeze_step, variance step when s ≡ 0 (mod var_interval):
  ḡ by a dense all-reduce, m ← β1·m + (1−β1)·ḡ, v ← β2·v + (1−β2)·ḡ²;
  var_interval starts at 1 and doubles after every var_update_scaler (κ)
  variance steps, so they thin out exponentially;
- s ≤ var_freeze_step, the other steps: m ← β1·m + (1−β1)·C̄(g) (the
  gradient is compressed, as DeepSpeed does; m stays identical on every
  worker), v unchanged; update −lr·(m/D + wd·p);
- s > var_freeze_step, v frozen: each worker with its own g:
  m ← β1·m + (1−β1)·g, Δ = −lr·(m/D + wd·p), u ← u + Δ, Λ ← Λ + lr;
  a local step (no communication) applies Δ; a sync step,
  s ≡ 0 (mod local_interval), sends ū = C̄(u·D), sets m ← −ū/Λ and moves
  the params from the last sync point by ū/D (update ū/D − (u − Δ)), then
  u ← 0, Λ ← 0; local_interval starts at 1 and doubles every
  local_step_scaler steps up to local_step_clipper (H);
- the residuals are zeroed when v freezes; no bias correction.

Every schedule is computed in the jitted step from int32 counters in the
state, identical on all workers, so every worker decides alike whether to
communicate. A variance step moves dense Adam's bytes; a 1-bit step or a
sync moves the 1-bit exchange's; a local step moves nothing. Defaults are
DeepSpeed's; `var_freeze_step=100000` and `local_step_scaler=32678` are
meant for pre-training runs of several 100k steps (DeepSpeed puts
`var_freeze_step` at the end of the lr warm-up): scale them down for short
runs (about 15% and 10% of the steps). Differences from DeepSpeed: its
first call only sets up buffers and it freezes one step later; the sign's
scale is mean|x| (DeepSpeed ‖x‖₂/√d). A NaN on a communicating step keeps
every worker's state; on a local step only that worker's (no collective
can tell the others). As for 1-bit Adam, params and state are per worker
(local steps make them differ between syncs): `out_specs=P("data")` or
`pmap`.

# Honest accounting

Two views, held equal by the tests for every transform at n = 8:

- `jaxcomm.wire_bytes(tx, params, n_workers)`: what the algorithm sends,
  the operand bytes each worker contributes to collectives per step
  (all-reduce: the payload S; all-gather: its own piece). It traces
  `tx.update` abstractly, so it needs no devices, works for any n and for
  compositions. `jaxcomm.accounting.wire_report` lists each collective;
  `jaxcomm.accounting.traffic_bytes(report, n)` turns it into bytes sent
  with bandwidth-optimal algorithms (ring all-reduce 2(n−1)/n·S, all-gather
  (n−1)·s).
- `jaxcomm.accounting.collective_bytes(compiled)`: what the compiled
  program moves, the operand bytes of every all-reduce, all-gather,
  reduce-scatter, collective-permute and all-to-all in the optimised HLO.
- Both count collectives too: `jaxcomm.accounting.wire_count(tx, params,
  n)` and `jaxcomm.accounting.collective_count(compiled)` (each `Collective`
  carries `operands`, for HLO instructions XLA combined).

**Backend truth.** XLA:CPU promotes every bf16 collective to f32 (the HLO
shows `f32` and `to_apply=..._promoted`). Collectives that only move data
(all-gather, all-to-all, collective-permute) therefore carry 16-bit floats
as their uint16 bits (bit-identical, 2 bytes per entry on every backend:
top-k's bf16 values, two-phase chunks, bucketed bf16 leaves), and the
report counts a bf16 all-reduce at the 4 bytes per entry XLA:CPU moves
(`cast(..., accumulate="psum")`, bf16 leaves below `min_size`). So
`wire_report` equals `collective_bytes` to the byte on every backend.
`wire_report(tx, params, n, backend="gpu")` gives the bytes a GPU/TPU
cluster moves, from a CPU machine (the default, `backend=None`, is the
backend JAX runs on; `netsim.step_time_for`, the what-if tables and
`experiments.studies.compare`'s native wire use `"gpu"`). fp16 and
int8/uint8/uint16/uint32 payloads are moved as they are everywhere.

# Buckets: one collective per bucket

Over real processes each collective pays a fixed latency, and XLA:CPU
neither combines all-gathers nor sends the operands of a combined
all-reduce together. So every transform packs the payloads of all leaves
that go through the same collective into one flat buffer per bucket and
exchanges it with **one single-operand collective** (`jaxcomm.buckets`;
Horovod's Tensor Fusion, PyTorch DDP's buckets).

Option on every factory: `bucket_bytes: int | str | None = "auto"`
(keyword-only; `None`/0: one collective per payload array). `"auto"` is
25 MiB (PyTorch DDP's) on GPU/TPU; on CPU 1 MiB for the sums and 25 MiB for
the all-gathers and all-to-alls (`jaxcomm.buckets.default_bucket_bytes`),
resolved when the step is traced: on CPU, packing a dense gradient and
cutting it out again are copies that cost about what a loopback collective
of the same bytes costs, so only small payloads gain from sharing a sum,
while the gathered payloads are compressed and few buckets suit them
(`experiments/results/buckets.md`). A payload larger than a bucket goes as it
is (no copy). Buckets fill
from the last leaf to the first (backprop order). psum buckets hold one
dtype; all-gather buckets bit-cast mixed payloads (values + int32 indices,
codes + scales, bf16) to raw `uint8` bytes. Consecutive buckets are chained
by a data dependency so XLA's all-reduce combiner cannot merge them back
into one multi-operand instruction. Results are bit-identical to the
per-leaf exchange. PowerSGD puts all P's (with the dense leaves) in one
all-reduce per bucket, all Q's in one; TernGrad agrees its shared scales in
one bucketed `pmax`. `netsim.exchange_time` charges α per collective (and
per operand of a combined HLO instruction).

**Small sums across CPU processes.** Over gloo a small all-reduce cost about
3x an all-gather of the same operand (2 processes, 1.6 kB: 1.53 vs 0.48 ms
added to a step). So across CPU processes a sum whose operand times the
workers is at most `buckets.GATHER_SUM_BYTES` (256 KiB) is an all-gather and
a local add, worker by worker (`buckets.sum_over`; on 2 workers the gather
receives what a ring all-reduce does, on n workers n/2 times as much, hence
the bound). The wire report and the HLO then show an all-gather. Within one
process (fake devices) the all-reduce stays. On the digits MLP with 2
processes this took PowerSGD's step at 100 Mbit/s from +3.89 ms to +0.94
and +1.28 ms (two runs) over the step with no exchange
(`experiments/results/step_parts.md`).

**How a bucket is built.** Each bucket is written into one buffer with an
in-place `dynamic_update_slice` per payload, moving the payload's bits as
unsigned words of its width (`buckets.pack`), not with `jnp.concatenate`,
which XLA:CPU compiles into a slow loop for a few large leaves. A 16-bit
float payload is held to its 16 bits on both paths (XLA may otherwise keep
it in f32 up to the collective on one path and not the other), so bucketed
and per-leaf results stay bit-identical.

On fake devices in one process a combined all-reduce is cheap and the
bucket costs a copy, so measure bucketing across processes: `python -m
experiments.bench.buckets` times bucketed and per-leaf steps over 2
processes and counts the compiled collectives on 8 fake devices
(`experiments/results/buckets.json`; the 2-process table, generated:
`experiments/results/buckets.md`).

# Performance benchmarks

`python -m experiments.bench.compressors` times one jitted update (memory
add, encode, exchange, decode, residual update) under `shard_map` on 8 fake
CPU devices, divided by the time of a gradient copy (`x * 2.0`) in the same
run, and bytes divided by a dense fp32 ring all-reduce; it prints the table
and writes JSON (`--out`); `--tree resnet18` (or `gpt2`) uses model-shaped
trees. Compare ratios within a column, not absolute seconds. By structure:
on XLA:CPU the psum cast is a convert, an f32 all-reduce and a convert back
(more than dense; on GPU/TPU a native bf16 all-reduce); the all-gather
codecs decode all n payloads on every worker, O(n·d) work, so they pay off
only when the network is the bottleneck, or with the two-phase exchange;
the psum-able codecs (`sign_majority`, `terngrad` with a shared scale,
PowerSGD, shared-index random-k) decode once.

`python -m experiments.bench.floor` times the sparsifiers the same way in
interleaved rounds, in two layouts (8 fake devices x 4M entries, and one
device per core): exact top-k, threshold with and without error feedback,
per leaf, the library at an earlier git revision and the selection
threshold replaced (both loaded from git), and the passes over the
gradient of such a step without any selection work (read g + e to choose,
read them again for the residual, write the update), and the same in the
order with fewer bytes (write p = g + e, read it back to choose, write the
update). It states the targets they meet (`experiments/results/floor.md`).

## The threshold selection

`threshold` is the fast sparsifier: one fold of the gradient and a top-k
over 4k candidates instead of all d entries. The entries fall into m classes
p[j], p[j+m], p[j+2m], …, m a prime >= 2k; folding the (d/m, m) view, 8 row
slices a level, gives each class's largest and runner-up, and the k largest
of these 2m candidates that reach a sampled threshold are sent (k slots,
top-k's wire). The threshold is a sort-free exact k-th largest of a
prime-stride sample (about 1%, made denser where fewer than 32 sampled
entries would reach it), set at 1.25× the sample's top-ratio count so that
it rarely cuts into the true top-k. The k-th largest candidate is found in
the same bisection loop over bit patterns, and the candidates at or above
both are compacted into the slots: no sort and no `lax.top_k` anywhere. A
prime period spreads mass held in a few rows or columns of a matrix over
distinct classes; a class loses only its third and later entries of the true
top-k (about 1.6% of them on i.i.d. entries). m is chosen for d when the
update is traced: of the 17 smallest primes >= 2k not dividing d, the one
whose worst band of adjacent columns, over every view of the leaf as rows,
keeps the most among the candidates. The choice is deterministic (every
worker picks the same m). What is not sent waits in the residual.
`jaxcomm.compressors.sparse.threshold_usage(grads, state.residual,
ratio=...)` returns the slots a step fills per leaf; `experiments.bench.threshold_fill`
measures the share of the true top-k sent (`results/threshold_fill.json`).

# Experiments: configs, launcher, resume

`experiments/main.py` parses flags only and calls
`train.train_and_evaluate(config, workdir)`. Each config file's docstring
gives its exact command and the result to expect.

```bash
python -m experiments.main --config experiments/configs/digits_mlp.py --workdir runs/digits
python -m experiments.main --config experiments/configs/digits_mlp.py:powersgd --workdir runs/psgd
python -m experiments.main --config experiments/configs/cifar_resnet.py --workdir runs/c10 \
  --config.data.name=cifar10 --config.data.dir=PATH/cifar-10-batches-py
```

| config | model, data | method |
|---|---|---|
| `digits_mlp.py` | MLP 128, scikit-learn digits | top-k 1% + EF, SGD |
| `char_transformer.py` | 2-layer decoder, stdlib source bytes | PowerSGD r=4, Adam |
| `cifar_resnet.py` | ResNet-8, synthetic CIFAR-shaped | top-k 1% on kernels, SGD+momentum |

`digits_mlp.py`'s variants (`:dense`, `:bf16`, `:powersgd`, `:local_sgd`,
…) are listed in its docstring. Components are picked by name:
`config.compressor.name` / `.kwargs` become
`getattr(jaxcomm, name)(**kwargs, axis_name="data")` (a `key` is added when
the factory takes one); `config.policy="matrices"` uses `optax.partition`
(compressor on matrices, dense all-reduce on the rest);
`config.wrapper.name` is `none`, `accumulate`, `local_sgd` or `diloco`. Bad
values (unknown names, a ratio outside (0, 1], a missing CIFAR directory)
raise an error naming the config key before any data is read or anything
compiled. The step runs under `jax.shard_map` over a `("data",)` mesh of
all devices (8 fake CPU devices without accelerators);
`config.steps_per_call` steps run in one jitted `lax.scan` with donated
state, and each worker draws its batch on device.

**Resume.** orbax saves params, BatchNorm statistics, the whole optimizer
state (residuals, PowerSGD Q, PRNG keys, counters) and the step every
`config.checkpoint_every` steps. The step is also the data position:
batches are a pure function of (seed, worker, step). Running again with the
same `--workdir` resumes from the latest checkpoint, bit-identical to an
uninterrupted run (`tests/test_train.py`). Resuming with another number of
workers is refused with an error naming both counts. So is a workdir trained
with another method or model: its checkpoints are intact, and the error names
the leaves and config keys that differ (each checkpoint records its config in
`jaxcomm_config.json`); resume with that configuration or use a fresh
`--workdir`. Nothing is moved aside for it.

**Divergence.** A run whose training loss or state turns NaN/Inf stops with
`NonFiniteError` (exit status 1), saving nothing non-finite; the message names
the step, the last good checkpoint and the fixes (a lower learning rate,
`jaxcomm.skip_nonfinite`, or `--config.on_nonfinite=continue`, which trains
on; non-finite states are still never checkpointed). `metrics.jsonl` is strict
JSON: NaN/Inf are written as `null`. A `--config.KEY` the config lacks is
refused with close matches and the keys available; the learning rate must be
finite and > 0 and `--workdir` writable, both checked before data is loaded.

**Checkpoint integrity.** Each process writes
`checkpoints/<step>/jaxcomm_checksums.p<i>.json`, the SHA-256 of every
shard it saved. On resume the newest checkpoint is verified (every shard
against its checksum, every float leaf finite); one that fails or cannot be
read is named in a warning, moved to `corrupt_checkpoints/<step>.<time>`,
and the next older one is tried; if none is usable the launcher stops with
an error listing why each failed. A state holding NaN/Inf is not saved, so
`max_to_keep=2` never rotates out the last good checkpoint.

**Outputs in the workdir.** `metrics.jsonl`, one line per eval (step,
losses, accuracy, cumulative wire bytes per worker, simulated communication
time at `config.netsim.gbps`); `metrics.png`; `checkpoints/`.

**The comparison job.** `python -m experiments.studies.compare` trains a
label-skewed digits MLP with ten methods (variants of
`experiments/configs/digits_compare.py`, the method registry) on 8 simulated workers and reports
accuracy, bytes per step and the time to target at 0.01–10 Gbit/s (measured
compute plus `jaxcomm.netsim` communication for the bytes GPU/TPU move;
`--wire=xla_cpu` for XLA:CPU's); `--noquick` runs the longer preset; it
writes `compare_out/compare.json` and `.png`. `python -m experiments.bench.sync_sweep` compares
the schedules of "Less frequent communication" the same way.

# Several processes and real links

Everything above also runs across processes: the same transform under the
same `jax.shard_map`, over a mesh whose devices belong to several
`jax.distributed` processes (gloo collectives on CPU; NCCL/TPU unchanged).

```python
info = jaxcomm.distributed.initialize()  # first; args, JAX_* env vars or SLURM
mesh = jaxcomm.distributed.global_mesh("data")  # every device of every process
batch = jaxcomm.distributed.shard_rows(per_worker_batches, mesh, "data")  # own rows only
```

`jaxcomm.distributed` is the only module that knows about processes.
`initialize` takes coordinator / count / id from its arguments, from
`JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, or from
SLURM (`SLURM_NTASKS` / `SLURM_PROCID` / `SLURM_STEP_NODELIST`), and selects
gloo for CPU collectives; `shard_rows` turns host data with a leading worker
axis into a global array, each process passing only its rows
(`jax.make_array_from_process_local_data`); `local_row` and `gather` go back.
Start-up failures that JAX reports by aborting from C++ become clear errors:
a coordinator that does not resolve (`ValueError`) or cannot be reached
within `timeout_s` (`TimeoutError`), processes started with different
counts or devices per process (`ValueError` on every process), and a
process that never comes (exit status 3 from a watchdog, not a hang).

## Local processes: `experiments/launch.py`

```bash
python -m experiments.launch --processes=2 --devices_per_process=2 -- \
  python -m experiments.main --config=experiments/configs/digits_mlp.py --workdir=runs/mp
python -m experiments.launch --processes=4 --rate=100mbit -- \
  python -m experiments.main --config=experiments/configs/digits_mlp.py:powersgd --workdir=runs/mp4
```

It starts N processes of any command with M fake CPU devices each, sets the
three variables, prefixes each process's output with `[p0]`, `[p1]`, …, and
fails fast: when one process dies it stops the others and exits with its
status. In `experiments.main` only process 0 evaluates and writes metrics;
every process saves its own checkpoint shards. `metrics.jsonl` gains
`train_s` (seconds inside the compiled training calls) and `compile_s`.

**On a GPU cluster** no launcher is needed: run the same command once per
host (e.g. `srun --nodes=4 --ntasks-per-node=1 python -m experiments.main
...`), or set `JAX_COORDINATOR_ADDRESS=host0:12355 JAX_NUM_PROCESSES=4
JAX_PROCESS_ID=i` on host i. `--workdir` must be on a file system every
host can write.

## Shaped links: the network lab (`--rate`)

With `--rate=10mbit|100mbit|1gbit` the launcher runs each process in its
own network namespace (`experiments/netlab/`), joined by veth pairs through
a bridge in a namespace of its own (the root namespace is not touched),
every egress shaped with `tc qdisc … tbf` on both sides, like a switch with
full-duplex ports. Everything is torn down on exit, on an exception and on
SIGINT/SIGTERM/SIGHUP; `python -m experiments.netlab down` removes what a
SIGKILLed run left. It needs root and iproute2 (`python -m experiments.netlab
check` says what is missing). The lab shapes bandwidth only; latency stays
in `jaxcomm.netsim`. Link settings: tbf burst max(32 KiB, 2 ms at the rate),
queue limit max(1 MiB, 4 bursts, 100 ms at the rate), segmentation offload
off at ≤ 100 Mbit/s (64 KiB packets would overflow the queue).
`python -m experiments.netlab probe` measures the utilisation a dense
all-reduce reaches (`experiments/results/netlab_utilisation.json`).

**Not every collective reaches the all-reduce's rate.** `python -m
experiments.bench.collectives --out=experiments/results/collectives.json`,
run under the launcher, measures all-gathers and all-to-alls against the
fp32 all-reduce in the same run. On gloo some take longer than their bytes
predict, so halving the bytes can save less than half the time;
`jaxcomm.netsim` and the `exchange="auto"` rule count bytes only.

## Fault tolerance

**Preemption.** SIGTERM (or Ctrl-C) to the launcher sends SIGTERM to every
process; `experiments.main` takes it as JAX's preemption notice: every
process saves a checkpoint at the same step, process 0 prints `preempted
(SIGTERM) at step N`, and they exit. The launcher sends SIGKILL after
`--stop_grace_s` (60 s; a second signal kills at once) and exits with 128 +
the signal. The same command again resumes. On a cluster, SIGTERM to every
process does the same. When a process dies, a survivor's failed collective
makes it exit at once with a message, instead of waiting in
`jax.distributed`'s shutdown barrier and aborting. (A survivor that was
inside a checkpoint's save barrier when its peer died still waits for JAX's
heartbeat timeout.) The DiLoCo family needs floating-point params: an
integer or bool leaf raises `TypeError` naming it (leave such leaves out with
`optax.partition` / `optax.masked`).

Checkpoints become visible only when complete. `tests/test_distributed.py`
runs 2 processes and `kill -9`s one after the step-100 checkpoint: the
launcher stops the other and exits 137; the same command again resumes
from the latest complete checkpoint, and the final state (params,
residuals, keys, counters) equals an uninterrupted run's bit for bit.
Another split of the same number of workers (1 process × 4 devices ↔ 2 × 2)
resumes, since the state is per worker; another number of workers is
refused (jaxcomm does not merge or split error-feedback residuals). On the
same global data, 2 processes × 2 devices and 1 × 4 give bit-identical
params for top-k (payloads decoded in worker order everywhere) and params
equal to float32 rounding for dense all-reduce and PowerSGD (gloo and XLA
sum in different orders).

**Surviving a lost replica** (the DiLoCo family, `jaxcomm.ElasticDiLoCo`,
the `ft` extra: torch and torchft). Each replica group is its own JAX
program; only the outer exchange goes through torchft's Manager and its
gloo process group, which re-forms the quorum every round. A replica killed
between syncs is dropped and the survivors commit the next round without
it; killed inside the outer all-reduce, the survivors' round is rolled back
(params return to the last anchor, never half-applied); a restarted replica
heals from a live peer (params, inner and outer optimizer state, anchor) and
is bit-equal to them from then on. JAX's own fault tolerance on CPU cannot
heal a restarted process or survive losing process 0, hence torchft (its
module docstring says more). `python -m experiments.elastic_demo` runs it
with a kill and a restart; `tests/test_elastic.py` tests both kinds of kill.

## Time to accuracy on shaped links (`experiments/studies/netstudy.py`)

```bash
python -m experiments.studies.netstudy --processes=2,4   # as root
python -m experiments.studies.netstudy --report          # tables, experiments/results/netstudy.png
python -m experiments.studies.netstudy --repredict       # redo netsim's predictions of stored cells
python -m experiments.studies.netstudy --rerun=wide_mlp/2/dense   # measure some cells again
```

Every cell is a real run (2 or 4 gloo processes, shaped by tbf or on
loopback) of `digits_mlp` or `wide_mlp`, timed by `train_s` to dense
loopback's final accuracy minus 1 point; cells too slow to run in full
measure `--probe_steps` steps and multiply by the steps the method needed on
loopback (the trajectory does not depend on the link); `jaxcomm.netsim`,
calibrated on loopback, predicts each step time. Results in
`experiments/results/netstudy.json`, tables in `netstudy.md` beside it. One
seed per cell; the LM study (`experiments/studies/lm.py`) runs several and
follows the rules of `experiments/studies/verdict.py`.

# Is compression worth it here? `jaxcomm.auto` and `experiments.advise`

Whether a compressor pays depends on the link, the model and the backend:
on a fast link its encode and decode cost more than the bytes it saves.
`jaxcomm.auto` settles it on your own mesh, once, before training:

```python
mesh = jax.make_mesh((jax.device_count(),), ("data",))
tx = optax.chain(jaxcomm.auto(params, mesh, "data", warmup_steps=100), optax.adamw(1e-3))
```

It compiles one small `shard_map` program per candidate
(`jaxcomm.policy.DEFAULT_CANDIDATES`: dense, bf16 words, PowerSGD rank 2
and 4, int8 and top-k 1% with error feedback), each drawing a per-worker gradient
shaped like `params` and exchanging it, plus a baseline that exchanges
nothing; a candidate's cost is its time minus the baseline's (the slowest
process's, so every process chooses alike), timed in rounds, each in a fresh
order. The cheapest wins, but a compressed candidate must beat dense by
`margin` (default 10%: a tie goes to dense), must have done so in at least
`min_wins` of the rounds (default 80%: one lucky round does not choose) and
may not compress more than `max_ratio`; `warmup_steps` runs the dense mean
first. The table is printed; `jaxcomm.policy.choose` returns it as
a `Choice` (`choice.drifted(step_s, compute_s)` says when a measured step
left the prediction by more than 20%: call `choose(..., refresh=True)`), and
`choose(..., costs=...)` decides from costs measured before. The harness's
`compressor.name="auto"` records the costs and their rounds in
`workdir/auto_choice.json`, and a resumed run decides from them (the
checkpoint's state layout is the choice's).

```bash
python -m experiments.advise --config=experiments/configs/lm_shakespeare.py
python -m experiments.launch --processes=2 --rate=10mbit -- \
    python -m experiments.advise --config=experiments/configs/digits_mlp.py
```

prints the calibrated link (`jaxcomm.calibrate`: alpha and bandwidth per
collective kind), the step with no exchange, each candidate's measured cost,
alpha-beta time, predicted step time and the recommendation with its reason.
The predicted step is the no-exchange step plus the larger of the measured
cost and the alpha-beta time (`experiments.advise.predicted_step`): a short
timed program can beat the link's sustained rate (a `tbf` link passes its
burst at line rate), a training step cannot. Its prediction is of
training's *median* step: the no-exchange step and each cost are the median
of their samples
(`policy.measure(..., statistic="median")`), where `auto` compares the least
(a choice wants the noise out) and asks a compressed candidate to have beaten
dense by the margin in at least `policy.MIN_WINS` (80%) of the timed rounds
(`policy.wins_over_dense`, the `wins` column): on 2 processes over loopback
the digits MLP's candidates differ by less than the noise (dense's median
training step 0.96 ms, its least 0.50 ms; top-k 1.00 and 0.62), and the order
of their least costs changed from run to run. Two processes sharing a small machine stall
each other now and then (on the digits MLP a call of 25 steps took 11 to 100
ms on loopback), so the mean step, which time to target pays, can sit well
above the median. `experiments/bench/auto.py` runs dense, `auto` and fixed
methods side by side on shaped links and checks the predictions against the
measured median steps (`experiments/results/auto.md`); the training loop
records each call's seconds (`call_s` in `metrics.jsonl`).

The accuracy guard is yours to set: `auto` picks by time, and a compressor
that is fast on your link may not reach your model's quality. Error feedback
is on in every lossy candidate; beyond it, `max_ratio` caps how much a
candidate may compress. Set it from a quality run of your model (a short
loopback study is enough): on the LM of `experiments/results/lm_study.md`
(AdamW) the every-step exchanges that reached dense's target compress at most
31x (PowerSGD rank 4), and those compressing more missed it (1-bit signs
32x, sampled top-1% 50x, PowerSGD rank 2 58x), so its `auto` config sets
`max_ratio=32` and `python -m experiments.advise` applies an `auto`
config's `margin`, `max_ratio` and `min_wins` to its recommendation. On the
MLPs, whose SGD runs reached the target with top-k 1% and PowerSGD rank 2,
no cap is set.

Where a small model's compressed step goes (the step with no exchange, the
codec, the collectives, the rest) is measured by
`python -m experiments.bench.step_parts` (`experiments/results/step_parts.md`).

# Side by side with PyTorch DDP comm hooks (`experiments/bench/peers.py`)

```bash
pip install -e ".[peers]" --extra-index-url https://download.pytorch.org/whl/cpu   # torch, CPU
python -m experiments.bench.peers                      # all parts on loopback
python -m experiments.bench.peers --part=peers --rates=100mbit,1gbit   # shaped links (root)
python -m experiments.bench.peers --report             # tables from experiments/results/peers.json
pytest -q tests/test_peers.py                          # skipped without torch
```

torch is an optional extra (`peers`), never a core dependency; without it
the benchmark runs only the part that needs no torch. The JSON keeps every
command line. Parts (`--part=`): `overhead` (on 8 fake devices,
`jaxcomm.allreduce()` against a hand-written `lax.pmean` step; identical
params); `peers` (DDP's all-reduce, `fp16_compress_hook`,
`bf16_compress_hook` and `powerSGD_hook` rank 2 against `allreduce()`,
`cast(float16)`, `cast(bfloat16)` and `powersgd(2, start_iter=2)`, over real
gloo processes, one device and one thread each, on the same MLP and
ResNet-18 built alike in both, `experiments/bench/torch_peers.py`); `agree`
(torch's hook and `powersgd(matrix_view="first")` from the same Q, at world
size 1 and 2); `castcost` (bare 16-bit all-reduces). On CPU DDP refuses a
hook *named* `bf16_compress_hook` without NCCL (the benchmark registers it
under another name), and `powerSGD_hook` needs one DDP bucket on gloo.

What agrees: outputs and Q to float32 rounding (the hook orthogonalises Q
before `P = MQ`, which leaves P̂ unchanged), the dense steps bit for bit,
the bytes exactly. The residuals agree **as a worker mean only**: torch's
hook keeps `M_w − P̂ Q̄ᵀ`, jaxcomm the paper's local `M_w − P̂ Q_wᵀ`; the
next step's output depends only on the mean (`tests/test_peers.py`).
jaxcomm's 16-bit casts leave leaves below `min_size` in fp32, so its bytes
exceed torch's, which casts the whole bucket, by those leaves.

**Why `cast(float16)` widens on CPU.** XLA:CPU's gloo communicator sums
`F16` in scalar software (half → float → half per element), slower than
fp32 (`bench.peers --part=castcost`, in `experiments/results/peers.json`).
So on CPU `cast(float16)` rounds each worker's g/n to fp16 (the same values
as on GPU) and widens it to float32 for the sum (`Cast.widened()`; the wire
report says 4 bytes per entry; GPU/TPU keep the 16-bit all-reduce). The
bf16 psum `bench.peers` pins also moves 4 bytes per entry on CPU, where
torch's gloo moves 2.

# When is the network the bottleneck? (`jaxcomm.netsim`)

`jaxcomm.netsim` is a pure-Python alpha-beta cost model (it does not import
JAX): latency α per message, bandwidth B, payload S, n workers. It costs
collectives (ring and halving/doubling all-reduce, all-gather,
reduce-scatter, collective permute, parameter server with k shards,
hierarchical all-reduce, PowerSGD's two sequential all-reduces). It turns
them into an iteration time with bucketed overlap: bucket i's exchange
starts when its gradients are ready during the backward pass, and
encode/decode run on the compute stream. From that it gives the scaling
factor `SF = T_c / T_iter` and the compression ratio a link needs.

```python
from jaxcomm import netsim

nic = netsim.Link.from_gbps(10, latency_s=25e-6)  # Link(bandwidth_bps, latency_s)
cluster = netsim.Cluster(8, 8, intra=netsim.Link.from_gbps(1200, 5e-6), inter=nic)
st = netsim.step_time(4 * 25.6e6, cluster, compute_time=0.1, algorithm="hierarchical")
st.scaling_factor  # ResNet-50-sized fp32 gradient, 64 GPUs
netsim.required_compression(4 * 25.6e6, 0.1, cluster, 0.9, algorithm="hierarchical")
netsim.step_time_for(tx, params, cluster, 0.1)  # any transform, via wire_report
```

`exchange_time(report, n, link_or_cluster)` and `step_time_for_collectives`
accept any objects with `.kind` and `.nbytes`, such as the output of
`jaxcomm.accounting.wire_report`, so compositions of transforms are costed
exactly as they communicate. Conventions:

- `bandwidth_bps` is in bits/s.
- `Cluster.intra` is each GPU's bandwidth inside its node.
- `Cluster.inter` is a node's network interface, shared by its GPUs.
- A hierarchical all-reduce is reduce-scatter inside the node, then a ring
  between nodes, then all-gather inside the node.
- Every link is assumed used at its full rate; measured systems fall
  short of it, so the model is optimistic (`experiments/studies/netstudy.py`
  compares its predictions with measured step times).

## What-if tables

`python -m experiments.bench.whatif` sweeps SF against 1–400 Gbps for ResNet-50,
VGG-16, BERT-Large, GPT-2 1.5B and FasterRCNN with dense fp32, bf16 and each
compressor, tabulates the ratio needed for SF ≥ 0.9 (the question of Zhang
et al. 2020, "Is Network the Bottleneck of Distributed Training?",
arXiv:2006.10103) and DGC's step time on a FasterRCNN-sized model, and
writes PNG plots and `whatif.json`. It uses analytic byte formulas, or with
`--from_transforms` the `wire_report` of the real transforms. Its inputs
(flags, stored in `whatif.json`): 8 nodes × 8 GPUs, NVLink 1200 Gbps and
5 µs inside a node, 25 µs between nodes, hierarchical all-reduce, 25 MiB
buckets, backward pass 2/3 of the compute time T_c, full link utilisation.
The T_c per model are estimates for V100-class GPUs (FLOPs at half of peak;
FasterRCNN from Detectron2's model zoo), not figures from the papers. The
required ratio is sensitive to T_c: a shorter compute time needs more
compression for the same SF.

## Top-k over all-gather against a dense ring

With d entries, density ρ = k/d, value bytes v, index bytes i and dense
bytes per entry b, the code compares bandwidth terms:

    ratio(n, ρ) = (n−1)·ρ·d·(v+i) / (2·(n−1)/n · d·b) = n·ρ·(v+i) / (2·b)
    break-even  ρ* = 2·b / (n·(v+i))                      # = 1/n for v = i = b = 4

This is `netsim.topk_allgather_ratio` and `netsim.topk_break_even_density`,
plotted against n in `topk_break_even.png`. Latency is left out: the
all-gather sends n−1 messages, the ring 2(n−1). Top-k at 1% pays off only
below 100 workers, and 0.1% only below 1000; this is why sparse all-gather
schemes need far higher compression ratios than an all-reduce payload for
the same scaling factor.

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
  (`experiments/bench/overlap.py` measures both; results in
  `experiments/results/overlap.json`). `ov.wait_s` is the communication
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

# Notebooks

`colab/` holds three notebooks that import `jaxcomm` and `experiments` and
plot inline; each opens in Colab from its badge (its first cell installs the
package there) and runs on 8 simulated CPU devices or the runtime's TPU/GPU:
`01_quickstart.ipynb` (a top-k `shard_map` step on digits, bytes against
dense, `wire_bytes` against the compiled HLO),
`02_is_the_network_the_bottleneck.ipynb` (`jaxcomm.netsim` what-if, the
top-k break-even, measured against predicted step times from
`experiments/results/netstudy.json` when present) and
`03_error_feedback_dgc_powersgd.ipynb`. Locally: `pip install
-e ".[notebooks]" jupyterlab`. `tests/test_notebooks.py` executes all three
(with `JAXCOMM_QUICK=1`) and checks they are committed without outputs.

# Layout

    jaxcomm/
      protocol.py      the Compressor protocol, CompressorBase, CompressState and their checks
      core.py          compress(): its update in small stages (check state, step key, add
                       memory, group leaves, strategy, new state); re-exports protocol.py
      checks.py        the shared argument and state validators (check_int, check_float,
                       check_ratio, check_tx, ...); imports nothing of jaxcomm
      strategies.py    the exchange strategies with one signature: local, gather (psum or
                       all-gather, bucketed), two_phase, reduce_scatter
      ledger.py        the byte ledger: what a transform sends (Collective records)
      collectives.py   psum / all_gather / reduce-scatter / all-to-all / ppermute
                       wrappers that record to the ledger; as_varying, axis checks
      branches.py      typed_cond / typed_switch: lax.cond and lax.switch whose branches
                       are typed alike under shard_map
      buckets.py       tensor fusion: one collective per bucket of payloads
      exchange.py      ring all-reduce, two-phase exchange, compressed reduce-scatter,
                       hierarchical exchange
      compressors/     dense.py (allreduce, cast), sparse/ (topk, randomk, threshold: one
                       module each), selection.py (the threshold's strided-prime
                       selection), quantize.py (int8, qsgd, terngrad), sign.py (onebit,
                       ef_sign, sign_majority), twobit.py, blocks.py (bucket views and
                       the streamed decode they share), packing.py (bit packing), dgc/
                       (schedule, selection, transform, chain), powersgd.py
      sync/            accumulation (accumulate), averaging (local_sgd, diloco), delays
                       (delayed_averaging, stale), nonfinite (skip_nonfinite)
      loco/            the DiLoCo family: streaming.py (streaming_diloco, the
                       StreamingDiLoCo rule), overlap.py (Overlap: exchanges in a host
                       thread), sparseloco.py, muloco.py
      optim/           onebit_adam.py (1-bit Adam), zero_one_adam.py (0/1 Adam),
                       demo.py (DeMo)
      accounting.py    wire_bytes / wire_report / traffic_bytes; collective bytes in HLO
      netsim/          alpha-beta cost model (costs), step-time model (step), what-if
                       analysis (questions); Link and Cluster (links)
      calibrate/       per-kind alpha/beta: the fit and the model (model), measured on the
                       user's mesh (measure)
      policy/          auto / choose / measure: the exchange measured cheapest on the mesh
                       (timing, choice, transform)
      distributed.py   jax.distributed start-up, global mesh, per-process data
      parallel/        data_parallel / init_state: the data-parallel step helper (layout,
                       arguments: the batch and keys, step)
      divergence.py    which values of a traced step may differ between workers
      flax.py          the same for flax nnx (imports flax; optional)
      guide.py         this guide (a docstring only)
    experiments/       main.py + train.py (the harness's loop), optimizers.py (a config's optax
                       chain), checkpoints.py (checksummed orbax checkpoints) + configs/ (their
                       variants are the method registry); advise.py (is compression worth it here?);
                       digits.py (train.py's step on digits, any tx); examples/ (nnx and linen
                       loops); bench/ (benchmarks: timings, threshold_fill, whatif, sync_sweep,
                       overlap, auto, torch_peers: PyTorch DDP twins); launch.py, netlab/ (real
                       processes, shaped links); studies/ (the comparison job and its time axis, the
                       LM study, the MLP netstudy, verdict rules, generated tables); results/ (the
                       JSON behind every table)
    tests/             one module per jaxcomm module, test_registry.py (every public
                       transform), convergence, real processes, netlab, notebooks
    colab/             notebooks
"""
