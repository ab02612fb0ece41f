"""Benchmarks: timings, traffic and what-if sweeps (each module runs with ``python -m``).

``buckets`` (tensor fusion: collectives and step time, buckets off vs on;
``python -m experiments.bench.buckets``), ``collectives`` (bare collectives between
real processes, run under ``experiments.launch``; ``python -m experiments.bench.collectives``),
``compressors`` (compressor cost against a gradient copy, bytes against dense;
``python -m experiments.bench.compressors``), ``dispatch`` (a CPU data-parallel loop
without ``block_until_ready``; ``python -m experiments.bench.dispatch``), ``peers``
(jaxcomm against plain optax and PyTorch DDP comm hooks; ``python -m experiments.bench.peers``),
``torch_peers`` (its PyTorch twins and DDP worker; ``python -m experiments.bench.torch_peers``),
``peers_report`` (the peers bench's tables; pure Python), ``peers_jax`` (its jaxcomm side:
transforms, step, the launched jaxcomm processes), ``peers_setup`` (what both sides share;
NumPy only), ``peers_agree`` (its ``agree`` part: torch's PowerSGD hook beside
``jaxcomm.powersgd``), ``torch_lm`` (the LM study's GPT,
its AdamW, schedule and batches in PyTorch, checked against the Flax model; a library),
``two_phase`` (two-phase against all-gather exchange; ``python -m experiments.bench.two_phase``),
``threshold_fill`` (the share of the true top-k ``threshold`` sends;
``python -m experiments.bench.threshold_fill``), ``sync_sweep`` (accuracy against the number
of synchronisations; ``python -m experiments.bench.sync_sweep``), ``whatif`` (netsim's
step-time model over link speeds; ``python -m experiments.bench.whatif``; its models and
schemes in ``whatif_inputs``) and ``timing``
(the median-of-repeated-calls helper the benchmarks share; no command). A bench's
``<name>_report`` module (``auto_report``, ``step_parts_report``, ``peers_report``) renders
its tables from its JSON, below both the bench and ``experiments.studies.tables``.
"""
