r"""
# The jaxcomm user guide

How to use each part of jaxcomm, and the contracts it keeps. Read it with
`python -m pydoc jaxcomm.guide` (and `jaxcomm.guide.<chapter>`), or as pages
of `pdoc jaxcomm`. Every public function's docstring gives its arguments,
its rule and the paper it follows; this guide shows how the parts fit
together.

The guide states what the code does, not how fast it runs on some machine:
measurements are made by commands in `experiments/` and stored as JSON in
`experiments/results/`. Byte counts here are closed forms.

# Chapters

1. `jaxcomm.guide.training_step`: using a transform in a training step (the
   `data_parallel` helper, flax, checkpoints; by hand under `shard_map` and
   `pmap`).
2. `jaxcomm.guide.transforms`: the transforms, choosing a compressor (bytes
   on the wire and collective of each, DGC, PowerSGD, the threshold
   selection).
3. `jaxcomm.guide.conventions`: conventions shared by every compressor
   (error feedback and its state, small leaves, randomness, the NaN rule,
   bad input, dtypes).
4. `jaxcomm.guide.exchanges`: exchanges (per-leaf policies, hierarchical,
   two-phase and `exchange="auto"`, the server residual, compressed
   reduce-scatter and FSDP).
5. `jaxcomm.guide.compressed_adam`: 1-bit Adam and 0/1 Adam.
6. `jaxcomm.guide.bytes_and_buckets`: honest accounting, buckets, what an
   update costs to compute.
7. `jaxcomm.guide.processes`: several processes and real links, fault
   tolerance.
8. `jaxcomm.guide.is_it_worth_it`: is compression worth it here?
   (`jaxcomm.auto`).
9. `jaxcomm.guide.pytorch_ddp`: side by side with PyTorch DDP comm hooks.
10. `jaxcomm.guide.network_model`: when is the network the bottleneck?
    (`jaxcomm.netsim`).
11. `jaxcomm.guide.less_communication`: less frequent communication (local
    SGD, DiLoCo and its family, delayed averaging).
12. `jaxcomm.guide.layout`: the layout of the package, and the notebooks.

Running experiments (the harness, configs, launcher, benchmarks, studies) is
documented in the `experiments` package of the source repository, not part
of the wheel: `python -m pydoc experiments`.
"""

__all__ = [
    "training_step",
    "transforms",
    "conventions",
    "exchanges",
    "compressed_adam",
    "bytes_and_buckets",
    "processes",
    "is_it_worth_it",
    "pytorch_ddp",
    "network_model",
    "less_communication",
    "layout",
]
