"""Walking a traced program: every equation of a jaxpr, inside every sub-jaxpr.

The checks that read a traced step (which collectives the program holds,
:func:`jaxcomm.accounting.in_program`; which primitives combine entries of
the parameters, :mod:`jaxcomm.parallel.fsdp_checks`; which collectives sit
under a branch, :mod:`jaxcomm.divergence`) all visit the equations of a jaxpr
and of the jaxprs nested in them (``cond`` branches, loop bodies, ``pjit``,
``shard_map``, ``custom_jvp_call``, ...). This module is that walk, once.
It imports nothing of jaxcomm.
"""

from collections.abc import Iterator
from typing import Any

from jax.extend import core as jcore

__all__ = ["equations", "subjaxprs"]


def subjaxprs(eqn: Any) -> Iterator[Any]:
    """The jaxprs nested in one equation's parameters (a ``ClosedJaxpr`` as its ``Jaxpr``).

    Found in any parameter holding a jaxpr or a tuple/list of them (``cond``'s
    ``branches``, ``while``'s ``cond_jaxpr`` and ``body_jaxpr``, ``scan``'s and
    ``pjit``'s ``jaxpr``, ...), in parameter order.
    """
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jcore.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jcore.Jaxpr):
                yield sub


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), depth first.

    Each equation comes before those nested in it (:func:`subjaxprs`), which
    come before the equation that follows it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
      >>> [e.primitive.name for e in equations(closed)]
      ['gt', 'convert_element_type', 'cond', 'cos', 'sin']
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from equations(sub)
