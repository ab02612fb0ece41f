"""Every transform on a GPU/TPU against the same transform on the CPU, in one process.

CI has no accelerator, so this module is skipped there. On a machine with one:

  JAX_PLATFORMS=cuda,cpu pytest tests/test_accelerator.py -n 0 -s

Each transform of ``tests/test_golden.py`` (the registry and the transforms
tested elsewhere) runs three steps for 8 workers under ``jax.vmap(...,
axis_name="data")`` (one chip holds them all), once on the accelerator and
once on the CPU, from the same gradients; the third step has a NaN on one
worker. Checked, per step: the updates and the state agree, the dtypes are
kept, and the compiled step holds no host transfer (no callback,
infeed/outfeed or host send/recv). ``-s`` prints each transform's largest
relative error (2-norm of a leaf's difference over its norm) and its entries
beyond the tolerance (flips, summed over the steps and leaves).

Agree means: NaNs and infinities in the same places, and every entry within
``TOL`` of the run's dtype (relative to the entry plus the leaf's RMS), bar
at most 0.5% of a leaf's entries (at least one), and the leaf's relative
error within 10 x ``TOL`` (so no flip goes far). The two backends sum in
other orders, so a value at a rounding tie or at a selection's boundary may
go the other way: on one H200, bf16 int8 with round-to-nearest moved one
code of 480 (relative error of the residual 0.1), while every other
difference was within 2e-3 (bf16) or 2e-7 (float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers as H
from tests.test_golden import TRANSFORMS
from tests.test_registry import PARAMS

pytestmark = pytest.mark.skipif(
    jax.default_backend() == "cpu",
    reason="needs a GPU/TPU (JAX_PLATFORMS=cuda,cpu or tpu,cpu); CI has none",
)

STEPS = 3
# an entry's difference allowed, over (|entry| + the leaf's RMS), by the run's dtype: the
# float32 state of a bf16 run (residuals, momenta) holds differences of bf16 values
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}
# where the backends differ by design: off CPU a bf16 cast sums its payload in bf16 (the
# psum), on CPU in f32 (uint16 words)
LOOSE = {"cast": 2e-2}
FLIPS = 0.005  # the share of a leaf's entries that may go the other way (at least one)
# Seen on one H200 (jax 0.11.2), beyond the rule above; kept visible, not loosened away.
# Two of them move between runs of the same code on the same chip (its reductions are not
# bit-reproducible run to run): int8:nearest_ef bf16's relative error 1.9e-3 then 0.53,
# dgc:warmup_nesterov_clip bf16's 3.1e-3 then 0.11 (experiments/results/accelerator.json)
KNOWN = {
    # residual = p - q*scale cancels: the GPU contracts it into one FMA, the CPU rounds the
    # product first; off by 1e-5 of the residual's RMS on 81 of 2304 entries (norm 1.4e-5)
    ("int8:nearest_ef", "f32"): "the residual's cancellation, FMA on the GPU only",
    ("int8:nearest_ef", "bf16"): "the residual's cancellation and rounding ties: 16 of 2304",
    ("dgc:warmup_nesterov_clip", "bf16"): "13 of 2304 entries at the selection's edge",
    # 128 of 2304 entries at step 1, relative error 0.15. On 8 workers it runs two-phase:
    # with exchange="gather" it agrees (bf16 relative error 1.6e-3, no flip), so the server's
    # re-quantisation differs. Not the order of the chunk's sum: summing it in float32 left
    # the same 128 entries (and made terngrad's two-phase bf16 server flip 8 entries)
    ("onebit:bucket", "bf16"): "two-phase server's re-quantisation (gather agrees): 128 of 2304",
}
HOST_TRANSFER = ("outfeed", "infeed", "is_host_transfer=true", "callback", "host_compute")


def grads(dtype, step):
    g = H.per_worker_grads(jax.tree.map(lambda x: x.astype(dtype), PARAMS), seed=40 + step)
    if step == STEPS - 1:  # one worker's gradient is not finite: the NaN rule on both
        g["w"] = g["w"].at[3, 0, 0].set(jnp.nan)
    return g


def run(name, dtype, device):
    """Per step, (updates, state) of 8 vmapped workers on ``device``, and the compiled text."""
    tx = TRANSFORMS[name]("data")
    params = jax.tree.map(lambda x: x.astype(dtype), PARAMS)
    state = jax.device_put(H.stack(tx.init(params)), device)
    fn = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="data"))
    out, text = [], None
    for step in range(STEPS):
        g = jax.device_put(grads(dtype, step), device)
        if text is None:
            text = fn.lower(g, state).compile().as_text()
        u, state = fn(g, state)
        out.append((u, state))
    return out, text


def leaves(tree):
    """(dtype, float64 array) of each leaf; PRNG keys as their data."""
    got = []
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        got.append((x.dtype, np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)))
    return got


def compare(a, b, tol):
    """(relative error, entries off by more than ``tol``, entries allowed to be)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    assert np.array_equal(np.isnan(a), np.isnan(b)), "NaNs in other places"
    assert np.array_equal(np.isfinite(a), np.isfinite(b)), "infinities in other places"
    ok = np.isfinite(b)
    a, b = a[ok], b[ok]
    if b.size == 0:
        return 0.0, 0, 0
    rms = np.sqrt(np.mean(b * b))
    off = int(np.sum(np.abs(a - b) > tol * (np.abs(b) + rms)))
    err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return err, off, max(1, int(FLIPS * b.size))


def cases():
    for name in sorted(TRANSFORMS):
        for dtype, tag in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
            why = KNOWN.get((name, tag))
            marks = [pytest.mark.xfail(reason=why, strict=False)] if why else []
            yield pytest.param(name, dtype, id=f"{name}-{tag}", marks=marks)


@pytest.mark.parametrize("name,dtype", list(cases()))
def test_accelerator_agrees_with_cpu(name, dtype):
    acc, text = run(name, dtype, jax.devices()[0])
    cpu, _ = run(name, dtype, jax.devices("cpu")[0])
    tol = max(TOL[jnp.dtype(dtype)], LOOSE.get(name, 0.0))
    worst, flips, wrong = 0.0, 0, []
    for step, ((ua, sa), (uc, sc)) in enumerate(zip(acc, cpu)):
        for k in PARAMS:
            assert ua[k].dtype == dtype and ua[k].shape == (H.N,) + PARAMS[k].shape
        for (da, a), (dc, c) in zip(leaves((ua, sa)), leaves((uc, sc))):
            assert da == dc
            if jnp.issubdtype(da, jnp.floating):
                err, off, allowed = compare(a, c, tol)
                worst, flips = max(worst, err), flips + off
                # a flip may go the other way, not far: the leaf's norm bounds them all
                if off > allowed or err > 10 * tol:
                    wrong.append(f"step {step}: {off} of {a.size} entries differ by more than "
                                 f"{tol:.0e} (relative error {err:.2e})")  # fmt: skip
            else:  # counters, keys, packed codes: the same bits
                assert np.array_equal(a, c), f"step {step}: integer state differs"
    # printed before the verdict, so experiments.bench.accelerator reads failures' figures too
    print(f"\n{name} {jnp.dtype(dtype).name}: largest relative error {worst:.2e}, {flips} flips")
    assert not wrong, "; ".join(wrong)
    found = [w for w in HOST_TRANSFER if w in text.lower()]
    assert not found, f"the compiled step moves data to the host: {found}"
