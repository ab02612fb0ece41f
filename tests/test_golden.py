"""Every registry transform's updates and state, bit for bit, against saved digests.

``tests/data/golden.json`` holds, for every entry of ``tests/test_registry.py``'s
REGISTRY plus the transforms tested elsewhere, the SHA-256 of the updates and of
the new state (each leaf: dtype, shape, bytes) of three steps on 8 workers
(shard_map, fixed per-worker gradients). It was written before the pipeline's
redesign (one pipeline with exchange strategies), so a refactor that changes
any bit of any transform fails here.

PowerSGD above rank 2 orthogonalises with LAPACK's QR, whose last bits depend on the
kernels OpenBLAS picks for the CPU; ``tests/conftest.py`` pins its AVX2 kernels, with
which these digests were written.

Regenerate only when a change of numbers is intended, and say so in the commit:
  JAXCOMM_REGEN_GOLDEN=1 pytest tests/test_golden.py -n 0
"""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import helpers as H
from tests.test_registry import KEY, PARAMS, REGISTRY

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden.json")
REGEN = bool(os.environ.get("JAXCOMM_REGEN_GOLDEN"))
STEPS = 3

# transforms the registry leaves to other files, in a form these steps can run
EXTRA = {
    "onebit_adam": lambda ax: jaxcomm.onebit_adam(0.01, axis_name=ax, warmup_steps=1),
    "zero_one_adam": lambda ax: jaxcomm.zero_one_adam(0.01, axis_name=ax),
    "powersgd:adam_after": lambda ax: optax.chain(
        jaxcomm.powersgd(2, key=KEY, axis_name=ax), optax.adam(0.01)
    ),
}
TRANSFORMS = {**REGISTRY, **EXTRA}


def unstacked(t):
    return jax.tree.map(lambda x: x[0], t)


def stacked(t):
    return jax.tree.map(lambda x: x[None], t)


def run(name):
    """Per step, the updates and the state's leaves (worker axis kept), as flat arrays."""
    tx = TRANSFORMS[name]("data")
    state = H.stack(tx.init(PARAMS))
    out, moved = {}, []
    # updates kept per worker (out_specs P("data")): 1-bit/0-1 Adam's are typed per worker
    fn = jax.jit(jax.shard_map(lambda g, s: stacked(tx.update(unstacked(g), unstacked(s))),
                               mesh=H.mesh(), in_specs=(P("data"),) * 2,
                               out_specs=(P("data"),) * 2))  # fmt: skip
    sh = NamedSharding(H.mesh(), P("data"))
    for t in range(STEPS):
        g = H.per_worker_grads(PARAMS, seed=10 + t)
        u, state = fn(jax.device_put(g, sh), jax.device_put(state, sh))
        for i, leaf in enumerate(jax.tree.leaves(u)):
            out[f"{name}|{t}|u{i}"] = digest(leaf)
        for i, leaf in enumerate(jax.tree.leaves(state)):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out[f"{name}|{t}|s{i}"] = digest(leaf)
        moved.append(any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u)))
    out[f"{name}|moved"] = any(moved)
    return out


def digest(x) -> str:
    x = np.asarray(x)
    return f"{x.dtype}{x.shape}:" + hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def golden():
    if REGEN:
        saved = {}
        for name in sorted(TRANSFORMS):
            saved.update(run(name))
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            json.dump(saved, f, indent=0, sort_keys=True)
    with open(GOLDEN) as f:
        return json.load(f)


def test_every_transform_is_saved(golden):
    assert {k.split("|")[0] for k in golden} == set(TRANSFORMS)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_bit_identical_to_the_saved_outputs(name, golden):
    got = run(name)
    want = {k: v for k, v in golden.items() if k.split("|")[0] == name}
    assert sorted(got) == sorted(want), "the update's or the state's tree changed"
    changed = [k for k in sorted(want) if got[k] != want[k]]
    assert not changed, f"bits changed in (transform|step|leaf): {changed}"
    assert got[f"{name}|moved"]  # some update was non-zero: the saved run is not trivial
