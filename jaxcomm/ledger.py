"""The byte ledger: what a transform sends, recorded while it is traced.

:func:`jaxcomm.accounting.wire_report` traces a transform's ``update``
abstractly inside :func:`recording`; the collectives of
:mod:`jaxcomm.collectives` then find the open ledger (:func:`current_ledger`),
note the operand of each collective (a :class:`Collective`: the bytes a worker
contributes) and stand in for the collective by shape alone, so no devices or
mesh are needed. Each entry is tagged in the jaxpr under a named scope
starting with :data:`MARKER`, so only the collectives that end up in the
traced program are counted.

This module imports nothing else of jaxcomm.
"""

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax

AxisName = str | tuple[str, ...]


class Collective(NamedTuple):
    """One collective a worker takes part in during one step.

    Attributes:
      kind: ``"all_reduce"``, ``"all_gather"``, ``"collective_permute"`` or
        ``"reduce_scatter"``.
      axis: the mesh axis name (or tuple of names) it runs over.
      nbytes: bytes this worker contributes: the operand size (for an
        all-reduce the whole payload S, for an all-gather the worker's piece).
      dtype: dtype name of the operand as the algorithm sends it.
      shape: operand shape (the first operand's, for several).
      operands: number of operands (arrays) the one collective carries:
        always 1 for what jaxcomm issues; compiled HLO may combine several
        collectives into one instruction with several operands (XLA:CPU then
        still exchanges them one by one).
    """

    kind: str
    axis: Any
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    operands: int = 1


BACKENDS = ("cpu", "gpu", "tpu")


class _Ledger:
    def __init__(self, sizes: int | Mapping[str, int], backend: str | None = None):
        self.sizes = sizes
        self.backend = backend
        self.collectives: list[Collective] = []

    def size(self, axis_name: AxisName) -> int:
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        if isinstance(self.sizes, int):
            return self.sizes ** len(names)
        missing = [a for a in names if a not in self.sizes]
        if missing:
            raise ValueError(
                f"n_workers: no size given for mesh axis {missing[0]!r}; pass an int or a "
                f"dict with every axis the transform uses, e.g. {{{missing[0]!r}: 8}}"
            )
        return math.prod(self.sizes[a] for a in names)


_local = threading.local()


def current_ledger() -> _Ledger | None:
    """The innermost open ledger (see :func:`recording`), or ``None`` when none is open."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def backend() -> str:
    """The backend whose collectives are being built: ``"cpu"``, ``"gpu"`` or ``"tpu"``.

    ``jax.default_backend()``, unless a ledger records for another one
    (``wire_report(..., backend="gpu")`` on a CPU machine). What differs by
    backend is only what XLA:CPU does to 16-bit floats
    (:func:`jaxcomm.collectives.moved_itemsize`).
    """
    ledger = current_ledger()
    if ledger is not None and ledger.backend is not None:
        return ledger.backend
    return jax.default_backend()


@contextlib.contextmanager
def recording(sizes: int | Mapping[str, int], backend: str | None = None) -> Iterator[_Ledger]:
    """Open a ledger: collectives traced inside are recorded, not run.

    Use through :func:`jaxcomm.accounting.wire_report`; only meant for abstract
    tracing (``jax.make_jaxpr``), since the stand-ins compute nothing useful.
    ``backend`` (one of :data:`BACKENDS`, ``None``: the one JAX runs on) is
    the backend the bytes are counted for (see :func:`backend`).
    """
    if isinstance(sizes, int) and sizes < 1:
        raise ValueError(f"n_workers: must be >= 1, got {sizes}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected None or one of {BACKENDS}, got {backend!r}")
    ledger = _Ledger(sizes, backend)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ledger)
    try:
        yield ledger
    finally:
        stack.pop()


MARKER = "jaxcomm_wire_"
"""Prefix of the named scope that tags each recorded collective in the jaxpr."""
