"""Timing for the benchmarks: the median of repeated, synchronised calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (after one untimed call: compile, warm-up).

    Each call is waited for with ``jax.block_until_ready``, so asynchronous
    dispatch does not hide the work.
    """
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
