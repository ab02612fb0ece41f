"""jaxcomm next to PyTorch: the twin models agree, and PowerSGD equals torch's DDP hook.

Skipped without torch, except where ``JAXCOMM_REQUIRE_TORCH`` is set
(:func:`tests.helpers.import_torch`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import helpers

torch = helpers.import_torch()

from experiments import launch, models  # noqa: E402
from experiments.bench import peers_agree, peers_setup  # noqa: E402
from experiments.bench import torch_peers as tp  # noqa: E402


def _losses(flax_model, torch_model, shape, batch=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch,) + shape).astype(np.float32)
    y = rng.integers(0, 10, size=batch).astype(np.int32)
    v = flax_model.init(jax.random.key(1), jnp.asarray(x), train=False)
    kw = {"mutable": ["batch_stats"]} if "batch_stats" in v else {}
    logits = flax_model.apply(v, jnp.asarray(x), train=True, **kw)
    logits = logits[0] if kw else logits
    lj = float(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(y)).mean())
    net = tp.load_flax(torch_model, v["params"]).train()
    with torch.no_grad():
        out = net(tp.to_torch_input(x))
        lt = float(torch.nn.functional.cross_entropy(out, torch.from_numpy(y).long()))
    return lj, lt


def test_mlp_twins_same_loss():
    flax_model = models.MLP(num_classes=10, hidden=16, depth=2)
    lj, lt = _losses(flax_model, tp.TorchMLP(12, 10, 16, 2), (12,))
    np.testing.assert_allclose(lt, lj, rtol=1e-5)


def test_resnet_twins_same_loss():
    # stride-2 stages (Flax SAME pads the end only), projections, BatchNorm in training mode
    flax_model = models.ResNet(num_classes=10, stages=(4, 8), blocks=1)
    lj, lt = _losses(flax_model, tp.TorchResNet(10, (4, 8), 1, in_ch=3), (6, 6, 3))
    np.testing.assert_allclose(lt, lj, rtol=1e-5)


@pytest.fixture(scope="module")
def gloo_group():
    peers_agree.init_gloo_single(launch.free_port())
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# Two tensors share a shape, apart in the bucket: the hook lays their Q's out side by side.
_SHAPES = [(32, 16), (32,), (8, 4, 3, 3), (32, 16), (4, 4), (10, 32)]


def _grads(steps=5):
    rng = np.random.default_rng(0)
    return [[rng.normal(size=s).astype(np.float32) for s in _SHAPES] for _ in range(steps)]


def test_powersgd_equals_torch_hook(gloo_group):
    r = peers_agree.powersgd_side_by_side(_grads(), rank=2, start_iter=2, min_rate=2.0)
    assert r["compressed"] == 4  # (4, 4) is left dense by the compression-rate rule
    tol = 2e-6 * r["output_scale"]
    assert max(r["output_max_abs_diff"]) < tol, r
    assert r["q_max_abs_diff"] < tol and r["residual_max_abs_diff"] < tol, r


def test_powersgd_wire_bytes_equal_torch_hook():
    import jaxcomm

    tx = jaxcomm.powersgd(2, key=jax.random.key(0), axis_name="data", matrix_view="first")
    tree = {f"t{i:03d}": jnp.zeros(s) for i, s in enumerate(_SHAPES)}
    layout = tp.hook_q_layout(_SHAPES, 2, 2.0)
    floats = 0
    for i, s in enumerate(_SHAPES):  # compressed: P (a·r) + Q (b·r); else the whole tensor
        floats += (s[0] + layout[i][1]) * layout[i][2] if i in layout else int(np.prod(s))
    assert jaxcomm.wire_bytes(tx, tree, 2) == 4 * floats


def test_powersgd_another_q_disagrees(gloo_group):
    """The check can fail: jaxcomm started from another Q than torch's."""
    grads = _grads()
    layout = tp.hook_q_layout(_SHAPES, 2, 2.0)
    rng = np.random.default_rng(7)
    other = [rng.normal(size=(m, r)).astype(np.float32) for _, (_, m, r) in sorted(layout.items())]
    r = peers_agree.powersgd_side_by_side(
        grads, rank=2, start_iter=2, min_rate=2.0, q_override=other
    )
    assert max(r["output_max_abs_diff"]) > 1e-2 * r["output_scale"]


# --- world size 2: torch's hook in a real 2-process gloo group, jaxcomm over 2 devices ----

_GROUP = dict(world=2, steps=5, rank=2, start_iter=2, min_rate=2.0, seed=0)


@pytest.fixture(scope="module")
def torch_group():
    """torch's powerSGD_hook on 2 gloo processes (loopback), each with its own gradients."""
    q0 = peers_agree.initial_q(_SHAPES, rank=_GROUP["rank"], min_rate=_GROUP["min_rate"])
    return peers_agree.torch_powersgd_group(_SHAPES, q0, **_GROUP), q0


def _tol(c):
    return 1e-5 * c["output_scale"]


def test_powersgd_world2_equals_torch_hook(torch_group):
    t, _ = torch_group
    grads = [peers_setup.worker_grads(_SHAPES, 0, w) for w in range(2)]
    assert min(np.abs(a - b).max() for a, b in zip(*grads)) > 0.1  # the workers differ
    c = peers_agree.compare_powersgd_group(t, peers_agree.jaxcomm_powersgd_group(_SHAPES, **_GROUP))
    tol = _tol(c)
    # 2 dense steps (torch's hook needs start_powerSGD_iter >= 2 with error feedback or warm
    # start), then 3 PowerSGD steps (warm start, error feedback)
    assert c["output_max_abs_diff"][:2] == [0.0, 0.0], c
    assert max(c["output_max_abs_diff"]) < tol, c
    assert c["q_max_abs_diff"] < tol, c
    # torch keeps M_w - P̂ Q̄ᵀ (and M_w - mean M on dense tensors), jaxcomm M_w - P̂ Q_wᵀ:
    # the same mean over workers, which is all the next step's output depends on
    assert c["residual_mean_max_abs_diff"] < tol, c
    assert c["jaxcomm_outputs_spread_over_workers"] == 0.0
    assert c["jaxcomm_q_spread_over_workers"] == 0.0
    # bytes handed to dist.all_reduce: the dense step, then P + Q + the dense tensors
    dense = 4 * sum(int(np.prod(s)) for s in _SHAPES)
    assert c["torch_bytes_per_step"] == [dense] * 2 + [c["jaxcomm_wire_bytes"]] * 3, c
    assert c["torch_all_reduce_calls_per_step"] == [1, 1, 3, 3, 3], c


@pytest.mark.parametrize("breakage", ["same_grads", "no_error_feedback", "perturbed_q"])
def test_powersgd_world2_breakage_disagrees(torch_group, breakage):
    """The check can fail: jaxcomm sees worker 0's gradients on both workers, drops error
    feedback, or starts from a Q turned away from torch's (a rescaled Q would not do:
    orthogonalisation removes the scale)."""
    t, q0 = torch_group
    kw = {
        "same_grads": dict(grads_of=[0, 0]),
        "no_error_feedback": dict(error_feedback=False),
        "perturbed_q": dict(
            q_override=[
                q + 0.1 * np.random.default_rng(7).normal(size=q.shape).astype(np.float32)
                for q in q0
            ]
        ),
    }[breakage]
    c = peers_agree.compare_powersgd_group(
        t, peers_agree.jaxcomm_powersgd_group(_SHAPES, **_GROUP, **kw)
    )
    assert max(c["output_max_abs_diff"]) > 100 * _tol(c), c


def test_digits_twins_same_loss_and_size():
    """The bench's ``digits`` model (64-256-10, tanh) in both frameworks."""
    from experiments.bench import peers_jax

    kw, shape = peers_setup.MODELS["digits"]
    net = tp.torch_model("digits")
    _, params, _ = peers_jax.build_model("digits")
    assert sum(p.numel() for p in net.parameters()) == 19210
    assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params)) == 19210
    lj, lt = _losses(models.build(**kw), net, shape)
    np.testing.assert_allclose(lt, lj, rtol=1e-5)


def test_every_torch_configuration_has_a_jaxcomm_twin_of_the_same_name():
    from experiments.bench import peers, peers_report

    assert set(tp.CONFIGS) <= set(peers_report.JAX_CONFIGS)
    assert set(peers.DEFAULT_CONFIGS) <= set(tp.CONFIGS)
