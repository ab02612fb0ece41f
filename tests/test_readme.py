"""The README's training-step example runs as written."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_training_step_example_runs_and_learns():
    block = next(b for b in python_blocks() if "def step(" in b)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8 * 32, 64)), jnp.float32)
    y = x @ jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)

    def loss_fn(params, batch):
        bx, by = batch
        return jnp.mean((bx @ params["w"] + params["b"] - by) ** 2)

    # w (2048 entries) is above top-k's min_size (1024): compressed, 1% per worker
    # per step; b (32) is averaged densely and alone cannot fit y
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    assert params["w"].size >= 1024 > params["b"].size
    batch = (np.asarray(x), np.asarray(y))  # the global batch, NumPy: the helper places it
    scope = {"params": params, "loss_fn": loss_fn, "batch": batch}
    exec(block, scope)  # noqa: S102 - the README's own code (runs one step)
    first = float(loss_fn(params, (x, y)))
    step, params, opt_state = scope["step"], scope["params"], scope["opt_state"]
    for _ in range(200):  # no block_until_ready: the helper keeps one step in flight on CPU
        params, opt_state = step(params, opt_state, batch)
    # the top-k compressed weight must learn the regression; with w never updated
    # (top-k sending zeros) b alone leaves ~1.0
    assert float(loss_fn(params, (x, y))) < 0.2 * first
    # momentum (optax.sgd's trace) is replicated, top-k's residual per worker
    assert opt_state[1][0].trace["w"].sharding.is_fully_replicated
    assert opt_state[0].residual["w"].shape == (8, 64, 32)


# The first line of the README's architecture picture (a ```text block).
ARCHITECTURE = "jaxcomm: the path a gradient takes"
MAX_LINES = 250
MAX_PICTURE_LINES = 22
ROOT = README.parent


def readme_problems(text: str) -> list[str]:
    """What keeps ``text`` from being the README: too long, or no true architecture picture."""
    problems = []
    if len(text.splitlines()) > MAX_LINES:
        problems.append(f"{len(text.splitlines())} lines, more than {MAX_LINES}")
    pictures = [b for b in re.findall(r"```text\n(.*?)```", text, re.S) if ARCHITECTURE in b]
    if not pictures:
        return [*problems, f"no architecture picture (a text block with {ARCHITECTURE!r})"]
    picture = pictures[0]
    if len(picture.splitlines()) > MAX_PICTURE_LINES:
        problems.append(f"the picture has more than {MAX_PICTURE_LINES} lines")
    # every module or folder the picture names exists (in jaxcomm/, experiments/ or the root)
    for name in re.findall(r"\b[a-z_]\w*(?:\.py|/)", picture):
        if not any(
            (ROOT / where / name.rstrip("/")).exists() for where in ("jaxcomm", "experiments", ".")
        ):
            problems.append(f"the picture names {name}, which does not exist")
    return problems


def test_readme_is_short_and_has_the_architecture_picture():
    assert readme_problems(README.read_text()) == []


def test_readme_problems_names_a_long_readme_a_missing_picture_and_a_wrong_module():
    text = README.read_text()
    assert readme_problems(text + "\n" * MAX_LINES) == [
        f"{len((text + chr(10) * MAX_LINES).splitlines())} lines, more than {MAX_LINES}"
    ]
    assert readme_problems(text.replace(ARCHITECTURE, "the path")) == [
        f"no architecture picture (a text block with {ARCHITECTURE!r})"
    ]
    assert readme_problems(text.replace("ledger.py", "ledgers.py")) == [
        "the picture names ledgers.py, which does not exist"
    ]
