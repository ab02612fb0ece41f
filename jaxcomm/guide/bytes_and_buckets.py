r"""
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
codes + scales, bf16) to the widest unsigned word they all split into (`uint16`
for a cast; `uint8` beside byte codes or the NaN flag's byte, as for top-k).
Consecutive buckets are chained
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
bucket costs a copy, so measure bucketing across processes: bucketed and
per-leaf steps over 2 processes, and the compiled collectives on 8 fake
devices, are in `experiments/results/buckets.json` (the 2-process table,
generated: `experiments/results/buckets.md`; the command is in the
`experiments` package's docstring).

# What an update costs to compute

By structure: on XLA:CPU the psum cast is a convert, an f32 all-reduce and
a convert back (more than dense; on GPU/TPU a native bf16 all-reduce); the
all-gather codecs decode all n payloads on every worker, O(n·d) work, so
they pay off only when the network is the bottleneck, or with the two-phase
exchange; the psum-able codecs (`sign_majority`, `terngrad` with a shared
scale, PowerSGD, shared-index random-k) decode once. The timings (one
jitted update against a gradient copy, and the sparsifiers against the
passes a step must make over the gradient) are benchmarks of the
`experiments` package.

"""
