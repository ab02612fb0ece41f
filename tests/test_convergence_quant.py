"""Quantisers and sign methods train on real data (scikit-learn digits) across 8 workers.

Learning rates (plain SGD, 300 steps, logistic regression):
* dense, and every method whose output keeps the gradient's scale (EF-sign,
  1-bit, 2-bit with error feedback; QSGD, TernGrad, int8, which are unbiased):
  lr 0.5, the dense baseline's lr; the point is that they need no retuning.
* signSGD with majority vote outputs ±1 per entry, so the lr *is* the step
  per weight: lr 0.003 (300 steps move a weight by at most 0.9, the scale of
  the dense solution's weights).
Measured here (test accuracy): dense 0.964; EF-sign 0.967, 1-bit 0.967,
2-bit (τ=0.5) 0.967, QSGD(16) 0.962, TernGrad 0.969, int8 0.964; scaled sign
without EF 0.953 (train loss 0.108 vs 0.062 with EF); majority vote 0.953.
"""

import jax
import optax
import pytest

import jaxcomm
from experiments import digits

STEPS = 300
KEY = jax.random.key(0)
# The all-gather exchange, with which the accuracies above were measured (the default
# exchange="auto" goes two-phase on 8 workers: README "Two-phase exchange").
G = "gather"


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.ef_sign(axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.onebit(axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.twobit(0.5, axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.qsgd(16, key=KEY, axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.terngrad(key=KEY, axis_name="data", min_size=0, exchange=G),
        lambda: jaxcomm.int8(key=KEY, axis_name="data", min_size=0, exchange=G),
    ],
    ids=["ef_sign", "onebit", "twobit", "qsgd16", "terngrad", "int8"],
)
def test_quantised_training_matches_dense_within_two_points(make, digits_split, dense_accuracy):
    assert dense_accuracy > 0.93  # the harness itself learns
    acc = digits.train(
        optax.chain(make(), optax.sgd(0.5)), steps=STEPS, split=digits_split
    ).accuracy
    assert acc >= dense_accuracy - 0.02, (acc, dense_accuracy)


def test_sign_without_error_feedback_is_reported(digits_split, dense_accuracy):
    """Reported, not a claim of the methods: plain scaled sign and majority vote, no EF."""
    plain = jaxcomm.ef_sign(axis_name="data", min_size=0, error_feedback=False, exchange=G)
    ef = jaxcomm.ef_sign(axis_name="data", min_size=0, exchange=G)
    vote = jaxcomm.sign_majority(axis_name="data", min_size=0)
    r_plain = digits.train(optax.chain(plain, optax.sgd(0.5)), steps=STEPS, split=digits_split)
    r_ef = digits.train(optax.chain(ef, optax.sgd(0.5)), steps=STEPS, split=digits_split)
    r_vote = digits.train(optax.chain(vote, optax.sgd(0.003)), steps=STEPS, split=digits_split)
    print(
        f"dense {dense_accuracy:.4f}  EF-sign {r_ef.accuracy:.4f}  sign no EF "
        f"{r_plain.accuracy:.4f}  majority vote {r_vote.accuracy:.4f}"
    )
    # error feedback is what closes the gap: the training loss shows it (measured 0.108 vs 0.062)
    assert r_plain.train_loss > 1.3 * r_ef.train_loss
    assert r_vote.accuracy > 0.9  # majority vote learns with a sign-sized lr
