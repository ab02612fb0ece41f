r"""How much of the true top-k ``jaxcomm.threshold`` sends: structured, small and real leaves.

Command (about two minutes on two cores):
  python -m experiments.bench.threshold_fill --out=experiments/results/threshold_fill.json

One selection step (``Threshold.encode``: the first step, zero residual) at
``--ratio``, with the 1% sample threshold. "fill" (recall) is the number of
the true top-k entries (``k = ceil(ratio·d)``) the step sends, over ``k``.
Each case runs under two selections, in one run:

* ``before``: the library's ``Threshold`` as of ``--before`` (a git
  revision; default the last one with the two-period selection: one slot per
  class of two prime periods summing to just under ``k``), loaded from the
  repository's history with ``git show`` (skipped where there is none);
* ``now``: today's ``Threshold`` (the two largest entries of each class of
  one prime period ``>= 2k``, the ``k`` largest of them above the sampled
  threshold).

Cases: ``band``, a matrix with small noise and heavy mass in adjacent
columns holding about ``k`` entries; ``columns``/``rows``, the same in random
columns/rows over ``--draws`` draws; ``iid``, normal leaves of conv-kernel
size over ``--draws`` draws and of 10^6 entries over 3; ``real``, every compressible leaf of the
first-step gradients of the digits MLP (hidden 1024, depth 2) and ResNet of
``experiments.models`` on 256 training images. Rows are printed and written
to ``--out`` as JSON.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from jaxcomm.compressors.sparse import Threshold

# the last revision whose Threshold used the two-period selection
BEFORE = "58d4ac7"


def threshold_at(rev: str) -> type | None:
    """The ``Threshold`` class of ``jaxcomm/compressors/sparse.py`` at git revision ``rev``.

    ``None`` where the repository's history is not at hand (no git, or a copy
    without ``.git``). The old module runs against today's ``jaxcomm`` (it
    imports ``checks``, ``core`` and ``exchange`` from it).
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        src = subprocess.run(
            ["git", "-C", root, "show", f"{rev}:jaxcomm/compressors/sparse.py"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType(f"threshold_at_{rev}")
    exec(compile(src, f"{rev}:jaxcomm/compressors/sparse.py", "exec"), module.__dict__)
    return module.Threshold


def transform_before(ratio: float, axis_name: str, rev: str = BEFORE):
    """``jaxcomm.compress`` of the old ``Threshold(ratio, 0.01)`` over ``axis_name``; ``None``
    where the history is not at hand (the benchmarks' ``threshold_before`` case)."""
    import jaxcomm

    cls = threshold_at(rev)
    return None if cls is None else jaxcomm.compress(cls(ratio, 0.01), axis_name=axis_name)


def selections(before: str = BEFORE) -> dict[str, type]:
    """``{"before": old Threshold (if at hand), "now": Threshold}``."""
    old = threshold_at(before)
    return {**({"before": old} if old is not None else {}), "now": Threshold}


def define_flags() -> None:
    """The command-line flags (only when run as a program: importing defines none)."""
    flags.DEFINE_float("ratio", 0.01, "fraction of entries kept")
    flags.DEFINE_integer("draws", 20, "random draws per random case")
    flags.DEFINE_bool("quick", False, "small shapes only (a smoke run)")
    flags.DEFINE_string("out", None, "write the rows to this JSON file")
    flags.DEFINE_string("before", BEFORE, "git revision of the 'before' selection")


def fills(leaves: np.ndarray, ratio: float, cls: type = Threshold) -> np.ndarray:
    """Fill of each flat leaf of ``leaves`` (shape ``(draws, d)``) under selection ``cls``."""
    d = leaves.shape[1]
    k = math.ceil(ratio * d)
    comp = cls(ratio, 0.01)
    vals, idx = jax.jit(jax.vmap(lambda p: comp.encode(p, None)[0]))(jnp.asarray(leaves))
    out = []
    for p, v, i in zip(leaves, np.asarray(vals), np.asarray(idx)):
        top = np.argpartition(-np.abs(p), k - 1)[:k]
        out.append(np.intersect1d(i[v != 0], top).size / k)
    return np.asarray(out)


def structured(shape, lines, kind, rng) -> np.ndarray:
    """0.01·N(0, 1) noise plus N(0, 1) in ``lines`` rows or columns."""
    g = 0.01 * rng.standard_normal(shape)
    if kind == "rows":
        g[lines, :] += rng.standard_normal((len(lines), shape[1]))
    else:
        g[:, lines] += rng.standard_normal((shape[0], len(lines)))
    return g.astype(np.float32).reshape(1, -1)


def cases(ratio: float, draws: int, quick: bool):
    """(case, shape, leaves of shape (draws, d)) to measure."""
    bands = [((1000, 1000), 10), ((3072, 768), 8), ((256, 4000), 40)]
    small = [(3, 3, 32, 32), (3, 3, 32, 64), (256, 64)]
    if quick:
        bands, small, draws = [((256, 400), 4)], [(3, 3, 32, 32)], 3
    for shape, width in bands:
        start = shape[1] // 3
        yield (
            "band",
            shape,
            structured(shape, start + np.arange(width), "cols", np.random.default_rng(0)),
        )
    shape = bands[0][0]
    n_lines = bands[0][1]
    for kind in ("columns", "rows"):
        rng = np.random.default_rng(1)
        size = shape[1] if kind == "columns" else shape[0]
        leaves = [
            structured(shape, rng.choice(size, n_lines, replace=False), kind, rng)
            for _ in range(draws)
        ]
        yield kind, shape, np.concatenate(leaves)
    for shape in small:
        rng = np.random.default_rng(2)
        yield "iid", shape, rng.standard_normal((draws, math.prod(shape))).astype(np.float32)
    if not quick:  # the issue's case: N(0, 1), d = 1e6
        rng = np.random.default_rng(3)
        yield "iid", (10**6,), rng.standard_normal((min(draws, 3), 10**6)).astype(np.float32)


def real_gradients(quick: bool):
    """(name, leaf) of the first-step gradients of the digits MLP and ResNet."""
    from experiments import data as data_lib
    from experiments import models

    ds = data_lib.digits(1)
    x, y = jnp.asarray(ds.x_train[0, :256]), jnp.asarray(ds.y_train[0, :256])
    nets = [("mlp", {"hidden": 1024, "depth": 2}, x)]
    if not quick:
        nets.append(("resnet", {}, x.reshape(-1, 8, 8, 1)))
    for name, kw, inputs in nets:
        model = models.build(name, num_classes=10, **kw)
        variables = model.init(jax.random.key(0), inputs[:1])

        def loss(params, model=model, variables=variables, inputs=inputs):
            v = {**variables, "params": params}
            if "batch_stats" in variables:
                logits, _ = model.apply(v, inputs, train=True, mutable=["batch_stats"])
            else:
                logits = model.apply(v, inputs, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss)(variables["params"])
        for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
            if leaf.size >= 1024:
                yield (
                    f"{name}{jax.tree_util.keystr(path)}",
                    leaf.shape,
                    np.asarray(leaf).reshape(1, -1),
                )


def run(ratio: float, draws: int, quick: bool, before: str = BEFORE) -> list[dict]:
    rules = selections(before)
    rows = []
    measured = [(c, s, x) for c, s, x in cases(ratio, draws, quick)]
    measured += [("real:" + n, s, x) for n, s, x in real_gradients(quick)]
    for case, shape, leaves in measured:
        row = {
            "case": case,
            "shape": list(shape),
            "k": math.ceil(ratio * leaves.shape[1]),
            "draws": len(leaves),
        }
        for rule, cls in rules.items():
            f = fills(leaves, ratio, cls)
            row[rule] = {
                "mean": float(f.mean()),
                "min": float(f.min()),
                "below_half": int((f < 0.5).sum()),
            }
        rows.append(row)
        cells = [
            f"{r}: mean {row[r]['mean']:.2f} min {row[r]['min']:.2f} "
            f"<1/2 {row[r]['below_half']}/{row['draws']}"
            for r in rules
        ]
        head = f"{case:42s} {str(tuple(shape)):18s} k={row['k']:6d}  "
        print(head + "  ".join(cells), flush=True)
    return rows


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    rows = run(f.ratio, f.draws, f.quick, f.before)
    if f.out:
        os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
        with open(f.out, "w") as fh:
            json.dump({"ratio": f.ratio, "before": f.before, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
