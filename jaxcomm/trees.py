"""The trees every transform starts from: the update's leaves, checked, and the zero state.

Shared by :func:`jaxcomm.core.compress` and the transforms of their own
(PowerSGD, DGC, DeMo, SparseLoCo); the NaN rule's stages are in
:mod:`jaxcomm.stages`.
"""

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import collectives
from jaxcomm.collectives import AxisName
from jaxcomm.protocol import check_float_leaves, resolve_state_dtype


def leaves(updates: Any, axis_name: AxisName | None) -> tuple[list, Any, list]:
    """The update's start: ``(with_path, treedef, grads)`` of ``updates``, after checking that
    every leaf is floating and that the updates are per worker over ``axis_name``."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(updates)
    check_float_leaves(with_path, "updates")
    collectives.check_per_worker(updates, axis_name)
    return with_path, treedef, [g for _, g in with_path]


def zero_state(params: Any, state_dtype: Any = None) -> Any:
    """A zero residual per leaf of ``params`` (floating leaves only, checked): the params'
    tree and shapes, in :func:`jaxcomm.protocol.resolve_state_dtype`'s dtype."""
    check_float_leaves(jax.tree_util.tree_leaves_with_path(params), "params")
    return jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), resolve_state_dtype(jnp.result_type(p), state_dtype)),
        params,
    )
