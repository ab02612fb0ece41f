"""Every method name in the project resolves in :mod:`jaxcomm.methods`, and builds.

Configs, benchmarks, examples, studies, the policy and the tests name methods
(and config variants); each table is read here and each name is resolved and
built, so a name that drifted from the library (``whatif``'s scheme once named
a ``majority_vote`` that does not exist, and was skipped without a word) fails
this file rather than a run.
"""

import ast
import dataclasses
import inspect
import pathlib

import jax
import numpy as np
import optax
import pytest

import jaxcomm
from experiments import examples, optimizers
from experiments.bench import buckets, floor, step_parts, whatif_inputs
from experiments.bench import compressors as bench
from experiments.configs import (
    char_transformer,
    cifar_resnet,
    common,
    digits_compare,
    digits_mlp,
    lm_shakespeare,
)
from experiments.studies import lm_methods
from jaxcomm import methods, policy
from tests import test_golden, test_parallel, test_registry

CONFIGS = {"digits_mlp": digits_mlp, "digits_compare": digits_compare, "lm": lm_shakespeare}
VARIANTS = [(name, v) for name, mod in CONFIGS.items() for v in mod.VARIANTS]


def is_transform(tx) -> bool:
    return isinstance(tx, optax.GradientTransformation)


def test_methods_are_jaxcomms_public_factories_and_the_compressors_modules():
    names = methods.names()
    for name in names:
        factory = methods.get(name)
        assert inspect.isfunction(factory)
        if name in jaxcomm.__all__:
            assert factory is getattr(jaxcomm, name)
    # every public factory returning a transform is a method; helpers and the pipeline are not
    assert {"topk", "cast", "powersgd", "dgc_sgd", "local_sgd", "auto", "demo"} <= set(names)
    assert not {"compress", "wire_bytes", "ring_allreduce", "data_parallel", "fsdp"} & set(names)
    comp = methods.compressors()
    assert set(comp) < set(names) and "local_sgd" not in comp and "auto" not in comp
    assert {m.__module__.split(".")[1] for m in map(methods.get, comp)} == {"compressors"}


def test_an_unknown_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown method 'majority_vote'.*'sign_majority'"):
        methods.get("majority_vote")
    with pytest.raises(ValueError, match="whatif scheme 'x'.*majority_vote"):
        whatif_inputs.build_transform(
            dataclasses.replace(whatif_inputs.SCHEMES[0], label="x", factory="majority_vote")
        )


def test_make_adds_the_key_a_factory_takes():
    params = {"w": jax.numpy.zeros(2048)}

    def key(tx):
        return np.asarray(tx.init(params).key)

    by_hand = key(jaxcomm.randomk(0.1, key=jax.random.key(0)))
    np.testing.assert_array_equal(key(methods.make("randomk", ratio=0.1)), by_hand)
    assert np.any(key(methods.make("randomk", ratio=0.1, seed=1)) != by_hand)
    assert is_transform(methods.make("topk", ratio=0.1))  # takes no key: none added


@pytest.mark.parametrize("config, variant", VARIANTS, ids=[f"{c}:{v}" for c, v in VARIANTS])
def test_every_config_variant_builds_its_optimizer(config, variant):
    assert is_transform(common.optimizer(CONFIGS[config], variant))


def test_other_configs_and_a_compressors_name_as_a_variant():
    for mod in (char_transformer, cifar_resnet):
        assert is_transform(optimizers.make_optimizer(mod.get_config()))
    for name in set(methods.compressors()) - set(digits_mlp.VARIANTS):  # the table wins
        c = digits_mlp.get_config(name)
        assert c.compressor.name == name and dict(c.compressor.kwargs) == {}
    assert set(methods.compressors()) < set(optimizers.compressor_names())
    with pytest.raises(ValueError, match="digits_mlp variant: unknown 'zip'"):
        digits_mlp.get_config("zip")


def assigned(path: str, name: str):
    """The literal a module assigns to ``name``, read without importing it (the comparison
    study defines its command-line flags on import)."""
    tree = ast.parse((pathlib.Path(__file__).parents[1] / path).read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and [getattr(t, "id", None) for t in n.targets] == [name]]  # fmt: skip
    return ast.literal_eval(value)


def test_studies_name_config_variants():
    for m in assigned("experiments/studies/compare.py", "DEFAULT_METHODS"):
        assert m in digits_compare.VARIANTS
    for m in lm_methods.METHODS:
        assert lm_methods.variant(m) in lm_shakespeare.VARIANTS
    for m in step_parts.METHODS:
        assert m in digits_mlp.VARIANTS


def test_every_bench_case_builds():
    for name in bench.case_names():
        if name not in bench.LOADED:  # loaded from git history
            assert is_transform(bench.build(name, 0.01)), name
    for make in buckets._transforms().values():
        assert is_transform(make()) and is_transform(make(bucket_bytes=None))
    for name, _, make in floor.VECTOR_CASES + floor.TREE_CASES:
        if not name.endswith("_rev") and name != "threshold_before":  # git history
            assert is_transform(make(0.01, floor.REV)), name
    for scheme in whatif_inputs.SCHEMES:
        assert is_transform(whatif_inputs.build_transform(scheme)), scheme.label


def test_examples_and_policy_candidates_build():
    for name in examples.COMPRESSORS:
        assert is_transform(examples.compressor(name))
    for cand in policy.DEFAULT_CANDIDATES:
        assert is_transform(cand.make("data")), cand.name


def test_the_tests_tables_name_methods():
    tables = {
        "test_registry.REGISTRY": test_registry.REGISTRY,
        "test_registry.TESTED_ELSEWHERE": test_registry.TESTED_ELSEWHERE,
        "test_golden.EXTRA": test_golden.EXTRA,
        "test_parallel.COMPRESSORS": test_parallel.COMPRESSORS,
    }
    for where, table in tables.items():
        for key in table:
            assert methods.get(key.split(":")[0]), where  # raises naming the choices
    assert not test_registry.missing_entries(test_registry.REGISTRY)
