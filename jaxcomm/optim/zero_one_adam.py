"""0/1 Adam (Lu et al. 2022): adaptive variance freezing, 1-bit exchanges and local steps.

See :mod:`jaxcomm.optim` for why the variance is frozen. The factory is
:func:`zero_one_adam`; its rule in full:

Rule at step ``s = count + 1`` (DeepSpeed's ``ZeroOneAdam``), with
``C̄(x)`` the 1-bit compressed mean of the workers' ``x``: scaled sign
(``mean|x|·sign(x)``, one bit per entry plus a float32 scale per chunk)
on the two-phase exchange with worker and server error feedback
(:func:`jaxcomm.compress`), ``ḡ`` the dense mean of the gradients,
``D = √v + ε``:

* variance stage, ``s <= var_freeze_step``:

  - ``s ≡ 0 (mod var_interval)`` (a variance step, dense all-reduce):
    ``m ← β1·m + (1-β1)·ḡ``, ``v ← β2·v + (1-β2)·ḡ²``; after
    ``var_update_scaler`` such steps ``var_interval`` doubles (1, then
    2, 4, ...: the steps in ``T_v`` thin out exponentially);
  - otherwise (1-bit): ``m ← β1·m + (1-β1)·C̄(g)``, ``v`` unchanged (as
    DeepSpeed: the gradient is compressed, the momentum stays identical
    on every worker);
  - update ``-lr·(m/D + wd·p)``;

* after freezing, ``s > var_freeze_step``, ``v`` is fixed; on every
  worker, with its own gradient ``g``: ``m ← β1·m + (1-β1)·g``,
  ``Δ = -lr·(m/D + wd·p)``, ``u ← u + Δ``, ``Λ ← Λ + lr``;

  - a local step (no communication): the update is ``Δ``;
  - a sync step, ``s ≡ 0 (mod local_interval)``: ``ū = C̄(u·D)``;
    ``m ← -ū/Λ``; the params go back to the last sync point and take the
    averaged step: update ``ū/D - (u - Δ)``; then ``u ← 0``, ``Λ ← 0``;
  - ``local_interval`` starts at 1 and doubles every
    ``local_step_scaler`` steps, up to ``local_step_clipper`` (the
    paper's H);

* the worker and server residuals are zeroed when ``v`` freezes (they
  measured gradients, now accumulated updates). No bias correction.

Differences from DeepSpeed: its first call only sets up buffers (no
update) and it freezes after the step that passes ``var_freeze_step``
(one step later); here every call is a step and ``var_freeze_step`` is
the last step that may refresh ``v``. If ``Λ = 0`` (lr 0 since the last
sync) ``m`` keeps its local value instead of dividing by zero. The
scale of the sign is the mean magnitude (DeepSpeed: ``‖x‖₂/√d``).

Wire per worker: a variance step is a dense all-reduce of the gradients
(``4d`` bytes, as Adam); a 1-bit step or a sync about ``2(n-1)/n·d/8``
(two-phase: 1/28 of Adam's bytes at n = 8); a local step nothing. With
the defaults, after freezing the average is that divided by the sync
interval (up to 16). :func:`jaxcomm.wire_bytes` counts every branch
(dense, 1-bit and sync exchanges); build it with ``var_freeze_step=0``
to report the steps after freezing.

Defaults are DeepSpeed's (betas, eps and the four schedule integers;
``local_step_scaler=32678`` as DeepSpeed spells it).
``var_freeze_step=100000`` and ``local_step_scaler`` are meant for
pre-training runs of several 100k steps (BERT, GPT-2); DeepSpeed places
``var_freeze_step`` at the end of the learning-rate warm-up. For a short
run scale them down (e.g. ~15% and ~10% of the steps).

The update is per worker between syncs (local steps): keep params per
worker (``shard_map`` with ``out_specs=P("data")`` for params and
state, or ``pmap``). A NaN/Inf gradient on a communicating step makes
every worker's update non-finite and every worker keeps ``m``, ``v``,
``u``, ``Λ`` and the residuals; on a local step only that worker's
update is non-finite and only it keeps its state (no collective to tell
the others; the counters and ``Λ`` advance everywhere).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives, core, stages
from jaxcomm.branches import typed_cond
from jaxcomm.optim import common
from jaxcomm.options import Options, Unpack, take

__all__ = ["ZeroOneAdamState", "zero_one_adam"]


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam`.

    The int32 counters are the same on every worker, so every schedule (and
    thus whether a step communicates) is decided alike everywhere.

    Attributes:
      count: int32 ``[]``, steps taken; this step is ``s = count + 1``.
      var_interval: int32 ``[]``, the variance is refreshed on steps
        ``s ≡ 0 (mod var_interval)``; doubles every ``var_update_scaler``
        refreshes (starts at 1).
      var_counter: int32 ``[]``, refreshes made at the current interval.
      local_interval: int32 ``[]``, after freezing, sync on steps
        ``s ≡ 0 (mod local_interval)``; doubles every ``local_step_scaler``
        steps, up to ``local_step_clipper`` (starts at 1).
      local_counter: int32 ``[]``, steps since ``local_interval`` last doubled.
      lrs: float32 ``[]``, sum of the learning rates since the last sync.
      mu: the momentum (params' tree, float32); identical on every worker
        before freezing and right after a sync, per worker between syncs.
      nu: the variance (float32), identical on every worker.
      u: the accumulated update since the last sync (float32, per worker;
        zero before freezing).
      comm: state of the compressed exchange (a :func:`jaxcomm.compress`
        state: worker and server residuals); zeroed when the variance freezes.
      nonfinite: int32 ``[]``, steps whose update held NaN/Inf (float state
        left unchanged).
    """

    count: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_interval: jax.Array
    local_counter: jax.Array
    lrs: jax.Array
    mu: Any
    nu: Any
    u: Any
    comm: Any
    nonfinite: jax.Array


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    var_freeze_step: int = 100_000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    weight_decay: float = 0.0,
    **options: Unpack[Options],
) -> optax.GradientTransformation:
    """0/1 Adam (Lu et al. 2022): a thinning variance schedule, 1-bit exchanges, local steps.

    Rule: Adam whose variance is refreshed (dense) on ever sparser steps until
    ``var_freeze_step``, with 1-bit momentum between; then local steps and a 1-bit
    sync every ``local_interval`` steps (:mod:`jaxcomm.optim.zero_one_adam`).
    Wire per worker: ``4d`` bytes on a variance step, about ``2(n-1)/n·d/8`` on a
    1-bit step or a sync, nothing on a local step. Keep params per worker.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps: Adam's (0.9, 0.999, 1e-8).
      var_freeze_step: last step that may refresh the variance, an int >= 0.
      var_update_scaler: refreshes per variance interval before it doubles (κ), >= 1.
      local_step_scaler: steps per local interval before it doubles, an int >= 1.
      local_step_clipper: largest local interval (H), an int >= 1.
      weight_decay: decoupled weight decay (AdamW style), needs ``params``.
      **options: ``axis_name`` (``None``: one worker, compressed locally),
        ``exchange`` (``"auto"``, ``"two_phase"`` or ``"gather"``),
        ``min_size``, ``bucket_bytes`` (of every collective): see
        :class:`jaxcomm.options.Options`.

    Returns:
      An optimizer (``optax.GradientTransformation``) with :class:`ZeroOneAdamState`.

    Example:
      >>> tx = jaxcomm.zero_one_adam(1e-3, var_freeze_step=2000, axis_name="data")

    Reference:
      Lu et al., "Maximizing Communication Efficiency for Large-scale Training
      via 0/1 Adam", ICLR 2023, arXiv:2202.06009.
    """
    # Notes. The local interval doubles up to ``local_step_clipper``. The defaults are DeepSpeed's,
    # for runs of several 100k steps: scale ``var_freeze_step`` and ``local_step_scaler`` down for a
    # short one (e.g. ``local_step_scaler=1000``). ``var_freeze_step=0`` freezes ``v`` at zero, ``D
    # = ε``: only to account the bytes of the steps after freezing. Keep params per worker:
    # ``shard_map`` with ``out_specs=P("data")`` for params and state, or ``pmap``. The bytes,
    # DeepSpeed's differences and the NaN rule: the module docstring.
    opts = take("zero_one_adam", options, ("axis_name", "exchange", "min_size", "bucket_bytes"))
    var_freeze_step = checks.check_int(var_freeze_step, "var_freeze_step", 0)
    var_update_scaler = checks.check_int(var_update_scaler, "var_update_scaler", 1)
    local_step_scaler = checks.check_int(local_step_scaler, "local_step_scaler", 1)
    local_step_clipper = checks.check_int(local_step_clipper, "local_step_clipper", 1)
    eps = common.check_adam_args(b1, b2, eps, weight_decay)
    axis_name = collectives.check_axis_name(opts["axis_name"])
    bucket_bytes = buckets.check_bucket_bytes(opts["bucket_bytes"])
    comm_tx = common.momentum_exchange(axis_name, opts["min_size"], bucket_bytes, opts["exchange"])
    schedule = (var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
    o = _Options(b1, b2, eps, weight_decay, axis_name, bucket_bytes, comm_tx, *schedule)

    def init_fn(params):
        return _init(comm_tx, params)

    def update_fn(updates, state, params=None):
        checks.check_state(state, ZeroOneAdamState, "zero_one_adam")
        if weight_decay and params is None:
            raise ValueError("params: weight_decay > 0 needs tx.update(updates, state, params)")
        collectives.check_per_worker(updates, axis_name)
        return _update(o, learning_rate, updates, state, params if weight_decay else None)

    return optax.GradientTransformation(init_fn, update_fn)


class _Options(NamedTuple):
    """:func:`zero_one_adam`'s checked options (static), as the module's helpers take them."""

    b1: float
    b2: float
    eps: float
    weight_decay: float
    axis_name: Any
    bucket_bytes: Any
    comm_tx: optax.GradientTransformation
    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int


def _init(comm_tx: optax.GradientTransformation, params) -> ZeroOneAdamState:
    """:func:`zero_one_adam`'s initial state (floating params only)."""
    core.check_float_leaves(jax.tree_util.tree_leaves_with_path(params), "params")
    one = lambda: jnp.ones((), jnp.int32)  # noqa: E731
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    return ZeroOneAdamState(
        count=zero(),
        var_interval=one(),
        var_counter=zero(),
        local_interval=one(),
        local_counter=zero(),
        lrs=jnp.zeros((), jnp.float32),
        mu=common.zeros_f32(params),
        nu=common.zeros_f32(params),
        u=common.zeros_f32(params),
        comm=comm_tx.init(common.zeros_f32(params)),
        nonfinite=zero(),
    )


def _direction(o: _Options, mu, nu, p):
    """``m/D + wd·p``."""
    step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + o.eps), mu, nu)
    if o.weight_decay:
        step = jax.tree.map(lambda a, w: a + o.weight_decay * w.astype(jnp.float32), step, p)
    return step


def _update(o: _Options, learning_rate, updates, state: ZeroOneAdamState, p):
    """One step of :func:`zero_one_adam` (``p``: the params where weight decay needs them)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    lr = jnp.asarray(common.learning_rate_at(learning_rate, state.count), jnp.float32)
    s = state.count + 1
    frozen = s > o.var_freeze_step
    is_var = ~frozen & (s % state.var_interval == 0)
    is_sync = frozen & (s % state.local_interval == 0)

    comm0 = state.comm
    if o.var_freeze_step > 0:  # the residuals measured gradients until now
        first = s == o.var_freeze_step + 1
        clear = lambda t: jax.tree.map(lambda x: jnp.where(first, jnp.zeros_like(x), x), t)  # noqa: E731
        comm0 = comm0._replace(residual=clear(comm0.residual), server=clear(comm0.server))

    args = (grads, state.mu, state.nu, state.u, state.lrs, comm0, p)
    frozen_stage = _frozen_stage(o, lr, is_sync)
    if o.var_freeze_step == 0:
        mu, nu, u, lrs, comm, out = frozen_stage(*args)
    else:
        variance_stage = _variance_stage(o, lr, is_var)
        mu, nu, u, lrs, comm, out = typed_cond(frozen, frozen_stage, variance_stage, *args)
    out = jax.tree.map(lambda x, g: x.astype(g.dtype), out, updates)
    new = (mu, nu, u, lrs, comm)
    return out, _next_state(o, state, comm0, new, (frozen, is_var, is_sync))


def _variance_stage(o: _Options, lr, is_var):
    """The branch of steps up to ``var_freeze_step``: a dense variance refresh where
    ``is_var``, else a 1-bit step; ``v`` unchanged on 1-bit steps."""

    def variance_stage(g, mu, nu, u, lrs, comm, p):
        def refresh(g, mu, nu, comm):
            if o.axis_name is not None:
                g = buckets.bucketed_pmean(g, o.axis_name, o.bucket_bytes)
            mu = jax.tree.map(lambda m, x: o.b1 * m + (1 - o.b1) * x, mu, g)
            nu = jax.tree.map(lambda v, x: o.b2 * v + (1 - o.b2) * x * x, nu, g)
            return mu, nu, comm

        def onebit(g, mu, nu, comm):
            g, comm = o.comm_tx.update(g, comm)
            mu = jax.tree.map(lambda m, x: o.b1 * m + (1 - o.b1) * x, mu, g)
            return mu, nu, comm

        mu, nu, comm = typed_cond(is_var, refresh, onebit, g, mu, nu, comm)
        out = jax.tree.map(lambda a: -lr * a, _direction(o, mu, nu, p))
        return mu, nu, u, lrs, comm, out

    return variance_stage


def _frozen_stage(o: _Options, lr, is_sync):
    """The branch of steps after ``var_freeze_step``: a local step, or a sync where
    ``is_sync`` (the 1-bit mean of ``u·D``; the params go back to the last sync point)."""

    def frozen_stage(g, mu, nu, u, lrs, comm, p):
        mu = jax.tree.map(lambda m, x: o.b1 * m + (1 - o.b1) * x, mu, g)
        delta = jax.tree.map(lambda a: -lr * a, _direction(o, mu, nu, p))
        u_new = jax.tree.map(jnp.add, u, delta)
        lrs = lrs + lr

        def synced(mu, u_new, lrs, comm):
            den = jax.tree.map(lambda v: jnp.sqrt(v) + o.eps, nu)
            x = jax.tree.map(jnp.multiply, u_new, den)
            ubar, comm = o.comm_tx.update(x, comm)
            # Λ = 0 (lr 0 since the last sync): m keeps its local value, no division by zero
            mu = jax.tree.map(lambda a, m: jnp.where(lrs > 0, -a / lrs, m), ubar, mu)
            out = jax.tree.map(lambda a, d, b: a / d - b, ubar, den, u)
            zeros = jax.tree.map(jnp.zeros_like, u)
            return mu, zeros, jnp.zeros_like(lrs), comm, out

        def local(mu, u_new, lrs, comm):
            return mu, u_new, lrs, comm, delta

        mu, u, lrs, comm, out = typed_cond(is_sync, synced, local, mu, u_new, lrs, comm)
        return mu, nu, u, lrs, comm, out

    return frozen_stage


def _next_state(o: _Options, state: ZeroOneAdamState, comm0, new, flags) -> ZeroOneAdamState:
    """The state after a step: the schedule's counters advanced; the new float state
    ``new = (mu, nu, u, lrs, comm)`` kept where finite; ``flags = (frozen, is_var, is_sync)``."""
    (mu, nu, u, lrs, comm), (frozen, is_var, is_sync) = new, flags
    # ``ok`` is the same on every worker on steps that communicate (pmean and
    # compress spread a non-finite input to everyone); per worker on local
    # steps, where Λ (a sum of the schedule) advances regardless.
    ok = common.all_finite(mu, nu, u)
    vc = state.var_counter + is_var.astype(jnp.int32)
    roll_v = is_var & (vc == o.var_update_scaler)
    lc = state.local_counter + frozen.astype(jnp.int32)
    roll_l = frozen & (lc == o.local_step_scaler)
    doubled = jnp.minimum(state.local_interval * 2, o.local_step_clipper)
    return ZeroOneAdamState(
        count=optax.safe_int32_increment(state.count),
        var_interval=jnp.where(roll_v, state.var_interval * 2, state.var_interval),
        var_counter=jnp.where(roll_v, 0, vc),
        local_interval=jnp.where(roll_l, doubled, state.local_interval),
        local_counter=jnp.where(roll_l, 0, lc),
        lrs=jnp.where(ok | (frozen & ~is_sync), lrs, state.lrs),
        mu=stages.keep_unless(ok, mu, state.mu),
        nu=stages.keep_unless(ok, nu, state.nu),
        u=stages.keep_unless(ok, u, state.u),
        comm=stages.keep_unless(ok, comm, comm0),
        nonfinite=stages.count_nonfinite(state.nonfinite, ok),
    )
