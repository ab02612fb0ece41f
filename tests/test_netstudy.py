"""The network study's own arithmetic: netsim prediction inputs and time-to-accuracy."""

import math

import pytest

from experiments.studies import netstudy


def test_dense_prediction_is_ring_allreduce_of_the_gradient_at_goodput():
    # digits MLP (64-128-10): 64*128 + 128 + 128*10 + 10 = 9610 fp32 entries.
    n, rate = 2, 100e6
    wire, seconds, collectives = netstudy._comm_prediction("digits_mlp", n, "dense", rate, 400)
    gradient = 9610 * 4
    assert wire == pytest.approx(2 * (n - 1) / n * gradient)
    assert seconds == pytest.approx(wire * 8 / (rate * netstudy.ETHERNET_GOODPUT))
    assert collectives == 2  # one bucket for the 4 leaves + the loss pmean


def test_bf16_on_cpu_moves_what_dense_moves_and_local_sgd_one_sync_in_eight():
    dense, _, _ = netstudy._comm_prediction("digits_mlp", 4, "dense", 1e9, 400)
    bf16, _, _ = netstudy._comm_prediction("digits_mlp", 4, "bf16", 1e9, 400)
    local, _, _ = netstudy._comm_prediction("digits_mlp", 4, "local_sgd", 1e9, 400)
    assert bf16 == pytest.approx(dense)  # XLA:CPU widens 16-bit all-reduces to f32
    assert local == pytest.approx(dense / 8)  # params (same size as grads) every 8 steps


def test_dgc_is_priced_at_the_density_of_each_step_not_every_warm_up_branch_at_once():
    # digits_mlp:dgc is DGC 1% with 50 warm-up steps in 4 epochs (boundaries 13, 25, 38, 50):
    # densities 0.25, 0.0625, 0.015625, then max(0.01, 0.0039) = 0.01. Each leaf sends
    # ceil(rho * d) fp32 values and int32 indices in one all-gather: (n - 1) copies leave.
    leaves = (64 * 128, 128, 128 * 10, 10)

    def sent(rho):
        return sum(math.ceil(rho * d) * 8 for d in leaves)

    wire, _, collectives = netstudy._comm_prediction("digits_mlp", 2, "dgc", 1e8, 200)
    mean = (13 * sent(0.25) + 12 * sent(0.0625) + 13 * sent(0.015625) + 162 * sent(0.01)) / 200
    assert wire == pytest.approx(mean)
    assert collectives == 2  # one bucketed all-gather + the loss pmean
    first, _, _ = netstudy._comm_prediction("digits_mlp", 2, "dgc", 1e8, 10)
    assert first == pytest.approx(sent(0.25))  # a 10-step probe runs in the first epoch


def test_time_to_accuracy_takes_the_first_evaluation_that_reaches_the_target():
    curve = [
        {"step": 25, "accuracy": 0.90, "train_s": 1.0},
        {"step": 50, "accuracy": 0.95, "train_s": 2.0},
        {"step": 75, "accuracy": 0.97, "train_s": 3.0},
    ]
    assert netstudy.time_to(curve, 0.95) == (2.0, 50)
    assert netstudy.time_to(curve, 0.99) == (None, None)
