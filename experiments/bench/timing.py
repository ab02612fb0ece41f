"""Timing for the benchmarks: the median of repeated, synchronised calls; interleaved rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np


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


def shuffled_rounds(names: Iterable[str], rounds: int, seed: int = 0) -> Iterator[list[str]]:
    """``rounds`` orders of ``names``, each drawn anew from ``seed`` (the same on every process).

    Interleaved timing (every case once a round) in a fixed order let a case's
    time depend on the case before it: two ResNet-18 cases compiling to the same
    program differed by 1.6x (``experiments/bench/buckets.py``).
    """
    names = list(names)
    order = np.random.default_rng(seed)
    for _ in range(rounds):
        yield [str(k) for k in order.permutation(names)]
