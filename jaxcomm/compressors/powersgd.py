"""PowerSGD: rank-r gradient compression by one step of power iteration.

Each leaf of two or more dimensions is viewed as a matrix ``M`` of shape
``(a, b) = (shape[0], prod(shape[1:]))`` (``matrix_view="last"``:
``(prod(shape[:-1]), shape[-1])``, for Flax layouts). With warm-started ``Q`` (b×r) the
workers exchange ``P = M Q`` (a×r) and ``Q = Mᵀ P̂`` (b×r) instead of ``M``:
``(a+b)·r`` float32 values in two all-reduces, P then Q. Leaves of fewer
than two dimensions and matrices that would not shrink by
``min_compression_rate`` are averaged densely, without error feedback, as in
torch's PowerSGD hook.

Each worker ``w`` computes, for every compressed leaf (``r = min(rank, a, b)``)::

    M_w = g_w + E_w                       # error feedback
    P   = Σ_w M_w Q        (all-reduce 1) # Q: last step's, shared
    P̂   = orthogonalize(P)
    Q_w = M_wᵀ P̂ ;  Q̄ = mean_w Q_w       (all-reduce 2)
    E_w ← M_w − P̂ Q_wᵀ                    # own compression error
    return P̂ Q̄ᵀ                          # = mean_w P̂ Q_wᵀ

and keeps ``Q̄`` for the next step (warm start: the power iteration goes on
across steps). The P's, then the Q's, are packed into buckets of
``bucket_bytes`` filled from the last leaf to the first (one all-reduce per
bucket, as torch's hook per DDP bucket); the dense leaves ride in the P
buckets of their dtype. The error is the paper's local one (Algorithm 2,
"memorize local errors"); torch's DDP hook keeps ``M_w − P̂ Q̄ᵀ`` instead.
Both have the same mean over workers.

Options mirror torch's ``PowerSGDState``: ``rank`` = ``matrix_approximation_rank`` (torch's
default 1; the paper's CIFAR setting, and ours, 2), ``start_iter`` = ``start_powerSGD_iter``
(torch's 1000; ours 0), ``min_compression_rate``, ``error_feedback`` =
``use_error_feedback``, ``warm_start``, ``orthogonalization_epsilon``, ``batch_same_shape``
= ``batch_tensors_with_same_shape``. As in torch, each leaf is its own matrix; only the
transport is bucketed. With ``start_iter > 0`` the step is chosen with ``lax.cond`` on the
step count, made identical on all workers by a 4-byte all-reduce; both branches' collectives
are in the program (and ``jaxcomm.wire_bytes``). ``matrix_view="last"``: conv ``(kh, kw, in,
out)`` -> ``(kh·kw·in, out)``; ``"first"``: torch conv ``(out, in, kh, kw)`` -> ``(out,
in·kh·kw)``, but a Flax HWIO kernel is then a kh-row matrix the rate rule leaves dense. Both
are plain reshapes, no transposes.

This does not fit the flat-vector :class:`jaxcomm.core.Compressor` protocol
(it needs the matrix shape and two dependent all-reduces), so it is its own
optax transform, with the same conventions as :func:`jaxcomm.compress`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives, core, stages, trees
from jaxcomm.branches import typed_cond
from jaxcomm.options import Options, Unpack, take

__all__ = ["PowerSGDState", "leaf_plan", "powersgd", "orthogonalize"]

#: the common options (:class:`jaxcomm.options.Options`) :func:`powersgd` takes, with
#: :data:`jaxcomm.options.DEFAULTS`' defaults (``key`` has none: it is required)
OPTIONS = ("key", "axis_name", "error_feedback", "bucket_bytes", "state_dtype")

# Gram-Schmidt treats a column whose norm after projection is at most this
# fraction of its norm before as dependent on the previous ones (it becomes 0).
_DEPENDENT = 1e-4


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    Attributes:
      count: int32 ``[]``, updates made (saturates at the int32 maximum).
      key: uint32 ``[2]`` raw PRNG key, split every step to draw a fresh Q;
        ``None`` with ``warm_start`` (Q is drawn once, at init).
      q: with ``warm_start``, a tuple with one float32 ``(b, r)`` array per
        compressed leaf (tree-flatten order): the worker mean of last step's
        Q, identical on all workers. ``None`` without warm start.
      residual: error-feedback memory ``M - P̂ Q_wᵀ``, same tree and shapes
        as the params (one extra model copy; zero on dense leaves), float32
        for bf16/fp16 params (``state_dtype``); ``None`` without error feedback.
      nonfinite: int32 ``[]``, steps in which some worker's gradient held NaN
        or Inf; on those steps ``q`` and ``residual`` were left unchanged.
    """

    count: jax.Array
    key: jax.Array | None
    q: tuple[jax.Array, ...] | None
    residual: Any
    nonfinite: jax.Array


class _Leaf(NamedTuple):
    a: int
    b: int
    r: int


def _plan(
    shapes: list[tuple[int, ...]], rank: int, min_rate: float, view: str = "first"
) -> list[_Leaf | None]:
    """Per leaf: its matrix view and rank if compressed, else None (dense)."""
    plan: list[_Leaf | None] = []
    for shape in shapes:
        if len(shape) < 2 or math.prod(shape) == 0:
            plan.append(None)
            continue
        if view == "first":
            a, b = shape[0], math.prod(shape[1:])
        else:
            a, b = math.prod(shape[:-1]), shape[-1]
        r = min(rank, a, b)
        # torch's rule: compress iff (a + b)·r · min_compression_rate < a·b
        plan.append(_Leaf(a, b, r) if (a + b) * r * min_rate < a * b else None)
    return plan


def leaf_plan(
    params: Any, rank: int = 2, *, min_compression_rate: float = 2.0, matrix_view: str = "last"
) -> list[dict]:
    """Per leaf of ``params``: how :func:`powersgd` sends it, and why.

    Returns one dict per leaf (tree-flatten order): ``path``, ``shape``,
    ``compressed`` (bool), ``matrix`` ``(a, b)`` and ``rank`` when compressed,
    ``floats`` sent per step (``(a + b)·r`` compressed, the size otherwise) and
    ``reason``: ``"low rank"``, ``"1-D or empty"`` or ``"(a + b)·r·rate >=
    a·b"`` (compressing would not save ``min_compression_rate``×, torch's rule).

    Example:
      >>> [(d["path"], d["reason"]) for d in leaf_plan(params) if not d["compressed"]]
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    shapes = [tuple(jnp.shape(x)) for _, x in flat]
    plan = _plan(shapes, rank, min_compression_rate, matrix_view)
    out = []
    for (path, _), shape, leaf in zip(flat, shapes, plan):
        d = {"path": jax.tree_util.keystr(path), "shape": shape, "compressed": leaf is not None}
        if leaf is not None:
            d.update(matrix=(leaf.a, leaf.b), rank=leaf.r, floats=(leaf.a + leaf.b) * leaf.r)
            d["reason"] = "low rank"
        else:
            d["floats"] = math.prod(shape)
            d["reason"] = (
                "1-D or empty"
                if len(shape) < 2 or math.prod(shape) == 0
                else f"(a + b)·r·{min_compression_rate:g} >= a·b"
            )
        out.append(d)
    return out


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` in full float32 on every backend.

    JAX's default precision runs float32 matmuls in TF32 on recent NVIDIA GPUs
    (and bf16 passes on TPU): measured on one GPU, PowerSGD's update then
    differed from the CPU's by 4e-4 (relative), against 1e-7 for every other
    transform. These products are rank-r (memory-bound), so full precision
    costs little; torch's PowerSGD hook also multiplies in float32.
    """
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def orthogonalize(p: jax.Array, epsilon: float = 0.0) -> jax.Array:
    """Orthonormal columns spanning those of ``p`` (``(..., a, r)``, r <= a).

    Rank 1 and 2: Gram-Schmidt (each column projected out twice, "twice is
    enough"), normalised by ``norm + epsilon``; a zero column, or one that
    depends on the previous columns (norm after projection at most 1e-4 of its
    norm before), becomes zero instead of NaN. Rank > 2: Householder QR
    (``jnp.linalg.qr``), which returns orthonormal columns for zero or
    rank-deficient input. NaN in ``p`` stays NaN. This is torch's choice of
    method (GS for rank <= 2, QR above).
    """
    r = p.shape[-1]
    if r > 2:
        q, _ = jnp.linalg.qr(p)
        return q
    cols: list[jax.Array] = []
    for i in range(r):
        c = p[..., i]
        n0 = jnp.linalg.norm(c, axis=-1, keepdims=True)
        for _ in range(2):
            for prev in cols:
                c = c - jnp.sum(prev * c, axis=-1, keepdims=True) * prev
        n = jnp.linalg.norm(c, axis=-1, keepdims=True)
        dependent = n <= _DEPENDENT * n0  # False for NaN: NaN stays visible
        safe = jnp.where(dependent, 1.0, n + epsilon)
        cols.append(jnp.where(dependent, 0.0, c / safe))
    return jnp.stack(cols, axis=-1)


def _check_state(state: Any, updates: Any, *, error_feedback: bool, warm_start: bool) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"state: expected the PowerSGDState made by jaxcomm.powersgd(...).init(params), got "
            f"{type(state).__name__}"
        )
    if warm_start and state.q is None:
        raise ValueError("state: state.q is None; it comes from a powersgd without warm_start")
    if not warm_start and state.key is None:
        raise ValueError("state: state.key is None; it comes from a powersgd with warm_start")
    if error_feedback:
        if state.residual is None:
            raise ValueError(
                "state: state.residual is None; it comes from a powersgd with error_feedback=False"
            )
        core.check_residual(state.residual, updates)


def _fresh_q(key: jax.Array, plan: list[_Leaf | None]) -> tuple[jax.Array, ...]:
    """One i.i.d. normal float32 (b, r) matrix per compressed leaf."""
    qs = []
    for i, leaf in enumerate(plan):
        if leaf is not None:
            qs.append(jax.random.normal(jax.random.fold_in(key, i), (leaf.b, leaf.r), jnp.float32))
    return tuple(qs)


def _matrices(grads, residuals, plan, comp) -> dict[int, jax.Array]:
    """Each compressed leaf as its (a, b) float32 matrix, plus its residual (``M = G + E``)."""
    ms = {}
    for i in comp:
        m = grads[i].reshape(plan[i].a, plan[i].b).astype(jnp.float32)
        if residuals is not None:
            m = m + residuals[i].reshape(m.shape).astype(jnp.float32)
        ms[i] = m
    return ms


def _batches(plan, comp, batch_same_shape: bool) -> list[list[int]]:
    """Groups of leaves computed as one batch: same (a, b, r), or one leaf each."""
    if not batch_same_shape:
        return [[i] for i in comp]
    by_shape: dict[_Leaf, list[int]] = {}
    for i in comp:
        by_shape.setdefault(plan[i], []).append(i)
    return list(by_shape.values())


def powersgd(
    rank: int = 2,
    *,
    start_iter: int = 0,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    batch_same_shape: bool = False,
    matrix_view: str = "last",
    **options: Unpack[Options],
) -> optax.GradientTransformation:
    """PowerSGD low-rank gradient compression (Vogels et al. 2019).

    Rule: each leaf viewed as a matrix ``M`` (``a×b``) sends ``P = Σ_w M_w Q`` and
    ``Q̄ = mean_w M_wᵀ P̂`` (``P̂`` orthonormalised); the update is ``P̂ Q̄ᵀ``.
    Wire: ``Σ (a+b)·r·4`` bytes per worker per step (two all-reduces) plus the dense
    leaves'. Chain momentum after it. A NaN/Inf on any worker makes the output NaN:
    skip such steps with :func:`jaxcomm.skip_nonfinite`.

    Args:
      rank: rank r, >= 1 (capped at ``min(a, b)``). start_iter: dense steps first, >= 0.
      min_compression_rate: compress only if ``(a+b)·r < a·b / min_compression_rate``; > 0.
      warm_start: reuse last step's Q̄. orthogonalization_epsilon: Gram-Schmidt's, >= 0.
      batch_same_shape: one batched matmul per group of equal (a, b, r); same result.
      matrix_view: ``"last"``: ``(rest, shape[-1])``; ``"first"``: ``(shape[0], rest)``.
      **options: ``key`` (required: the initial Q's, shared by all workers: pass the same
        key everywhere; it is not folded with the worker index), ``axis_name`` (``None``
        compresses locally), ``error_feedback`` (keep ``M_w − P̂ Q_wᵀ`` and add it to the
        next gradient), ``bucket_bytes`` (all P's with the dense leaves, then all Q's, in
        buckets of at most this many bytes, one all-reduce each; ``None`` or 0: one per
        matrix) and ``state_dtype`` (the residual's): see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`PowerSGDState`.

    Example:
      >>> tx = optax.chain(jaxcomm.powersgd(2, key=jax.random.key(0), axis_name="data"),
      ...                  optax.sgd(0.1, momentum=0.9))

    References:
      Vogels, Karimireddy & Jaggi, "PowerSGD", NeurIPS 2019, arXiv:1905.13727.
    """
    # Notes. Step by step, with torch's options: the module docstring. ``start_iter``: plain dense
    # averaging, no error feedback. ``matrix_view="last"`` suits Flax/JAX layouts, ``"first"``
    # torch-layout weights; :func:`leaf_plan` lists which leaves are compressed and why.
    # ``batch_same_shape`` is faster for many equal layers (e.g. transformer blocks), same bytes.
    # Updates keep their dtype; the matmuls run in float32, Q is float32. A NaN/Inf reaches every
    # worker because P is shared (``state.nonfinite`` counts it); ``optax.apply_if_finite`` would
    # leave the other workers waiting in the collective. Integer or bool leaves raise ``TypeError``.
    given = take("powersgd", options, OPTIONS)
    args = (given["axis_name"], rank, start_iter, min_compression_rate, orthogonalization_epsilon)
    flags = (given["error_feedback"], warm_start, batch_same_shape)
    common = (given["key"], given["bucket_bytes"], given["state_dtype"])
    o, start_iter, raw_key = _check_args(*args, matrix_view, *common, flags)

    def init_fn(params):
        return _init(o, raw_key, params)

    def update_fn(updates, state, params=None):
        del params
        return _update(o, start_iter, updates, state)

    return optax.GradientTransformation(init_fn, update_fn)


class _Options(NamedTuple):
    """:func:`powersgd`'s checked options (static)."""

    axis_name: Any
    rank: int
    min_rate: float
    eps: float
    matrix_view: str
    bucket_bytes: int | None
    state_dtype: Any
    error_feedback: bool
    warm_start: bool
    batch_same_shape: bool


def _check_args(
    axis_name, rank, start_iter, min_rate, eps, matrix_view, key, bucket_bytes, state_dtype, flags
) -> tuple[_Options, int, jax.Array]:
    """:func:`powersgd`'s arguments checked: the options, ``start_iter`` and the raw key."""
    axis_name = collectives.check_axis_name(axis_name)
    rank = checks.check_int(rank, "rank", 1)
    start_iter = checks.check_int(start_iter, "start_iter", 0)
    min_rate = checks.check_float(min_rate, "min_compression_rate", low=0.0, strict=True)
    eps = checks.check_float(eps, "orthogonalization_epsilon", low=0.0, strict=False)
    if matrix_view not in ("first", "last"):
        raise ValueError(f"matrix_view: expected 'first' or 'last', got {matrix_view!r}")
    raw_key = core.key_bits(key)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    state_dtype = checks.check_state_dtype(state_dtype)
    o = _Options(axis_name, rank, min_rate, eps, matrix_view, bucket_bytes, state_dtype, *flags)
    return o, start_iter, raw_key


def _init(o: _Options, raw_key: jax.Array, params: Any) -> PowerSGDState:
    """:func:`powersgd`'s initial state: Q drawn (warm start) or the key kept; zero residuals."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    core.check_float_leaves(leaves, "params")
    plan = _plan([jnp.shape(x) for _, x in leaves], o.rank, o.min_rate, o.matrix_view)
    return PowerSGDState(
        count=jnp.zeros((), jnp.int32),
        key=None if o.warm_start else raw_key,
        q=_fresh_q(raw_key, plan) if o.warm_start else None,
        residual=trees.zero_state(params, o.state_dtype) if o.error_feedback else None,
        nonfinite=jnp.zeros((), jnp.int32),
    )


def _update(o: _Options, start_iter: int, updates: Any, state: PowerSGDState):
    """One :func:`powersgd` step: dense averaging before ``start_iter``, PowerSGD after."""
    _check_state(state, updates, error_feedback=o.error_feedback, warm_start=o.warm_start)
    _, treedef, grads = trees.leaves(updates, o.axis_name)
    if o.warm_start:
        n_comp = sum(
            leaf is not None
            for leaf in _plan([g.shape for g in grads], o.rank, o.min_rate, o.matrix_view)
        )
        if len(state.q) != n_comp:
            raise ValueError(
                f"state.q: holds {len(state.q)} matrices but the updates have {n_comp} "
                f"compressible leaves; was the state initialised with other params?"
            )

    if start_iter == 0:
        out, key_, q, res, nonfinite = _power_step(o, grads, state, treedef)
    else:
        started = state.count >= start_iter
        if o.axis_name is not None:  # identical, and typed invariant, on all workers
            started = collectives.agree(started.astype(jnp.int32), o.axis_name) > 0
        out, key_, q, res, nonfinite = typed_cond(
            started,
            lambda s: _power_step(o, grads, s, treedef),
            lambda s: _dense_step(o, grads, s),
            state,
        )
    count = optax.safe_int32_increment(state.count)
    return treedef.unflatten(out), PowerSGDState(count, key_, q, res, nonfinite)


def _dense_step(o: _Options, grads, state):
    """The step before ``start_iter``: the dense mean, the state as it is."""
    grads = stages.dense_mean(grads, o.axis_name, o.bucket_bytes)
    return grads, state.key, state.q, state.residual, state.nonfinite


def _sum_over_workers(o: _Options, arrays: list[jax.Array]) -> list[jax.Array]:
    """Σ over workers of every array (in leaf order): one all-reduce per bucket."""
    return (
        arrays
        if o.axis_name is None
        else buckets.bucketed_psum(arrays, o.axis_name, o.bucket_bytes)
    )


def _power_step(o: _Options, grads, state, treedef):
    """The PowerSGD step (see the module docstring): the outputs (leaf list), key, Q,
    residual and non-finite count."""
    plan = _plan([g.shape for g in grads], o.rank, o.min_rate, o.matrix_view)
    comp = [i for i, leaf in enumerate(plan) if leaf is not None]
    residuals = treedef.flatten_up_to(state.residual) if o.error_feedback else None
    outputs: list[jax.Array | None] = [None] * len(grads)
    dense = [i for i, leaf in enumerate(plan) if leaf is None]
    if not comp:
        return _dense_step(o, grads, state)

    new_key = state.key
    if o.warm_start:
        qs = list(state.q)
    else:
        new_key, step_key = jax.random.split(state.key)
        qs = list(_fresh_q(step_key, plan))

    ms = _matrices(grads, residuals, plan, comp)
    q_of = dict(zip(comp, qs))
    groups = _batches(plan, comp, o.batch_same_shape)
    m_b = [jnp.stack([ms[i] for i in grp]) for grp in groups]  # (k, a, b)
    q_b = [jnp.stack([q_of[i] for i in grp]) for grp in groups]  # (k, b, r)

    # All-reduce 1: P = Σ_w M_w Q, bucketed; the dense leaves' sums ride along.
    p_b, n = _reduce_p(o, grads, dense, groups, [_mm(m, q) for m, q in zip(m_b, q_b)], outputs)
    finite = stages.all_finite(p_b)  # P is summed over the workers: agreed
    p_hat = [orthogonalize(p, o.eps) for p in p_b]
    # All-reduce 2: Q̄ = mean_w M_wᵀ P̂.
    q_w = [_mm(jnp.swapaxes(m, 1, 2), ph) for m, ph in zip(m_b, p_hat)]
    q_mean = [q / n for q in _sum_over_workers(o, q_w)]

    factors = (p_hat, q_mean, q_w, m_b)
    new_q, new_res = _apply(o, grads, residuals, groups, factors, q_of, finite, outputs)
    q_state = tuple(new_q[i] for i in comp) if o.warm_start else None
    residual = treedef.unflatten(new_res) if o.error_feedback else None
    nonfinite = stages.count_nonfinite(state.nonfinite, finite)
    return outputs, new_key, q_state, residual, nonfinite


def _reduce_p(o: _Options, grads, dense, groups, p_b, outputs):
    """All-reduce 1: the sums of the groups' P's, bucketed with the dense leaves (whose
    means go to ``outputs``, in place); the P sums and the worker count."""
    order = sorted(
        [(i, ("dense", i)) for i in dense] + [(g[0], ("p", j)) for j, g in enumerate(groups)]
    )
    arrays = {("dense", i): grads[i] for i in dense}
    arrays.update({("p", j): p for j, p in enumerate(p_b)})
    summed = dict(zip([t for _, t in order], _sum_over_workers(o, [arrays[t] for _, t in order])))
    n = 1 if o.axis_name is None else collectives.axis_size(o.axis_name)
    for i in dense:
        s = summed[("dense", i)]
        outputs[i] = s if o.axis_name is None else s / jnp.asarray(n, s.dtype)
    return [summed[("p", j)] for j in range(len(groups))], n


def _apply(o: _Options, grads, residuals, groups, factors, q_of, finite, outputs):
    """Each compressed leaf's output ``P̂ Q̄ᵀ`` (into ``outputs``, in place; NaN unless
    ``finite``), its next Q̄ and residual (kept as they were unless ``finite``)."""
    p_hat, q_mean, q_w, m_b = factors
    new_q = dict(q_of)
    new_res = list(residuals) if o.error_feedback else None
    # the NaN rule as an addition, not stages.nan_unless: -0.0 + 0.0 is +0.0, and the
    # saved outputs hold that
    poison = jnp.where(finite, 0.0, jnp.nan).astype(jnp.float32)
    for grp, ph, qm, qw, m in zip(groups, p_hat, q_mean, q_w, m_b):
        approx = _mm(ph, jnp.swapaxes(qm, 1, 2)) + poison  # (k, a, b)
        err = m - _mm(ph, jnp.swapaxes(qw, 1, 2)) if o.error_feedback else None
        for j, i in enumerate(grp):
            g = grads[i]
            outputs[i] = approx[j].reshape(g.shape).astype(g.dtype)
            # A zero column of Q̄ (zero or rank-deficient M: P̂ has a zero column) would
            # stay zero for ever under warm start; keep last step's column instead.
            live = jnp.any(qm[j] != 0, axis=0, keepdims=True)
            new_q[i] = stages.keep_unless(finite & live, qm[j], q_of[i])
            if o.error_feedback:
                r = err[j].reshape(g.shape).astype(residuals[i].dtype)
                new_res[i] = stages.keep_unless(finite, r, residuals[i])
    return new_q, new_res
