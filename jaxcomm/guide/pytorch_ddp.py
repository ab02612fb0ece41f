r"""
# Side by side with PyTorch DDP comm hooks

The `peers` benchmark of the `experiments` package runs PyTorch DDP's comm
hooks and their jaxcomm twins on the same models over the same gloo
processes (torch is an optional extra, `peers`, never a core dependency;
`tests/test_peers.py` is skipped without it).

What agrees: outputs and Q to float32 rounding (the hook orthogonalises Q
before `P = MQ`, which leaves P̂ unchanged), the dense steps bit for bit,
the bytes exactly. The residuals agree **as a worker mean only**: torch's
hook keeps `M_w − P̂ Q̄ᵀ`, jaxcomm the paper's local `M_w − P̂ Q_wᵀ`; the
next step's output depends only on the mean (`tests/test_peers.py`).
jaxcomm's 16-bit casts leave leaves below `min_size` in fp32, so its bytes
exceed torch's, which casts the whole bucket, by those leaves.

**Why `cast(float16)` widens on CPU.** XLA:CPU's gloo communicator sums
`F16` in scalar software (half → float → half per element), slower than
fp32 (the `castcost` part of `experiments/results/peers.json`).
So on CPU `cast(float16)` rounds each worker's g/n to fp16 (the same values
as on GPU) and widens it to float32 for the sum (`Cast.widened()`; the wire
report says 4 bytes per entry; GPU/TPU keep the 16-bit all-reduce). The
bf16 psum the peers benchmark pins also moves 4 bytes per entry on CPU, where
torch's gloo moves 2.

"""
