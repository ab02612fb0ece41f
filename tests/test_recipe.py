"""The "Add a compressor" recipe of :mod:`jaxcomm.methods`, followed to the letter.

The recipe's code block is written, as it stands in the docstring, to one file
in a folder added to ``jaxcomm.compressors``' search path (as if dropped into
``jaxcomm/compressors/``), and its one test entry is read from the docstring
too. Nothing else is edited, and then: the registry finds the method and asks
for exactly that entry; the entry passes the registry's property tests; the
codec matches a NumPy reference; a training config trains with it by name; the
compressor benchmark and a what-if scheme take it by name; and its golden
outputs are added beside the saved ones without any other entry's digest
changing.
"""

import dataclasses
import importlib
import re
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcomm
from experiments import train
from experiments.bench import compressors as bench
from experiments.bench import whatif_inputs
from experiments.configs import digits_mlp
from jaxcomm import methods
from tests import golden_regen, test_golden, test_registry
from tests import helpers as H
from tests.test_train import tiny

NAME = "fp8"
DOC = methods.__doc__


def recipe_file() -> str:
    """The recipe's one library file: its python code block."""
    (block,) = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
    return block


def recipe_entry() -> dict:
    """The recipe's one test entry, the line it says to add to REGISTRY."""
    (line,) = [s.strip() for s in DOC.splitlines() if s.strip().startswith(f'"{NAME}": lambda')]
    return eval("{" + line + "}", {"methods": methods})


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    """The recipe's file on ``jaxcomm.compressors``' path; removed again afterwards."""
    folder = tmp_path_factory.mktemp("compressors")
    (folder / f"{NAME}.py").write_text(recipe_file())
    package = jaxcomm.compressors
    path = list(package.__path__)
    assert NAME not in methods.names()
    package.__path__.append(str(folder))
    try:
        yield importlib.import_module(f"jaxcomm.compressors.{NAME}")
    finally:
        package.__path__[:] = path
        sys.modules.pop(f"jaxcomm.compressors.{NAME}", None)
        if hasattr(package, NAME):
            delattr(package, NAME)


@pytest.fixture(scope="module")
def registry(codec):
    return {**test_registry.REGISTRY, **recipe_entry()}


def test_the_registry_finds_it_and_asks_for_its_one_test_entry(codec):
    assert NAME in methods.names() and NAME in methods.compressors()
    assert methods.get(NAME) is codec.fp8
    assert getattr(jaxcomm, NAME) is codec.fp8  # jaxcomm.fp8, with no edit of jaxcomm/
    assert test_registry.missing_entries(test_registry.REGISTRY) == {NAME}
    assert test_registry.missing_entries({**test_registry.REGISTRY, **recipe_entry()}) == set()


def test_the_entry_passes_the_registrys_property_tests(registry, monkeypatch):
    monkeypatch.setattr(test_registry, "REGISTRY", registry)
    for dtype in (jnp.float32, jnp.bfloat16):
        test_registry.test_jit_local_state_stable_dtype_preserved(NAME, dtype)
    test_registry.test_shard_map_equals_pmap_equals_vmap(NAME)
    test_registry.test_hlo_collective_bytes_equal_wire_bytes(NAME)
    test_registry.test_one_workers_nan_makes_every_workers_update_nonfinite(NAME)


def fp8_reference(p: np.ndarray) -> np.ndarray:
    """Per worker row: ``s = max|p| / 448``, ``p / s`` rounded to e4m3 (ml_dtypes), times s."""
    s = np.abs(p).max(axis=1, keepdims=True).astype(np.float32) / np.float32(448.0)
    s = np.where(s > 0, s, np.float32(1.0))
    return (p / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s


def test_the_codec_matches_numpy(codec):
    params = {"w": jnp.zeros((32, 40)), "b": jnp.zeros((7,))}
    g = H.per_worker_grads(params, seed=5)
    tx = codec.fp8(axis_name=H.AXIS, min_size=16)
    state = H.stack(tx.init(params))
    out, new_state = H.shard_map_update(tx, g, state)
    w = np.asarray(g["w"]).reshape(H.N, -1)
    sent = fp8_reference(w)
    # XLA may form s = max|p| / 448 an ulp apart (a multiply by 1/448): 1e-6 of the largest
    # |p| covers that, while the smallest e4m3 step (2^-9 s = max|p| / 229376) is 4x larger
    atol = 1e-6 * np.abs(w).max()
    mean = np.asarray(out["w"]).reshape(-1)
    np.testing.assert_allclose(mean, sent.mean(axis=0), rtol=0, atol=atol)
    residual = np.asarray(new_state.residual["w"]).reshape(H.N, -1)
    np.testing.assert_allclose(residual, w - sent, rtol=0, atol=atol)
    # "b" (7 entries < min_size) is the dense mean
    np.testing.assert_allclose(np.asarray(out["b"]), np.asarray(g["b"]).mean(0), rtol=1e-6)
    # a byte per entry and one float32 scale per vector (and the NaN flag's bytes)
    flag = jaxcomm.core.nan_flag_bytes(codec.Fp8())
    assert jaxcomm.wire_bytes(tx, params, H.N) == 32 * 40 + 4 + flag + 7 * 4


def test_a_training_config_trains_with_it_by_name(codec, tmp_path):
    config = tiny(digits_mlp.get_config(NAME), steps=2, per_call=2)
    assert config.compressor.name == NAME
    result = train.train_and_evaluate(config, str(tmp_path))
    (row,) = result.metrics
    assert row["step"] == 2 and np.isfinite(row["loss"]) and row["wire_bytes"] > 0


def test_benchmarks_take_it_by_name(codec):
    assert NAME in bench.case_names()
    (row,) = bench.bench_size(4096, [NAME], ratio=0.01, reps=1)
    assert row["compressor"] == NAME and row["time_over_copy"] > 0
    assert row["wire_bytes"] == jaxcomm.wire_bytes(
        bench.build(NAME, 0.01), {"g": jnp.zeros(4096)}, 8
    )
    scheme = dataclasses.replace(whatif_inputs.SCHEMES[0], label="fp8", factory=NAME)
    assert whatif_inputs.build_transform(scheme) is not None


def test_its_golden_outputs_are_added_beside_the_others(registry, tmp_path):
    old, old_seeds = test_golden.load()
    new = test_golden.run(NAME, 0, registry)
    golden, digests = tmp_path / "golden.npz", tmp_path / "digests.json"
    golden_regen.write(old, old_seeds, new, {NAME: 0}, {NAME}, golden, digests)
    saved = test_golden.read_digests(str(digests))
    assert {k: v for k, v in saved.items() if k != NAME} == test_golden.read_digests()
    arrays, seeds = test_golden.load(str(golden))
    assert (
        test_golden.mismatches({k: v for k, v in arrays.items() if k.startswith("fp8|")}, new) == []
    )
    assert test_golden.entry_digests(arrays, seeds) == saved
    # another entry's outputs changed without being named: refused, nothing written
    k = next(k for k in old if k.startswith("int8|") and "|u" in k)
    moved = {**new, k: old[k] * 2}
    with pytest.raises(SystemExit, match=r"\['int8'\] would change unnamed"):
        golden_regen.write(old, old_seeds, moved, {NAME: 0}, {NAME}, golden, tmp_path / "no")
    assert not (tmp_path / "no").exists()
