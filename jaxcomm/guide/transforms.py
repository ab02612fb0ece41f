r"""
# The transforms

What goes on the wire per worker per leaf of d entries (fp32 gradients), and
through which collective:

- `allreduce()`: 4d bytes; all-reduce. The dense baseline.
- `cast(dtype=bf16 | fp16)`: 2d bytes; a 16-bit all-reduce on GPU/TPU
  (fp16: each worker sends g/n, so the sum cannot overflow; values below
  ~6e-8·n underflow, as with torch's fp16 hook), uint16 words summed in
  fp32 on CPU (see "Casts choose by backend" in
  `jaxcomm.guide.exchanges`).
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
  and local steps on schedules (see "0/1 Adam" in `jaxcomm.guide.compressed_adam`).
- `hierarchical(tx, inner_axis=, inner_size=)`: dense on the fast axis,
  `tx` on the slow axis; reduce-scatter / all-gather + `tx`.
- `ring_allreduce(x, axis_name)`: 2(n−1)/n·S bytes by `ppermute`
  (collective-permute); a reference implementation.
- `accumulate`, `local_sgd`, `diloco`, `delayed_averaging`, `stale`: see
  "Less frequent communication" (`jaxcomm.guide.less_communication`).
- `skip_nonfinite(tx)`: skips a step with a non-finite update on every
  worker alike (see the NaN rule in `jaxcomm.guide.conventions`).
- `compress(compressor, ...)`: the generic path every compressor runs on.

The quantisers (`int8`, `qsgd`, `terngrad`, `onebit`, `ef_sign`, `twobit`)
and `cast` take `exchange=`: the default `"auto"` picks the all-gather or the
two-phase exchange by bytes for the number of workers n, the all-gather on a
tie (see "Two-phase exchange" in `jaxcomm.guide.exchanges`).

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
ratio=...)` returns the slots a step fills per leaf; the share of the true
top-k sent is measured in `experiments/results/threshold_fill.json`.
"""
