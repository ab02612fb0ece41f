"""Honest accounting: what a transform sends, and what the compiled program moves.

Two views, held equal by the tests:

* :func:`wire_report` / :func:`jaxcomm.wire_bytes` — what the *algorithm*
  sends: the operand of every collective jaxcomm issues, per worker per step,
  in the dtype the algorithm chose (as the backend moves it, see below).
  Obtained by tracing ``tx.update`` abstractly (no devices, any number of
  workers), so it covers compositions (``optax.chain``, ``optax.partition``,
  ``optax.MultiSteps``) for free.
* :func:`collective_bytes` / :func:`hlo_collectives` — what the *compiled
  program* moves: the operand bytes of every all-reduce, all-gather,
  reduce-scatter, collective-permute and all-to-all in optimised HLO text.

Convention: bytes are the operand a worker contributes (all-reduce: the
payload S; all-gather: its own piece s), not the traffic of a particular
algorithm. A ring all-reduce of S sends ``2(n-1)/n·S`` per worker, an
all-gather of s sends ``(n-1)·s``; :mod:`jaxcomm.netsim` turns a report into
time with those formulas.

Both views count collectives as well as bytes (:func:`wire_count`,
:func:`collective_count`): over real processes each collective pays a fixed
latency, which is why jaxcomm packs payloads into buckets
(:mod:`jaxcomm.buckets`), one collective per bucket.

Backend differences: XLA:CPU promotes every bf16 collective to float32 (the
HLO shows ``f32`` and ``to_apply=..._promoted``). jaxcomm therefore moves
16-bit floats as their ``uint16`` bits in collectives that only move data
(all-gather, all-to-all, collective-permute: 2 bytes per entry on every
backend), and the report counts a bf16 all-reduce or reduce-scatter at the 4
bytes per entry XLA:CPU moves when it is made for the CPU backend
(``backend=None`` on a CPU machine, or ``backend="cpu"``), at 2 for GPU/TPU,
which reduce bf16 natively. So the two views agree to the byte on every
backend; ``wire_report(..., backend="gpu")`` plans for a GPU cluster from a
CPU machine.
"""

import importlib
import math
import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm.jaxprs import equations
from jaxcomm.ledger import MARKER, Collective, recording

__all__ = [
    "Collective",
    "collective_bytes",
    "collective_count",
    "hlo_collectives",
    "payload_bytes",
    "traffic_bytes",
    "wire_bytes",
    "wire_count",
    "wire_report",
]


def wire_report(
    tx: optax.GradientTransformation,
    params: Any,
    n_workers: int | Mapping[str, int],
    *,
    backend: str | None = None,
) -> list[Collective]:
    """Every collective one worker takes part in during one update of ``tx``.

    ``tx.update`` is traced to a jaxpr with a ledger open, so nothing is
    computed and no mesh or devices are needed; only collectives that end up
    in the traced program count. Collectives inside ``lax.cond`` branches
    (:func:`jaxcomm.accumulate`, :func:`jaxcomm.local_sgd`) are counted once:
    the report describes a step that communicates (``optax.MultiSteps``
    runs its inner update, exchange included, on every micro-step). A
    collective inside a loop body (``lax.scan``/``fori_loop``) is also counted
    once, like an HLO instruction. Where a transform switches between modes
    with different payloads (``lax.switch``/``cond``: DGC's warm-up
    densities, PowerSGD's dense steps before ``start_iter``), every branch's
    collectives are counted, as they all appear in the compiled program: an
    upper bound for any single step. Build the transform in its steady-state
    setting (no warm-up) to report steady-state bytes.

    Args:
      tx: any optax transformation containing jaxcomm transforms.
      params: the params (arrays or ``jax.ShapeDtypeStruct``); gradients are
        taken to have the same shapes and dtypes.
      n_workers: workers on every mesh axis (an int), or a dict mapping axis
        name to its size (e.g. ``{"node": 4, "local": 8}``).
      backend: count the bytes as this backend moves them: ``"cpu"``,
        ``"gpu"`` or ``"tpu"``; ``None`` (default): the one JAX runs on, so
        the report equals what :func:`collective_bytes` reads from this
        machine's compiled program. The backends differ only in 16-bit
        floats: XLA:CPU sums bf16 in float32 (a bf16 all-reduce moves 4
        bytes per entry there, 2 on GPU/TPU), and ``jaxcomm.cast``'s default
        exchange differs (uint16 words on CPU, the psum elsewhere). Pass
        ``"gpu"`` on a laptop to plan for a GPU cluster.

    Returns:
      A list of :class:`jaxcomm.ledger.Collective`.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params
    )
    # traced outside any mesh the caller set (jax.set_mesh): the ledger simulates the axes
    no_mesh = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))
    with no_mesh, recording(n_workers, backend) as ledger:
        # a fresh function: jax caches traces by function, and init may depend on n
        state = jax.eval_shape(lambda p: tx.init(p), abstract)
        closed = jax.make_jaxpr(lambda u, s, p: tx.update(u, s, p))(abstract, state, abstract)
    return in_program(closed, ledger.collectives)


def in_program(closed: Any, recorded: list[Collective]) -> list[Collective]:
    """The collectives of ``recorded`` (a ledger's, in order) whose tag is in the traced
    program ``closed`` (a ``ClosedJaxpr``): a function traced more than once (a branch
    traced to learn its types, ``jax.eval_shape``) records more than its program holds."""
    found = {
        int(m)
        for eqn in equations(closed)
        if eqn.primitive.name == "optimization_barrier"
        for m in _MARK.findall(str(eqn.source_info.name_stack))
    }
    return [c for i, c in enumerate(recorded) if i in found]


_MARK = re.compile(MARKER + r"(\d+)")


def wire_bytes(
    tx: optax.GradientTransformation,
    params: Any,
    n_workers: int | Mapping[str, int],
    *,
    axis: Any = None,
    backend: str | None = None,
) -> int:
    """Bytes each worker contributes to collectives in one step of ``tx``.

    The sum of :func:`wire_report`'s ``nbytes``: the all-reduce payloads plus
    the worker's all-gathered pieces, in the dtypes the algorithms send.
    ``axis`` counts only the collectives over that mesh axis (e.g. the slow
    ``"node"`` axis of a :func:`jaxcomm.hierarchical` exchange). ``backend``:
    as for :func:`wire_report` (default: the backend JAX runs on).

    Example:
      >>> params = {"w": jnp.zeros((1000, 1000))}
      >>> jaxcomm.wire_bytes(jaxcomm.topk(0.01), params, 8)   # axis_name=None: 0
      >>> jaxcomm.wire_bytes(jaxcomm.topk(0.01, axis_name="data"), params, 8)
      80000
    """
    return sum(
        c.nbytes
        for c in wire_report(tx, params, n_workers, backend=backend)
        if axis is None or c.axis == axis
    )


def wire_count(
    tx: optax.GradientTransformation,
    params: Any,
    n_workers: int | Mapping[str, int],
    *,
    axis: Any = None,
    backend: str | None = None,
) -> int:
    """Number of collectives one worker takes part in during one step of ``tx``.

    ``len(wire_report(...))`` (restricted to mesh axis ``axis`` if given): with
    tensor fusion on, one per bucket (plus e.g. an 8-byte key agreement).
    :func:`collective_count` reads the same number out of compiled HLO.

    Example:
      >>> jaxcomm.accounting.wire_count(jaxcomm.allreduce(axis_name="data"), params, 8)
      1
    """
    report = wire_report(tx, params, n_workers, backend=backend)
    return sum(1 for c in report if axis is None or c.axis == axis)


def traffic_bytes(collectives: list[Collective], n_workers: int) -> float:
    """Bytes one worker sends for ``collectives`` with bandwidth-optimal algorithms.

    All-reduce of S: ``2(n-1)/n·S`` (ring / reduce-scatter + all-gather).
    All-gather of a piece s: ``(n-1)·s``. Reduce-scatter of S: ``(n-1)/n·S``.
    Collective-permute of s: ``s``. This is what makes sparse all-gathers
    lose to a dense ring as n grows (see :mod:`jaxcomm.netsim`).

    Example:
      >>> report = jaxcomm.accounting.wire_report(tx, params, 8)
      >>> jaxcomm.accounting.traffic_bytes(report, 8)
    """
    n = n_workers
    if n < 1:
        raise ValueError(f"n_workers: must be >= 1, got {n}")
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": n - 1,
        "reduce_scatter": (n - 1) / n,
        "collective_permute": 1.0 if n > 1 else 0.0,
        "all_to_all": (n - 1) / n,
    }
    return sum(factor[c.kind] * c.nbytes for c in collectives)


def payload_bytes(compressor: Any, d: int, dtype: Any, n_workers: int = 1) -> int:
    """Bytes of the payload ``compressor`` encodes a ``(d,)`` vector of ``dtype`` into.

    ``compressor.wire_size(d, dtype, n_workers)``, the one payload size
    (:meth:`jaxcomm.Compressor.wire_size`): by default the sizes of the arrays
    ``encode`` returns, per-bucket scales and word padding included.
    """
    return int(compressor.wire_size(d, dtype, n_workers))


def __getattr__(name: str) -> Any:
    # exchange_traffic moved to jaxcomm.strategies, with the strategies' traffic models
    # (imported by name when asked for: jaxcomm.strategies is built on this module)
    if name == "exchange_traffic":
        warnings.warn(
            "jaxcomm.accounting.exchange_traffic moved: import it from jaxcomm.strategies",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module("jaxcomm.strategies").exchange_traffic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- compiled HLO -------------------------------------------------------------

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
}  # fmt: skip

_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "collective-permute": "collective_permute",
    "all-to-all": "all_to_all",
}
# `%x = TYPE op(` where op is a collective or its async -start form.
_LINE = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|collective-permute|"
    r"all-to-all)(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


def _shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dt, dims in _SHAPE.findall(type_str):
        if dt in _DTYPE_BITS:
            out.append((dt, tuple(int(x) for x in dims.split(",") if x)))
    return out


def _nbytes(dt: str, dims: tuple[int, ...]) -> int:
    return math.ceil(math.prod(dims) * _DTYPE_BITS[dt] / 8)


def _group_size(line: str, default: int | None) -> int | None:
    m = _GROUPS_LIST.search(line)
    if m:
        inner = m.group(1).strip("{}")
        return len(inner.split(",")) if inner else default
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    return default


def _hlo_text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    if hasattr(compiled, "compile") and not hasattr(compiled, "as_text"):
        compiled = compiled.compile()
    text = compiled.as_text()
    if text is None:
        raise ValueError("compiled: this object has no HLO text (as_text() returned None)")
    return text


def hlo_collectives(compiled: Any, *, n_devices: int | None = None) -> list[Collective]:
    """Collectives in a compiled program's optimised HLO, with operand bytes.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``),
        a ``Lowered`` (compiled here), or HLO text.
      n_devices: group size to assume where the HLO gives no replica groups.

    Returns:
      One :class:`jaxcomm.ledger.Collective` per collective instruction;
      ``nbytes`` is the operand size per participant (all-gather: result /
      group size; reduce-scatter: result × group size), ``axis`` the group size,
      ``operands`` the number of arrays the instruction carries (XLA may
      combine several all-reduces into one multi-operand instruction).
    """
    out = []
    for line in _hlo_text(compiled).splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        op = m.group("op")
        shapes = _shapes(m.group("type"))
        if not shapes:
            continue
        async_pair = m.group("start") and op in ("all-gather", "collective-permute")
        if async_pair and len(shapes) >= 2:
            # async start: result is (operands..., outputs...); keep the operands.
            shapes = shapes[: len(shapes) // 2]
            group = 1
        else:
            group = _group_size(line, n_devices) or 1
        nbytes = sum(_nbytes(dt, dims) for dt, dims in shapes)
        if op == "all-gather" and not m.group("start"):
            nbytes //= group
        elif op == "reduce-scatter":
            nbytes *= group
        dt, dims = shapes[0]
        out.append(Collective(_KINDS[op], group, nbytes, dt, dims, len(shapes)))
    return out


def collective_bytes(compiled: Any, *, n_devices: int | None = None) -> int:
    """Total operand bytes of the collectives in a compiled program (per device).

    Example:
      >>> compiled = jax.jit(step).lower(params, state, batch).compile()
      >>> jaxcomm.accounting.collective_bytes(compiled)
    """
    return sum(c.nbytes for c in hlo_collectives(compiled, n_devices=n_devices))


def collective_count(compiled: Any, *, operands: bool = False) -> int:
    """Number of collective instructions in a compiled program.

    Args:
      compiled: as for :func:`hlo_collectives`.
      operands: count operands instead of instructions (an all-reduce that
        XLA combined from k all-reduces counts k; on XLA:CPU each operand is
        a separate exchange).

    Example:
      >>> jaxcomm.accounting.collective_count(jax.jit(step).lower(*args).compile())
    """
    found = hlo_collectives(compiled)
    return sum(c.operands for c in found) if operands else len(found)
