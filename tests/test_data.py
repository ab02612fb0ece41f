"""The LM study's corpus and its shared schedule."""

import numpy as np
import optax
import pytest

from experiments import data as data_lib
from experiments import optimizers
from experiments.configs import lm_shakespeare


@pytest.fixture(scope="module")
def plays():
    return data_lib.shakespeare_plays()


def test_corpus_is_real_english_text_over_a_megabyte(plays):
    text = b"".join(t for _, t in plays)
    assert len(plays) == 42 and len(text) > 5_000_000
    assert b"To be, or not to be" in dict(plays)["hamlet"]
    assert text.decode("ascii", errors="strict")  # plain text, no binary


def test_validation_windows_come_only_from_held_out_plays(plays):
    ds = data_lib.shakespeare(2, seq_len=128, test_windows=128)
    held = b"\n\n".join(t for _, t in plays[-data_lib.SHAKESPEARE_VAL_PLAYS :])
    train_bytes = ds.x_train.astype(np.uint8).tobytes()
    assert ds.x_test.shape == (128, 129) and ds.x_train.shape[0] == 2
    for w in ds.x_test[::16]:
        piece = w.astype(np.uint8).tobytes()
        assert piece in held and piece not in train_bytes
    # train is the other plays' text, dealt contiguously to the workers
    assert len(train_bytes) + len(held) <= sum(len(t) for _, t in plays) + 2 * len(plays)


def test_every_variant_shares_dense_s_optimizer_and_schedule():
    dense = lm_shakespeare.get_config("dense")
    sched = optimizers.learning_rate(dense)
    # warm-up from 0 to the peak at step 100, cosine to 0.1x at the last step (closed form)
    peak, last = dense.optimizer.learning_rate, dense.num_train_steps
    assert last == 2000  # the study's length
    assert float(sched(0)) == 0.0 and float(sched(100)) == pytest.approx(peak)
    mid = 100 + (last - 100) // 2
    assert float(sched(mid)) == pytest.approx(0.1 * peak + 0.9 * peak * 0.5, rel=1e-4)
    assert float(sched(last)) == pytest.approx(0.1 * peak)
    # methods defined by their own optimizer keep dense's peak rate (x lr_scale) and schedule
    own = {"muloco": "muon", "muon": "muon", "demo": "demo", "demo_full": "demo"}
    for name in lm_shakespeare.VARIANTS:
        c = lm_shakespeare.get_config(name)
        if name in own:
            assert c.optimizer.name == own[name], name
            assert c.optimizer.learning_rate == dense.optimizer.learning_rate, name
            assert c.optimizer.schedule.to_dict() == dense.optimizer.schedule.to_dict(), name
        else:
            assert c.optimizer.to_dict() == dense.optimizer.to_dict(), name
        assert isinstance(optimizers.make_optimizer(c), optax.GradientTransformation)
    # the counterparts: MuLoCo's inner Muon every step; DeMo's optimizer keeping everything
    muon, muloco = (lm_shakespeare.get_config(m) for m in ("muon", "muloco"))
    assert muon.optimizer.to_dict() == muloco.optimizer.to_dict() and muon.wrapper.name == "none"
    demo, full = (lm_shakespeare.get_config(m).optimizer.to_dict() for m in ("demo", "demo_full"))
    assert full["kwargs"].pop("compression_topk") == 64 * 64  # a 2-D chunk's entries: all kept
    assert full == demo


def test_schedule_rejects_a_warmup_as_long_as_the_run():
    c = lm_shakespeare.get_config()
    c.optimizer.schedule.warmup_steps = c.num_train_steps
    with pytest.raises(ValueError, match="warmup_steps"):
        optimizers.learning_rate(c)
