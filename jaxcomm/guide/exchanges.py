r"""
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
tree (`jaxcomm.strategies.exchange_traffic`: the all-gather receives
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

Measured: `experiments/results/two_phase.json` (traffic, decode, accuracy)
and `experiments/results/cast_words.json` (the cast runs); the commands,
and the config variants that run these exchanges over real processes, are
in the `experiments` package's docstring.

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

"""
