"""Sharded data parallelism (FSDP, ZeRO stage 3) with compressed collectives on both sides.

Every worker keeps ``1/n`` of the parameters (fp32 master weights) and of the
optimizer state; a step all-gathers the weights, takes the gradient of its
slice of the batch, and reduce-scatters the gradient so that each worker
updates only its own shard:

    mesh = jax.make_mesh((8,), ("data",))
    trainer = jaxcomm.fsdp(loss_fn, optax.adamw(1e-3), mesh,
                           weights="int8",                      # ZeRO++ qwZ
                           gradients=jaxcomm.int8(axis_name="data", error_feedback=True,
                                                  exchange="reduce_scatter"))  # qgZ
    state = trainer.init(params)               # params, optimizer sharded; residuals per worker
    state, loss = trainer.step(state, batch)   # batch: the global batch
    params = trainer.params(state)             # the whole model, gathered

Layout (PyTorch FSDP's flat parameter): the float leaves of ``params`` are
raveled into one ``float32`` vector of ``D`` entries, zero-padded to
``L = n * c`` (``c`` a multiple of ``block_size`` when ``weights="int8"``),
and worker ``j`` owns entries ``[j c, (j + 1) c)``. One all-gather and one
reduce-scatter per step, whatever the number of leaves: small leaves ride in
the same vector instead of paying a collective each. The optimizer sees that
one ``(c,)`` shard, so it must be element-wise (SGD, momentum, Adam, AdamW,
Lion, ...). An optimizer that reduces over the parameters
(``clip_by_global_norm``, Muon, Shampoo, LAMB's trust ratio) would compute
from this worker's shard alone: :func:`fsdp` finds the reduction in the
traced update and refuses it, naming the primitive. Also refused: a ``tx``
that exchanges over the data axis itself (``optax.chain(jaxcomm.int8(...),
...)``: fsdp hands it this worker's shard of the mean already; compress with
``gradients=``), and a per-leaf mask or labels (``optax.masked``,
``multi_transform``, ``adamw(mask=...)``), which would cover the one vector.

Weights (``weights``), what a worker sends of its shard per step:

* ``"float32"``: the master shard, ``4 c`` bytes; the model sees the exact
  master weights.
* ``"bfloat16"``: rounded to bfloat16 (``2 c``; moved as 16-bit words).
* ``"int8"``: ZeRO++'s quantised weights (qwZ): per block of ``block_size``
  entries one float32 scale ``max|w| / 127`` and int8 codes
  ``round(w / scale)``: ``c + 4 c / block_size`` bytes.

The master weights stay float32 on their owner; the forward and backward run
at the decoded weights and their gradient updates the master shard.

Gradients (``gradients``): ``None`` is the dense reduce-scatter
(``lax.psum_scatter``, ``4 L`` bytes of operand). Otherwise a jaxcomm
transform with ``exchange="reduce_scatter"`` on ``axis_name`` (e.g.
``jaxcomm.int8(..., error_feedback=True, exchange="reduce_scatter")``, qgZ's
quantised gradients over an all-to-all): it hands each worker its ``(c,)``
chunk of the worker mean, with its residual kept per worker in the state.

Replica groups (``replica_axis``, a ``replica x data`` mesh): the DiLoCo family
over sharded inner steps, as torchft #171 and prime-diloco ask. Each replica
keeps its own sharded params and state (a leading replica axis on every
leaf), its inner steps exchange within the replica as above, and ``tx``
(e.g. ``jaxcomm.diloco(optax.adamw(1e-3), every=50, axis_name="replica")``)
averages across replicas: each worker moves only its own ``(c,)`` shard, with
the workers holding the same shard in the other replicas.

The step runs under ``jax.shard_map(check_vma=False)`` over ``axis_name``;
the batch's leading axis is split over the workers. :meth:`Fsdp.wire_report`
lists the step's collectives as the byte ledger sees them (held equal to the
compiled HLO's in the tests); :meth:`Fsdp.memory` reads each worker's bytes
of parameters and optimizer state from the arrays' shardings.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import accounting, collectives
from jaxcomm.ledger import Collective, recording
from jaxcomm.parallel import fsdp_checks
from jaxcomm.parallel.layout import axis_size

__all__ = ["Fsdp", "FsdpState", "WEIGHTS", "fsdp"]

#: What the weight all-gather sends: the master shard, bfloat16, or int8 with block scales.
WEIGHTS = ("float32", "bfloat16", "int8")


class FsdpState(NamedTuple):
    """A sharded training state (every array placed on the mesh).

    Attributes:
      params: ``(L,)`` float32, the flat padded master weights, sharded over the
        data axis (worker ``j`` holds ``[j c, (j + 1) c)``).
      opt_state: the optimizer's state over the flat vector: its ``(L,)``
        leaves sharded like ``params``, its scalars (step counts) replicated.
      comm_state: the gradient transform's state with a leading worker axis
        ``(n, ...)``, sharded over it (a residual per worker); ``None`` for the
        dense reduce-scatter.
    """

    params: jax.Array
    opt_state: Any
    comm_state: Any


class Fsdp:
    """What :func:`fsdp` returns: ``init``, ``step``, ``params``, ``load``, ``wire_report``,
    ``memory``."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        axis_name: str,
        weights: str,
        gradients: optax.GradientTransformation | None,
        block_size: int,
        has_aux: bool,
        replica_axis: str | None = None,
    ):
        self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
        self.replica_axis = replica_axis
        self.replicas = 1 if replica_axis is None else axis_size(mesh, replica_axis)
        self.axis_name, self.weights, self.gradients = axis_name, weights, gradients
        self.block_size, self.has_aux = block_size, has_aux
        self.n = axis_size(mesh, axis_name)
        fsdp_checks.check_tx(tx, 16, axis_name, self._simulated_axes)
        self._unravel = None
        self._size = None
        self._step = None

    def _layout(self, params: Any) -> None:
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise ValueError(
                    f"params: leaf {jax.tree_util.keystr(path)} has dtype "
                    f"{jnp.result_type(leaf)}; fsdp shards float leaves only (keep integer "
                    "state out of params)"
                )
        flat, unravel = ravel_pytree(params)
        dtypes = jax.tree.map(jnp.result_type, params)
        self._size = flat.shape[0]
        # ravel_pytree's unravel keeps the vector's dtype when every leaf shares one: cast
        # back to each leaf's own (an all-bfloat16 model runs in bfloat16)
        self._unravel = lambda v: jax.tree.map(lambda x, d: x.astype(d), unravel(v), dtypes)
        unit = self.n * (self.block_size if self.weights == "int8" else 1)
        self.length = -(-self._size // unit) * unit
        self.chunk = self.length // self.n

    def _flat(self, tree: Any) -> jax.Array:
        v = ravel_pytree(tree)[0].astype(jnp.float32)
        return jnp.pad(v, (0, self.length - v.shape[0]))

    def _specs(self, state_tree: Any) -> Any:
        """Stored leaves' specs: the flat-vector leaves (and residuals' worker axis) over the
        data axis, scalars replicated; with replicas, a leading replica axis on every leaf."""
        ax, r = self.axis_name, self.replica_axis
        lead = 0 if r is None else 1

        def spec(x):
            shape = jnp.shape(x)
            flat = len(shape) > lead and shape[lead] == self.length
            inner = (ax,) if flat else ()
            return P(*(() if r is None else (r,)), *inner)

        return jax.tree.map(spec, state_tree)

    def _comm_specs(self, comm_state: Any) -> Any:
        """The residuals' specs: a leading worker axis (after the replica axis)."""
        lead = () if self.replica_axis is None else (self.replica_axis,)
        return jax.tree.map(lambda _: P(*lead, self.axis_name), comm_state)

    def _stored(self, tree: Any) -> Any:
        """One replica's leaves as stored: with replicas, a leading replica axis (copies)."""
        if self.replica_axis is None:
            return tree
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.replicas, *jnp.shape(x))), tree)

    def _put(self, tree: Any, specs: Any = None) -> Any:
        return jax.tree.map(
            lambda x, spec: jax.device_put(x, NamedSharding(self.mesh, spec)),
            tree,
            self._specs(tree) if specs is None else specs,
        )

    @property
    def _axes(self) -> Any:
        """Every worker of every replica (the batch's and the loss's axes)."""
        return self.axis_name if self.replica_axis is None else (self.replica_axis, self.axis_name)

    def init(self, params: Any) -> FsdpState:
        """The sharded state of ``params``: flat master weights, optimizer and residuals."""
        self._layout(params)
        fsdp_checks.check_tx(self.tx, self.chunk, self.axis_name, self._simulated_axes)
        if self.gradients is not None:
            fsdp_checks.check_gradients(
                self.gradients, self.length, self.axis_name, self._simulated_axes
            )
        fsdp_checks.refuse_tree_options(self.tx, self.length)
        flat = self._flat(params)
        with self._simulated_axes():
            opt_state = self.tx.init(flat)
        flat, opt_state = self._put(self._stored(flat)), self._put(self._stored(opt_state))
        comm_state = None if self.gradients is None else self._fresh_comm_state()
        self._step = None
        return FsdpState(flat, opt_state, comm_state)

    def load(self, state: FsdpState) -> FsdpState:
        """A state saved by a trainer of the same model on any worker count, laid out here.

        ``state``'s arrays may be on the host (e.g. an orbax restore as NumPy) or on
        another mesh. The flat vectors (params and every optimizer leaf of their
        length) are cut to the model's ``D`` entries and zero-padded to this
        mesh's length, so the values carry over bit for bit. The gradient
        transform's residuals are per worker: they load only onto the same
        worker count; for another, pass ``state._replace(comm_state=None)`` to
        start fresh residuals (the last steps' compression error is dropped).
        Call :meth:`init` (or give the params once) first, for the layout.
        """
        self._need_layout()
        if self.replica_axis is not None:
            want = (self.replicas, self.length)
            if tuple(jnp.shape(state.params)) != want:
                raise ValueError(
                    "state.params: with replica_axis, a state loads onto the same replica and "
                    f"worker counts only (saved {tuple(jnp.shape(state.params))}, here {want})"
                )
            state = jax.tree.map(jnp.asarray, state)
            if state.comm_state is None and self.gradients is not None:
                return self._put(state._replace(comm_state=None))._replace(
                    comm_state=self._fresh_comm_state()
                )
            return self._put(state, self._state_specs(state))
        old = int(jnp.shape(state.params)[0])
        if old < self._size:
            raise ValueError(
                f"state.params: {old} entries, fewer than this model's {self._size}: "
                "a state of another model"
            )

        def relay(x):
            x = jnp.asarray(x)
            if x.ndim >= 1 and x.shape[0] == old:  # a flat vector: cut to D, re-padded here
                x = jnp.pad(x[: self._size], (0, self.length - self._size))
            return x

        params = self._put(relay(state.params))
        opt_state = self._put(jax.tree.map(relay, state.opt_state))
        comm_state = state.comm_state
        if self.gradients is None or comm_state is None:
            comm_state = None if self.gradients is None else self._fresh_comm_state()
        else:
            lead = {jnp.shape(x)[0] for x in jax.tree.leaves(comm_state)}
            if lead != {self.n} or old != self.length:
                raise ValueError(
                    f"state.comm_state: residuals saved for {sorted(lead)} workers and "
                    f"{old} entries; this trainer has {self.n} workers and {self.length}. "
                    "They are per worker: pass state._replace(comm_state=None) to start "
                    "fresh residuals"
                )
            comm_state = jax.tree.map(jnp.asarray, comm_state)
            comm_state = self._put(comm_state, self._comm_specs(comm_state))
        return FsdpState(params, opt_state, comm_state)

    def _fresh_comm_state(self) -> Any:
        one = self.gradients.init(jnp.zeros((self.length,), jnp.float32))
        workers = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.n, *jnp.shape(x))), one)
        if self.replica_axis is not None:  # each replica its own keys (stochastic rounding)

            def per_replica(path, x):
                name = getattr(path[-1], "name", None) if path else None
                fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))  # over the workers
                if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                    return jnp.stack([fold(x, r) for r in range(self.replicas)])
                if name == "key" and x.dtype == jnp.uint32:  # a state's raw key data
                    keys = jax.random.wrap_key_data(x)
                    return jnp.stack(
                        [jax.random.key_data(fold(keys, r)) for r in range(self.replicas)]
                    )
                return jnp.broadcast_to(x, (self.replicas, *jnp.shape(x)))

            workers = jax.tree_util.tree_map_with_path(per_replica, workers)
        return self._put(workers, self._comm_specs(workers))

    def _state_specs(self, state: FsdpState) -> FsdpState:
        return FsdpState(
            self._specs(state.params),
            self._specs(state.opt_state),
            self._comm_specs(state.comm_state),
        )

    def _simulated_axes(self) -> Any:
        """The mesh axes as the byte ledger simulates them (tracing outside the mesh)."""
        sizes = {self.axis_name: self.n}
        if self.replica_axis is not None:
            sizes[self.replica_axis] = self.replicas
        return recording(sizes)

    def params(self, state: FsdpState, replica: int = 0) -> Any:
        """The whole model from the master weights (exact float32; each leaf's dtype);
        with replicas, replica ``replica``'s (all equal right after an outer step)."""
        self._need_layout()
        flat = jax.device_put(state.params, NamedSharding(self.mesh, P()))
        if self.replica_axis is not None:
            flat = jax.lax.index_in_dim(flat, replica, keepdims=False)
        return self._unravel(jax.lax.slice_in_dim(flat, 0, self._size))

    def _need_layout(self) -> None:
        if self._unravel is None:
            raise ValueError("state: build it with this trainer's init(params) first")

    # -- collectives --------------------------------------------------------------------
    def _gather_weights(self, shard: jax.Array) -> jax.Array:
        ax = self.axis_name
        if self.weights == "float32":
            return collectives.all_gather(shard, ax, tiled=True)
        if self.weights == "bfloat16":
            return collectives.all_gather(shard.astype(jnp.bfloat16), ax, tiled=True).astype(
                jnp.float32
            )
        blocks = shard.reshape(-1, self.block_size)
        scale = jnp.max(jnp.abs(blocks), axis=1) / 127.0
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = jnp.clip(jnp.round(blocks / safe[:, None]), -127, 127).astype(jnp.int8)
        codes, scale = collectives.all_gather((codes, scale), ax, tiled=True)
        return (codes.astype(jnp.float32) * scale[:, None]).reshape(-1)

    def _reduce_scatter(self, g: jax.Array, comm_state: Any) -> tuple[jax.Array, Any]:
        if self.gradients is None:
            total = collectives.psum_scatter(g, self.axis_name)
            return total / jnp.asarray(self.n, total.dtype), None
        local = jax.tree.map(lambda x: x[0], comm_state)
        u, local = self.gradients.update(g, local)
        if jnp.shape(u) != (self.chunk,):
            raise ValueError(
                f"gradients: its update has shape {jnp.shape(u)}, not this worker's "
                f"({self.chunk},) chunk; build it with exchange='reduce_scatter' and "
                f"axis_name={self.axis_name!r}"
            )
        return u, jax.tree.map(lambda x: x[None], local)

    # -- the step -----------------------------------------------------------------------
    def _worker(self, params, opt_state, comm_state, batch):
        w = self._gather_weights(params)
        full = self._unravel(w[: self._size])
        grad_fn = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)
        out, grads = grad_fn(full, batch)
        loss = out[0] if self.has_aux else out
        g, comm_state = self._reduce_scatter(self._flat(grads), comm_state)
        updates, opt_state = self.tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        loss = collectives.pmean(loss, self._axes)
        return params, opt_state, comm_state, loss

    def _replica_worker(self, params, opt_state, comm_state, batch):
        """:meth:`_worker` on this replica's leaves (the leading replica axis of size 1 here)."""
        strip = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        lead = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731
        *out, loss = self._worker(strip(params), strip(opt_state), strip(comm_state), batch)
        return (*lead(tuple(out)), loss)

    def _compiled(self, state: FsdpState, batch: Any) -> Callable:
        if self._step is None:
            specs = tuple(self._state_specs(state))
            batch_specs = jax.tree.map(lambda _: P(self._axes), batch)
            worker = self._worker if self.replica_axis is None else self._replica_worker
            fn = jax.shard_map(
                worker,
                mesh=self.mesh,
                in_specs=(*specs, batch_specs),
                out_specs=(*specs, P()),
                check_vma=False,
            )
            self._step = jax.jit(fn)
        return self._step

    def step(self, state: FsdpState, batch: Any) -> tuple[FsdpState, jax.Array]:
        """One training step on the global ``batch`` (its leading axis split over workers)."""
        self._need_layout()
        workers = self.n * self.replicas
        for path, x in jax.tree_util.tree_leaves_with_path(batch):
            if jnp.ndim(x) == 0 or jnp.shape(x)[0] % workers:
                raise ValueError(
                    f"batch: leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(x)}; its "
                    f"leading axis must split evenly over the {workers} workers"
                )
        batch = self._place(batch)
        fn = self._compiled(state, batch)
        params, opt_state, comm_state, loss = fn(*state, batch)
        return FsdpState(params, opt_state, comm_state), loss

    def _place(self, batch: Any) -> Any:
        """The global batch split over the workers (a no-op for arrays already there)."""
        shard = NamedSharding(self.mesh, P(self._axes))
        return jax.tree.map(lambda x: jax.device_put(x, shard), batch)

    def lower(self, state: FsdpState, batch: Any) -> Any:
        """The jitted step lowered for ``state`` and ``batch`` (for its compiled HLO)."""
        batch = self._place(batch)
        return self._compiled(state, batch).lower(*state, batch)

    def wire_report(self, state: FsdpState, batch: Any) -> list[Collective]:
        """The collectives one worker takes part in during one step (the byte ledger's view)."""
        self._need_layout()

        sizes = {self.axis_name: self.n, self.replica_axis: self.replicas}

        def local(x, spec):
            shape = list(jnp.shape(x))
            for i, names in enumerate(spec):
                for name in (names,) if isinstance(names, str) else names or ():
                    shape[i] //= sizes[name]
            return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x))

        args = [
            jax.tree.map(local, part, spec) for part, spec in zip(state, self._state_specs(state))
        ]
        b = jax.tree.map(lambda x: local(x, P(self._axes)), batch)
        worker = self._worker if self.replica_axis is None else self._replica_worker
        no_mesh = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))
        with no_mesh, self._simulated_axes() as ledger:
            closed = jax.make_jaxpr(worker)(*args, b)
        return accounting.in_program(closed, ledger.collectives)

    def memory(self, state: FsdpState) -> dict[str, int]:
        """Bytes on the first device, from the shardings: parameters and optimizer state
        (sharded) and the gradient transform's state (a residual of the whole vector)."""

        def on_device(tree):
            return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

        return {
            "params": on_device(state.params),
            "opt_state": on_device(state.opt_state),
            "comm_state": on_device(state.comm_state),  # residuals: whole (L,) per worker
        }


def fsdp(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    weights: str = "float32",
    gradients: optax.GradientTransformation | None = None,
    block_size: int = 256,
    has_aux: bool = False,
    replica_axis: str | None = None,
) -> Fsdp:
    """Sharded data-parallel training of ``loss_fn(params, batch)`` with ``tx`` on ``mesh``.

    Args:
      loss_fn: one worker's loss on its slice of the batch, ``(params, batch) ->
        loss`` (``(loss, aux)`` with ``has_aux``).
      tx: an element-wise optax optimizer (refused otherwise; see the module doc).
      mesh: the device mesh; ``axis_name`` is the axis the workers are on.
      weights: what the weight all-gather sends: ``"float32"``, ``"bfloat16"``
        or ``"int8"`` (block scales, ZeRO++'s qwZ).
      gradients: ``None`` (dense reduce-scatter) or a jaxcomm transform built
        with ``exchange="reduce_scatter"`` and this ``axis_name``.
      block_size: entries per int8 scale (``weights="int8"``), >= 1.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is dropped.
      replica_axis: a second mesh axis of replica groups (the DiLoCo family over
        sharded inner steps): each replica keeps its own sharded params and
        state (a leading replica axis on every leaf), and ``tx`` exchanges across
        replicas itself, e.g. ``jaxcomm.diloco(optax.adamw(1e-3), every=50,
        axis_name="replica")``: its averaging then moves each worker's shard
        only, between the workers holding the same shard in each replica.

    Returns:
      An :class:`Fsdp`: ``init(params)``, ``step(state, batch)``,
      ``params(state)``, ``wire_report(state, batch)``, ``memory(state)``.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights: {weights!r} is not one of {WEIGHTS}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an int >= 1, got {block_size!r}")
    axis_size(mesh, axis_name)
    if replica_axis is not None and replica_axis == axis_name:
        raise ValueError(f"replica_axis: must differ from axis_name ({axis_name!r})")
    return Fsdp(
        loss_fn, tx, mesh, axis_name=axis_name, weights=weights, gradients=gradients,
        block_size=block_size, has_aux=has_aux, replica_axis=replica_axis,
    )  # fmt: skip
