"""jaxcomm.jaxprs: the one walk over a traced program reaches every nested equation."""

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.jaxprs import equations, subjaxprs


def _names(fn, *args):
    return [e.primitive.name for e in equations(jax.make_jaxpr(fn)(*args))]


def test_equations_visits_each_equation_then_those_nested_in_it():
    def f(x):
        y = jnp.sin(x)
        z = lax.cond(y > 0, lambda v: jnp.exp(v), lambda v: jnp.log(v), y)
        return jnp.cos(z)

    names = _names(f, 1.0)
    # cond's branches in order (false first), inside the cond, before what follows it
    assert names.index("sin") < names.index("cond") < names.index("log")
    assert names.index("log") < names.index("exp") < names.index("cos")
    assert names.count("exp") == names.count("log") == 1


def test_equations_reaches_loops_jit_and_nesting_in_nesting():
    @jax.jit
    def inner(v):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, v))

    def f(xs):
        def body(carry, x):
            return carry + inner(x)[1], jnp.abs(x)

        return lax.scan(body, 0.0, xs)

    names = _names(f, jnp.ones(4))
    assert {"jit", "pjit"} & set(names)  # the jit call's name differs between JAX versions
    for name in ("scan", "while", "lt", "tanh", "abs"):
        assert name in names, name
    # every name the top-level jaxpr alone shows is in the walk; the walk shows more
    top = [e.primitive.name for e in jax.make_jaxpr(f)(jnp.ones(4)).eqns]
    assert top == ["scan"] and len(names) > len(top)


def test_subjaxprs_gives_a_cond_its_branches_and_a_plain_equation_none():
    closed = jax.make_jaxpr(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
    cond = next(e for e in closed.jaxpr.eqns if e.primitive.name == "cond")
    subs = list(subjaxprs(cond))
    assert [[e.primitive.name for e in s.eqns] for s in subs] == [["cos"], ["sin"]]
    gt = closed.jaxpr.eqns[0]
    assert list(subjaxprs(gt)) == []
