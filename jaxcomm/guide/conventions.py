r"""
# Conventions shared by every compressor

These hold for everything built on `jaxcomm.compress`.

- **Options**: a factory takes its codec's own arguments by name (`ratio`,
  `bucket_size`, ...) and the common options (`axis_name`,
  `error_feedback`, `min_size`, `key`, `scope`, `bucket_bytes`,
  `state_dtype`, `exchange`) as keywords, documented once in
  `jaxcomm.options.Options`. Each factory's docstring names the ones it takes
  and any default of its own; one it does not take, or a misspelled
  argument, is refused with a `TypeError` naming the factory
  (`jaxcomm.onebit(key=...)`: 1-bit SGD draws no random numbers).

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
  (`strategies.dense_rides`: one collective's latency times the bandwidth is
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

"""
