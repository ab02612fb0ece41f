"""What :func:`jaxcomm.fsdp` refuses, found by tracing (the optimizer, the gradient transform).

Each worker's optimizer sees one ``(c,)`` shard of one flat vector; these checks
trace ``tx`` and ``gradients`` outside the mesh (the byte ledger simulating the
axes) and refuse what would be silently wrong there: a reduction over the
parameters, an exchange over the data axis inside ``tx``, a per-leaf mask, a
gradient transform exchanging over another axis.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm.jaxprs import equations
from jaxcomm.ledger import Collective

__all__ = ["axes_of", "check_elementwise", "check_gradients", "check_tx", "refuse_tree_options"]

# primitives that combine entries of an array: under FSDP they would see one shard only
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
     "argmax", "argmin", "dot_general", "cumsum", "cumprod", "cummax", "cummin", "sort",
     "top_k", "approx_top_k", "fft", "conv_general_dilated", "scatter-add", "scatter_add"}
)  # fmt: skip


def _reductions(jaxpr: Any) -> set[str]:
    """The primitives of ``jaxpr`` (sub-jaxprs included) that combine entries of an array."""
    return {
        eqn.primitive.name
        for eqn in equations(jaxpr)
        if eqn.primitive.name in _REDUCTIONS
        and any(getattr(v.aval, "ndim", 0) >= 1 for v in eqn.invars)
    }


def check_elementwise(tx: optax.GradientTransformation, size: int = 16) -> None:
    """Raise if ``tx.update`` combines entries of the parameter vector (see the module doc)."""
    v = jax.ShapeDtypeStruct((size,), jnp.float32)
    state = jax.eval_shape(tx.init, v)
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(v, state, v)
    found = _reductions(closed)
    if found:
        raise ValueError(
            f"tx: its update combines entries of the parameters ({', '.join(sorted(found))}), "
            "e.g. clip_by_global_norm, Muon or a trust ratio; under fsdp each worker holds "
            "1/n of the parameters, so that would see one shard only. Use an element-wise "
            "optimizer (sgd, adam, adamw, lion, ...), or the replicated data_parallel"
        )


def axes_of(recorded: list[Collective]) -> set[str]:
    """The mesh axis names the recorded collectives run over."""
    names = set()
    for c in recorded:
        names |= set(c.axis) if isinstance(c.axis, tuple) else {c.axis}
    return names


def _no_mesh() -> Any:
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def check_tx(
    tx: optax.GradientTransformation, size: int, axis_name: str, simulated: Callable
) -> None:
    """``tx`` is element-wise on a ``(size,)`` shard and does not exchange over the data
    axis (fsdp hands it this worker's shard of the mean already: an exchange there
    would average different parameters' entries). ``simulated()``: the ledger's axes."""
    with _no_mesh(), simulated() as ledger:
        check_elementwise(tx, size)
    if axis_name in axes_of(ledger.collectives):
        raise ValueError(
            f"tx: it exchanges over axis_name={axis_name!r}, but fsdp already "
            "reduce-scatters the gradient there and tx sees one worker's shard (an "
            "exchange would mix different parameters); compress with gradients=..., and "
            "average across replica groups with replica_axis"
        )


def refuse_tree_options(tx: optax.GradientTransformation, length: int) -> None:
    """``optax.masked`` / ``multi_transform`` label the params tree: fsdp's one vector has
    one leaf, so a mask or labels meant per leaf would apply to all of it."""
    state = jax.eval_shape(tx.init, jax.ShapeDtypeStruct((length,), jnp.float32))
    names = ("MaskedState", "MultiTransformState")
    is_tree_option = lambda x: type(x).__name__ in names  # noqa: E731
    found = {
        type(x).__name__
        for x in jax.tree.leaves(state, is_leaf=is_tree_option)
        if is_tree_option(x)
    }
    if found:
        raise ValueError(
            f"tx: it holds {sorted(found)} (optax.masked / multi_transform, or a "
            "mask= argument): fsdp gives tx one flat vector, so a per-leaf mask or label "
            "would cover every parameter alike; drop the mask (e.g. weight decay on all "
            "leaves) or use the replicated data_parallel"
        )


def check_gradients(
    gradients: optax.GradientTransformation, length: int, axis_name: str, simulated: Callable
) -> None:
    """``gradients`` exchanges over the data axis only (traced on the flat vector)."""
    v = jax.ShapeDtypeStruct((length,), jnp.float32)
    with _no_mesh(), simulated() as ledger:
        state = jax.eval_shape(gradients.init, v)
        jax.make_jaxpr(lambda g, st: gradients.update(g, st))(v, state)
    other = axes_of(ledger.collectives) - {axis_name}
    if other:
        raise ValueError(
            f"gradients: it exchanges over {sorted(other)}; fsdp needs its reduce-scatter "
            f"over axis_name={axis_name!r} (build it with that axis_name and "
            "exchange='reduce_scatter')"
        )
