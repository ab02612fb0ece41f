"""The exchange strategies of :func:`jaxcomm.core.compress`: one object each.

A strategy is how a transform's payloads cross the wire. Each is an instance
of a :class:`Strategy` subclass that owns, in one place:

- its **name** (``exchange="gather"``, ...) and the compressors it accepts
  (:meth:`Strategy.check`, when the transform is built);
- its **server state**: whether ``init`` makes a second residual
  (:meth:`Strategy.needs_server`);
- its **choice**: which strategy a trace runs, checked that it can
  (:meth:`Strategy.resolve`; ``"auto"`` picks by bytes);
- its **traffic model**: the bytes one worker sends for the payloads
  (:meth:`Strategy.traffic`, by :func:`jaxcomm.accounting.traffic_bytes`);
- the **exchange** itself (:meth:`Strategy.run`): encode, exchange, decode,
  the NaN rule and the new residuals, from the :class:`jaxcomm.stages.Step`.

:func:`jaxcomm.core.compress` looks the ``exchange=`` option up in
:data:`STRATEGIES` (or takes a :class:`Strategy` instance as it is) and
dispatches through it; without an axis it runs :data:`LOCAL`.

- :class:`Local`: no axis; every vector is encoded and decoded here.
- :class:`Gather`: the payloads are summed (``kind="psum"``) or all-gathered,
  bucketed, with the dense leaves and the NaN rule's flag.
- :class:`TwoPhase`: :func:`jaxcomm.exchange.two_phase`, with a server residual.
- :class:`ReduceScatter`: :func:`jaxcomm.exchange.reduce_scatter`, shard-shaped updates.
- :class:`Auto`: the one of gather and two-phase that moves fewer bytes.

Add an exchange strategy
------------------------
Subclass :class:`Strategy` (a frozen dataclass: options become fields), set
``name`` and ``kinds`` (the compressor kinds it accepts), and write
:meth:`Strategy.run` from the stages of :mod:`jaxcomm.stages` and the
collectives of :mod:`jaxcomm.buckets` / :mod:`jaxcomm.collectives` (they
record what is sent, so :func:`jaxcomm.wire_bytes` counts it) and
:meth:`Strategy.traffic` (the bytes ``run`` sends for the payloads, by
:func:`jaxcomm.accounting.traffic_bytes`). Override :meth:`Strategy.check`,
:meth:`Strategy.needs_server` or :meth:`Strategy.resolve` only where it
refuses more, keeps a server residual or picks another strategy. Pass an
instance as ``exchange=``; to make it a name, add it to :data:`STRATEGIES`
in this module. Nothing else changes. For example, every worker's decoded
payload summed by one all-reduce:

    @dataclasses.dataclass(frozen=True)
    class DecodedSum(strategies.Strategy):
        name: ClassVar[str] = "decoded_sum"
        kinds: ClassVar[tuple[str, ...]] = ("all_gather",)

        def traffic(self, compressor, vectors, n):
            size = collectives.moved_itemsize
            sent = [Collective("all_reduce", None, d * size(t), "", (d,)) for d, t in vectors]
            return accounting.traffic_bytes(sent, n)

        def run(self, compressor, step, state, config):
            encoded, ok = stages.encode(compressor, step, config)
            ...  # decode each own payload, buckets.bucketed_psum the vectors, put_mean
            return outputs, stages.memory(compressor, step, state, encoded, ok, config)

``tests/test_strategies.py`` builds that strategy in full and holds it to a
NumPy reference and to the compiled program's bytes.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxcomm import accounting, buckets, collectives, exchange, stages
from jaxcomm.ledger import Collective
from jaxcomm.protocol import path_str
from jaxcomm.stages import Config, Memory, Payload, Step


@dataclasses.dataclass(frozen=True)
class Strategy:
    """An exchange strategy (see the module doc); subclasses set ``name`` and ``kinds``."""

    name: ClassVar[str] = ""
    kinds: ClassVar[tuple[str, ...]] = ("all_gather",)  # compressor kinds it accepts

    def check(self, compressor: Any, *, scope: str) -> None:
        """Raise if the transform cannot run this strategy (when it is built)."""
        if compressor.kind not in self.kinds and self.kinds == ("all_gather",):
            raise ValueError(
                f"exchange: {self.name!r} is for compressors whose payloads are all-gathered; "
                f"this one's payloads are summed (kind={compressor.kind!r}), already a single "
                "all-reduce"
            )
        if compressor.kind not in self.kinds:
            raise ValueError(
                f"exchange: {self.name!r} is for compressors of kind {self.kinds}, not "
                f"kind={compressor.kind!r}"
            )
        if compressor.agrees:
            raise ValueError("exchange: this compressor agrees on values per vector; use 'gather'")

    def needs_server(self, compressor: Any, leaves: list, config: Config) -> bool:
        """Whether ``init`` (of ``leaves``, with error feedback on an axis) makes ``server``."""
        return False

    def resolve(self, compressor: Any, step: Step, state: Any, config: Config) -> "Strategy":
        """The strategy this trace runs (on a bound axis), checked that it can run."""
        return self

    def traffic(self, compressor: Any, vectors: list[tuple[int, Any]], n: int) -> float:
        """Bytes one worker sends for the payloads of ``vectors`` (``(d, dtype)``) on ``n``."""
        raise NotImplementedError(f"{type(self).__name__}.traffic")

    def run(self, compressor: Any, step: Step, state: Any, config: Config) -> tuple[list, Memory]:
        """The exchange: the updates as flat leaves (tree order) and the new memory."""
        raise NotImplementedError(f"{type(self).__name__}.run")


def _sizes(compressor: Any, n: int):
    """``s(d, dtype, codec)``: payload bytes (:func:`jaxcomm.accounting.payload_bytes`), cached."""
    cache: dict[tuple[int, int, str], int] = {}

    def s(d, dtype, codec=compressor):
        k = (id(codec), d, jnp.dtype(dtype).name)
        if k not in cache:
            cache[k] = accounting.payload_bytes(codec, d, dtype, n)
        return cache[k]

    return s


# --- the strategies -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Local(Strategy):
    """No axis (``axis_name=None``): every vector encoded and decoded on this worker."""

    name: ClassVar[str] = "local"
    kinds: ClassVar[tuple[str, ...]] = ("psum", "all_gather")

    def traffic(self, compressor, vectors, n):
        return 0.0

    def run(self, compressor, step, state, config):
        encoded, ok = stages.encode(compressor, step, config)
        outputs = [g if i in step.dense else None for i, g in enumerate(step.grads)]
        received = [
            payload if compressor.kind == "psum" else tuple(x[None] for x in payload)
            for payload, _ in encoded
        ]
        stages.decode_groups(compressor, step, received, encoded, ok, None, outputs)
        return outputs, stages.memory(compressor, step, state, encoded, ok, config)


DENSE_RIDE_BYTES = 64 * 2**10
"""Bytes a gather-path step may add per worker to save one collective (see :func:`dense_rides`)."""


def dense_rides(n: int, dense_bytes: int) -> bool:
    """Whether an all-gathered codec's dense (small) leaves ride in its all-gather.

    A step then runs one collective per bucket instead of an all-gather beside
    an all-reduce of the small leaves. Gathering ``s`` bytes instead of
    all-reducing them receives ``(n-1)·s`` instead of ``2(n-1)/n·s``: nothing
    more on 2 workers, ``(n-1)(n-2)/n·s`` more on n, against one collective's
    fixed latency α saved. α times the bandwidth is about 1 MB for NCCL in a
    node (~10 µs at 100 GB/s), a few MB for gloo over TCP (a few ms per
    collective at 1-10 Gbit/s) and 0.6 MB across regions (50 ms at 100
    Mbit/s); the rule keeps the added bytes under :data:`DENSE_RIDE_BYTES`
    (64 KiB), well below all of them. The two-phase exchange needs no rule:
    its small leaves ride in both phases at a ring all-reduce's bytes.

    Args:
      n: workers on the axis.
      dense_bytes: bytes of the small leaves a worker holds.
    """
    return n <= 2 or (n - 1) * (n - 2) / n * dense_bytes <= DENSE_RIDE_BYTES


def _wire(
    compressor: Any, step: Step, encoded: list, ok: jax.Array, config: Config, outputs: list
) -> tuple[list[Payload], jax.Array, int]:
    """Dense leaves (plain means, into ``outputs``) and payloads over the axis, in leaf order.

    Bucketed, one collective per bucket; the NaN rule's flag rides in the
    first bucket (see :func:`jaxcomm.stages.flag`). Returns every group's received
    payload, whether every worker's ``g + e`` was finite, and the number of workers.
    """
    n = collectives.axis_size(config.axis_name)
    first = {group[0]: gi for gi, group in enumerate(step.groups)}
    summed, gathered = [], []  # (leaf or group id, array)
    dest = summed if compressor.kind == "psum" else gathered
    # the small leaves ride in the payload's all-gather as raw words (one collective per
    # bucket) unless gathering them costs more bytes than a collective's latency
    dense_bytes = sum(step.grads[i].size * step.grads[i].dtype.itemsize for i in step.dense)
    ride = dest is gathered and step.groups and dense_rides(n, dense_bytes)
    for i in range(len(step.grads)):
        if i in step.dense:
            (gathered if ride else summed).append((("leaf", i), step.grads[i]))
        if i in first:
            dest.extend((("group", first[i]), x) for x in encoded[first[i]][0])
    if step.groups and not compressor.carries_nonfinite:
        dest.append((("flag", 0), stages.flag(ok, encoded[-1][0], compressor.kind)))
    sums = buckets.bucketed_psum([x for _, x in summed], config.axis_name, config.bucket_bytes)
    gath = buckets.bucketed_all_gather(
        [x for _, x in gathered], config.axis_name, config.bucket_bytes
    )
    parts: dict[int, list[jax.Array]] = {gi: [] for gi in range(len(step.groups))}
    for (tag, j), x in zip([t for t, _ in summed] + [t for t, _ in gathered], sums + gath):
        if tag == "leaf":
            x = buckets.sum_rows(x) if ride else x  # as the all-reduce adds
            outputs[j] = x / jnp.asarray(n, x.dtype)
        elif tag == "flag":
            ok = ~jnp.any(x > 0)
        else:
            parts[j].append(x)
    return [tuple(parts[gi]) for gi in range(len(step.groups))], ok, n


@dataclasses.dataclass(frozen=True)
class Gather(Strategy):
    """The payloads summed (``kind="psum"``) or all-gathered over the axis, bucketed.

    Traffic: ``(n-1)·s(d)`` per all-gathered vector, ``2(n-1)/n·s(d)`` per summed one.
    """

    name: ClassVar[str] = "gather"
    kinds: ClassVar[tuple[str, ...]] = ("psum", "all_gather")

    def check(self, compressor, *, scope):
        pass  # every compressor; agreeing ones agree in one bucketed all-reduce

    def traffic(self, compressor, vectors, n):
        s = _sizes(compressor, n)
        kind = "all_reduce" if compressor.kind == "psum" else "all_gather"
        sent = [Collective(kind, None, s(d, t), "uint8", (s(d, t),)) for d, t in vectors]
        return accounting.traffic_bytes(sent, n)

    def run(self, compressor, step, state, config):
        encoded, ok = stages.encode(compressor, step, config)
        outputs: list[jax.Array | None] = [None] * len(step.grads)
        received, ok, n = _wire(compressor, step, encoded, ok, config, outputs)
        stages.decode_groups(compressor, step, received, encoded, ok, n, outputs)
        return outputs, stages.memory(compressor, step, state, encoded, ok, config)


def _two_phase_memory(
    step: Step, group: list[int], own: jax.Array, server: jax.Array, ok: jax.Array, new: tuple
) -> None:
    """A group's residual ``p - own`` and server residual, into ``new = (residuals, servers)``."""
    residuals, (new_res, new_srv) = step.residuals, new
    dtype = jnp.result_type(*[residuals[i].dtype for i in group])
    parts = {i: step.ps_state.get(i, step.ps[i]) for i in group}
    vec = stages.group_state(parts, group).astype(dtype)
    res = vec - own.astype(dtype)
    for i, sl in stages.slices(group, step.ps):
        r = res[sl].reshape(residuals[i].shape).astype(residuals[i].dtype)
        new_res[i] = stages.keep_unless(ok, r, residuals[i])
        new_srv[i] = server[sl].reshape(residuals[i].shape)


def _counted(state: Any, ok: jax.Array) -> jax.Array:
    """The state's count of non-finite steps, this one counted if some ``g + e`` was not."""
    return stages.count_nonfinite(state.nonfinite, ok)


@dataclasses.dataclass(frozen=True)
class TwoPhase(Strategy):
    """:func:`jaxcomm.exchange.two_phase` for the payloads; error feedback on both sides.

    Traffic: ``(n-1)·(s(c) + s'(c))`` per vector, ``c = ceil(d/n)``, ``s'`` the
    payload of the compressor's ``server_codec()``: an all-to-all of n chunk
    payloads and an all-gather of one compressed chunk mean.
    """

    name: ClassVar[str] = "two_phase"

    def needs_server(self, compressor, leaves, config):
        return True

    def resolve(self, compressor, step, state, config):
        if config.error_feedback and state.server is None:
            n = collectives.axis_size(config.axis_name)
            raise ValueError(
                f"state.server is None, but exchange={config.strategy.name!r} runs the "
                f"two-phase exchange on {n} workers for these updates and needs its server "
                "residual: the state was made by init on an axis size where 'auto' picks "
                "'gather' (or saved by a transform with exchange='gather'). Make the state "
                "with tx.init(params) outside shard_map, or build the transform with "
                "exchange='gather' to keep using this state."
            )
        return self

    def traffic(self, compressor, vectors, n):
        s, server, sent = _sizes(compressor, n), compressor.server_codec(), []
        for d, dtype in vectors:
            c = -(-d // n)
            sc, ss = s(c, dtype), s(c, dtype, server)
            sent.append(Collective("all_to_all", None, n * sc, "uint8", (n, sc)))
            sent.append(Collective("all_gather", None, ss, "uint8", (ss,)))
        return accounting.traffic_bytes(sent, n)

    def run(self, compressor, step, state, config):
        ok = stages.all_finite(step.vecs)
        axis_name, bucket_bytes, ef = config.axis_name, config.bucket_bytes, config.error_feedback
        n = collectives.axis_size(axis_name)
        outputs: list[jax.Array | None] = [None] * len(step.grads)
        dense_ids = sorted(step.dense)
        server_leaves = step.treedef.flatten_up_to(state.server) if ef else None
        servers = [stages.group_state(server_leaves, g) for g in step.groups]
        dense = [step.grads[i] for i in dense_ids]  # ride in both phases
        means, own, new_servers, ok, sums = exchange.two_phase(
            compressor, step.vecs, step.keys, servers, ok, axis_name, bucket_bytes, dense
        )
        for i, x in zip(dense_ids, sums):
            outputs[i] = x / jnp.asarray(n, x.dtype)
        new = (list(step.residuals), list(server_leaves)) if ef else None
        for gi, group in enumerate(step.groups):
            stages.put_mean(compressor, step, group, means[gi], ok, outputs)
            if ef:
                _two_phase_memory(step, group, own[gi], new_servers[gi], ok, new)
        if not ef:
            return outputs, Memory(None, None, _counted(state, ok))
        residual, server = (step.treedef.unflatten(x) for x in new)
        return outputs, Memory(residual, server, _counted(state, ok))


@dataclasses.dataclass(frozen=True)
class ReduceScatter(Strategy):
    """:func:`jaxcomm.exchange.reduce_scatter`: this worker's shard of each leaf's mean.

    Every leaf's first dimension must be a multiple of the axis size (checked
    in :meth:`resolve`); the update has shape ``(shape[0] // n, *shape[1:])``.
    Traffic: ``(n-1)·s(c)`` per vector, an all-to-all of n chunk payloads.
    """

    name: ClassVar[str] = "reduce_scatter"

    def check(self, compressor, *, scope):
        super().check(compressor, scope=scope)
        if scope != "leaf":
            raise ValueError("exchange: 'reduce_scatter' shards each leaf; it needs scope='leaf'")

    def resolve(self, compressor, step, state, config):
        n = collectives.axis_size(config.axis_name)
        for path, g in step.with_path:
            if g.ndim == 0 or g.shape[0] % n:
                raise ValueError(
                    f"exchange='reduce_scatter': leaf {path_str(path)} has shape {g.shape}; its "
                    f"first dimension must be a multiple of the {n} workers (the shard axis)"
                )
        return self

    def traffic(self, compressor, vectors, n):
        s = _sizes(compressor, n)
        sent = []
        for d, dtype in vectors:
            sc = s(-(-d // n), dtype)
            sent.append(Collective("all_to_all", None, n * sc, "uint8", (n, sc)))
        return accounting.traffic_bytes(sent, n)

    def run(self, compressor, step, state, config):
        ok = stages.all_finite(step.vecs)
        axis_name, bucket_bytes, grads = config.axis_name, config.bucket_bytes, step.grads
        n = collectives.axis_size(axis_name)
        shard = [(g.shape[0] // n,) + g.shape[1:] for g in grads]
        outputs: list[jax.Array | None] = [None] * len(grads)
        dense_ids = sorted(step.dense)
        sums = buckets.bucketed_psum_scatter(
            [grads[i].reshape(-1) for i in dense_ids], axis_name, bucket_bytes
        )
        for i, x in zip(dense_ids, sums):
            outputs[i] = (x / jnp.asarray(n, x.dtype)).reshape(shard[i])
        chunks, own, ok = exchange.reduce_scatter(
            compressor, step.vecs, step.keys, ok, axis_name, bucket_bytes
        )
        new_res = list(step.residuals) if config.error_feedback else None
        for gi, group in enumerate(step.groups):
            (i,) = group  # scope="leaf"
            chunk = chunks[gi][: grads[i].size // n]
            if not compressor.carries_nonfinite:
                chunk = stages.nan_unless(ok, chunk)
            outputs[i] = chunk.reshape(shard[i]).astype(grads[i].dtype)
            if config.error_feedback:
                dtype = step.residuals[i].dtype
                res = step.ps_state.get(i, step.ps[i]).astype(dtype) - own[gi].astype(dtype)
                new_res[i] = stages.keep_unless(
                    ok, res.reshape(step.residuals[i].shape), step.residuals[i]
                )
        residual = step.treedef.unflatten(new_res) if config.error_feedback else None
        return outputs, Memory(residual, state.server, _counted(state, ok))


LOCAL = Local()
GATHER = Gather()
TWO_PHASE = TwoPhase()
REDUCE_SCATTER = ReduceScatter()


@dataclasses.dataclass(frozen=True)
class Auto(Strategy):
    """Gather or two-phase, whichever moves fewer bytes per worker (:meth:`choose`)."""

    name: ClassVar[str] = "auto"
    kinds: ClassVar[tuple[str, ...]] = ("psum", "all_gather")

    def check(self, compressor, *, scope):
        pass  # valid for every kind: for summed payloads it is their one all-reduce

    def choose(self, compressor: Any, vectors: list[tuple[int, Any]], n: int | None) -> Strategy:
        """The strategy ``"auto"`` runs for ``compressor``'s payloads of ``vectors`` on ``n``.

        For all-gathered payloads, the one of :data:`GATHER` and
        :data:`TWO_PHASE` whose :meth:`Strategy.traffic` is smaller: each
        worker receives ``(n-1)·s(d)`` in the all-gather, and sends
        ``(n-1)·(s(ceil(d/n)) + s'(ceil(d/n)))`` in the two-phase exchange,
        summed over the vectors, with ``s`` the codec's payload bytes
        (per-chunk scales and word padding included). On a tie, gather: one
        compression, no server residual. That is every n <= 2 for every
        codec, and a tree of small leaves where the chunks' scales and padding
        outweigh the saving. Only codecs that set ``auto_two_phase`` (the
        quantisers and the uint16 cast) are considered: two-phase changes
        what a sparse codec selects, so it stays an explicit choice there.
        Summed payloads (``kind="psum"``) always take their one all-reduce.

        Args:
          compressor: the transform's :class:`jaxcomm.Compressor`.
          vectors: ``(d, dtype)`` of each vector compressed on its own.
          n: workers on the axis; ``None`` (axis size not known, e.g. in ``init``
            outside ``shard_map``): whether two-phase is picked on some axis
            size. Payload bytes grow with the chunk, so the smallest two-phase
            figure is at chunks of one entry; two-phase, once chosen at some n,
            is chosen at every larger n.
        """
        if compressor.kind != "all_gather" or not compressor.auto_two_phase or not vectors:
            return GATHER
        if n is None:
            n = max(2, max(d for d, _ in vectors))  # every chunk a single entry
        two = TWO_PHASE.traffic(compressor, vectors, n)
        return TWO_PHASE if two < GATHER.traffic(compressor, vectors, n) else GATHER

    def needs_server(self, compressor, leaves, config):
        n = collectives.bound_axis_size(config.axis_name)  # where init sees the axis
        specs = stages.vector_specs(leaves, config)
        return self.choose(compressor, specs, n).needs_server(compressor, leaves, config)

    def resolve(self, compressor, step, state, config):
        specs = [(v.shape[0], v.dtype) for v in step.vecs]
        chosen = self.choose(compressor, specs, collectives.axis_size(config.axis_name))
        return chosen.resolve(compressor, step, state, config)

    def traffic(self, compressor, vectors, n):
        return self.choose(compressor, vectors, n).traffic(compressor, vectors, n)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (GATHER, TWO_PHASE, Auto(), REDUCE_SCATTER)}
"""The strategies ``exchange=`` names, by name (:data:`LOCAL` runs where there is no axis)."""

EXCHANGES = tuple(STRATEGIES)
"""The names ``exchange=`` accepts."""


def get(exchange_option: "str | Strategy") -> Strategy:
    """The strategy an ``exchange=`` option names (a :class:`Strategy` is taken as it is)."""
    if isinstance(exchange_option, Strategy):
        return exchange_option
    if isinstance(exchange_option, str) and exchange_option in STRATEGIES:
        return STRATEGIES[exchange_option]
    raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange_option!r}")


def exchange_traffic(
    compressor: Any, vectors: list[tuple[int, Any]], n_workers: int
) -> dict[str, float]:
    """Bytes one worker sends for the payloads of ``vectors``: all-gather vs two-phase.

    ``{"gather": GATHER.traffic(...), "two_phase": TWO_PHASE.traffic(...)}``,
    the figures behind ``exchange="auto"`` (:meth:`Auto.choose`). Only the
    payloads: dense leaves, the NaN flag (1 byte in an all-gather either way)
    and a key agreement are the same on both paths.

    Example:
      >>> comp = jaxcomm.compressors.quantize.Int8(512, False)
      >>> jaxcomm.strategies.exchange_traffic(comp, [(2**20, jnp.float32)], 8)
      {'gather': 7397376, 'two_phase': 1849344.0}
    """
    if n_workers < 1:
        raise ValueError(f"n_workers: must be >= 1, got {n_workers}")
    return {s.name: s.traffic(compressor, vectors, n_workers) for s in (GATHER, TWO_PHASE)}
