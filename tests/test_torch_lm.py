"""The LM study's GPT in PyTorch (experiments.bench.torch_lm) computes what the Flax one does.

Skipped without torch, except where ``JAXCOMM_REQUIRE_TORCH`` is set
(:func:`tests.helpers.import_torch`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import helpers

torch = helpers.import_torch()

from experiments import data, models, optimizers  # noqa: E402
from experiments.bench import torch_lm  # noqa: E402
from experiments.configs import lm_shakespeare  # noqa: E402

CONFIG = lm_shakespeare.get_config("dense")
STUDY_PARAMS = 875_520  # the config docstring's count


def _flax():
    return models.build(CONFIG.model.name, **CONFIG.model.kwargs)


def _tokens(seed: int, batch: int = 4) -> np.ndarray:
    """``batch`` windows of ``seq_len + 1`` random bytes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (batch, CONFIG.data.seq_len + 1)).astype(np.int32)


@jax.jit
def _flax_apply(params, w):
    logits = _flax().apply({"params": params}, w[:, :-1])
    return logits, optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:]).mean()


def _flax_loss(params, w):
    logits, loss = _flax_apply(params, jnp.asarray(w))
    return np.asarray(logits), float(loss)


def _torch_loss(net, w):
    w = torch.from_numpy(w.astype(np.int64))
    with torch.no_grad():
        logits = net(w[:, :-1])
        return logits.numpy(), float(torch_lm.lm_loss(logits, w[:, 1:]))


_init = jax.jit(lambda key: _flax().init(key, jnp.zeros((1, CONFIG.data.seq_len), jnp.int32)))


def test_same_parameters_and_shapes():
    model = _flax()
    x = jnp.zeros((1, CONFIG.data.seq_len), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flax_paths = {tuple(k.key for k in path): leaf.shape for path, leaf in leaves}
    net = torch_lm.from_config(CONFIG)
    torch_shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert sum(math.prod(s) for s in flax_paths.values()) == STUDY_PARAMS
    assert sum(p.numel() for p in net.parameters()) == STUDY_PARAMS
    pairs = torch_lm.param_pairs(net)
    # one torch tensor per Flax leaf, each in the layout the conversion gives
    assert sorted(n for n, _, _ in pairs) == sorted(torch_shapes)
    assert sorted(p for _, p, _ in pairs) == sorted(flax_paths)
    assert len(pairs) == 70
    for name, path, convert in pairs:
        assert convert(np.zeros(flax_paths[path])).shape == torch_shapes[name], (name, path)


def test_same_function_with_copied_weights():
    params = _init(jax.random.key(0))["params"]
    net = torch_lm.load_from_flax(torch_lm.from_config(CONFIG), params)
    w = _tokens(1)
    lj_logits, lj = _flax_loss(params, w)
    lt_logits, lt = _torch_loss(net, w)
    # Measured: loss 6.10827 in both (relative difference 8e-8), logits within 3.5e-6
    np.testing.assert_allclose(lt, lj, rtol=1e-5)
    np.testing.assert_allclose(lt_logits, lj_logits, rtol=0, atol=1e-4)


def test_own_initialisation_same_loss():
    # Each framework initialises from its own random stream (Flax keys 0-2, torch seeds 0-2),
    # drawing from the same distributions. The loss at init is ln(256) + ~1/2, not ln(256)
    # = 5.545: the final LayerNorm makes each position's 128 features unit-variance and the
    # head's weights have variance 1/128, so every logit is ~N(0, 1) whatever the target, and
    # E[logsumexp of 256 of them] = ln 256 + 1/2. That depends on the distributions only, not
    # on the framework; a single draw moves it by ~0.03 on uniform random bytes (by ~0.15 on
    # Shakespeare, whose few frequent bytes make fewer distinct positions: 12 draws a side
    # gave Flax 6.01 +- 0.14, torch 6.09 +- 0.18), so the batch is random bytes and each
    # side averages 3 draws. Measured here: Flax 6.0714, 6.0791, 6.0772 (mean 6.0759); torch
    # 6.0541, 6.0203, 5.9711 (mean 6.0152). A wrong init fails it: torch's own nn.Linear
    # default (uniform, variance 1/(3 fan_in)) gives a mean of 5.75.
    w = _tokens(2)
    lj = np.mean([_flax_loss(_init(jax.random.key(k))["params"], w)[1] for k in range(3)])
    lt = []
    for seed in range(3):
        torch.manual_seed(seed)
        lt.append(_torch_loss(torch_lm.from_config(CONFIG), w)[1])
    lt = np.mean(lt)
    assert abs(lj - lt) < 0.1, (lj, lt)
    for loss in (lj, lt):
        assert abs(loss - (math.log(256) + 0.5)) < 0.1, loss


def test_schedule_equals_jax():
    sched = optimizers.learning_rate(CONFIG)
    warm = CONFIG.optimizer.schedule["warmup_steps"]
    last = CONFIG.num_train_steps
    steps = (0, 1, warm // 2, warm, (warm + last) // 2, last - 1, last)
    net = torch.nn.Linear(2, 2)
    opt, lr_sched = torch_lm.adamw(net, CONFIG)
    seen = {}
    for s in range(last + 1):  # the rate the k-th optimizer.step() uses
        seen[s] = opt.param_groups[0]["lr"]
        opt.step()
        lr_sched.step()
    for s in steps:  # optax computes in float32 (step 1: 1.999992e-05 for 2e-05)
        want = float(sched(s))
        np.testing.assert_allclose(torch_lm.learning_rate(CONFIG, s), want, rtol=1e-5, atol=0)
        np.testing.assert_allclose(seen[s], want, rtol=1e-5, atol=0)
    assert seen[0] == 0.0 and seen[warm] == pytest.approx(CONFIG.optimizer.learning_rate)
    assert seen[last] == pytest.approx(0.1 * CONFIG.optimizer.learning_rate)
    g = opt.param_groups[0]
    assert g["betas"] == (0.9, 0.95) and g["weight_decay"] == 0.1 and g["eps"] == 1e-8


def test_adamw_equals_optax():
    # optax.adamw as experiments.optimizers builds it (every leaf decayed), 6 steps from
    # count 0 on the same gradients: the moves agree (the decay's part, 0.1 x p x the summed
    # rate, is ~2e-5: 40x the tolerance)
    rng = np.random.default_rng(3)
    p0 = rng.normal(size=(2, 5)).astype(np.float32)
    grads = rng.normal(size=(6, 2, 5)).astype(np.float32)
    tx = optax.adamw(optimizers.learning_rate(CONFIG), **CONFIG.optimizer.kwargs)
    pj = jnp.asarray(p0)
    state = tx.init(pj)
    w = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt, lr_sched = torch_lm.adamw(torch.nn.ParameterList([w]), CONFIG)
    for g in grads:
        updates, state = tx.update(jnp.asarray(g), state, pj)
        pj = optax.apply_updates(pj, updates)
        w.grad = torch.from_numpy(g.copy())
        opt.step()
        lr_sched.step()
        moved = w.detach().numpy() - p0
        # atol: float32's spacing at the params' size (up to 2), the rounding of p - p0
        np.testing.assert_allclose(moved, np.asarray(pj) - p0, rtol=1e-4, atol=5e-7)
    assert np.abs(moved).max() > 1e-4  # it moved: 200x the tolerance


def test_batches_equal_harness():
    stream = np.arange(5_000, dtype=np.int32) % 251  # any stream; positions visible in values
    seq, bs, seed = 16, 3, 7
    for worker in (0, 1):
        starts = torch_lm.batch_starts(seed, worker, range(4), len(stream), bs, seq)
        key = jax.random.fold_in(jax.random.key(seed + 1), worker)  # train.make_train_call's
        for step in range(4):
            bx, by = data.sample_batch(jnp.asarray(stream), None, key, jnp.int32(step), bs, seq)
            x, y = torch_lm.windows(stream, starts[step], seq)
            np.testing.assert_array_equal(x.numpy(), np.asarray(bx))
            np.testing.assert_array_equal(y.numpy(), np.asarray(by))
    assert not np.array_equal(starts[0], starts[1])  # steps (and workers) differ


def test_ddp_runs_write_the_harness_rows_and_step_as_the_mean_gradient(tmp_path):
    """experiments.bench.torch_lm_train on 2 processes (gloo), 4 steps, dense and PowerSGD:
    rows in the JAX harness's format; dense DDP's model after 4 steps equals AdamW on the
    mean of the two ranks' gradients computed here (each rank's windows as the harness
    draws them); bytes: dense 4 D a step, PowerSGD fewer. ``after`` (one flat all-reduce
    after the backward pass) equals dense DDP, ``after_fp16`` sends 2 D bytes a step. The
    compute floor (``nocomm``) sends nothing and rank 0's model is AdamW on rank 0's own
    gradients."""
    import json

    from experiments.studies import lm
    from tests.test_distributed import launch

    rows = {}
    for hook in ("none", "powersgd", "after", "after_fp16", "nocomm"):
        work = tmp_path / hook
        run = launch(2, 1, "-m", "experiments.bench.torch_lm_train", f"--hook={hook}",
                     f"--workdir={work}", "--stop_after=4", "--eval_every=2")  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        rows[hook] = [json.loads(line) for line in open(work / "metrics.jsonl")]
        assert [r["step"] for r in rows[hook]] == [2, 4]
        assert all(set(lm.KEEP) <= set(r) for r in rows[hook])
    d = STUDY_PARAMS
    assert [r["wire_bytes"] for r in rows["none"]] == [2 * 4 * d, 4 * 4 * d]
    # PowerSGD: 2 dense steps first (start_powerSGD_iter=2), then rank-4 factors: steps 3-4
    psgd = [r["wire_bytes"] for r in rows["powersgd"]]
    assert psgd[0] == 2 * 4 * d and 0 < psgd[1] - psgd[0] < 0.2 * 2 * 4 * d
    # the reference: one process, both ranks' gradients averaged
    config = lm_shakespeare.get_config("dense")
    ds = data.shakespeare(2, seq_len=config.data.seq_len, test_windows=config.data.test_windows)
    streams = [np.asarray(ds.x_train[r]) for r in range(2)]
    seq, per = config.data.seq_len, config.data.batch_size
    starts = [torch_lm.batch_starts(0, r, range(4), len(streams[r]), per, seq) for r in range(2)]

    def averaged(combine):  # AdamW on both ranks' gradients combined (AdamW: a mean or sum)
        torch.manual_seed(0)
        model = torch_lm.from_config(config)
        opt, sched = torch_lm.adamw(model, config)
        for step in range(4):
            grads = []
            for r in range(2):
                model.zero_grad()
                x, y = torch_lm.windows(streams[r], starts[r][step], seq)
                torch_lm.lm_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = combine(g0, g1)
            opt.step()
            sched.step()
        return torch_lm.evaluate(model, ds.x_test)

    want = averaged(lambda g0, g1: (g0 + g1) / 2)
    assert rows["none"][-1]["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert rows["none"][-1]["eval_loss"] < rows["none"][0]["eval_loss"]
    # after the backward pass, one flat buffer: the same bytes and the same model as DDP's
    assert [r["wire_bytes"] for r in rows["after"]] == [2 * 4 * d, 4 * 4 * d]
    assert rows["after"][-1]["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert [r["wire_bytes"] for r in rows["after_fp16"]] == [2 * 2 * d, 4 * 2 * d]
    # the floor: nothing sent, rank 0 alone on its own windows
    assert [r["wire_bytes"] for r in rows["nocomm"]] == [0, 0]
    torch.manual_seed(0)
    model = torch_lm.from_config(config)
    opt, sched = torch_lm.adamw(model, config)
    for step in range(4):
        model.zero_grad()
        torch_lm.lm_loss(
            model(torch_lm.windows(streams[0], starts[0][step], seq)[0]),
            torch_lm.windows(streams[0], starts[0][step], seq)[1],
        ).backward()
        opt.step()
        sched.step()
    alone = torch_lm.evaluate(model, ds.x_test)["eval_loss"]
    assert rows["nocomm"][-1]["eval_loss"] == pytest.approx(alone, rel=1e-5)
    assert alone != pytest.approx(want["eval_loss"], rel=1e-5)


def _after_rank(rank: int, init: str, out: str, half: bool) -> None:
    from experiments.bench import torch_lm_train

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    for i, p in enumerate(model.parameters()):  # each rank its own gradient
        g = torch.linspace(-1.0, 1.0, p.numel()) * (rank + 1.3) / (i + 0.7)
        p.grad = (g + 1e-4 * torch.sin(torch.arange(p.numel()) * (rank + 1.0))).view_as(p)
    torch_lm_train.exchange_after(model, half, 2)
    torch.save([p.grad for p in model.parameters()], f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("half", [False, True])
def test_exchange_after_averages_the_flat_gradient_like_ddp_hooks(tmp_path, half):
    """``--hook=after`` / ``after_fp16``'s exchange on 2 gloo ranks: every rank's gradients
    become (g0 + g1) / 2 exactly (float32), or fp16(g0 / 2) + fp16(g1 / 2) in float16
    (``fp16_compress_hook``'s arithmetic), leaf by leaf in the model's order."""
    import torch.multiprocessing as mp

    init, out = f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "grads")
    mp.spawn(_after_rank, args=(init, out, half), nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    ranks = []
    for rank in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
        ranks.append([
            (torch.linspace(-1.0, 1.0, p.numel()) * (rank + 1.3) / (i + 0.7)
             + 1e-4 * torch.sin(torch.arange(p.numel()) * (rank + 1.0))).view_as(p)
            for i, p in enumerate(model.parameters())
        ])  # fmt: skip
    for k, (g0, g1) in enumerate(zip(*ranks)):
        if half:
            want = ((g0.half() / 2) + (g1.half() / 2)).float()
        else:
            want = (g0 + g1) / 2
        for r in range(2):
            torch.testing.assert_close(got[r][k], want, rtol=0, atol=0)
    assert not torch.equal(got[0][0], ranks[0][0])
