"""Every registry transform's updates and state against saved values, on any CPU.

``tests/data/golden.npz`` holds, for every entry of ``tests/test_registry.py``'s
REGISTRY plus the transforms tested elsewhere, every leaf of the updates and of
the new state (dtype, shape, values) of three steps on 8 workers (shard_map,
fixed per-worker gradients).

**What is compared, and why not bits.** XLA:CPU compiles for the host's CPU: the
vector width and whether ``a * b + c`` becomes one fused multiply-add change the
last bits of floats between CPU models (an AMD or Intel laptop, Apple silicon,
a server with AVX-512). So by default:

* what is exact by construction is compared exactly: integer and boolean leaves
  (codes, packed bits, selected indices, step counters) and PRNG key data;
* floats are compared within ``RTOL`` of the leaf's largest magnitude,
  elementwise (see ``RTOL`` for the bound it comes from);
* the inputs keep values away from boundaries: every gradient is a multiple of
  1/16 below 8 in magnitude, so sums, means and sums of squares of them are exact
  in float32 in any order, and each transform's input seed was chosen when the
  file was written so that its results agree under XLA natively, with LLVM's
  full optimisation and with ``--xla_cpu_max_isa=AVX2``, ``AVX`` and ``SSE4_2``
  (no stochastic rounding, sign or top-k choice within reach of a last-bit
  difference there). A flipped code moves a value by a whole quantisation
  level, far outside ``RTOL``, and fails.

**Strict mode, for refactors on one machine** (bit for bit, against digests of
*this* machine; the file is not committed):

    pytest tests/test_golden.py -n 0 --golden-strict=save    # before the change
    pytest tests/test_golden.py -n 0 --golden-strict=check   # after: names what moved

**Regenerate** only when a change of numbers is intended, and say so in the
commit; ``--only`` writes just the named entries (a new transform's too), the
others stay as saved, bit for bit:

    python -m tests.golden_regen --only NAME ...    # or --all, every entry

**Per-entry digests.** ``tests/data/golden_digests.json`` holds one SHA-256 per
entry (its saved leaves and input seed), one entry a line, and
``test_saved_outputs_match_their_digests`` holds the saved file to it: an
entry's saved outputs cannot change without its line changing, and
``golden_regen`` refuses to change a line whose entry was not named
(:func:`unnamed_changes`). A diff of that file names every re-blessed entry.
"""

from __future__ import annotations

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

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden.npz")
DIGESTS = os.path.join(os.path.dirname(__file__), "data", "golden_digests.json")
STEPS = 3
# Floats agree within RTOL x the leaf's largest magnitude. The leaves are sums of at most a
# few hundred products (PowerSGD's P = M Q over 24 rows, its QR, Adam's moments), and a
# sum of n terms in another order or with fused multiply-adds differs by at most about
# n * 2^-24 of the sum of magnitudes: 2^-12 ~ 2.4e-4 covers n up to a few thousand
# with room, while the smallest real change of numbers the tests make (one step of a
# momentum 0.9 -> 0.901, one code flipped) moves a leaf by 1e-3 of its scale or more.
# The deviations measured between the five XLA settings above are below 1e-6.
RTOL = 2.0**-12
# and within ATOL: a residual p - q (what a quantiser did not send) is small but keeps the
# absolute rounding error of p, whose entries reach ~8 (one ULP 2^-21): 2^-16 is 32 such
# ULPs, while a flipped code or a wrong residual moves an entry by a quantisation step
# (1e-2 or more here). Measured between the settings: up to 6e-7.
ATOL = 2.0**-16

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


def gradients(seed: int):
    """Per-worker gradients, multiples of 1/16 with |g| < 8: exact sums in any order."""

    def grid(x):
        return jnp.asarray(np.clip(np.round(16 * np.asarray(x)), -127, 127) / 16, x.dtype)

    return jax.tree.map(grid, H.per_worker_grads(PARAMS, seed=seed))


def run(name: str, seed: int = 0, transforms=None) -> dict[str, np.ndarray]:
    """Per step, the updates' and the state's leaves (worker axis kept), as NumPy arrays.

    Keys are ``name|step|u<i>`` (updates) and ``name|step|s<i>`` (state); PRNG keys
    come out as their key data. Step t's gradients come from seed ``1000 * seed + t``.
    """
    tx = (transforms or TRANSFORMS)[name]("data")
    state = H.stack(tx.init(PARAMS))
    out = {}
    # updates kept per worker (out_specs P("data")): 1-bit/0-1 Adam's are typed per worker
    fn = jax.jit(jax.shard_map(lambda g, s: stacked(tx.update(unstacked(g), unstacked(s))),
                               mesh=H.mesh(), in_specs=(P("data"),) * 2,
                               out_specs=(P("data"),) * 2))  # fmt: skip
    sh = NamedSharding(H.mesh(), P("data"))
    for t in range(STEPS):
        g = gradients(1000 * seed + t)
        u, state = fn(jax.device_put(g, sh), jax.device_put(state, sh))
        for i, leaf in enumerate(jax.tree.leaves(u)):
            out[f"{name}|{t}|u{i}"] = np.asarray(leaf)
        for i, leaf in enumerate(jax.tree.leaves(state)):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out[f"{name}|{t}|s{i}"] = np.asarray(leaf)
    return out


def describe(x: np.ndarray) -> str:
    return f"{x.dtype}{tuple(x.shape)}"


def exact_kind(x: np.ndarray) -> bool:
    """Integer and boolean leaves: codes, packed bits, indices, counters, key data."""
    return not np.issubdtype(x.dtype, np.floating) and x.dtype.kind not in "fV"


def mismatches(got: dict, want: dict, *, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """The keys whose leaf differs beyond what the comparison allows, with why.

    Integer and boolean leaves must be equal; floats within ``atol + rtol * m`` entry
    by entry, ``m`` the leaf's largest finite magnitude, NaN/Inf at the same places.
    """
    bad = [f"{k}: missing" for k in sorted(set(want) - set(got))]
    bad += [f"{k}: not saved" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if describe(g) != describe(w):
            bad.append(f"{k}: {describe(g)}, saved {describe(w)}")
            continue
        if exact_kind(g):
            if not np.array_equal(g, w):
                bad.append(f"{k}: {int(np.sum(g != w))} of {g.size} entries differ")
            continue
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if not np.array_equal(np.isfinite(g64), np.isfinite(w64)):
            bad.append(f"{k}: NaN/Inf at other positions")
            continue
        fin = np.isfinite(w64)
        scale = float(np.max(np.abs(w64[fin]), initial=0.0))
        err = np.abs(g64[fin] - w64[fin])
        allowed = atol + rtol * scale
        if np.any(err > allowed) or not np.array_equal(g64[~fin], w64[~fin]):
            worst = float(np.max(err, initial=0.0))
            bad.append(f"{k}: off by {worst:.3g} (allowed {allowed:.3g})")
    return bad


def save(path: str, arrays: dict[str, np.ndarray], seeds: dict[str, int]) -> None:
    """Floats as float32 (bf16/fp16 widen exactly), the dtypes and seeds beside them."""
    meta = {"dtypes": {k: str(v.dtype) for k, v in arrays.items()}, "seeds": seeds}
    stored = {
        k: (
            v.astype(np.float32)
            if v.dtype.kind == "V" or v.dtype.itemsize < 4 and v.dtype.kind == "f"
            else v
        )  # fmt: skip
        for k, v in arrays.items()
    }
    np.savez_compressed(path, __meta__=np.array(json.dumps(meta, sort_keys=True)), **stored)


def load(path: str = GOLDEN) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    with np.load(path) as f:
        meta = json.loads(str(f["__meta__"]))
        arrays = {
            k: np.asarray(f[k]).astype(jnp.dtype(meta["dtypes"][k])) for k in f if k != "__meta__"
        }
    return arrays, meta["seeds"]


def digests(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """Strict mode's record: dtype, shape and the SHA-256 of every leaf's bytes."""
    return {
        k: describe(v) + ":" + hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
        for k, v in arrays.items()
    }


def entry_digests(arrays: dict[str, np.ndarray], seeds: dict[str, int]) -> dict[str, str]:
    """Entry -> the SHA-256 of its input seed and its leaves (keys, dtypes, shapes, bytes)."""
    out = {}
    for name in sorted(seeds):
        h = hashlib.sha256(f"seed {seeds[name]}".encode())
        for k in sorted(k for k in arrays if k.split("|")[0] == name):
            h.update(f"{k} {describe(arrays[k])}".encode())
            h.update(np.ascontiguousarray(arrays[k]).tobytes())
        out[name] = h.hexdigest()
    return out


def unnamed_changes(before: dict[str, str], after: dict[str, str], named=()) -> list[str]:
    """Entries of ``before`` whose digest ``after`` changes or drops, ``named`` excepted."""
    return sorted(k for k in before if k not in named and after.get(k) != before[k])


def read_digests(path: str = DIGESTS) -> dict[str, str]:
    with open(path) as f:
        return json.load(f)


def write_digests(digests: dict[str, str], path: str = DIGESTS) -> None:
    """One entry a line, sorted: a diff names the entries whose outputs were re-saved."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(digests.items())]
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


@pytest.fixture(scope="module")
def golden():
    return load()


@pytest.fixture(scope="module")
def strict(request):
    """(mode, digests file, saved digests): None unless --golden-strict was given."""
    mode = request.config.getoption("--golden-strict")
    path = request.config.getoption("--golden-strict-file")
    if mode != "check":
        return mode, path, {}
    if not os.path.exists(path):
        pytest.fail(f"{path} missing: run with --golden-strict=save before the change")
    return mode, path, read_strict(path)


def test_every_transform_is_saved(golden):
    arrays, seeds = golden
    assert {k.split("|")[0] for k in arrays} == set(TRANSFORMS) == set(seeds)


def test_saved_outputs_match_their_digests(golden):
    arrays, seeds = golden
    saved = read_digests()
    assert unnamed_changes(saved, entry_digests(arrays, seeds)) == []
    assert set(saved) == set(seeds), "run python -m tests.golden_regen --only NAME"


def test_an_entry_is_added_or_rewritten_only_where_named(golden):
    """What golden_regen checks before it writes: adding one entry leaves every other
    entry's digest as it was; a changed entry that was not named is refused."""
    arrays, seeds = golden
    before = entry_digests(arrays, seeds)
    added = {**arrays, **{k.replace("int8|", "int8:copy|"): v for k, v in arrays.items()
                          if k.startswith("int8|")}}  # fmt: skip
    after = entry_digests(added, {**seeds, "int8:copy": seeds["int8"]})
    assert unnamed_changes(before, after) == [] and set(after) - set(before) == {"int8:copy"}
    k = next(k for k in arrays if k.startswith("onebit|"))
    moved = {**arrays, k: arrays[k] + np.ones_like(arrays[k])}
    assert unnamed_changes(before, entry_digests(moved, seeds)) == ["onebit"]
    assert unnamed_changes(before, entry_digests(moved, seeds), named=["onebit"]) == []
    assert unnamed_changes(before, entry_digests(arrays, {**seeds, "int8": 99})) == ["int8"]
    dropped = {n: s for n, s in seeds.items() if n != "twobit"}
    assert unnamed_changes(before, entry_digests(arrays, dropped)) == ["twobit"]


def test_inputs_are_exact_in_any_order():
    for seed in (0, 1, 2):
        for g in jax.tree.leaves(gradients(seed)):
            g = np.asarray(g, np.float64)
            assert np.all(g * 16 == np.round(g * 16)) and np.max(np.abs(g)) < 8
            # a leaf's sum of squares stays below 2^24 / 256: every partial sum is exact
            assert np.sum(g**2) * 256 < 2**24


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_matches_the_saved_outputs(name, golden, strict):
    arrays, seeds = golden
    got = run(name, seeds[name])
    want = {k: v for k, v in arrays.items() if k.split("|")[0] == name}
    assert any(np.any(v != 0) for k, v in got.items() if "|u" in k), "trivial run"
    mode, path, saved = strict
    if mode == "save":
        with open(path, "a+") as f:  # one JSON object a line: xdist workers append
            f.write(json.dumps(digests(got)) + "\n")
    elif mode == "check":
        theirs = {k: v for k, v in saved.items() if k.split("|")[0] == name}
        changed = strict_changes(digests(got), theirs)
        assert not changed, f"bits changed in (transform|step|leaf): {changed}"
    bad = mismatches(got, want)
    assert not bad, f"{name} (input seed {seeds[name]}) differs from the saved run: {bad}"


def strict_changes(got: dict[str, str], saved: dict[str, str]) -> list[str]:
    """Keys whose digest differs from, or is missing in, the other record."""
    return sorted(k for k in set(got) | set(saved) if got.get(k) != saved.get(k))


def read_strict(path: str) -> dict[str, str]:
    """The digests file --golden-strict=save wrote (one JSON object a line)."""
    out = {}
    with open(path) as f:
        for line in f:
            out.update(json.loads(line))
    return out


# -- the comparison itself can fail --------------------------------------------------------

SMALL = {"int8": TRANSFORMS["int8"], "onebit": TRANSFORMS["onebit"]}


def _changed(scale):
    """int8 followed by a scale: the same codes, different floats."""
    return {**SMALL, "int8": lambda ax: optax.chain(TRANSFORMS["int8"](ax), optax.scale(scale))}


def test_the_tolerant_comparison_fails_on_a_real_change_and_only_there(golden):
    arrays, seeds = golden
    want = {k: v for k, v in arrays.items() if k.split("|")[0] in SMALL}
    base = {**run("int8", seeds["int8"], SMALL), **run("onebit", seeds["onebit"], SMALL)}
    assert mismatches(base, want) == []
    # last-bit noise on every float is allowed ...
    nudged = {
        k: (np.nextafter(v, np.inf).astype(v.dtype) if not exact_kind(v) else v)
        for k, v in base.items()
    }
    assert mismatches(nudged, want) == []
    # ... a 0.1% change of one transform's updates is named, and nothing else is
    moved = {**base, **run("int8", seeds["int8"], _changed(1.001))}
    bad = mismatches(moved, want)
    assert bad and all(b.startswith("int8|") and "|u" in b.split(":")[0] for b in bad), bad
    # one integer entry (a code, a counter) changed by one is named
    flipped = dict(base)
    k = next(k for k, v in base.items() if exact_kind(v) and k.startswith("onebit|"))
    flipped[k] = base[k].copy()
    flipped[k].flat[0] += 1
    assert [b.split(":")[0] for b in mismatches(flipped, want)] == [k]


def test_strict_mode_names_only_the_transform_whose_bits_changed(tmp_path):
    before = {**run("int8", 0, SMALL), **run("onebit", 0, SMALL)}
    path = tmp_path / "strict.jsonl"
    with open(path, "w") as f:  # as two xdist workers would append it
        f.write(json.dumps(digests({k: v for k, v in before.items() if "int8" in k})) + "\n")
        f.write(json.dumps(digests({k: v for k, v in before.items() if "onebit" in k})) + "\n")
    saved = read_strict(path)
    assert strict_changes(digests(before), saved) == []
    # the smallest change there is: int8's updates scaled by (1 + 2^-23), one ULP or less
    after = {**before, **run("int8", 0, _changed(1 + 2.0**-23))}
    changed = strict_changes(digests(after), saved)
    assert changed and all(k.startswith("int8|") and "|u" in k for k in changed), changed
    assert mismatches(after, before) == []  # a last-bit change: only strict mode sees it
