r"""
# Running the experiments

The experiments behind jaxcomm's measurements: a training harness, configs,
a launcher for local processes on real or shaped links, benchmarks and
studies. This package is part of the source repository, not of the wheel;
the library itself is documented in `jaxcomm.guide` (its user guide) and in
each public function's docstring. Measurements are stored as JSON in
`experiments/results/`; each config and benchmark module's docstring gives
its exact command and the result to expect.

# The harness

- `experiments/train.py` is the training harness (its step: `make_train_call`,
  a chunk of steps in one compiled `shard_map`); `experiments/digits.py`
  drives that step on digits in a few lines, with any `tx`.
- Complete training loops with the `jaxcomm.data_parallel` helper:
  `experiments/examples/linen_digits.py` (a flax linen `TrainState`) and
  `experiments/examples/nnx_digits.py` (the official Flax nnx MNIST example
  made data-parallel with `jaxcomm.flax`, six changed lines).

# Configs, launcher, resume

`experiments/main.py` parses flags only and calls
`train.train_and_evaluate(config, workdir)`. Each config file's docstring
gives its exact command and the result to expect.

```bash
python -m experiments.main --config experiments/configs/digits_mlp.py --workdir runs/digits
python -m experiments.main --config experiments/configs/digits_mlp.py:powersgd --workdir runs/psgd
python -m experiments.main --config experiments/configs/cifar_resnet.py --workdir runs/c10 \
  --config.data.name=cifar10 --config.data.dir=PATH/cifar-10-batches-py
```

| config | model, data | method |
|---|---|---|
| `digits_mlp.py` | MLP 128, scikit-learn digits | top-k 1% + EF, SGD |
| `char_transformer.py` | 2-layer decoder, stdlib source bytes | PowerSGD r=4, Adam |
| `cifar_resnet.py` | ResNet-8, synthetic CIFAR-shaped | top-k 1% on kernels, SGD+momentum |

`digits_mlp.py`'s variants (`:dense`, `:bf16`, `:powersgd`, `:local_sgd`,
…) are listed in its docstring. Components are picked by name:
`config.compressor.name` / `.kwargs` become
`getattr(jaxcomm, name)(**kwargs, axis_name="data")` (a `key` is added when
the factory takes one); `config.policy="matrices"` uses `optax.partition`
(compressor on matrices, dense all-reduce on the rest);
`config.wrapper.name` is `none`, `accumulate`, `local_sgd`, `diloco`,
`streaming_diloco`, `sparseloco` or `no_exchange` (each worker alone: a compute floor). Bad
values (unknown names, a ratio outside (0, 1], a missing CIFAR directory)
raise an error naming the config key before any data is read or anything
compiled. The step runs under `jax.shard_map` over a `("data",)` mesh of
all devices (8 fake CPU devices without accelerators);
`config.steps_per_call` steps run in one jitted `lax.scan` with donated
state, and each worker draws its batch on device.

**Resume.** orbax saves params, BatchNorm statistics, the whole optimizer
state (residuals, PowerSGD Q, PRNG keys, counters) and the step every
`config.checkpoint_every` steps. The step is also the data position:
batches are a pure function of (seed, worker, step). Running again with the
same `--workdir` resumes from the latest checkpoint, bit-identical to an
uninterrupted run (`tests/test_train.py`). Resuming with another number of
workers is refused with an error naming both counts. So is a workdir trained
with another method or model: its checkpoints are intact, and the error names
the leaves and config keys that differ (each checkpoint records its config in
`jaxcomm_config.json`); resume with that configuration or use a fresh
`--workdir`. Nothing is moved aside for it.

**Divergence.** A run whose training loss or state turns NaN/Inf stops with
`NonFiniteError` (exit status 1), saving nothing non-finite; the message names
the step, the last good checkpoint and the fixes (a lower learning rate,
`jaxcomm.skip_nonfinite`, or `--config.on_nonfinite=continue`, which trains
on; non-finite states are still never checkpointed). `metrics.jsonl` is strict
JSON: NaN/Inf are written as `null`. A `--config.KEY` the config lacks is
refused with close matches and the keys available; the learning rate must be
finite and > 0 and `--workdir` writable, both checked before data is loaded.

**Checkpoint integrity.** Each process writes
`checkpoints/<step>/jaxcomm_checksums.p<i>.json`, the SHA-256 of every
shard it saved. On resume the newest checkpoint is verified (every shard
against its checksum, every float leaf finite); one that fails or cannot be
read is named in a warning, moved to `corrupt_checkpoints/<step>.<time>`,
and the next older one is tried; if none is usable the launcher stops with
an error listing why each failed. A state holding NaN/Inf is not saved, so
`max_to_keep=2` never rotates out the last good checkpoint.

**Outputs in the workdir.** `metrics.jsonl`, one line per eval (step,
losses, accuracy, cumulative wire bytes per worker, simulated communication
time at `config.netsim.gbps`); `metrics.png`; `checkpoints/`.

**The comparison job.** `python -m experiments.studies.compare` trains a
label-skewed digits MLP with ten methods (variants of
`experiments/configs/digits_compare.py`, the method registry) on 8 simulated workers and reports
accuracy, bytes per step and the time to target at 0.01–10 Gbit/s (measured
compute plus `jaxcomm.netsim` communication for the bytes GPU/TPU move;
`--wire=xla_cpu` for XLA:CPU's); `--noquick` runs the longer preset; it
writes `compare_out/compare.json` and `.png`. `python -m experiments.bench.sync_sweep` compares
the schedules of "Less frequent communication"
(`jaxcomm.guide.less_communication`) the same way.

# Several processes and real links

The library's side (`jaxcomm.distributed`: start-up, the global mesh,
per-process data) is in `jaxcomm.guide.processes`.

## Local processes: `experiments/launch.py`

```bash
python -m experiments.launch --processes=2 --devices_per_process=2 -- \
  python -m experiments.main --config=experiments/configs/digits_mlp.py --workdir=runs/mp
python -m experiments.launch --processes=4 --rate=100mbit -- \
  python -m experiments.main --config=experiments/configs/digits_mlp.py:powersgd --workdir=runs/mp4
```

It starts N processes of any command with M fake CPU devices each, sets the
three variables, prefixes each process's output with `[p0]`, `[p1]`, …, and
fails fast: when one process dies it stops the others and exits with its
status. In `experiments.main` only process 0 evaluates and writes metrics;
every process saves its own checkpoint shards. `metrics.jsonl` gains
`train_s` (seconds inside the compiled training calls) and `compile_s`.

**On a GPU cluster** no launcher is needed: run the same command once per
host (e.g. `srun --nodes=4 --ntasks-per-node=1 python -m experiments.main
...`), or set `JAX_COORDINATOR_ADDRESS=host0:12355 JAX_NUM_PROCESSES=4
JAX_PROCESS_ID=i` on host i. `--workdir` must be on a file system every
host can write.

## Shaped links: the network lab (`--rate`)

With `--rate=10mbit|100mbit|1gbit` the launcher runs each process in its
own network namespace (`experiments/netlab/`), joined by veth pairs through
a bridge in a namespace of its own (the root namespace is not touched),
every egress shaped with `tc qdisc … tbf` on both sides, like a switch with
full-duplex ports. Everything is torn down on exit, on an exception and on
SIGINT/SIGTERM/SIGHUP; `python -m experiments.netlab down` removes what a
SIGKILLed run left. It needs root and iproute2 (`python -m experiments.netlab
check` says what is missing). The lab shapes bandwidth only; latency stays
in `jaxcomm.netsim`. Link settings: tbf burst max(32 KiB, 2 ms at the rate),
queue limit max(1 MiB, 4 bursts, 100 ms at the rate), segmentation offload
off at ≤ 100 Mbit/s (64 KiB packets would overflow the queue).
`python -m experiments.netlab probe` measures the utilisation a dense
all-reduce reaches (`experiments/results/netlab_utilisation.json`).

**Not every collective reaches the all-reduce's rate.** `python -m
experiments.bench.collectives --out=experiments/results/collectives.json`,
run under the launcher, measures all-gathers and all-to-alls against the
fp32 all-reduce in the same run. On gloo some take longer than their bytes
predict, so halving the bytes can save less than half the time;
`jaxcomm.netsim` and the `exchange="auto"` rule count bytes only.

## Fault tolerance

**Preemption.** SIGTERM (or Ctrl-C) to the launcher sends SIGTERM to every
process; `experiments.main` takes it as JAX's preemption notice: every
process saves a checkpoint at the same step, process 0 prints `preempted
(SIGTERM) at step N`, and they exit. The launcher sends SIGKILL after
`--stop_grace_s` (60 s; a second signal kills at once) and exits with 128 +
the signal. The same command again resumes. On a cluster, SIGTERM to every
process does the same. When a process dies, a survivor's failed collective
makes it exit at once with a message, instead of waiting in
`jax.distributed`'s shutdown barrier and aborting. (A survivor that was
inside a checkpoint's save barrier when its peer died still waits for JAX's
heartbeat timeout.)

Checkpoints become visible only when complete. `tests/test_distributed.py`
runs 2 processes and `kill -9`s one after the step-100 checkpoint: the
launcher stops the other and exits 137; the same command again resumes
from the latest complete checkpoint, and the final state (params,
residuals, keys, counters) equals an uninterrupted run's bit for bit.

A replica of the DiLoCo family surviving the loss of another
(`jaxcomm.ElasticDiLoCo`): `python -m experiments.elastic_demo` runs it with
a kill and a restart.

## Time to accuracy on shaped links (`experiments/studies/netstudy.py`)

```bash
python -m experiments.studies.netstudy --processes=2,4   # as root
python -m experiments.studies.netstudy --report          # tables, experiments/results/netstudy.png
python -m experiments.studies.netstudy --repredict       # redo netsim's predictions of stored cells
python -m experiments.studies.netstudy --rerun=wide_mlp/2/dense   # measure some cells again
```

Every cell is a real run (2 or 4 gloo processes, shaped by tbf or on
loopback) of `digits_mlp` or `wide_mlp`, timed by `train_s` to dense
loopback's final accuracy minus 1 point; cells too slow to run in full
measure `--probe_steps` steps and multiply by the steps the method needed on
loopback (the trajectory does not depend on the link); `jaxcomm.netsim`,
calibrated on loopback, predicts each step time. Results in
`experiments/results/netstudy.json`, tables in `netstudy.md` beside it. One
seed per cell; the LM study (`experiments/studies/lm.py`) runs several and
follows the rules of `experiments/studies/verdict.py`.

# Is compression worth it here? `experiments.advise`

`jaxcomm.auto` and its rules are in `jaxcomm.guide.is_it_worth_it`. The
harness's `compressor.name="auto"` records the costs and their rounds in
`workdir/auto_choice.json`, and a resumed run decides from them (the
checkpoint's state layout is the choice's).

```bash
python -m experiments.advise --config=experiments/configs/lm_shakespeare.py
python -m experiments.launch --processes=2 --rate=10mbit -- \
    python -m experiments.advise --config=experiments/configs/digits_mlp.py
```

prints the calibrated link (`jaxcomm.calibrate`: alpha and bandwidth per
collective kind), the step with no exchange, each candidate's measured cost,
alpha-beta time, predicted step time and the recommendation with its reason.
The predicted step is the no-exchange step plus the larger of the measured
cost and the alpha-beta time (`experiments.advise.predicted_step`): a short
timed program can beat the link's sustained rate (a `tbf` link passes its
burst at line rate), a training step cannot. Its prediction is of
training's *median* step: the no-exchange step and each cost are the median
of their samples
(`policy.measure(..., statistic="median")`), where `auto` compares the least
(a choice wants the noise out) and asks a compressed candidate to have beaten
dense by the margin in at least `policy.MIN_WINS` (80%) of the timed rounds
(`policy.wins_over_dense`, the `wins` column): on 2 processes over loopback
the digits MLP's candidates differ by less than the noise (dense's median
training step 0.96 ms, its least 0.50 ms; top-k 1.00 and 0.62), and the order
of their least costs changed from run to run. Two processes sharing a small machine stall
each other now and then (on the digits MLP a call of 25 steps took 11 to 100
ms on loopback), so the mean step, which time to target pays, can sit well
above the median. `experiments/bench/auto.py` runs dense, `auto` and fixed
methods side by side on shaped links and checks the predictions against the
measured median steps (`experiments/results/auto.md`); the training loop
records each call's seconds (`call_s` in `metrics.jsonl`).
`python -m experiments.advise` applies an `auto` config's `margin`,
`max_ratio` and `min_wins` to its recommendation.

# Benchmarks

## Two-phase exchange

`python -m experiments.bench.two_phase` (`--part=traffic|decode|accuracy`)
writes `experiments/results/two_phase.json`; the digits config's variants
`int8` (gather), `int8_2p`, `int8_auto`, `ef_sign_2p` and `bf16_words` run
the exchanges over real processes ("Several processes and real links",
above); the cast runs are in
`experiments/results/cast_words.json`.

## Buckets

On fake devices in one process a combined all-reduce is cheap and the
bucket costs a copy, so measure bucketing across processes: `python -m
experiments.bench.buckets` times bucketed and per-leaf steps over 2
processes and counts the compiled collectives on 8 fake devices
(`experiments/results/buckets.json`; the 2-process table, generated:
`experiments/results/buckets.md`).

## Performance benchmarks

`python -m experiments.bench.compressors` times one jitted update (memory
add, encode, exchange, decode, residual update) under `shard_map` on 8 fake
CPU devices, divided by the time of a gradient copy (`x * 2.0`) in the same
run, and bytes divided by a dense fp32 ring all-reduce; it prints the table
and writes JSON (`--out`); `--tree resnet18` (or `gpt2`) uses model-shaped
trees. Compare ratios within a column, not absolute seconds. By structure:
on XLA:CPU the psum cast is a convert, an f32 all-reduce and a convert back
(more than dense; on GPU/TPU a native bf16 all-reduce); the all-gather
codecs decode all n payloads on every worker, O(n·d) work, so they pay off
only when the network is the bottleneck, or with the two-phase exchange;
the psum-able codecs (`sign_majority`, `terngrad` with a shared scale,
PowerSGD, shared-index random-k) decode once.

`python -m experiments.bench.floor` times the sparsifiers the same way in
interleaved rounds, in two layouts (8 fake devices x 4M entries, and one
device per core): exact top-k, threshold with and without error feedback,
per leaf, the library at an earlier git revision and the selection
threshold replaced (both loaded from git), and the passes over the
gradient of such a step without any selection work (read g + e to choose,
read them again for the residual, write the update), and the same in the
order with fewer bytes (write p = g + e, read it back to choose, write the
update). It states the targets they meet (`experiments/results/floor.md`).

## Threshold fill and step parts

`python -m experiments.bench.threshold_fill` measures the share of the true
top-k that `jaxcomm.threshold` sends (`results/threshold_fill.json`).
Where a small model's compressed step goes (the step with no exchange, the
codec, the collectives, the rest) is measured by
`python -m experiments.bench.step_parts` (`experiments/results/step_parts.md`).

## Overlap

`experiments/bench/overlap.py` measures asynchronous dispatch and
`jaxcomm.loco.Overlap`'s host thread against each other (results in
`experiments/results/overlap.json`).

## What-if tables

`python -m experiments.bench.whatif` sweeps SF against 1–400 Gbps for ResNet-50,
VGG-16, BERT-Large, GPT-2 1.5B and FasterRCNN with dense fp32, bf16 and each
compressor, tabulates the ratio needed for SF ≥ 0.9 (the question of Zhang
et al. 2020, "Is Network the Bottleneck of Distributed Training?",
arXiv:2006.10103) and DGC's step time on a FasterRCNN-sized model, and
writes PNG plots and `whatif.json`. It uses analytic byte formulas, or with
`--from_transforms` the `wire_report` of the real transforms. Its inputs
(flags, stored in `whatif.json`): 8 nodes × 8 GPUs, NVLink 1200 Gbps and
5 µs inside a node, 25 µs between nodes, hierarchical all-reduce, 25 MiB
buckets, backward pass 2/3 of the compute time T_c, full link utilisation.
The T_c per model are estimates for V100-class GPUs (FLOPs at half of peak;
FasterRCNN from Detectron2's model zoo), not figures from the papers. The
required ratio is sensitive to T_c: a shorter compute time needs more
compression for the same SF.

## Side by side with PyTorch DDP comm hooks (`experiments/bench/peers.py`)

```bash
pip install -e ".[peers]" --extra-index-url https://download.pytorch.org/whl/cpu   # torch, CPU
python -m experiments.bench.peers                      # all parts on loopback
python -m experiments.bench.peers --part=peers --rates=100mbit,1gbit   # shaped links (root)
python -m experiments.bench.peers --report             # tables from experiments/results/peers.json
pytest -q tests/test_peers.py                          # skipped without torch
```

torch is an optional extra (`peers`), never a core dependency; without it
the benchmark runs only the part that needs no torch. The JSON keeps every
command line. Parts (`--part=`): `overhead` (on 8 fake devices,
`jaxcomm.allreduce()` against a hand-written `lax.pmean` step; identical
params); `peers` (DDP's all-reduce, `fp16_compress_hook`,
`bf16_compress_hook` and `powerSGD_hook` rank 2 against `allreduce()`,
`cast(float16)`, `cast(bfloat16)` and `powersgd(2, start_iter=2)`, over real
gloo processes, one device and one thread each, on the same MLP and
ResNet-18 built alike in both, `experiments/bench/torch_peers.py`); `agree`
(torch's hook and `powersgd(matrix_view="first")` from the same Q, at world
size 1 and 2); `castcost` (bare 16-bit all-reduces). On CPU DDP refuses a
hook *named* `bf16_compress_hook` without NCCL (the benchmark registers it
under another name), and `powerSGD_hook` needs one DDP bucket on gloo.

# Layout

    experiments/       main.py + train.py (the harness's loop), optimizers.py (a config's optax
                       chain), checkpoints.py (checksummed orbax checkpoints) + configs/ (their
                       variants are the method registry); advise.py (is compression worth it here?);
                       digits.py (train.py's step on digits, any tx); examples/ (nnx and linen
                       loops); bench/ (benchmarks: timings, threshold_fill, whatif, sync_sweep,
                       overlap, auto, torch_peers: PyTorch DDP twins); launch.py, netlab/ (real
                       processes, shaped links); studies/ (the comparison job and its time axis, the
                       LM study, the MLP netstudy, verdict rules, generated tables); results/ (the
                       JSON behind every table)
"""
