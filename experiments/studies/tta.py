"""Time to accuracy: train a method on digits, then measured compute + modelled communication.

The time axis of the README's main job (``python -m experiments.studies.compare``)
and of the notebooks in ``colab/``. :func:`run` trains one method (a variant of
:mod:`experiments.configs.digits_compare`, the method registry, or any
optimizer) with :func:`experiments.digits.train_curve` and keeps what a time
axis needs in a :class:`Run`: the accuracy curve, the *measured* seconds of the
compiled training steps on this machine (compile and evaluation excluded) and
the transform's :func:`jaxcomm.accounting.wire_report`. :func:`elapsed` /
:func:`time_to_accuracy` then add the *modelled* communication of that report at
a link rate (:func:`jaxcomm.netsim.exchange_time`: ring all-reduce / all-gather
over the run's workers, ``latency_us`` per message, collectives one after
another and after the compute, no overlap).

Which bytes are charged is the ``wire`` argument: ``"native"`` is what the
algorithm sends, which is what GPU (NCCL) and TPU move (bf16: 2 bytes per
entry); ``"xla_cpu"`` widens 16-bit float all-reduces to 4 bytes per entry, as
XLA:CPU does (see :mod:`jaxcomm.accounting`). Measured multi-process runs over
shaped links are ``experiments/studies/netstudy.py``'s.

Example:
  >>> split = digits.label_skewed(digits.load(8))
  >>> runs = [run(m, split=split, steps=200, eval_every=20, lr=0.3)
  ...         for m in ("dense fp32", "EF-sign")]
  >>> time_to_accuracy(runs[1], 0.95, gbps=1.0)
  >>> print(summary(runs, target=0.95, gbps=[0.1, 1, 10, 100], latency_us=10, wire="native"))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

import jaxcomm
from experiments import digits, optimizers
from experiments.configs import common, digits_compare
from jaxcomm import netsim

WIRES = ("native", "xla_cpu")


@dataclasses.dataclass
class Run:
    """One training run of one method on digits, with what a time axis needs.

    Attributes:
      method: the label.
      steps: step count after each evaluation.
      accuracy: test accuracy (worker 0's params) at those steps.
      train_s: measured seconds of compiled training up to those steps
        (compile and evaluation excluded; every worker's compute, encode,
        decode and in-memory exchange on this machine).
      train_loss: final training loss (mean over workers' shards).
      report: one communicating step's collectives (``wire_report``).
      comm_every: the method communicates on one step in this many.
      n_workers: workers (mesh size).
    """

    method: str
    steps: list[int]
    accuracy: list[float]
    train_s: list[float]
    train_loss: float
    report: list[Any]
    comm_every: int
    n_workers: int

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1]

    @property
    def compute_s_per_step(self) -> float:
        """Measured seconds per step: the median over chunks of chunk time / chunk steps.

        The median (not the total) so that a chunk slowed by something else
        running on the machine does not shift a method's whole time axis.
        """
        times = np.diff([0.0, *self.train_s])
        steps = np.diff([0, *self.steps])
        return float(np.median(times / steps))

    def bytes_per_step(self, wire: str = "native") -> float:
        """Operand bytes one worker contributes per step (averaged over sync rounds)."""
        return sum(c.nbytes for c in moved(self.report, wire)) / self.comm_every

    def traffic_per_step(self, wire: str = "native") -> float:
        """Bytes one worker sends per step with ring all-reduce / all-gather."""
        report = moved(self.report, wire)
        return jaxcomm.accounting.traffic_bytes(report, self.n_workers) / self.comm_every


def run(
    method: str,
    *,
    split: digits.Split,
    steps: int,
    eval_every: int,
    lr: float,
    model: str = "mlp",
    hidden: int = 64,
    tx: optax.GradientTransformation | None = None,
    comm_every: int | None = None,
    on_chunk: Callable[[int, float], None] | None = None,
) -> Run:
    """Train ``method`` (a :mod:`~experiments.configs.digits_compare` variant, or any label
    with ``tx`` given) on digits.

    Args:
      method: label; a variant of :data:`experiments.configs.digits_compare.VARIANTS`
        unless ``tx`` is given.
      split: the data (:func:`experiments.digits.load`); its leading axis is
        the number of workers.
      steps: training steps (full local shard each), a multiple of ``eval_every``.
      eval_every: steps between test evaluations.
      lr: the variant's learning rate (:func:`experiments.configs.common.optimizer`).
      model: ``"mlp"`` or ``"logreg"``.
      hidden: MLP hidden width.
      tx: an optimizer to use instead of the variant's (its collectives over
        axis ``"data"``).
      comm_every: steps per communication (default: the variant's wrapper, or 1).
      on_chunk: called with ``(step, accuracy)`` after each evaluation.

    Returns:
      A :class:`Run`.
    """
    every = 1
    if tx is None:
        if method not in digits_compare.VARIANTS:
            raise ValueError(
                f"method: unknown {method!r}; choose from {sorted(digits_compare.VARIANTS)}"
            )
        config = common.variant_config(digits_compare, method, learning_rate=lr)
        tx, every = optimizers.make_optimizer(config), common.comm_every(config)
    n = split.x_train.shape[0]
    curve = digits.train_curve(
        tx,
        steps=steps,
        eval_every=eval_every,
        model=model,
        hidden=hidden,
        n_workers=n,
        split=split,
        on_chunk=on_chunk,
    )
    params = digits.init_params(model, jax.random.key(0), hidden=hidden)
    return Run(
        method=method,
        steps=list(curve.steps),
        accuracy=list(curve.accuracy),
        train_s=list(curve.train_s),
        train_loss=curve.result.train_loss,
        # the bytes GPU/TPU move ("native"); moved(..., "xla_cpu") widens them
        report=jaxcomm.accounting.wire_report(tx, params, n, backend="gpu"),
        comm_every=comm_every or every,
        n_workers=n,
    )


def moved(report: Sequence[Any], wire: str = "native") -> list[Any]:
    """The collectives as the backend moves them (``"xla_cpu"``: 16-bit float all-reduce -> f32)."""
    if wire not in WIRES:
        raise ValueError(f"wire: expected one of {WIRES}, got {wire!r}")
    if wire == "native":
        return list(report)
    return [
        c._replace(nbytes=2 * c.nbytes)
        if c.kind == "all_reduce" and str(c.dtype) in ("bfloat16", "float16")
        else c
        for c in report
    ]


def link(gbps: float, latency_us: float = 10.0) -> netsim.Link:
    """A link of ``gbps`` Gbit/s and ``latency_us`` per message."""
    return netsim.Link.from_gbps(gbps, latency_s=latency_us * 1e-6)


def comm_s_per_exchange(
    r: Run, gbps: float, *, latency_us: float = 10.0, wire: str = "native"
) -> float:
    """Modelled seconds of one communicating step's collectives (netsim, ring, in sequence)."""
    report = moved(r.report, wire)
    return netsim.exchange_time(report, r.n_workers, link(gbps, latency_us)) if report else 0.0


def elapsed(r: Run, gbps: float, *, latency_us: float = 10.0, wire: str = "native") -> list[float]:
    """Seconds at each evaluation: steps x measured compute per step + modelled communication.

    Compute per step is :attr:`Run.compute_s_per_step` (median over chunks);
    the collectives of each communicating step follow its compute (no overlap).
    """
    per = comm_s_per_exchange(r, gbps, latency_us=latency_us, wire=wire)
    compute = r.compute_s_per_step
    return [s * compute + (s // r.comm_every) * per for s in r.steps]


def time_to_accuracy(
    r: Run, target: float, gbps: float, *, latency_us: float = 10.0, wire: str = "native"
) -> float | None:
    """:func:`elapsed` at the first evaluation with accuracy >= ``target`` (None: never)."""
    times = elapsed(r, gbps, latency_us=latency_us, wire=wire)
    return next((t for t, a in zip(times, r.accuracy) if a >= target), None)


def ranking(
    runs: Sequence[Run],
    target: float,
    gbps: float,
    *,
    latency_us: float = 10.0,
    wire: str = "native",
) -> list[str]:
    """Methods that reach ``target``, fastest first at ``gbps``."""
    tta = {
        r.method: time_to_accuracy(r, target, gbps, latency_us=latency_us, wire=wire) for r in runs
    }
    return sorted((m for m, t in tta.items() if t is not None), key=lambda m: tta[m])


def fmt_seconds(t: float | None) -> str:
    """``1.23s`` / ``45ms`` / ``never``."""
    if t is None or math.isinf(t):
        return "never"
    return f"{t:.2f}s" if t >= 1 else f"{t * 1e3:.0f}ms"


def summary(
    runs: Sequence[Run],
    target: float,
    gbps: Sequence[float],
    *,
    latency_us: float,
    wire: str,
) -> str:
    """The terminal table: one row per method, then the ranking at each rate."""
    dense = next((r for r in runs if r.method == "dense fp32"), runs[0])
    where = "GPU/TPU (bf16 moves 2 B/entry)" if wire == "native" else "XLA:CPU (bf16 widened)"
    lines = [
        f"time to {100 * target:.1f}% test accuracy = measured compute here + netsim "
        f"communication on an {dense.n_workers}-worker ring ({latency_us:g} us/message), "
        f"bytes as on {where}",
        f"{'method':<17} {'acc':>6} {'loss':>6} {'bytes/step':>10} {'vs fp32':>8} "
        f"{'ms/step':>7}" + "".join(f" {f'@{g:g}G':>8}" for g in gbps),
    ]
    for r in runs:
        ratio = dense.traffic_per_step(wire) / max(r.traffic_per_step(wire), 1e-12)
        line = (
            f"{r.method:<17} {100 * r.final_accuracy:>5.1f}% {r.train_loss:>6.3f} "
            f"{r.bytes_per_step(wire):>10,.0f} {ratio:>7.1f}x {1e3 * r.compute_s_per_step:>7.2f}"
        )
        for g in gbps:
            t = time_to_accuracy(r, target, g, latency_us=latency_us, wire=wire)
            line += f" {fmt_seconds(t):>8}"
        lines.append(line)
    lines.append(
        "acc, loss: final test accuracy, training loss; bytes/step: what one worker contributes "
        "per step; vs fp32: dense fp32 ring traffic / the method's (an all-gather sends its "
        "piece n-1 times); ms/step: measured compute of all workers here; @rate: time to target"
    )
    lines.append("fastest to the target (x vs dense fp32 / dense bf16):")
    by_name = {r.method: r for r in runs}
    for g in gbps:
        order = ranking(runs, target, g, latency_us=latency_us, wire=wire)
        tta = {
            m: time_to_accuracy(by_name[m], target, g, latency_us=latency_us, wire=wire)
            for m in order
        }
        parts = []
        for m in order[:4]:
            vs = [tta.get(b) for b in ("dense fp32", "dense bf16")]
            sp = " / ".join("-" if v is None else f"{v / tta[m]:.1f}x" for v in vs)
            parts.append(f"{m} ({sp})")
        lines.append(f"  @{g:g} Gbps: " + ", ".join(parts))
    never = [r.method for r in runs if r.accuracy and max(r.accuracy) < target]
    if never:
        lines.append("never reached the target: " + ", ".join(never))
    return "\n".join(lines)


def to_json(
    runs: Sequence[Run], target: float, gbps: Sequence[float], *, latency_us: float, wire: str
) -> dict:
    """Everything behind the table and the plot."""
    rows = []
    for r in runs:
        rows.append(
            {
                "method": r.method,
                "accuracy": r.final_accuracy,
                "train_loss": r.train_loss,
                "bytes_per_step": r.bytes_per_step(wire),
                "traffic_per_step": r.traffic_per_step(wire),
                "compute_s_per_step": r.compute_s_per_step,
                "comm_every": r.comm_every,
                "curve_steps": r.steps,
                "curve_accuracy": r.accuracy,
                "curve_train_s": r.train_s,
                "collectives": [
                    {"kind": c.kind, "nbytes": c.nbytes, "dtype": str(c.dtype)}
                    for c in moved(r.report, wire)
                ],
                "comm_s_per_exchange": {
                    str(g): comm_s_per_exchange(r, g, latency_us=latency_us, wire=wire)
                    for g in gbps
                },
                "time_to_target_s": {
                    str(g): time_to_accuracy(r, target, g, latency_us=latency_us, wire=wire)
                    for g in gbps
                },
            }
        )
    return {
        "target": target,
        "gbps": list(gbps),
        "latency_us": latency_us,
        "wire": wire,
        "rows": rows,
    }


def plot(
    runs: Sequence[Run],
    target: float,
    gbps: Sequence[float],
    path: str | None = None,
    *,
    latency_us: float = 10.0,
    wire: str = "native",
):
    """Accuracy vs step, accuracy vs time at the slowest rate, time to target vs rate.

    Returns the matplotlib figure (saved to ``path`` and closed if given).
    """
    # lazy: the backend is chosen per call (Agg to save headless, the notebook's own to show)
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    slow = min(gbps)
    palette = plt.get_cmap("tab20").colors  # 20 colours: no two methods share one
    for i, r in enumerate(runs):
        style = "--" if "no EF" in r.method else "-"
        acc = [100 * a for a in r.accuracy]
        color = palette[(2 * i) % 20 + (2 * i) // 20 % 2]
        (line,) = ax1.plot(r.steps, acc, style, label=r.method, color=color)
        times = elapsed(r, slow, latency_us=latency_us, wire=wire)
        ax2.plot(times, acc, style, color=line.get_color())
        tta = [time_to_accuracy(r, target, g, latency_us=latency_us, wire=wire) for g in gbps]
        pts = [(g, t) for g, t in zip(gbps, tta) if t is not None]
        if pts:
            ax3.plot(*zip(*pts), style, marker="o", color=line.get_color())
    for ax in (ax1, ax2):
        ax.axhline(100 * target, color="gray", lw=0.8, ls=":")
        ax.set_ylim(max(0, 100 * target - 15), 100)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    ax1.set_xlabel("step")
    ax1.set_title("digits MLP, 8 workers")
    ax1.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.set_xlabel(f"measured compute + modelled comm at {slow:g} Gbps (s)")
    ax3.set_xscale("log")
    ax3.set_yscale("log")
    ax3.set_xlabel("link rate (Gbit/s)")
    ax3.set_ylabel(f"time to {100 * target:.1f}% (s)")
    ax3.set_title("lines that cross: the ranking changes with the link")
    ax3.grid(alpha=0.3, which="both")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
