'''The method registry: every gradient transform of jaxcomm, by name.

A method's name is the name of its factory: ``jaxcomm.topk`` is ``"topk"``.
:func:`names` lists them all (jaxcomm's public factories, found with
``getattr(jaxcomm, name)`` over ``jaxcomm.__all__``, plus the factories of
every module in :mod:`jaxcomm.compressors`), :func:`get` returns one and
:func:`make` builds one the way the experiments do (a ``key`` added where the
factory takes one). :func:`compressors` are the methods that exchange a
gradient and can stand first in an optimizer chain. Nothing else in the
project lists methods: configs, benchmarks, tests and the policy name them
and resolve the name here, and ``tests/test_names.py`` fails when a name
anywhere does not resolve.

## Add a compressor

A compressor is one file, ``jaxcomm/compressors/<name>.py``, holding three
things (a toy fp8 codec below; ``tests/test_recipe.py`` writes this very
block to a file and runs what this section promises):

1. a codec, derived from :class:`jaxcomm.core.CompressorBase`: ``encode``
   one flat vector into a tuple of static-shape arrays (the payload),
   ``decode`` the sum of the workers' payloads, ``kind`` how the payload
   travels (``"psum"`` where payloads add, else ``"all_gather"``); the
   wire size defaults to the encoded arrays' bytes;
2. a state class of its own, :func:`jaxcomm.core.state_type` (the fields of
   :class:`jaxcomm.core.CompressState`; another transform's state is
   refused by name);
3. a factory listed in the module's ``__all__``, returning
   ``core.compress(codec, **o)``: the shared pipeline adds error feedback,
   buckets, the exchange, the NaN rule and the byte ledger. The factory
   names its codec's own arguments (none for fp8) and takes the common
   options as ``**options: Unpack[Options]``; :func:`jaxcomm.options.take`
   resolves the ones it takes (and refuses any other, naming the factory),
   and its docstring lists them on one ``**options:`` line
   (:class:`jaxcomm.options.Options` documents each).

```python
"""FP8 (e4m3) gradients: one byte per entry and a float32 scale per vector."""

import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import core
from jaxcomm.options import Options, Unpack, take

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


Fp8State = core.state_type("Fp8State", __name__)


class Fp8(core.CompressorBase):
    """``p / s`` as float8_e4m3fn bits (``s = max|p| / 448``), all-gathered with ``s``."""

    state_cls = Fp8State
    kind = "all_gather"

    def encode(self, p, key):
        s = jnp.max(jnp.abs(p)).astype(jnp.float32) / E4M3_MAX
        s = jnp.where(s > 0, s, 1.0)
        q = (p.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn)
        return (lax.bitcast_convert_type(q, jnp.uint8), s[None]), None

    def decode(self, payload, aux, d, dtype):
        q, s = payload  # (workers, d) uint8, (workers, 1) float32
        x = lax.bitcast_convert_type(q, jnp.float8_e4m3fn).astype(jnp.float32)
        return (x * s).sum(axis=0).astype(dtype)


def fp8(**options: Unpack[Options]) -> optax.GradientTransformation:
    """Exchange gradients as fp8 (e4m3) with a per-vector scale: 1 byte per entry.

    Args:
      **options: ``axis_name``, ``error_feedback``, ``min_size``, ``bucket_bytes``,
        ``exchange``: see :class:`jaxcomm.options.Options`.

    Example:
      >>> tx = optax.chain(fp8(axis_name="data"), optax.sgd(0.1))
    """
    names = ("axis_name", "error_feedback", "min_size", "bucket_bytes", "exchange")
    return core.compress(Fp8(), **take("fp8", options, names))


__all__ = ["fp8", "Fp8", "Fp8State"]
```

Then one test entry, in ``tests/test_registry.py``'s ``REGISTRY`` (its
property tests: jit, state stable, dtypes kept, shard_map = pmap = vmap, HLO
bytes = ``wire_bytes``, the NaN rule; ``test_registry_is_complete`` fails
until the entry is there):

    "fp8": lambda ax, **kw: methods.get("fp8")(axis_name=ax, **kw, min_size=64),

and its saved outputs, added without rewriting any other entry's:
``python -m tests.golden_regen --only fp8`` (``tests/test_golden.py``
fails where an entry's saved outputs change without that entry being named).
A NumPy reference test of the codec goes in its own test module.

Nothing else changes. The method is then a training config's compressor
(``c.compressor.name = "fp8"``, or the variant ``:fp8`` of a config with
``VARIANTS``, see :mod:`experiments.configs.common`), a benchmark case
(``python -m experiments.bench.compressors --cases fp8``) and a what-if
scheme's ``factory``. To make it a top-level name (``jaxcomm.fp8``) as well,
import it in ``jaxcomm/__init__.py`` and list it in ``__all__``.
'''

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

import jax
import optax

import jaxcomm
from jaxcomm import options

__all__ = ["compressors", "get", "make", "names"]

_RETURNS = (optax.GradientTransformation, "optax.GradientTransformation", "GradientTransformation")


def _is_factory(obj: Any) -> bool:
    """A function that returns a gradient transformation (by its annotation), not the
    pipeline itself (:func:`jaxcomm.compress` takes a codec object, not options)."""
    if not inspect.isfunction(obj) or obj is jaxcomm.core.compress:
        return False
    return inspect.signature(obj).return_annotation in _RETURNS


def _compressor_modules() -> list[Any]:
    """Every module of :mod:`jaxcomm.compressors` (packages' submodules included)."""
    package = jaxcomm.compressors
    found = pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    return [importlib.import_module(info.name) for info in found]


def _from_compressors() -> dict[str, Callable]:
    """The factories listed in the ``__all__`` of a :mod:`jaxcomm.compressors` module."""
    out = {}
    for module in _compressor_modules():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if _is_factory(obj):
                out[name] = obj
    return out


def _registry() -> dict[str, Callable]:
    """Name -> factory: jaxcomm's public factories, then the compressors' modules'."""
    public = {n: getattr(jaxcomm, n) for n in jaxcomm.__all__ if _is_factory(getattr(jaxcomm, n))}
    return {**_from_compressors(), **public}


def names() -> list[str]:
    """Every method's name, sorted."""
    return sorted(_registry())


def compressors() -> list[str]:
    """The methods that exchange a gradient and stand first in an optimizer chain:
    the factories of :mod:`jaxcomm.compressors`' modules (the dense all-reduce and
    casts, sparsifiers, quantisers, sign methods, DGC, PowerSGD), sorted."""
    return sorted(_from_compressors())


def get(name: str) -> Callable[..., optax.GradientTransformation]:
    """The factory of method ``name``; a ``ValueError`` naming the known methods otherwise.

    Example:
      >>> tx = methods.get("topk")(0.01, axis_name="data")
    """
    registry = _registry()
    if name not in registry:
        raise ValueError(
            f"unknown method {name!r}; choose from {sorted(registry)} (a new compressor: "
            "see jaxcomm.methods, 'Add a compressor')"
        )
    return registry[name]


def make(name: str, *, seed: int = 0, **kwargs: Any) -> optax.GradientTransformation:
    """``get(name)(**kwargs)``, with ``key=jax.random.key(seed)`` where the factory takes a
    key and none is given (how configs, benchmarks and the policy build a method).

    Example:
      >>> tx = methods.make("powersgd", rank=2, axis_name="data")
    """
    factory = get(name)
    if "key" in kwargs:
        return factory(**kwargs)
    params = inspect.signature(factory).parameters
    if "key" in params:
        return factory(**kwargs, key=jax.random.key(seed))
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return factory(**kwargs)
    # common options as **options (jaxcomm.options): whether "key" is one it takes is in
    # the names it gives jaxcomm.options.take, which refuses it by name otherwise
    try:
        return factory(**kwargs, key=jax.random.key(seed))
    except options.UnknownOption as err:
        if "key" not in err.unknown:
            raise
    return factory(**kwargs)
