r"""ResNet-8 on CIFAR-shaped data, 8 workers, top-k 1% + EF on conv/dense kernels.

Synthetic CIFAR-shaped data by default (for throughput); for real CIFAR-10 set
``config.data.name=cifar10`` and ``config.data.dir`` to the extracted
``cifar-10-batches-py`` folder. BatchNorm statistics are averaged across
workers after every step.

Command:
  python -m experiments.main --config experiments/configs/cifar_resnet.py --workdir runs/cifar
Real CIFAR-10 (not run here; needs the pickles):
  python -m experiments.main --config experiments/configs/cifar_resnet.py --workdir runs/c10 \
    --config.data.name=cifar10 --config.data.dir=PATH/cifar-10-batches-py \
    --config.num_train_steps=5000

Runtime here (2 CPU cores, 8 fake devices): about 5.5 min (100 steps, ~3 s/step;
use a GPU for longer runs).
Expected result: synthetic test accuracy 77.5% at step 100 (chance 10%),
1.5 MB sent per worker, 0.41 s simulated at 10 Gbps.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = common.base()
    c.model.name = "resnet"
    c.model.kwargs = {"stages": (16, 32, 64), "blocks": 1}
    c.data.name = "synthetic_cifar"
    c.data.batch_size = 16
    c.data.n_train = 4096
    c.compressor.name = "topk"
    c.compressor.kwargs = {"ratio": 0.01}
    c.policy = "matrices"
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.05
    c.optimizer.kwargs = {"momentum": 0.9}
    c.num_train_steps = 100
    c.steps_per_call = 25
    c.eval_every = 25
    c.checkpoint_every = 50
    c.eval_batch_size = 256
    return c
