"""The LM study's counting baselines (experiments/studies/ngram.py) against a plain-Python
interpolated Kneser-Ney written from the formulas, on small texts."""

import collections
import math

import numpy as np
import pytest

from experiments.studies import ngram


def reference_kn(text: bytes, order: int):
    """P(w | context) by the textbook recursion, with dictionaries (no vectorisation)."""
    levels = []
    for k in range(1, order + 1):
        if k == order:
            counts = collections.Counter(text[i : i + k] for i in range(len(text) - k + 1))
        else:  # continuation counts: distinct bytes before each k-gram
            longer = {text[i : i + k + 1] for i in range(len(text) - k)}
            counts = collections.Counter(g[1:] for g in longer)
        n1 = sum(1 for c in counts.values() if c == 1)
        n2 = sum(1 for c in counts.values() if c == 2)
        d = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5
        total, followers = collections.Counter(), collections.Counter()
        for g, c in counts.items():
            total[g[:-1]] += c
            followers[g[:-1]] += 1
        levels.append((counts, total, followers, d))

    def prob(context: bytes, w: int) -> float:
        p = 1 / 256
        for k, (counts, total, followers, d) in enumerate(levels, start=1):
            if len(context) < k - 1:
                break
            ctx = context[len(context) - (k - 1) :] if k > 1 else b""
            if total[ctx] == 0:
                continue
            c = counts[ctx + bytes([w])]
            p = max(c - d, 0) / total[ctx] + d * followers[ctx] / total[ctx] * p
        return p

    return prob


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_window_loss_equals_the_textbook_recursion(order):
    rng = np.random.default_rng(order)
    # a small alphabet with structure: unseen contexts and unseen bytes both occur
    train = bytes(
        rng.choice(list(b"abcde "), size=3000, p=[0.3, 0.2, 0.2, 0.1, 0.05, 0.15]).tolist()
    )
    train = train.replace(b"ab", b"abc") + b" x y y"  # rare bytes: every discount D > 0
    windows = np.frombuffer(
        bytes(rng.choice(list(b"abcdefz "), size=5 * 9).tolist()), np.uint8
    ).reshape(5, 9)
    prob = reference_kn(train, order)
    want = []
    for win in windows:
        wb = bytes(win.tolist())
        want += [-math.log(prob(wb[max(0, t - (order - 1)) : t], wb[t])) for t in range(1, 9)]
    model = ngram.KneserNey(np.frombuffer(train, np.uint8), order)
    assert model.eval_windows(windows) == pytest.approx(np.mean(want), rel=1e-12)


def test_probabilities_sum_to_one_over_the_bytes():
    train = np.frombuffer(b"to be or not to be, that is the question. " * 20, np.uint8)
    model = ngram.KneserNey(train, 3)
    for ctx in (b"to", b"e ", b"zz", b"q"):
        c = np.array([list(ctx.rjust(2, b"\0"))] * 256)
        lp = model.log_prob(c, np.full(256, len(ctx)), np.arange(256))
        assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-12)


def test_more_context_predicts_english_better_and_order_is_checked():
    text = np.frombuffer(b"the cat sat on the mat. the dog sat on the log. " * 50, np.uint8)
    windows = text[:330].reshape(10, 33)
    losses = [ngram.KneserNey(text, k).eval_windows(windows) for k in (1, 2, 3)]
    assert losses[0] > losses[1] > losses[2]
    with pytest.raises(ValueError, match="order"):
        ngram.KneserNey(text, 0)
