r"""
# Is compression worth it here? `jaxcomm.auto`

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
`choose(..., costs=...)` decides from costs measured before.

For a config's model on the current mesh, `experiments.advise` prints the
calibrated link, each candidate's predicted step time and `auto`'s choice
(the `experiments` package's docstring says how to run it and what its
prediction means).

The accuracy guard is yours to set: `auto` picks by time, and a compressor
that is fast on your link may not reach your model's quality. Error feedback
is on in every lossy candidate; beyond it, `max_ratio` caps how much a
candidate may compress. Set it from a quality run of your model (a short
loopback study is enough): on the LM of `experiments/results/lm_study.md`
(AdamW) the every-step exchanges that reached dense's target compress at most
31x (PowerSGD rank 4), and those compressing more missed it (1-bit signs
32x, sampled top-1% 50x, PowerSGD rank 2 58x), so its `auto` config sets
`max_ratio=32`. On the MLPs, whose SGD runs reached the target with top-k 1% and PowerSGD rank 2,
no cap is set.

Where a small model's compressed step goes (the step with no exchange, the
codec, the collectives, the rest) is measured in
`experiments/results/step_parts.md`.

"""
