"""The data-parallel step in one call: per-worker state, specs and placement done for you.

A jaxcomm transform keeps **per-worker** state (an error-feedback residual is
what *this* worker did not send), while params and the state of optax
transforms after it (momentum, Adam's moments) are the same on every worker.
Writing that split by hand under ``jax.shard_map`` takes a page of specs and
slicing; :func:`init_state` and :func:`data_parallel` do it:

    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.adam(1e-3))
    opt_state = jaxcomm.init_state(tx, params, mesh)

    @jaxcomm.data_parallel(mesh)
    def train_step(params, opt_state, batch):  # one worker's step, plain optax
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, loss = train_step(params, opt_state, batch)  # batch: the global batch

The layout rule, applied to every argument and every output of the step:

* a **jaxcomm state** (any state class defined in ``jaxcomm``, found
  anywhere in the tree, e.g. inside a chain's tuple or a flax ``TrainState``)
  carries a leading worker axis of size ``n`` and is sharded over it;
* the **batch** arguments are split over workers along their leading axis
  (the global batch). Unless ``batch_argnums`` names them, they are found:
  the arguments whose array leaves share one leading size divisible by
  ``n``, that hold no per-worker state and no PRNG key, and that the step
  does not return (params and state come back, data does not). None, or
  candidates of different sizes, is an error naming the parameters;
* **everything else** (params, the other optimizer state, step counters) is
  replicated.

Inside the step each worker sees its own slice without the worker axis, and
gradients are per worker: the step runs under ``shard_map(check_vma=False)``
(pmap's semantics), so ``jax.grad`` of a replicated param does not insert
the dense all-reduce JAX adds under type checking, and the jaxcomm
transform does the only exchange. Outputs named in ``mean_outputs`` (e.g.
the loss) have their floating leaves averaged over workers; so have leaves
under a ``batch_stats`` key (linen's BatchNorm statistics) unless
``batch_stats="per_worker"``. PRNG keys handed to the step are folded with
the worker index (``fold_keys``), so each worker draws its own dropout.

Checks made before anything runs, each naming the leaf (by the step's
parameter names) and the fix: per-worker state without the worker axis
(state not built with :func:`init_state`), a batch whose leading axis does
not divide over the workers, a step with no jaxcomm state among its
arguments (gradients would not be exchanged), the parameter-averaging
wrappers (``local_sgd``, ``diloco``, ``zero_one_adam``), whose params are
per worker and need a hand-written step, a transform whose ``axis_name`` is
not the mesh's, and (:mod:`jaxcomm.divergence`, a walk over the traced step)
an output returned as replicated but computed from the batch without an
exchange, or a collective under a branch whose predicate comes from the
batch (``optax.apply_if_finite`` around a compressor).

Arrays are placed on the mesh on every call (a no-op for arrays already
there), so a NumPy batch, an orbax restore onto one device, or a mesh with
Explicit axes all work. On XLA:CPU with several devices in one process, the
helper waits for the previous step before dispatching the next: with many
collective programs in flight the in-process communicator can stall (only
some devices reach a rendezvous while the others' threads wait on a later
step). One step in flight keeps the host ahead of nothing but avoids it;
GPU/TPU keep JAX's asynchronous dispatch.
"""

from jaxcomm.parallel.arguments import leaf_name, param_names
from jaxcomm.parallel.fsdp import Fsdp, FsdpState, fsdp
from jaxcomm.parallel.layout import axis_size, init_state, is_worker_state, per_worker, state_mask
from jaxcomm.parallel.step import data_parallel

__all__ = [
    "Fsdp",
    "FsdpState",
    "axis_size",
    "data_parallel",
    "fsdp",
    "init_state",
    "is_worker_state",
    "leaf_name",
    "param_names",
    "per_worker",
    "state_mask",
]
