"""Alpha-beta network model: when is the network the bottleneck?

Pure Python (no JAX at import time). Three layers, each usable on its own (and each a
module of this package: :mod:`~jaxcomm.netsim.costs`, :mod:`~jaxcomm.netsim.step`,
:mod:`~jaxcomm.netsim.questions`; the value types in :mod:`~jaxcomm.netsim.links`):

1. **Collective costs** (Thakur et al. 2005; Patarasuk & Yuan 2009): seconds
   for one collective of ``nbytes`` over ``n`` workers on a :class:`Link`
   with latency α (s) and bandwidth B (``bandwidth_bps`` bits/s, so B/8 bytes/s):

   ===========================  ============================================
   ring all-reduce              ``2(n-1)α + 2(n-1)/n · S/B``
   halving/doubling all-reduce  ``2⌈log2 n⌉α + 2(n-1)/n · S/B``
   all-gather (s bytes each)    ``(n-1)α + (n-1) · s/B``
   reduce-scatter               ``(n-1)α + (n-1)/n · S/B``
   collective permute           ``α + s/B``
   parameter server, k shards   ``2α + 2n · S/(k·B)``
   hierarchical (m nodes × p)   reduce-scatter inside the node, all-reduce
                                between nodes, all-gather inside the node
   PowerSGD                     two all-reduces in sequence (P, then Q)
   ===========================  ============================================

   Every collective over ``n = 1`` worker costs nothing.

2. **Step time** (:func:`bucketed_step_time`, :func:`step_time`): compute
   ``T_c`` = forward + backward; gradients become ready bucket by bucket over
   the backward pass, each bucket's exchange starts when it is ready and the
   network is free, compression encode/decode run on the compute stream.
   ``SF = T_c / T_iter`` (Zhang et al. 2020). With many buckets and no
   latency this tends to ``T_iter = T_c + max(0, T_comm − backward time)``.

3. **Questions**: :func:`required_compression` (the compression ratio a
   link needs for a target SF), :func:`topk_allgather_ratio` /
   :func:`topk_break_even_density` (when top-k over all-gather beats a dense
   ring), :func:`exchange_time` / :func:`step_time_for` (time of a jaxcomm
   transform's :func:`jaxcomm.accounting.wire_report`).

Bandwidth convention for a :class:`Cluster`: ``intra`` is the bandwidth each
worker has to the others of its node (NVLink, PCIe); ``inter`` is the
bandwidth of a node's network interface, shared by its ``per_node`` workers
(a "100 Gbps network" is ``inter=Link(100e9)``). A flat ring over the cluster
crosses each node boundary once, so its slowest hop is
``min(intra, inter)``.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005.
  Patarasuk, Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009.
  Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
  Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019, arXiv:1905.13727.
"""

from jaxcomm.netsim.costs import (
    ALGORITHMS,
    KINDS,
    allgather_time,
    allreduce_time,
    alltoall_time,
    collective_permute_time,
    collective_time,
    halving_doubling_allreduce_time,
    hierarchical_allreduce_time,
    parameter_server_time,
    powersgd_bytes,
    powersgd_time,
    reduce_scatter_time,
    ring_allreduce_time,
)
from jaxcomm.netsim.links import Cluster, Link
from jaxcomm.netsim.questions import (
    required_compression,
    topk_allgather_ratio,
    topk_break_even_density,
)
from jaxcomm.netsim.step import (
    DEFAULT_BACKWARD_FRACTION,
    DEFAULT_BUCKET_BYTES,
    StepTime,
    bucketed_step_time,
    exchange_time,
    step_time,
    step_time_for,
    step_time_for_collectives,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BACKWARD_FRACTION",
    "DEFAULT_BUCKET_BYTES",
    "KINDS",
    "Cluster",
    "Link",
    "StepTime",
    "allgather_time",
    "allreduce_time",
    "bucketed_step_time",
    "collective_permute_time",
    "collective_time",
    "exchange_time",
    "halving_doubling_allreduce_time",
    "hierarchical_allreduce_time",
    "parameter_server_time",
    "powersgd_bytes",
    "powersgd_time",
    "reduce_scatter_time",
    "alltoall_time",
    "required_compression",
    "ring_allreduce_time",
    "step_time",
    "step_time_for",
    "step_time_for_collectives",
    "topk_allgather_ratio",
    "topk_break_even_density",
]
