r"""The comparison study's methods: MLP on digits, 8 workers, full-shard SGD, one variant each.

The method registry of ``python -m experiments.studies.compare`` (the README's
main job) and of the notebooks in ``colab/``: a variant is a method, named by
the label the study prints; :func:`experiments.configs.common.optimizer` builds
its optimizer (as :func:`experiments.optimizers.make_optimizer` does for any
config), so adding a method is adding one variant here.

Variants (``:NAME``): dense fp32, dense bf16 (the bf16 psum, as the recorded
studies measured it), top-k 1% +EF, top-k 1% no EF, threshold 1% +EF, random-k
10% +EF, DGC 1% (momentum 0.9 inside DGC, lr x 0.1, no warm-up: the reported
bytes are the steady-state 1%), PowerSGD r=2, EF-sign, sign no EF, QSGD 16
levels (these three on the all-gather exchange, as recorded), local SGD H=8.
jaxcomm's defaults otherwise (``min_size=1024``: small leaves go dense).

Command (the README's main job; ~1 minute on 2 CPU cores):
  python -m experiments.studies.compare
It trains every variant on label-skewed shards (lr 0.5, MLP 256, 400 steps, the
whole shard each step: :mod:`experiments.digits`). One variant under the
general harness (IID shards, flax init, the whole shard every step):
  python -m experiments.main --config "experiments/configs/digits_compare.py:EF-sign"

Expected result (the study's defaults): dense fp32 and bf16 97.1% test
accuracy (target 96.1%); EF-sign 97.1% (training loss 0.009), sign without EF
95.8% (loss 0.060), never reaching the target; at 0.01 Gbps PowerSGD, EF-sign
and top-k reach the target first (3.5-10x faster than dense fp32), at 10 Gbps
dense fp32 does.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import common

VARIANTS: dict[str, dict] = {
    "dense fp32": {"compressor": ("allreduce", {})},
    # the bf16 psum, the baseline the recorded studies measured (the CPU default since
    # is the uint16 words, accumulate="auto")
    "dense bf16": {"compressor": ("cast", {"dtype": "bfloat16", "accumulate": "psum"})},
    "top-k 1% +EF": {"compressor": ("topk", {"ratio": 0.01})},
    "top-k 1% no EF": {"compressor": ("topk", {"ratio": 0.01, "error_feedback": False})},
    "threshold 1% +EF": {"compressor": ("threshold", {"ratio": 0.01})},
    "random-k 10% +EF": {"compressor": ("randomk", {"ratio": 0.1})},
    # DGC keeps momentum 0.9 itself (lr scaled by 1 - momentum); no warm-up, so the
    # reported bytes are the steady-state 1%.
    "DGC 1%": {"compressor": ("dgc_sgd", {"ratio": 0.01}), "lr_scale": 0.1},
    "PowerSGD r=2": {"compressor": ("powersgd", {"rank": 2})},
    # the all-gather exchange, as the recorded results (experiments/results) were measured;
    # the default exchange="auto" goes two-phase on 8 workers (the guide, "Two-phase exchange")
    "EF-sign": {"compressor": ("ef_sign", {"exchange": "gather"})},
    "sign no EF": {"compressor": ("ef_sign", {"error_feedback": False, "exchange": "gather"})},
    "QSGD 16 levels": {"compressor": ("qsgd", {"levels": 16, "exchange": "gather"})},
    "local SGD H=8": {"compressor": ("allreduce", {}), "wrapper": ("local_sgd", 8)},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "dense fp32"
    c = common.base()
    c.n_workers = 8
    c.model.name = "mlp"
    c.model.kwargs = {"hidden": 256, "depth": 1}
    c.data.name = "digits"
    c.data.batch_size = 0  # the whole shard every step, as the study
    c.optimizer.learning_rate = 0.5
    common.apply_variant(c, common.variant(VARIANTS, variant, "digits_compare"))
    c.num_train_steps = 400
    c.steps_per_call = 20
    c.eval_every = 20
    c.checkpoint_every = 200
    return c
