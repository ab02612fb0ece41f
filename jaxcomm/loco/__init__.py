"""The DiLoCo family beyond :func:`jaxcomm.diloco`: Streaming DiLoCo, SparseLoCo, MuLoCo.

Each member is an optax transform with an explicit state NamedTuple, built
on :mod:`jaxcomm.sync`'s DiLoCo pieces (inner optimizer kept across rounds,
an anchor all workers share, an outer step on the averaged pseudo-gradient).
"""

from jaxcomm.loco.overlap import Overlap
from jaxcomm.loco.streaming import StreamingDiLoCo, StreamingDiLoCoState, streaming_diloco

__all__ = ["Overlap", "StreamingDiLoCo", "StreamingDiLoCoState", "streaming_diloco"]
