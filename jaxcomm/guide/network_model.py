r"""
# When is the network the bottleneck? (`jaxcomm.netsim`)

`jaxcomm.netsim` is a pure-Python alpha-beta cost model (it does not import
JAX): latency α per message, bandwidth B, payload S, n workers. It costs
collectives (ring and halving/doubling all-reduce, all-gather,
reduce-scatter, collective permute, parameter server with k shards,
hierarchical all-reduce, PowerSGD's two sequential all-reduces). It turns
them into an iteration time with bucketed overlap: bucket i's exchange
starts when its gradients are ready during the backward pass, and
encode/decode run on the compute stream. From that it gives the scaling
factor `SF = T_c / T_iter` and the compression ratio a link needs.

```python
from jaxcomm import netsim

nic = netsim.Link.from_gbps(10, latency_s=25e-6)  # Link(bandwidth_bps, latency_s)
cluster = netsim.Cluster(8, 8, intra=netsim.Link.from_gbps(1200, 5e-6), inter=nic)
st = netsim.step_time(4 * 25.6e6, cluster, compute_time=0.1, algorithm="hierarchical")
st.scaling_factor  # ResNet-50-sized fp32 gradient, 64 GPUs
netsim.required_compression(4 * 25.6e6, 0.1, cluster, 0.9, algorithm="hierarchical")
netsim.step_time_for(tx, params, cluster, 0.1)  # any transform, via wire_report
```

`exchange_time(report, n, link_or_cluster)` and `step_time_for_collectives`
accept any objects with `.kind` and `.nbytes`, such as the output of
`jaxcomm.accounting.wire_report`, so compositions of transforms are costed
exactly as they communicate. Conventions:

- `bandwidth_bps` is in bits/s.
- `Cluster.intra` is each GPU's bandwidth inside its node.
- `Cluster.inter` is a node's network interface, shared by its GPUs.
- A hierarchical all-reduce is reduce-scatter inside the node, then a ring
  between nodes, then all-gather inside the node.
- Every link is assumed used at its full rate; measured systems fall
  short of it, so the model is optimistic (`experiments/studies/netstudy.py`
  compares its predictions with measured step times).

## What-if tables

Tables of SF against 1–400 Gbps for well-known models, and the compression
ratio each needs for SF ≥ 0.9 (the question of Zhang et al. 2020, "Is
Network the Bottleneck of Distributed Training?", arXiv:2006.10103), are
built on this model by a benchmark of the `experiments` package (its
docstring gives the command and the inputs).

## Top-k over all-gather against a dense ring

With d entries, density ρ = k/d, value bytes v, index bytes i and dense
bytes per entry b, the code compares bandwidth terms:

    ratio(n, ρ) = (n−1)·ρ·d·(v+i) / (2·(n−1)/n · d·b) = n·ρ·(v+i) / (2·b)
    break-even  ρ* = 2·b / (n·(v+i))                      # = 1/n for v = i = b = 4

This is `netsim.topk_allgather_ratio` and `netsim.topk_break_even_density`,
plotted against n in `topk_break_even.png`. Latency is left out: the
all-gather sends n−1 messages, the ring 2(n−1). Top-k at 1% pays off only
below 100 workers, and 0.1% only below 1000; this is why sparse all-gather
schemes need far higher compression ratios than an all-reduce payload for
the same scaling factor.

"""
