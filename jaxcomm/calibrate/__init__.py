"""Calibrate the alpha-beta model on the user's mesh: α and B per collective kind.

:mod:`jaxcomm.netsim` charges every collective at one :class:`~jaxcomm.netsim.Link`.
Real backends run different collectives at different rates (an all-gather
or an all-to-all is often slower per byte than the all-reduce the link was
measured with), so this module

* fits α (latency, s) and B (bytes/s) of one collective kind to measured
  times at a few payload sizes (:func:`fit_alpha_beta`), through netsim's own
  formula for that kind, so the model and the fit cannot disagree;
* holds one Link per kind (:class:`KindLinks`) and times a
  :func:`jaxcomm.accounting.wire_report` with each collective charged at its
  own kind's link (:func:`exchange_time`);
* measures them on a mesh axis (:func:`calibrate`): one small jitted
  ``shard_map`` program per kind and size, timed, fitted, cached per mesh,
  printable as a table (:meth:`Calibration.table`).

The α fitted by :func:`calibrate` includes the cost of dispatching one
jitted program (it is what a step pays per collective launched alone).
"""

from jaxcomm.calibrate.measure import (
    ATTEMPTS,
    DEFAULT_KINDS,
    DEFAULT_SIZES,
    axis_size,
    calibrate,
    clear_cache,
    probe_program,
    slowest_process,
)
from jaxcomm.calibrate.model import (
    Calibration,
    KindLinks,
    Probe,
    exchange_time,
    fit_alpha_beta,
)

__all__ = [
    "ATTEMPTS",
    "DEFAULT_KINDS",
    "DEFAULT_SIZES",
    "Calibration",
    "KindLinks",
    "Probe",
    "calibrate",
    "clear_cache",
    "exchange_time",
    "fit_alpha_beta",
    "axis_size",
    "probe_program",
    "slowest_process",
]
