"""The options every compressor factory shares, documented once.

A factory such as :func:`jaxcomm.topk` takes its codec's own arguments
(``ratio``, ``rank``, ``bucket_size``, ...) by name, and the exchange's
common options as keywords typed :class:`Options`:

    >>> tx = jaxcomm.topk(0.01, axis_name="data", min_size=4096)

Each factory takes the options that mean something for its method (its
docstring names them, with any default that differs from
:data:`DEFAULTS`). An option it does not take, or a misspelled argument, is
refused with a ``TypeError`` that names the factory and what it takes:
nothing is silently ignored.

Adding an option for every method is one edit here; a factory that takes it
adds its name to the tuple it passes to :func:`take`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypedDict

from jaxcomm.buckets import DEFAULT_BUCKET_BYTES
from jaxcomm.ledger import AxisName

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10 has no typing.Unpack

    class Unpack:
        """``Unpack[Options]`` on Python 3.10, where ``typing`` has no ``Unpack``: the
        annotation evaluates to ``Options`` (no ``typing_extensions``: jaxcomm's runtime
        dependencies stay jax, optax and numpy)."""

        def __class_getitem__(cls, item: Any) -> Any:
            return item


if TYPE_CHECKING:
    import jax

__all__ = ["Options", "DEFAULTS", "UnknownOption", "take", "Unpack"]


class UnknownOption(TypeError):
    """A factory was passed arguments it does not take (:func:`take`'s refusal).

    Attributes:
      factory: the factory's public name.
      unknown: the names refused, sorted.
    """

    def __init__(self, message: str, factory: str, unknown: list[str]) -> None:
        super().__init__(message)
        self.factory, self.unknown = factory, unknown


class Options(TypedDict, total=False):
    """The common keyword options of the compressor factories.

    Attributes:
      axis_name: mesh axis to average over. ``None`` (default): no
        collective, the update is compressed and decompressed locally
        (single-worker research). Set: the update must run under
        ``jax.shard_map``/``jax.pmap``/``jax.vmap`` binding that axis, and
        returns the worker mean.
      error_feedback: keep what was not sent in a residual and add it to
        the next gradient (Seide et al. 2014; Karimireddy et al. 2019); one
        extra model copy in the state. Default ``True``; the lossless-ish
        quantisers and casts default to ``False`` (their docstrings say so).
      min_size: leaves with fewer entries go dense (a plain mean in their
        own dtype, no residual), as torch's PowerSGD hook does for biases.
        Default 1024.
      key: PRNG key, required by the stochastic codecs (random-k,
        stochastic rounding, QSGD, TernGrad, PowerSGD's draws).
      scope: ``"leaf"`` (default) compresses each leaf on its own;
        ``"global"`` concatenates the compressible leaves first (e.g. global
        top-k).
      bucket_bytes: tensor fusion: payloads packed into buffers of at most
        this many bytes, one collective each. Default ``"auto"`` (25 MiB on
        GPU/TPU; on CPU 1 MiB for sums, 25 MiB for gathers); ``None`` or 0:
        one collective per payload array. Results are bit-identical either
        way.
      state_dtype: dtype of the error-feedback residual. ``None`` (default):
        float32 for bf16/fp16 leaves, the leaf's dtype otherwise.
      exchange: how all-gathered payloads travel: ``"gather"``,
        ``"two_phase"``, ``"reduce_scatter"``, ``"auto"`` (default: the fewer
        bytes for this codec, tree and axis size), or a
        :class:`jaxcomm.strategies.Strategy` (see :func:`jaxcomm.compress`).
    """

    axis_name: AxisName | None
    error_feedback: bool
    min_size: int
    key: jax.Array | None
    scope: str
    bucket_bytes: int | str | None
    state_dtype: Any
    exchange: Any


#: Each option's default where a factory does not set its own.
DEFAULTS: dict[str, Any] = {
    "axis_name": None,
    "error_feedback": True,
    "min_size": 1024,
    "key": None,
    "scope": "leaf",
    "bucket_bytes": DEFAULT_BUCKET_BYTES,
    "state_dtype": None,
    "exchange": "auto",
}


def take(factory: str, given: dict[str, Any], names: tuple[str, ...], **defaults: Any) -> dict:
    """The options ``factory`` takes, from what its caller passed (``given``).

    Args:
      factory: the factory's public name (for the error).
      given: the ``**options`` the caller passed.
      names: the options of :class:`Options` this factory takes.
      **defaults: this factory's own defaults, where they differ from
        :data:`DEFAULTS`.

    Returns:
      ``{name: value}`` for every name of ``names``: the caller's value, else
      the factory's default, else :data:`DEFAULTS`'.

    Raises:
      UnknownOption: a ``TypeError``: ``given`` holds a name outside ``names``
        (a misspelled argument, or an option this method has no use for).
    """
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise UnknownOption(
            f"jaxcomm.{factory}: unexpected argument(s) {', '.join(map(repr, unknown))}; besides "
            f"its own arguments it takes the options {', '.join(names)} "
            "(see jaxcomm.options.Options)",
            factory,
            unknown,
        )
    return {name: given.get(name, defaults.get(name, DEFAULTS[name])) for name in names}
