r"""
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

"""
