"""jaxcomm: communication-efficient distributed training as optax transforms."""

from jaxcomm import (
    accounting,
    calibrate,
    core,
    distributed,
    divergence,
    exchange,
    guide,
    loco,
    methods,
    netsim,
    optim,
    options,
    parallel,
    policy,
    stages,
    strategies,
    sync,
)
from jaxcomm.accounting import wire_bytes
from jaxcomm.compressors.dense import allreduce, cast
from jaxcomm.compressors.dgc import dgc, dgc_sgd
from jaxcomm.compressors.powersgd import powersgd
from jaxcomm.compressors.quantize import int8, qsgd, terngrad
from jaxcomm.compressors.sign import ef_sign, onebit, sign_majority, twobit
from jaxcomm.compressors.sparse import randomk, threshold, topk
from jaxcomm.core import Compressor, CompressState, compress
from jaxcomm.elastic import ElasticDiLoCo
from jaxcomm.exchange import hierarchical, ring_allreduce
from jaxcomm.loco import muloco, sparseloco, streaming_diloco
from jaxcomm.optim import ZeroOneAdamState, demo, onebit_adam, zero_one_adam
from jaxcomm.parallel import data_parallel, fsdp, init_state
from jaxcomm.policy import auto
from jaxcomm.sync import (
    accumulate,
    delayed_averaging,
    diloco,
    local_sgd,
    skip_nonfinite,
    stale,
)

__version__ = "0.1.0"

__all__ = [
    "CompressState",
    "Compressor",
    "ElasticDiLoCo",
    "ZeroOneAdamState",
    "accounting",
    "accumulate",
    "allreduce",
    "auto",
    "calibrate",
    "cast",
    "data_parallel",
    "fsdp",
    "compress",
    "core",
    "delayed_averaging",
    "demo",
    "dgc",
    "dgc_sgd",
    "diloco",
    "distributed",
    "divergence",
    "ef_sign",
    "exchange",
    "guide",
    "hierarchical",
    "init_state",
    "int8",
    "local_sgd",
    "loco",
    "methods",
    "muloco",
    "netsim",
    "onebit",
    "onebit_adam",
    "optim",
    "options",
    "parallel",
    "policy",
    "powersgd",
    "qsgd",
    "randomk",
    "ring_allreduce",
    "sign_majority",
    "skip_nonfinite",
    "sparseloco",
    "stages",
    "stale",
    "strategies",
    "streaming_diloco",
    "sync",
    "terngrad",
    "threshold",
    "topk",
    "twobit",
    "wire_bytes",
    "zero_one_adam",
]


def __getattr__(name: str):
    # jaxcomm.flax imports flax: loaded on first use, so plain-optax users never import it
    if name == "flax":
        import importlib

        return importlib.import_module("jaxcomm.flax")
    if name in methods.compressors():  # a codec module added under jaxcomm/compressors/
        return methods.get(name)
    raise AttributeError(f"module 'jaxcomm' has no attribute {name!r}")
