"""Less frequent communication: accumulation, local SGD, DiLoCo, delayed averaging, staleness.

Every wrapper here takes an optax optimizer ``inner`` and decides *when* the
workers talk:

* :func:`accumulate` — average ``every`` micro-batch gradients, then run
  ``inner`` (and the exchange inside it) once.
* :func:`local_sgd` — ``every`` local steps, then parameter averaging;
  ``warmup_steps`` of every-step averaging first (post-local SGD).
* :func:`diloco` — local steps of ``inner``, then an outer optimizer step on
  the pseudo-gradient ``anchor - pmean(local params)``.
* :func:`delayed_averaging` — apply the local gradient now, correct with the
  worker mean when it arrives ``delay`` steps later.
* :func:`stale` — apply gradients ``staleness`` steps late (bounded staleness).
* :func:`skip_nonfinite` — skip a step whose update holds NaN/Inf, on every
  worker alike (the NaN-safe wrapper for any of the above or any jaxcomm chain).

Parameter-averaging methods (:func:`local_sgd`, :func:`diloco`) need
``params`` in ``update(updates, state, params)`` and keep params PER WORKER:
under ``jax.shard_map`` give params, optimizer state and data the leading
worker axis (``in_specs=P("data")``, ``out_specs=P("data")``), as
``experiments/digits.py`` does. Replicas drift apart between
synchronisations and agree right after one.

Sync decisions use ``lax.cond`` on int32 counters in the state, so a step
that does not synchronise executes no collective under ``shard_map``/``pmap``
(under ``vmap`` a cond becomes a select and both branches run). The counters
must be equal on all workers (they are when every worker starts from the same
``init``); workers disagreeing about a sync step would deadlock.
"""

from jaxcomm.sync.accumulation import AccumulateState, accumulate
from jaxcomm.sync.averaging import DiLoCoState, LocalSGDState, diloco, local_sgd
from jaxcomm.sync.delays import DelayedAveragingState, StaleState, delayed_averaging, stale
from jaxcomm.sync.nonfinite import SkipNonfiniteState, skip_nonfinite

__all__ = [
    "AccumulateState",
    "DiLoCoState",
    "DelayedAveragingState",
    "LocalSGDState",
    "SkipNonfiniteState",
    "StaleState",
    "accumulate",
    "delayed_averaging",
    "diloco",
    "local_sgd",
    "skip_nonfinite",
    "stale",
]
