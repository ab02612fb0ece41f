"""A link-aware exchange policy: :func:`auto` measures candidates on the mesh, keeps the fastest.

Whether compression pays depends on the link, the model and the backend
(on a fast link a compressor's encode and decode cost more than the bytes
they save). :func:`choose` settles it on the user's own mesh, in seconds:

1. every candidate exchange (:data:`DEFAULT_CANDIDATES`: dense fp32, 16-bit
   words, PowerSGD rank 2 and 4, top-k and int8 with error feedback) is built with the
   user's ``axis_name`` and compiled into one small ``shard_map`` program
   that draws a per-worker gradient shaped like ``params`` and runs the
   candidate's ``update`` on it, its state carried from call to call (after
   a few untimed steps from ``init``: the steady state of training, where
   PowerSGD's ``Q`` is warm-started and residuals are filled); a baseline
   program draws the gradient and exchanges nothing;
2. each program is timed (the minimum of ``repeats`` rounds, each round
   timing every program once; with several processes, the slowest
   process's time, so every process makes the same choice); a candidate's
   *cost* is its time minus the baseline's: what it adds to a step;
3. the choice is the candidate of least cost, where a compressed candidate
   must beat dense by ``margin`` (a tie goes to dense: noise must not make
   compression lose), must have done so in at least ``min_wins`` of the
   rounds (each round's samples compared: one lucky round does not choose)
   and may not compress more than ``max_ratio``. Each round times the
   programs in a fresh order (the same on every process).

With a :class:`jaxcomm.calibrate.Calibration` the table also shows each
candidate's alpha-beta prediction of its collectives
(:func:`jaxcomm.calibrate.exchange_time` of its wire report), the model
``python -m experiments.advise`` prints. :func:`auto` returns the chosen
transform (optionally after a dense warm-up); :meth:`Choice.drifted` says
when a measured step time has moved more than 20% from the prediction, the
cue to call :func:`choose` again with ``refresh=True``.

The choice happens outside ``jit``, once, from the shapes of ``params``:
the transform :func:`auto` returns is an ordinary jaxcomm transform with
static shapes and no host round-trip.
"""

from jaxcomm.policy.choice import (
    DEFAULT_CANDIDATES,
    MIN_WINS,
    Candidate,
    Choice,
    Row,
    choose,
    clear_cache,
    decide,
    measure,
    wins_over_dense,
)
from jaxcomm.policy.timing import (
    DROP_FACTOR,
    LEAD_IN_S,
    SAMPLE_S,
    STATISTICS,
    WARM_STEPS,
    time_programs,
    time_samples,
)
from jaxcomm.policy.transform import WarmupState as WarmupState
from jaxcomm.policy.transform import auto, dense_warmup

__all__ = [
    "DEFAULT_CANDIDATES",
    "DROP_FACTOR",
    "LEAD_IN_S",
    "MIN_WINS",
    "SAMPLE_S",
    "STATISTICS",
    "WARM_STEPS",
    "Candidate",
    "Choice",
    "Row",
    "auto",
    "choose",
    "clear_cache",
    "decide",
    "measure",
    "time_programs",
    "time_samples",
    "wins_over_dense",
    "dense_warmup",
]
