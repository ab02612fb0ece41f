"""Helpers shared by the tests: run a transform on 8 workers three ways."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

N = 8
AXIS = "data"


def mesh():
    return jax.make_mesh((N,), (AXIS,))


def stack(tree, n: int = N):
    """n identical copies along a new leading (worker) axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n,) + jnp.shape(x)), tree)


def per_worker_grads(params, seed: int = 0, n: int = N, scale: float = 1.0):
    """Different normal gradients on every worker: leaves of shape (n, *leaf.shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(scale * rng.normal(size=(n,) + p.shape), p.dtype), params
    )


def _unstack(t):
    return jax.tree.map(lambda x: x[0], t)


def _restack(t):
    return jax.tree.map(lambda x: x[None], t)


def sharded(tx, m=None, *, jit: bool = True):
    """(``tx.update`` under jax.shard_map over every axis of mesh ``m``, input sharding).

    Grads and state carry one leading worker axis, sharded over all mesh axes;
    the update comes out replicated (``out_specs=P()`` checks that), the new
    state per worker.
    """
    m = m or mesh()
    names = m.axis_names
    spec = P(names[0]) if len(names) == 1 else P(names)

    def f(g, s):
        u, s = tx.update(_unstack(g), _unstack(s))
        return u, _restack(s)

    fn = jax.shard_map(f, mesh=m, in_specs=(spec, spec), out_specs=(P(), spec))
    return (jax.jit(fn) if jit else fn), NamedSharding(m, spec)


def shard_map_update(tx, grads, state, *, jit: bool = True, m=None):
    """``tx.update`` under jax.shard_map; grads/state have a leading worker axis.

    Returns (updates of worker 0 — replicated, checked by out_specs=P() —,
    new per-worker state with the leading axis).
    """
    fn, sh = sharded(tx, m, jit=jit)
    return fn(jax.device_put(grads, sh), jax.device_put(state, sh))


def shard_map_compiled(tx, grads, state, *, m=None):
    """The compiled shard_map'd update (for HLO inspection)."""
    fn, sh = sharded(tx, m)
    return fn.lower(jax.device_put(grads, sh), jax.device_put(state, sh)).compile()


def pmap_update(tx, grads, state):
    """``tx.update`` under jax.pmap; outputs keep the leading worker axis."""
    return jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)(grads, state)


def vmap_update(tx, grads, state):
    """``tx.update`` under jax.vmap(axis_name=...): one device, n simulated workers."""
    return jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name=AXIS))(grads, state)


def np_tree(t):
    return jax.tree.map(lambda x: np.asarray(x, dtype=np.float64), t)


def ef_reference(step, grads_seq, params, min_size, **kw):
    """NumPy error feedback + mean over workers, leaf by leaf, for a per-worker rule.

    ``step(p, **kw) -> (sent, residual)`` is one worker's compressor rule on a
    flat vector; leaves smaller than ``min_size`` are averaged densely.
    Returns the per-step mean outputs and the final residuals (n, size).
    """
    names = sorted(params)
    res = {k: np.zeros((N, params[k].size)) for k in names}
    outs = []
    for g in grads_seq:
        out = {}
        for k in names:
            gk = np.asarray(g[k], np.float64).reshape(N, -1)
            if params[k].size < min_size:
                out[k] = gk.mean(0).reshape(params[k].shape)
                continue
            sent = np.zeros_like(gk)
            for w in range(N):
                sent[w], res[k][w] = step(gk[w] + res[k][w], **kw)
            out[k] = sent.mean(0).reshape(params[k].shape)
        outs.append(out)
    return outs, res


def assert_ef_telescopes(tx, *, steps: int = 12, atol: float = 2e-4, held_back: float = 1e-4):
    """Σ_t outputs + mean residual_T == Σ_t mean_w g_t under shard_map (nothing lost or invented).

    Also asserts that compression happened: the final mean residual holds
    more than ``held_back`` somewhere.
    """
    params = {"w": jnp.zeros((30, 50))}
    state = stack(tx.init(params))
    total_out = np.zeros((30, 50))
    total_in = np.zeros((30, 50))
    for s in range(steps):
        g = per_worker_grads(params, seed=100 + s)
        out, state = shard_map_update(tx, g, state)
        total_out += np.asarray(out["w"], np.float64)
        total_in += np.asarray(g["w"], np.float64).mean(0)
    mean_res = np.asarray(state.residual["w"], np.float64).mean(0)
    np.testing.assert_allclose(total_out + mean_res, total_in, atol=atol)
    assert np.abs(mean_res).max() > held_back


def bf16_telescoping_error(tx, memory, *, d: int = 4096, steps: int = 300) -> float:
    """Error feedback on bf16 params: |Σ g - Σ sent - memory| on the small entries / their mass.

    40 entries of 1.0 every step beside 4056 of 1e-3 (one worker, no axis):
    error feedback telescopes, Σ sent + the final memory (``memory(state)``,
    the residual or DGC's velocity) = Σ g. A bf16 memory rounds ``e + 1e-3``
    to a bf16 neighbour of ``e`` (0.002 apart near 0.25): mass is lost or made.
    """
    g = np.full(d, 1e-3)
    g[::103] = 1.0
    grads = {"w": jnp.asarray(g, jnp.bfloat16)}
    total = steps * np.asarray(grads["w"], np.float64)
    small = g < 0.5
    state = tx.init({"w": jnp.zeros(d, jnp.bfloat16)})
    step, sent = jax.jit(tx.update), np.zeros(d)
    for _ in range(steps):
        out, state = step(grads, state)
        assert out["w"].dtype == jnp.bfloat16
        sent += np.asarray(out["w"], np.float64)
    left = np.asarray(memory(state), np.float64)
    return float(np.abs(total - sent - left)[small].sum() / total[small].sum())


def import_torch():
    """``torch``, or skip the calling module: except where ``JAXCOMM_REQUIRE_TORCH`` is set
    (CI installs torch's CPU build and sets it), where a failed import fails the module.

    ``pip install -e ".[peers]" --extra-index-url https://download.pytorch.org/whl/cpu``.
    """
    import os

    import pytest

    if os.environ.get("JAXCOMM_REQUIRE_TORCH"):
        import torch

        return torch
    return pytest.importorskip(
        "torch",
        reason='needs torch: pip install -e ".[peers]" '
        "--extra-index-url https://download.pytorch.org/whl/cpu",
    )
