r"""
# Layout

    jaxcomm/
      protocol.py      the Compressor protocol, CompressorBase, CompressState and their checks
      core.py          compress(): its update in small stages (check state, step key, add
                       memory, group leaves, strategy, new state); re-exports protocol.py
      checks.py        the shared argument and state validators (check_int, check_float,
                       check_ratio, check_tx, ...); imports nothing of jaxcomm
      strategies.py    the exchange strategies as objects (Local, Gather, TwoPhase,
                       ReduceScatter, Auto): name, check, server state, choice, traffic
                       model and the exchange; core dispatches through STRATEGIES
      stages.py        the values the pipeline's stages pass, and the helpers the
                       strategies share
      jaxprs.py        one walk over a traced program (every equation, sub-jaxprs too)
      methods.py       the method registry (names -> factories) and "Add a compressor"
      ledger.py        the byte ledger: what a transform sends (Collective records)
      collectives.py   psum / all_gather / reduce-scatter / all-to-all / ppermute
                       wrappers that record to the ledger; as_varying, axis checks
      branches.py      typed_cond / typed_switch: lax.cond and lax.switch whose branches
                       are typed alike under shard_map
      buckets.py       tensor fusion: one collective per bucket of payloads
      exchange.py      ring all-reduce, two-phase exchange, compressed reduce-scatter,
                       hierarchical exchange
      compressors/     dense.py (allreduce, cast), sparse/ (topk, randomk, threshold: one
                       module each), selection.py (the threshold's strided-prime
                       selection), quantize.py (int8, qsgd, terngrad), sign.py (onebit,
                       ef_sign, sign_majority), twobit.py, blocks.py (bucket views and
                       the streamed decode they share), packing.py (bit packing), dgc/
                       (schedule, selection, transform, chain), powersgd.py
      sync/            accumulation (accumulate), averaging (local_sgd, diloco), delays
                       (delayed_averaging, stale), nonfinite (skip_nonfinite)
      loco/            the DiLoCo family: streaming.py (streaming_diloco, the
                       StreamingDiLoCo rule), overlap.py (Overlap: exchanges in a host
                       thread), sparseloco.py, muloco.py
      optim/           onebit_adam.py (1-bit Adam), zero_one_adam.py (0/1 Adam),
                       demo.py (DeMo)
      accounting.py    wire_bytes / wire_report / traffic_bytes; collective bytes in HLO
      netsim/          alpha-beta cost model (costs), step-time model (step), what-if
                       analysis (questions); Link and Cluster (links)
      calibrate/       per-kind alpha/beta: the fit and the model (model), measured on the
                       user's mesh (measure)
      policy/          auto / choose / measure: the exchange measured cheapest on the mesh
                       (timing, choice, transform)
      distributed.py   jax.distributed start-up, global mesh, per-process data
      parallel/        data_parallel / init_state: the data-parallel step helper (layout,
                       arguments: the batch and keys, step)
      divergence.py    which values of a traced step may differ between workers
      flax.py          the same for flax nnx (imports flax; optional)
      guide/           this guide: an index and one chapter a module (docstrings only)
    experiments/       the harness, configs, benchmarks and studies (not in the wheel; its
                       layout is in the `experiments` package's docstring)
    tests/             one module per jaxcomm module, test_registry.py (every public
                       transform), convergence, real processes, netlab, notebooks
    colab/             notebooks

# Notebooks

`colab/` holds three notebooks that import `jaxcomm` and `experiments` and
plot inline; each opens in Colab from its badge (its first cell installs the
package there) and runs on 8 simulated CPU devices or the runtime's TPU/GPU:
`01_quickstart.ipynb` (a top-k `shard_map` step on digits, bytes against
dense, `wire_bytes` against the compiled HLO),
`02_is_the_network_the_bottleneck.ipynb` (`jaxcomm.netsim` what-if, the
top-k break-even, measured against predicted step times from
`experiments/results/netstudy.json` when present) and
`03_error_feedback_dgc_powersgd.ipynb`. Locally: `pip install
-e ".[notebooks]" jupyterlab`. `tests/test_notebooks.py` executes all three
(with `JAXCOMM_QUICK=1`) and checks they are committed without outputs.
"""
