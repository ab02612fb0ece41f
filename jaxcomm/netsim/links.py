"""The network's value types, :class:`Link` and :class:`Cluster`, and the argument checks
of the alpha-beta model (:mod:`jaxcomm.netsim`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = [
    "Cluster",
    "Link",
    "choice",
    "count",
    "fraction",
    "non_negative",
    "open_fraction",
    "positive",
]


# --- validation -----------------------------------------------------------------


def positive(name: str, value: float) -> float:
    """``value`` as a float, checked finite and > 0; the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    return float(value)


def non_negative(name: str, value: float) -> float:
    """``value`` as a float, checked finite and >= 0; the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number >= 0, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    return float(value)


def count(name: str, value: int) -> int:
    """``value``, checked an integer >= 1; the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return value


def fraction(name: str, value: float) -> float:
    """``value`` as a float, checked in [0, 1]; the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: must be in [0, 1], got {value!r}")
    return float(value)


def open_fraction(name: str, value: float) -> float:
    """``value``, checked in the open interval (0, 1); the error names ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number in (0, 1), got {value!r}")
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name}: must be in the open interval (0, 1), got {value!r}")
    return value


def choice(name: str, value: str, allowed: Sequence[str]) -> str:
    """``value``, checked one of ``allowed``; the error names ``name``."""
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


# --- value types ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bits per second, latency α in seconds.

    Args:
      bandwidth_bps: bandwidth in **bits** per second, > 0 (10 Gbps = ``10e9``).
      latency_s: per-message latency α in seconds, >= 0.

    Example:
      >>> Link(100e9, 10e-6).bytes_per_s
      12500000000.0
    """

    bandwidth_bps: float
    latency_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "bandwidth_bps", positive("bandwidth_bps", self.bandwidth_bps))
        object.__setattr__(self, "latency_s", non_negative("latency_s", self.latency_s))

    @classmethod
    def from_gbps(cls, gbps: float, latency_s: float = 0.0) -> Link:
        """A link of ``gbps`` gigabits per second (``Link.from_gbps(10)`` is 10 Gbps)."""
        return cls(positive("gbps", gbps) * 1e9, latency_s)

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth B in bytes per second."""
        return self.bandwidth_bps / 8

    def seconds(self, nbytes: float) -> float:
        """Time to push ``nbytes`` through the link, without latency."""
        return nbytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``n_nodes`` nodes of ``per_node`` workers: a fast link inside, a slow one between.

    Args:
      n_nodes: number of nodes (machines), >= 1.
      per_node: workers (accelerators) per node, >= 1.
      intra: each worker's link to the others in its node; ``None``: the
        same as ``inter``.
      inter: each node's network interface, shared by its workers (required).

    Example:
      >>> c = Cluster(8, 8, intra=Link(1200e9, 5e-6), inter=Link(100e9, 20e-6))
      >>> c.n_workers
      64
    """

    n_nodes: int
    per_node: int = 1
    intra: Link | None = None
    inter: Link | None = None

    def __post_init__(self):
        count("n_nodes", self.n_nodes)
        count("per_node", self.per_node)
        if not isinstance(self.inter, Link):
            raise TypeError(f"inter: expected a Link, got {self.inter!r}")
        if self.intra is None:
            object.__setattr__(self, "intra", self.inter)
        elif not isinstance(self.intra, Link):
            raise TypeError(f"intra: expected a Link or None, got {self.intra!r}")

    @property
    def n_workers(self) -> int:
        """Total number of workers, ``n_nodes · per_node``."""
        return self.n_nodes * self.per_node

    @property
    def flat_link(self) -> Link:
        """The link a flat (topology-unaware) collective sees: the slowest hop.

        One node: ``intra``. Several: the lower bandwidth and the higher
        latency of ``intra`` and ``inter``. Right for a ring (it crosses each
        node boundary once); optimistic for patterns that send from every
        worker of a node through the interface at once (halving/doubling).
        """
        if self.n_nodes == 1:
            return self.intra
        return Link(
            min(self.intra.bandwidth_bps, self.inter.bandwidth_bps),
            max(self.intra.latency_s, self.inter.latency_s),
        )
