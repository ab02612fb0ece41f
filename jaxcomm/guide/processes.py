r"""
# Several processes and real links

Everything above also runs across processes: the same transform under the
same `jax.shard_map`, over a mesh whose devices belong to several
`jax.distributed` processes (gloo collectives on CPU; NCCL/TPU unchanged).

```python
info = jaxcomm.distributed.initialize()  # first; args, JAX_* env vars or SLURM
mesh = jaxcomm.distributed.global_mesh("data")  # every device of every process
batch = jaxcomm.distributed.shard_rows(per_worker_batches, mesh, "data")  # own rows only
```

`jaxcomm.distributed` is the only module that knows about processes.
`initialize` takes coordinator / count / id from its arguments, from
`JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, or from
SLURM (`SLURM_NTASKS` / `SLURM_PROCID` / `SLURM_STEP_NODELIST`), and selects
gloo for CPU collectives; `shard_rows` turns host data with a leading worker
axis into a global array, each process passing only its rows
(`jax.make_array_from_process_local_data`); `local_row` and `gather` go back.
Start-up failures that JAX reports by aborting from C++ become clear errors:
a coordinator that does not resolve (`ValueError`) or cannot be reached
within `timeout_s` (`TimeoutError`), processes started with different
counts or devices per process (`ValueError` on every process), and a
process that never comes (exit status 3 from a watchdog, not a hang).

How to start several local processes, on loopback or on shaped links, and
how the training harness checkpoints, resumes and stops on preemption over
them: the `experiments` package's docstring.

**Not every collective reaches the all-reduce's rate.** Measured over real
processes against the fp32 all-reduce in the same run
(`experiments/results/collectives.json`), on gloo some all-gathers and
all-to-alls take longer than their bytes predict, so halving the bytes can
save less than half the time; `jaxcomm.netsim` and the `exchange="auto"`
rule count bytes only.

## Fault tolerance

The DiLoCo family needs floating-point params: an integer or bool leaf
raises `TypeError` naming it (leave such leaves out with `optax.partition`
/ `optax.masked`).

Resuming from a checkpoint: another split of the same number of workers
(1 process × 4 devices ↔ 2 × 2) resumes, since the state is per worker; another number of workers is
refused (jaxcomm does not merge or split error-feedback residuals). On the
same global data, 2 processes × 2 devices and 1 × 4 give bit-identical
params for top-k (payloads decoded in worker order everywhere) and params
equal to float32 rounding for dense all-reduce and PowerSGD (gloo and XLA
sum in different orders).

**Surviving a lost replica** (the DiLoCo family, `jaxcomm.ElasticDiLoCo`,
the `ft` extra: torch and torchft). Each replica group is its own JAX
program; only the outer exchange goes through torchft's Manager and its
gloo process group, which re-forms the quorum every round. A replica killed
between syncs is dropped and the survivors commit the next round without
it; killed inside the outer all-reduce, the survivors' round is rolled back
(params return to the last anchor, never half-applied); a restarted replica
heals from a live peer (params, inner and outer optimizer state, anchor) and
is bit-equal to them from then on. Streaming DiLoCo's overlap is `start`
(quorum, pseudo-gradient, all-reduce launched) and `finish` (wait, commit,
`mix` of the local fragment) with `delay` inner steps between, as torchft's
`fragment_sync_delay` and `fragment_update_alpha`; `round` runs a whole round
given the inner-steps function, and its `wait_s` is the exchange time the
steps did not hide. JAX's own fault tolerance on CPU cannot
heal a restarted process or survive losing process 0, hence torchft (its
module docstring says more); `tests/test_elastic.py` tests both kinds of
kill (a demo with a kill and a restart is in the `experiments` package).
"""
