"""jaxcomm.checks: the shared validators convert good values and name the argument and range."""

from types import SimpleNamespace
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import checks

NAN, INF = float("nan"), float("inf")


# --- check_ratio ----------------------------------------------------------------------------


@pytest.mark.parametrize("good", [1, 1.0, 0.5, 1e-6, np.float32(0.25), np.int64(1)])
def test_check_ratio_returns_a_float(good):
    out = checks.check_ratio(good, "density")
    assert type(out) is float and out == float(good)


@pytest.mark.parametrize("bad", [True, False, "0.5", None, [0.5]])
def test_check_ratio_rejects_non_numbers(bad):
    with pytest.raises(TypeError, match=r"density: expected a float in \(0, 1\]"):
        checks.check_ratio(bad, "density")


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.0000001, 2, NAN, INF, -INF])
def test_check_ratio_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match=r"density: must be in \(0, 1\], got"):
        checks.check_ratio(bad, "density")


def test_check_ratio_default_name():
    with pytest.raises(ValueError, match=r"^ratio: must be in \(0, 1\], got 0.0$"):
        checks.check_ratio(0.0)


# --- check_int ------------------------------------------------------------------------------


@pytest.mark.parametrize("good,lo,hi", [(0, 0, None), (7, 1, None), (np.int32(3), 1, 3)])
def test_check_int_returns_an_int(good, lo, hi):
    out = checks.check_int(good, "every", lo, hi)
    assert type(out) is int and out == int(good)


@pytest.mark.parametrize("bad", [True, False, 2.0, 2.5, "2", None, NAN, INF, np.float32(2)])
def test_check_int_rejects_non_ints(bad):
    with pytest.raises(TypeError, match=r"every: expected an int >= 1, got"):
        checks.check_int(bad, "every", 1)


def test_check_int_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"^every: expected an int >= 1, got 0$"):
        checks.check_int(0, "every", 1)
    with pytest.raises(ValueError, match=r"^bits: expected an int in \[1, 16\], got 17$"):
        checks.check_int(17, "bits", 1, 16)
    with pytest.raises(ValueError, match=r"^bits: expected an int in \[1, 16\], got 0$"):
        checks.check_int(np.int8(0), "bits", 1, 16)
    assert checks.check_int(16, "bits", 1, 16) == 16
    assert checks.check_int(1, "bits", 1, 16) == 1


# --- check_float ----------------------------------------------------------------------------


def test_check_float_lower_bound_only():
    assert checks.check_float(0.0, "eps", low=0.0, strict=False) == 0.0
    out = checks.check_float(np.float16(0.5), "eps", low=0.0, strict=True)
    assert type(out) is float and out == 0.5
    assert type(checks.check_float(3, "eps", low=0, strict=True)) is float
    with pytest.raises(ValueError, match=r"^eps: expected a finite float > 0.0, got 0.0$"):
        checks.check_float(0.0, "eps", low=0.0, strict=True)
    with pytest.raises(ValueError, match=r"^eps: expected a finite float >= 0, got -1e-09$"):
        checks.check_float(-1e-9, "eps", low=0, strict=False)
    for bad in (NAN, INF, -INF):
        with pytest.raises(ValueError, match=r"eps: expected a finite float >= 0, got"):
            checks.check_float(bad, "eps", low=0, strict=False)


def test_check_float_interval():
    kw = dict(low=0, strict=False, high=1)
    assert checks.check_float(0, "momentum", **kw) == 0.0
    assert checks.check_float(0.999, "momentum", **kw) == 0.999
    for bad in (1.0, -0.1, NAN, INF, -INF):
        with pytest.raises(ValueError, match=r"momentum: expected a float in \[0, 1\), got"):
            checks.check_float(bad, "momentum", **kw)
    closed = dict(low=0, strict=False, high=1, high_strict=False)
    assert checks.check_float(1.0, "mix", **closed) == 1.0
    with pytest.raises(ValueError, match=r"^mix: expected a float in \[0, 1\], got 1.5$"):
        checks.check_float(1.5, "mix", **closed)
    opened = dict(low=0, strict=True, high=1, high_strict=False)
    with pytest.raises(ValueError, match=r"^p: expected a float in \(0, 1\], got 0.0$"):
        checks.check_float(0.0, "p", **opened)


@pytest.mark.parametrize("bad", [True, False, "0.5", None, jnp.zeros(2)])
def test_check_float_rejects_non_numbers(bad):
    with pytest.raises(TypeError, match=r"decay: expected a float in \[0, 1\), got"):
        checks.check_float(bad, "decay", low=0, strict=False, high=1)
    with pytest.raises(TypeError, match=r"eps: expected a float > 0.0, got"):
        checks.check_float(bad, "eps", low=0.0, strict=True)


# --- check_positive -------------------------------------------------------------------------


@pytest.mark.parametrize("good", [1, 1e-12, 3.5, np.float32(2.0), np.int16(4), 1e300])
def test_check_positive_returns_a_float(good):
    out = checks.check_positive(good, "clip_sigma")
    assert type(out) is float and out == float(good)


@pytest.mark.parametrize("bad", [True, "1.0", None])
def test_check_positive_rejects_non_numbers(bad):
    with pytest.raises(TypeError, match=r"clip_sigma: expected a float > 0, got"):
        checks.check_positive(bad, "clip_sigma")


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, NAN, INF, -INF])
def test_check_positive_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match=r"clip_sigma: expected a finite float > 0, got"):
        checks.check_positive(bad, "clip_sigma")


# --- check_state_dtype ----------------------------------------------------------------------


def test_check_state_dtype():
    assert checks.check_state_dtype(None) is None
    assert checks.check_state_dtype(jnp.bfloat16) == jnp.dtype(jnp.bfloat16)
    assert checks.check_state_dtype("float32") == jnp.dtype(jnp.float32)
    assert isinstance(checks.check_state_dtype(np.float16), np.dtype)
    with pytest.raises(ValueError, match=r"^state_dtype: expected None or a floating dtype"):
        checks.check_state_dtype(jnp.int32)
    with pytest.raises(ValueError, match=r"^state_dtype: expected None or a floating dtype"):
        checks.check_state_dtype(bool)
    with pytest.raises(TypeError, match=r"^mu_dtype: expected None or a floating dtype"):
        checks.check_state_dtype("not-a-dtype", "mu_dtype")


# --- check_tx, check_state, check_scalar_count, require_params -------------------------------


def test_check_tx():
    tx = optax.sgd(0.1)
    assert checks.check_tx(tx, "inner") is tx
    init_only = SimpleNamespace(init=tx.init, update=None)
    for bad in (None, 0.1, optax.sgd, object(), init_only, SimpleNamespace(update=tx.update)):
        with pytest.raises(TypeError, match=r"^inner: expected an optax.GradientTransformation"):
            checks.check_tx(bad, "inner")


class S(NamedTuple):
    count: object
    x: object


def test_check_state_and_scalar_count():
    checks.check_state(S(jnp.zeros((), jnp.int32), 1), S, "local_sgd")
    with pytest.raises(TypeError, match=r"^state: expected the S made by local_sgd\(\.\.\.\)"):
        checks.check_state(optax.EmptyState(), S, "local_sgd")
    with pytest.raises(ValueError, match=r"state.count of local_sgd has shape \(4,\)"):
        checks.check_state(S(jnp.zeros((4,), jnp.int32), 1), S, "local_sgd")
    checks.check_scalar_count(optax.EmptyState(), "f")  # no count field: nothing to check
    with pytest.raises(ValueError, match=r"state.count of f has shape \(2, 1\), expected a scalar"):
        checks.check_scalar_count(S(jnp.zeros((2, 1)), 0), "f")


def test_require_params():
    checks.require_params({"w": 0.0}, "diloco")
    with pytest.raises(ValueError, match=r"^params: diloco averages parameters.*params=None$"):
        checks.require_params(None, "diloco")


def test_checks_is_a_leaf_module():
    import ast
    import pathlib

    source = pathlib.Path(checks.__file__).read_text()
    mods = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add((node.module or "").split(".")[0] if not node.level else ".")
    assert mods <= {"jax", "numpy", "optax", "math", "typing"}, mods
