"""Named methods on the digits harness: train, time, account, and cost them on a link.

One registry of optimizers (label -> factory of the learning rate), shared by
the README's main job (``python -m experiments.compare``) and the notebooks in
``colab/``. :func:`run` trains one method with :func:`experiments.digits.train_curve`
and keeps what a time axis needs: the accuracy curve, the *measured* seconds
of the compiled training steps (compile and evaluation excluded) and the
transform's :func:`jaxcomm.accounting.wire_report`. :func:`elapsed` /
:func:`time_to_accuracy` then add *modelled* communication at a link rate
(:func:`jaxcomm.netsim.exchange_time` of the report, ring all-reduce /
all-gather over ``n`` workers).

Which bytes the model charges is the ``wire`` argument: ``"native"`` is what
the algorithm sends, which is what GPU (NCCL) and TPU move; ``"xla_cpu"``
widens 16-bit float all-reduces to 4 bytes per entry, as XLA:CPU does (see
:mod:`jaxcomm.accounting`). Measured multi-process runs over shaped links are
``experiments/studies/netstudy.py``'s.

Example:
  >>> split = digits.load(8)
  >>> r = run("EF-sign", split=split, steps=200, eval_every=20, lr=0.3)
  >>> time_to_accuracy(r, 0.95, gbps=1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from experiments import digits

AXIS = digits.AXIS
KEY = jax.random.key(0)
WIRES = ("native", "xla_cpu")

#: label -> factory of the full optimizer (learning rate -> optax transform).
METHODS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "dense fp32": lambda lr: optax.chain(jaxcomm.allreduce(axis_name=AXIS), optax.sgd(lr)),
    # the bf16 psum, the baseline the recorded studies measured (the CPU default since
    # is the uint16 words, accumulate="auto")
    "dense bf16": lambda lr: optax.chain(
        jaxcomm.cast(jnp.bfloat16, axis_name=AXIS, accumulate="psum"), optax.sgd(lr)
    ),
    "top-k 1% +EF": lambda lr: optax.chain(jaxcomm.topk(0.01, axis_name=AXIS), optax.sgd(lr)),
    "top-k 1% no EF": lambda lr: optax.chain(
        jaxcomm.topk(0.01, axis_name=AXIS, error_feedback=False), optax.sgd(lr)
    ),
    "threshold 1% +EF": lambda lr: optax.chain(
        jaxcomm.threshold(0.01, axis_name=AXIS), optax.sgd(lr)
    ),
    "random-k 10% +EF": lambda lr: optax.chain(
        jaxcomm.randomk(0.1, key=KEY, axis_name=AXIS), optax.sgd(lr)
    ),
    # DGC keeps momentum 0.9 itself (lr scaled by 1 - momentum); no warm-up, so the
    # reported bytes are the steady-state 1%.
    "DGC 1%": lambda lr: jaxcomm.dgc_sgd(lr * 0.1, 0.01, axis_name=AXIS),
    "PowerSGD r=2": lambda lr: optax.chain(
        jaxcomm.powersgd(2, key=KEY, axis_name=AXIS), optax.sgd(lr)
    ),
    # the all-gather exchange, as the recorded results (experiments/results) were measured;
    # the default exchange="auto" goes two-phase on 8 workers (README "Two-phase exchange")
    "EF-sign": lambda lr: optax.chain(
        jaxcomm.ef_sign(axis_name=AXIS, exchange="gather"), optax.sgd(lr)
    ),
    "sign no EF": lambda lr: optax.chain(
        jaxcomm.ef_sign(axis_name=AXIS, error_feedback=False, exchange="gather"), optax.sgd(lr)
    ),
    "QSGD 16 levels": lambda lr: optax.chain(
        jaxcomm.qsgd(16, key=KEY, axis_name=AXIS, exchange="gather"), optax.sgd(lr)
    ),
    "local SGD H=8": lambda lr: jaxcomm.local_sgd(optax.sgd(lr), every=8, axis_name=AXIS),
}
#: Methods that communicate on one step in ``every`` (``wire_report`` describes such a step).
EVERY = {"local SGD H=8": 8}


def label_skewed(split: digits.Split) -> digits.Split:
    """The same training set dealt to workers sorted by label: each holds one or two digits.

    Heterogeneous shards (as when each worker's data comes from its own
    source): the workers' gradients disagree, which is where a biased
    compressor without error feedback (scaled sign) drifts from the mean
    gradient, and error feedback repairs it (Karimireddy et al. 2019,
    arXiv:1901.09847). The test set is unchanged; dense SGD on the full
    batch is unaffected (the mean gradient is the same).
    """
    x = split.x_train.reshape(-1, split.x_train.shape[-1])
    y = split.y_train.reshape(-1)
    order = np.argsort(y, kind="stable")
    return digits.Split(
        x[order].reshape(split.x_train.shape),
        y[order].reshape(split.y_train.shape),
        split.x_test,
        split.y_test,
    )


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
    """Train ``method`` (a :data:`METHODS` label, or any label with ``tx`` given) on digits.

    Args:
      method: label; looked up in :data:`METHODS` unless ``tx`` is given.
      split: the data (:func:`experiments.digits.load`); its leading axis is
        the number of workers.
      steps: training steps (full local shard each), a multiple of ``eval_every``.
      eval_every: steps between test evaluations.
      lr: learning rate passed to the method's factory.
      model: ``"mlp"`` or ``"logreg"``.
      hidden: MLP hidden width.
      tx: an optimizer to use instead of the registry's (its collectives over
        axis ``"data"``).
      comm_every: steps per communication (default :data:`EVERY` or 1).
      on_chunk: called with ``(step, accuracy)`` after each evaluation.

    Returns:
      A :class:`Run`.
    """
    if tx is None:
        if method not in METHODS:
            raise ValueError(f"method: unknown {method!r}; choose from {sorted(METHODS)}")
        tx = METHODS[method](lr)
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
        comm_every=comm_every or EVERY.get(method, 1),
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
