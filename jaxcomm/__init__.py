"""jaxcomm: communication-efficient distributed training as optax transforms."""

from jaxcomm import accounting
from jaxcomm import core
from jaxcomm import exchange
from jaxcomm.accounting import wire_bytes
from jaxcomm.compressors.dense import allreduce
from jaxcomm.compressors.dense import cast
from jaxcomm.compressors.sparse import randomk
from jaxcomm.compressors.sparse import threshold
from jaxcomm.compressors.sparse import topk
from jaxcomm.core import CompressState
from jaxcomm.core import Compressor
from jaxcomm.core import compress

__version__ = "0.1.0"

__all__ = [
    "CompressState",
    "Compressor",
    "accounting",
    "allreduce",
    "cast",
    "compress",
    "core",
    "exchange",
    "randomk",
    "threshold",
    "topk",
    "wire_bytes",
]
