r"""Byte n-gram counting models: the reference lines of the LM study.

A language model that has only learned which bytes follow which is no better
than counting. These models are fitted on the study's training split and
scored on its validation windows exactly as the network is: the byte at
position ``t`` of a window is predicted from the bytes before it *in that
window* (the first byte of a window from none), in nats per byte.

Smoothing is interpolated Kneser-Ney (Chen & Goodman 1998, "An Empirical
Study of Smoothing Techniques for Language Modeling") with one absolute
discount per order, ``D = n1 / (n1 + 2 n2)`` from that order's counts of
n-grams seen once and twice; the lowest order interpolates with the uniform
distribution over the 256 bytes, so every byte has a non-zero probability.
Order 1 is the unigram model (counts interpolated with uniform); order ``k``
conditions on ``k - 1`` bytes.

Command (prints the table; the LM study stores the same numbers in its JSON):
  python -m experiments.studies.ngram --orders=1,2,3,4,5
"""

from __future__ import annotations

import numpy as np

V = 256  # bytes


def _codes(text: np.ndarray, k: int) -> np.ndarray:
    """The k-grams of ``text`` as int64 codes (first byte most significant)."""
    text = text.astype(np.int64)
    n = len(text) - k + 1
    code = np.zeros(n, np.int64)
    for i in range(k):
        code = code * V + text[i : i + n]
    return code


class _Table:
    """Sorted unique codes with a value each; ``get`` looks codes up (0 where absent)."""

    def __init__(self, codes: np.ndarray, values: np.ndarray):
        self.codes, self.values = codes, values

    @classmethod
    def count(cls, codes: np.ndarray) -> _Table:
        u, c = np.unique(codes, return_counts=True)
        return cls(u, c.astype(np.float64))

    def get(self, codes: np.ndarray) -> np.ndarray:
        i = np.clip(np.searchsorted(self.codes, codes), 0, max(len(self.codes) - 1, 0))
        hit = (len(self.codes) > 0) & (self.codes[i] == codes) if len(self.codes) else False
        return np.where(hit, self.values[i] if len(self.codes) else 0.0, 0.0)


def _by_context(grams: _Table) -> tuple[_Table, _Table]:
    """Per context (the code without its last byte): the summed value and distinct followers."""
    ctx = grams.codes // V
    u, start = np.unique(ctx, return_index=True)
    total = np.add.reduceat(grams.values, start) if len(u) else np.zeros(0)
    distinct = np.diff(np.append(start, len(ctx))).astype(np.float64)
    return _Table(u, total), _Table(u, distinct)


class KneserNey:
    """Interpolated Kneser-Ney byte model of order ``order`` fitted on ``text`` (uint8)."""

    def __init__(self, text: np.ndarray, order: int):
        if order < 1:
            raise ValueError(f"order: expected an int >= 1, got {order}")
        self.order = order
        self.levels = []  # per k = 1..order: (grams, context totals, context followers, D)
        for k in range(1, order + 1):
            if k == order:  # the highest order counts occurrences
                grams = _Table.count(_codes(text, k))
            else:  # lower orders count distinct bytes preceding the k-gram (continuations)
                longer = np.unique(_codes(text, k + 1))
                grams = _Table.count(longer % (V**k))
            n1 = float(np.sum(grams.values == 1))
            n2 = float(np.sum(grams.values == 2))
            d = n1 / (n1 + 2 * n2) if n1 + n2 > 0 else 0.5
            self.levels.append((grams, *_by_context(grams), d))

    def log_prob(self, context: np.ndarray, length: np.ndarray, byte: np.ndarray) -> np.ndarray:
        """ln P(byte | the last ``length`` bytes of ``context``) per row.

        ``context``: int [rows, order - 1], most recent byte last; ``length``: how many of
        its last bytes are real (the rest is ignored), ``byte``: int [rows].
        """
        rows = len(byte)
        p = np.full(rows, 1.0 / V)
        for k, (grams, totals, followers, d) in enumerate(self.levels, start=1):
            ctx = np.zeros(rows, np.int64)
            for j in range(k - 1):
                ctx = ctx * V + context[:, context.shape[1] - (k - 1) + j].astype(np.int64)
            code = ctx * V + byte.astype(np.int64)
            c = grams.get(code)
            total = totals.get(ctx) if k > 1 else np.full(rows, grams.values.sum())
            seen = followers.get(ctx) if k > 1 else np.full(rows, float(len(grams.codes)))
            safe = np.maximum(total, 1.0)
            mixed = np.maximum(c - d, 0.0) / safe + d * seen / safe * p
            usable = (length >= k - 1) & (total > 0)
            p = np.where(usable, mixed, p)
        return np.log(p)

    def eval_windows(self, windows: np.ndarray) -> float:
        """Mean negative log-likelihood (nats/byte) of bytes 1.. of each window given the
        bytes before them in the same window: the network's validation loss, counted."""
        windows = np.asarray(windows, np.int64)
        w = windows.shape[1]
        k = self.order - 1
        pad = np.concatenate([np.zeros((len(windows), k), np.int64), windows], axis=1)
        ctx, length, byte = [], [], []
        for t in range(1, w):
            ctx.append(pad[:, t : t + k] if k else np.zeros((len(windows), 0), np.int64))
            length.append(np.full(len(windows), min(t, k)))
            byte.append(windows[:, t])
        lp = self.log_prob(np.concatenate(ctx), np.concatenate(length), np.concatenate(byte))
        return float(-lp.mean())


def baselines(train: np.ndarray, windows: np.ndarray, orders=(1, 2, 3, 4, 5)) -> dict:
    """``{"orders": {k: nats/byte}, "smoothing": ..., "train_bytes": ...}``."""
    train = np.asarray(train, np.uint8).reshape(-1)
    return {
        "smoothing": "interpolated Kneser-Ney, one discount per order n1/(n1+2n2)",
        "train_bytes": int(train.size),
        "predicted_bytes": int(windows.shape[0] * (windows.shape[1] - 1)),
        "orders": {str(k): KneserNey(train, k).eval_windows(windows) for k in orders},
    }


def study_baselines(seq_len: int = 128, test_windows: int = 128, orders=(1, 2, 3, 4, 5)) -> dict:
    """The baselines on the LM study's split (the training plays, the validation windows)."""
    from experiments import data

    ds = data.shakespeare(1, seq_len=seq_len, test_windows=test_windows)
    return baselines(ds.x_train, ds.x_test, orders)


def main(argv: list[str]) -> None:
    del argv
    out = study_baselines(FLAGS.seq_len, FLAGS.test_windows, [int(o) for o in FLAGS.orders])
    print(f"{out['smoothing']}; {out['train_bytes']:,} training bytes, "
          f"{out['predicted_bytes']:,} predicted")  # fmt: skip
    for k, v in out["orders"].items():
        print(f"order {k} ({int(k) - 1}-byte context): {v:.4f} nats/byte")


NGRAM_NAMES = {"1": "unigram", "2": "bigram", "3": "trigram"}


def ngram_line(results: dict) -> str | None:
    """The counting models' validation losses as one sentence; None without ``results["ngram"]``."""
    ng = results.get("ngram")
    if not ng:
        return None
    parts = [f"{NGRAM_NAMES.get(k, f'{k}-gram')} {v:.3f}"
             for k, v in sorted(ng["orders"].items(), key=lambda kv: int(kv[0]))]  # fmt: skip
    return (f"Counting models on the same split: {', '.join(parts)} nats/byte "
            f"({ng['smoothing']}).")  # fmt: skip


if __name__ == "__main__":
    from absl import app, flags

    FLAGS = flags.FLAGS
    flags.DEFINE_list("orders", ["1", "2", "3", "4", "5"], "model orders")
    flags.DEFINE_integer("seq_len", 128, "the study's context (window = seq_len + 1)")
    flags.DEFINE_integer("test_windows", 128, "the study's validation windows")
    app.run(main)
