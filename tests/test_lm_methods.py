"""The LM study's method table (experiments.studies.lm_methods) resolves every name."""

import pytest

from experiments.configs import lm_shakespeare
from experiments.studies import lm_methods as lmm


def test_every_method_runs_a_config_variant():
    for m in lmm.METHODS:
        assert lmm.variant(m) in lm_shakespeare.VARIANTS, m
    for m, c in lmm.COUNTERPART.items():
        assert m in lmm.METHODS and c in lmm.METHODS, (m, c)


def test_schedules_follow_the_variants():
    every, fragments = lm_shakespeare.EVERY, lm_shakespeare.STREAM["fragments"]
    for m in ("dense", "bf16", "torch_ddp", "torch_fp16", "torch_powersgd"):
        assert (lmm.sync_period(m), lmm.peak_factor(m)) == (1, 1.0), m
    for m in ("diloco", "torchft_diloco"):
        assert (lmm.sync_period(m), lmm.peak_factor(m)) == (every, every), m
    for m in ("streaming", "streaming_int8", "torchft_streaming"):
        assert (lmm.sync_period(m), lmm.peak_factor(m)) == (every, every / fragments), m
    assert lmm.sync_period("diloco_h1") == 1
    assert lmm.peak_factor("an_old_method") == 1.0


def test_floors_run_and_stay_out_of_the_grid():
    assert lmm.variant("nocomm") in lm_shakespeare.VARIANTS
    assert not set(lmm.FLOORS) & set(lmm.METHODS)  # probed, never judged
    assert lmm.sync_period("nocomm") == lmm.sync_period("torch_nocomm") == 1
    assert (lmm.floor_of("powersgd"), lmm.floor_of("torch_powersgd")) == ("nocomm", "torch_nocomm")
    assert set(lmm.FLOORS) == {lmm.floor_of("dense"), lmm.floor_of("torchft_diloco")}


def test_torch_floor_is_a_hook_of_the_twin():
    pytest.importorskip("torch")  # the peers extra
    from experiments.bench import torch_lm_train

    assert lmm.TORCH["torch_nocomm"] in torch_lm_train.HOOKS
