"""torchft's DiLoCo on the LM study's GPT twin (experiments.bench.torch_lm_ft): the study's rule.

Skipped without torch and torchft, except where ``JAXCOMM_REQUIRE_TORCH`` /
``JAXCOMM_REQUIRE_TORCHFT`` are set (CI): then a failed import fails.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers

torch = helpers.import_torch()
if os.environ.get("JAXCOMM_REQUIRE_TORCHFT"):
    import torchft  # noqa: F401
else:
    pytest.importorskip("torchft", reason='needs torchft: pip install -e ".[ft]"')

from experiments import data, models  # noqa: E402
from experiments.bench import torch_lm, torch_lm_ft  # noqa: E402
from experiments.configs import lm_shakespeare  # noqa: E402
from jaxcomm.loco.streaming import fragment_of  # noqa: E402

CONFIG = lm_shakespeare.get_config("dense")


def test_fragments_hold_the_tensors_of_jaxcomms_fragments():
    """Each torch fragment holds the twins of the Flax leaves jaxcomm puts in it."""
    model = models.build(CONFIG.model.name, **CONFIG.model.kwargs)
    x = jnp.zeros((1, CONFIG.data.seq_len), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    net = torch_lm.from_config(CONFIG)
    twin = {path: name for name, path, _ in torch_lm.param_pairs(net)}
    named = dict(net.named_parameters())
    for n in (1, 2, 3):
        of = fragment_of(shapes, n)
        parts = torch_lm_ft.fragments(net, n)
        assert len(parts) == n
        for f, part in enumerate(parts):
            want = [named[twin[p]] for p, g in zip(paths, of) if g == f]
            assert len(want) == len(part) > 0
            assert all(a is b for a, b in zip(part, want))  # the same tensors, in Flax order


def test_settings_are_the_study_variants():
    assert torch_lm_ft.settings("ft_diloco") == {
        "every": lm_shakespeare.EVERY, "fragments": 1, "delay": 0, "mix": 0.0,
        "outer_learning_rate": 0.7,
    }  # fmt: skip
    s = torch_lm_ft.settings("ft_streaming")
    assert {k: s[k] for k in lm_shakespeare.STREAM} == lm_shakespeare.STREAM


@pytest.mark.slow
def test_ft_diloco_round_equals_the_rule(tmp_path):
    """2 processes, 10 inner steps (one DiLoCo round): rank 0's model after the round is the
    outer Nesterov step (0.7, 0.9) on the anchor with the mean of the two ranks' drifts,
    each rank's 10 AdamW steps on its own windows computed here; bytes 4 D for the round."""
    from tests.test_distributed import launch

    work = tmp_path / "ft"
    every = lm_shakespeare.EVERY
    run = launch(2, 1, "-m", "experiments.bench.torch_lm_train", "--hook=ft_diloco",
                 f"--workdir={work}", f"--stop_after={every}", f"--eval_every={every}")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = [json.loads(line) for line in open(work / "metrics.jsonl")]
    d = sum(p.numel() for p in torch_lm.from_config(CONFIG).parameters())
    assert row["step"] == every and row["wire_bytes"] == 4 * d
    # the reference: each rank's inner steps from the same start, then the outer step
    ds = data.shakespeare(2, seq_len=CONFIG.data.seq_len, test_windows=CONFIG.data.test_windows)
    seq, per = CONFIG.data.seq_len, CONFIG.data.batch_size
    local = []
    for r in range(2):
        torch.manual_seed(0)
        model = torch_lm.from_config(CONFIG)
        opt, sched = torch_lm.adamw(model, CONFIG)
        stream = np.asarray(ds.x_train[r])
        for s in torch_lm.batch_starts(0, r, range(every), len(stream), per, seq):
            x, y = torch_lm.windows(stream, s, seq)
            opt.zero_grad()
            torch_lm.lm_loss(model(x), y).backward()
            opt.step()
            sched.step()
        local.append([p.detach().clone() for p in model.parameters()])
    torch.manual_seed(0)
    model = torch_lm.from_config(CONFIG)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for p, a, b in zip(model.parameters(), *local):
        p.grad = p.detach() - (a + b) / 2  # the anchor minus the mean of the local params
    outer.step()
    want = torch_lm.evaluate(model, ds.x_test)
    assert row["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    # and not the plain average of the local params (the outer step matters)
    with torch.no_grad():
        for p, a, b in zip(model.parameters(), *local):
            p.copy_((a + b) / 2)
    assert abs(row["eval_loss"] - torch_lm.evaluate(model, ds.x_test)["eval_loss"]) > 1e-3
