"""The DiLoCo family beyond :func:`jaxcomm.diloco`: Streaming DiLoCo, SparseLoCo, MuLoCo.

Each member is an optax transform with an explicit state NamedTuple, built
on :mod:`jaxcomm.sync`'s DiLoCo pieces (inner optimizer kept across rounds,
an anchor all workers share, an outer step on the averaged pseudo-gradient).

* :func:`streaming_diloco` — the params synchronised in fragments on a
  staggered schedule, each merged ``delay`` steps after its send; with
  :class:`Overlap` the exchange really runs while those steps do
  (Douillard et al. 2025).
* :func:`sparseloco` — the outer momentum replaced by a decayed error-feedback
  buffer, sent top-k per chunk with 2-bit values (Sarfi et al. 2025).
* :func:`muloco` — :func:`jaxcomm.diloco` with Muon as the inner optimizer and
  an optional error-feedback compressor (Thérien et al. 2025).
"""

from jaxcomm.loco.muloco import muloco
from jaxcomm.loco.overlap import Overlap
from jaxcomm.loco.sparseloco import SparseLoCoState, sparseloco, sparseloco_sync_bytes
from jaxcomm.loco.streaming import StreamingDiLoCo, StreamingDiLoCoState, streaming_diloco

__all__ = [
    "Overlap",
    "SparseLoCoState",
    "StreamingDiLoCo",
    "StreamingDiLoCoState",
    "muloco",
    "sparseloco",
    "sparseloco_sync_bytes",
    "streaming_diloco",
]
