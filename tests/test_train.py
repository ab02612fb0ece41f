"""The experiment launcher: one step per config, checkpoint round trip, resume, bad configs."""

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import checkpoints, optimizers, train
from experiments import data as data_lib
from experiments.configs import (
    char_transformer,
    cifar_resnet,
    common,
    digits_compare,
    digits_mlp,
    lm_shakespeare,
)


def tiny(config, steps=1, per_call=1):
    """Shrink a config to a tiny model and ``steps`` steps."""
    config.num_train_steps = steps
    config.steps_per_call = per_call
    config.eval_every = per_call
    config.checkpoint_every = per_call
    config.progress = False
    config.plot = False
    name = config.model.name
    if name == "mlp":
        config.model.kwargs = {"hidden": 16, "depth": 1}
    elif name == "char_transformer":
        config.model.kwargs = {"dim": 16, "depth": 1, "heads": 2, "max_len": 16}
        config.data.seq_len, config.data.max_chars, config.data.batch_size = 16, 40_000, 4
    elif name == "gpt":
        config.model.kwargs = {"dim": 16, "depth": 1, "heads": 2, "max_len": 16}
        config.data.seq_len, config.data.batch_size, config.data.test_windows = 16, 4, 8
        if config.optimizer.get("schedule"):
            config.optimizer.schedule.warmup_steps = 0
    elif name == "resnet":
        config.model.kwargs = {"stages": (4, 8), "blocks": 1}
        config.data.n_train, config.data.batch_size = 256, 2
    return config


def leaves(state):
    return jax.tree_util.tree_leaves_with_path(state)


def assert_bit_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), f"leaf {jax.tree_util.keystr(path)} differs"


CONFIGS = {
    "digits_mlp": lambda: digits_mlp.get_config(),
    "digits_mlp:powersgd": lambda: digits_mlp.get_config("powersgd"),
    "digits_mlp:local_sgd": lambda: digits_mlp.get_config("local_sgd"),
    # the comparison study's registry; DGC: compressor dgc_sgd, learning rate x lr_scale
    "digits_compare:DGC 1%": lambda: digits_compare.get_config("DGC 1%"),
    "char_transformer": lambda: char_transformer.get_config(),
    "cifar_resnet": lambda: cifar_resnet.get_config(),
    "lm_shakespeare": lambda: lm_shakespeare.get_config(),
    "lm_shakespeare:diloco": lambda: lm_shakespeare.get_config("diloco"),
    "lm_shakespeare:nocomm": lambda: lm_shakespeare.get_config("nocomm"),  # sends nothing
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_step(name, tmp_path):
    config = tiny(CONFIGS[name]())
    result = train.train_and_evaluate(config, str(tmp_path))
    (row,) = result.metrics
    assert row["step"] == 1 and np.isfinite(row["loss"]) and 0.0 <= row["accuracy"] <= 1.0
    synced = optimizers.comm_steps(config, 1) == 1  # local SGD (every 8) has not synced yet
    assert (row["wire_bytes"] > 0) == synced and (row["sim_time_s"] > 0) == synced
    assert np.all(result.state.step == 1)
    assert os.path.exists(tmp_path / "metrics.jsonl")
    assert os.path.isdir(tmp_path / "checkpoints" / "1")


@pytest.mark.parametrize("variant", ["powersgd", "qsgd"])
def test_checkpoint_round_trip_bit_exact(variant, tmp_path):
    # PowerSGD: residuals, Q, counters; QSGD: a PRNG key and counters.
    config = tiny(digits_mlp.get_config(variant), steps=4, per_call=2)
    result = train.train_and_evaluate(config, str(tmp_path))
    mngr = checkpoints.checkpoint_manager(str(tmp_path))
    assert mngr.latest_step() == 4
    template = jax.tree.map(np.zeros_like, result.state)
    restored = checkpoints.restore_state(mngr, 4, template)
    assert_bit_equal(checkpoints.to_host(restored), result.state)
    opt_leaves = jax.tree.leaves(result.state.opt_state)
    assert any(x.dtype == np.int32 and x.max() > 0 for x in opt_leaves)  # counters moved
    if variant == "qsgd":  # typed PRNG keys are saved as their key data
        assert any(x.dtype == np.uint32 for x in opt_leaves)
    else:  # PowerSGD's Q (2-D, float) and residuals
        assert sum(x.ndim == 3 and x.dtype == np.float32 for x in opt_leaves) >= 2


@pytest.mark.parametrize("variant", ["powersgd", "local_sgd", "streaming_int8"])
def test_resume_equals_uninterrupted(variant, tmp_path):
    def cfg(steps):
        c = tiny(digits_mlp.get_config(variant), steps=steps, per_call=2)
        c.wrapper.every = 3  # local SGD: a sync falls after the resume point
        if variant == "streaming_int8":  # fragment 0 sends at step 2 and merges at 3: the
            c.wrapper.every = 4  # checkpoint of step 2 holds a sync whose merge is pending
        return c

    full = train.train_and_evaluate(cfg(6), str(tmp_path / "full"))
    part = train.train_and_evaluate(cfg(2), str(tmp_path / "part"))
    resumed = train.train_and_evaluate(cfg(6), str(tmp_path / "part"))
    assert np.all(part.state.step == 2) and np.all(resumed.state.step == 6)
    assert_bit_equal(resumed.state, full.state)
    assert [r["step"] for r in resumed.metrics] == [2, 4, 6]
    timing = ("wall_s", "train_s", "compile_s", "call_s")
    same = lambda row: {k: v for k, v in row.items() if k not in timing}
    assert same(resumed.metrics[-1]) == same(full.metrics[-1])
    # and training moved the params
    assert not np.array_equal(
        part.state.params["Dense_0"]["kernel"], full.state.params["Dense_0"]["kernel"]
    )


def test_metrics_rows_hold_each_calls_seconds(tmp_path):
    """A row's call_s lists the seconds of every training call since the row before (the
    median step of a benchmark is read from them); they add up to train_s."""
    c = tiny(digits_mlp.get_config("dense"), steps=6, per_call=2)
    c.eval_every = 4  # rows at step 4 (two calls) and at the end, 6 (one call)
    rows = train.train_and_evaluate(c, str(tmp_path)).metrics
    assert [r["step"] for r in rows] == [4, 6]
    assert [len(r["call_s"]) for r in rows] == [2, 1]
    assert all(t > 0 for r in rows for t in r["call_s"])
    np.testing.assert_allclose(sum(rows[0]["call_s"]), rows[0]["train_s"], rtol=1e-9)
    np.testing.assert_allclose(
        rows[1]["call_s"][0], rows[1]["train_s"] - rows[0]["train_s"], rtol=1e-9
    )


def _no_compile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("reached data loading / compilation")

    monkeypatch.setattr(train, "make_train_call", boom)
    monkeypatch.setattr(data_lib, "load", boom)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: setattr(c.compressor, "name", "zip"),
            r"config\.compressor\.name: unknown 'zip'",
        ),
        (lambda c: c.compressor.kwargs.update(ratio=1.5), r"config\.compressor\.kwargs.*ratio"),
        (lambda c: setattr(c.optimizer, "name", "nope"), r"config\.optimizer\.name"),
        (lambda c: setattr(c.wrapper, "name", "gossip"), r"config\.wrapper\.name"),
        (lambda c: setattr(c.model, "name", "vit"), r"config\.model\.name"),
        (lambda c: setattr(c, "steps_per_call", 3), r"multiple of config\.steps_per_call"),
        (lambda c: setattr(c.data, "name", "cifar10"), r"config\.data\.dir: required"),
    ],
)
def test_bad_config_errors_before_compile(edit, match, monkeypatch, tmp_path):
    config = tiny(digits_mlp.get_config(), steps=4, per_call=2)
    edit(config)
    _no_compile(monkeypatch)
    with pytest.raises(ValueError, match=match):
        train.train_and_evaluate(config, str(tmp_path))


def test_missing_cifar_dir_says_where(monkeypatch, tmp_path):
    config = tiny(cifar_resnet.get_config())
    config.data.name, config.data.dir = "cifar10", str(tmp_path / "absent")
    _no_compile(monkeypatch)
    with pytest.raises(FileNotFoundError, match=r"config\.data\.dir.*cifar-10-batches-py"):
        train.train_and_evaluate(config, str(tmp_path))


def _write_cifar(path, n, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, n).tolist()
    with open(path, "wb") as f:
        pickle.dump({b"data": raw, b"labels": labels, b"batch_label": b"x"}, f)
    return raw, labels


def test_cifar_pickle_loader(tmp_path):
    raw, labels = _write_cifar(tmp_path / "data_batch_1", 20, 0)
    _write_cifar(tmp_path / "data_batch_2", 4, 1)
    _write_cifar(tmp_path / "test_batch", 6, 2)
    x, y = data_lib._read_cifar_pickle(str(tmp_path / "data_batch_1"))
    assert x.shape == (20, 32, 32, 3) and x.dtype == np.uint8
    # channel planes R, G, B, each row-major 32x32
    assert x[3, 5, 7, 2] == raw[3, 2 * 1024 + 5 * 32 + 7]
    assert x[0, 31, 0, 1] == raw[0, 1024 + 31 * 32]
    assert y.tolist() == labels
    ds = data_lib.cifar10(8, str(tmp_path))
    assert ds.x_train.shape == (8, 3, 32, 32, 3) and ds.y_train.shape == (8, 3)
    assert ds.x_test.shape == (6, 32, 32, 3) and ds.num_classes == 10
    np.testing.assert_allclose(ds.x_train.reshape(-1, 3).mean(0), 0, atol=1e-5)


def test_resume_with_another_worker_count_says_what_the_checkpoint_holds(tmp_path):
    config = tiny(digits_mlp.get_config(), steps=2, per_call=2)
    train.train_and_evaluate(config, str(tmp_path))  # 8 workers
    config = tiny(digits_mlp.get_config(), steps=4, per_call=2)
    config.n_workers = 4
    with pytest.raises(
        ValueError, match=r"holds per-worker state .* of 8 workers, but this run has 4"
    ):
        train.train_and_evaluate(config, str(tmp_path))


def test_resume_with_fewer_workers_than_saved_says_what_the_checkpoint_holds(tmp_path):
    config = tiny(digits_mlp.get_config(), steps=2, per_call=2)
    config.n_workers = 4
    train.train_and_evaluate(config, str(tmp_path))  # 4 workers
    config = tiny(digits_mlp.get_config(), steps=4, per_call=2)  # all 8 devices
    with pytest.raises(
        ValueError, match=r"holds per-worker state .* of 4 workers, but this run has 8"
    ):
        train.train_and_evaluate(config, str(tmp_path))


# --- checkpoint integrity (issue 12, item 8) -----------------------------------------------


def _ckpt_cfg(steps):
    return tiny(digits_mlp.get_config(), steps=steps, per_call=2)  # checkpoints every 2 steps


@pytest.fixture(scope="module")
def uninterrupted_8(tmp_path_factory):
    return train.train_and_evaluate(_ckpt_cfg(8), str(tmp_path_factory.mktemp("full8")))


def _largest_data_file(step_dir):
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(step_dir)
        for f in names
        if os.sep + "d" + os.sep in os.path.join(root, f) + os.sep or root.endswith(os.sep + "d")
    ]
    return max(files, key=os.path.getsize)


def _flip(path, n=64):
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    for i in range(mid, min(mid + n, len(data))):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _empty_metadata(step_dir):
    open(os.path.join(step_dir, "default", "_METADATA"), "w").close()


def _remove_checksums(step_dir):
    for f in os.listdir(step_dir):
        if f.startswith("jaxcomm_checksums.p"):
            os.remove(os.path.join(step_dir, f))


@pytest.mark.parametrize(
    "damage", ["flipped_bytes", "truncated", "empty_metadata", "interrupted_before_checksums"]
)
def test_damaged_newest_checkpoint_falls_back_to_previous(
    damage, uninterrupted_8, tmp_path, caplog
):
    work = str(tmp_path)
    train.train_and_evaluate(_ckpt_cfg(6), work)  # keeps checkpoints 4 and 6
    step6 = os.path.join(work, "checkpoints", "6")
    if damage == "flipped_bytes":
        _flip(_largest_data_file(step6))
    elif damage == "truncated":
        _truncate(_largest_data_file(step6))
    elif damage == "empty_metadata":
        _empty_metadata(step6)
    else:  # killed after orbax finished, before the checksum files were written
        _remove_checksums(step6)
    with caplog.at_level("WARNING"):
        resumed = train.train_and_evaluate(_ckpt_cfg(8), work)
    assert "resuming from checkpoint 4, the newest good one" in caplog.text
    assert "step 6" in caplog.text
    # the run went on from step 4 and ends where an uninterrupted run does
    assert [r["step"] for r in resumed.metrics] == [2, 4, 6, 8]
    assert_bit_equal(resumed.state, uninterrupted_8.state)
    # the bad checkpoint was set aside (not rotated with the good ones), the good ones kept
    assert os.listdir(os.path.join(work, "corrupt_checkpoints"))[0].startswith("6.")
    assert sorted(checkpoints.checkpoint_manager(work).all_steps()) == [6, 8]


def test_flipped_bytes_are_caught_by_the_checksum(tmp_path):
    result = train.train_and_evaluate(_ckpt_cfg(2), str(tmp_path))
    mngr = checkpoints.checkpoint_manager(str(tmp_path))
    template = jax.tree.map(np.zeros_like, result.state)
    state = checkpoints.restore_state(mngr, 2, template)
    checkpoints.verify_state(mngr, 2, state)  # intact: passes
    kernel = np.array(state.params["Dense_0"]["kernel"])
    kernel.view(np.uint32)[3, 0, 0] ^= 1  # one low mantissa bit: finite, plausible
    bad = state._replace(params={**state.params, "Dense_0": {**state.params["Dense_0"]}})
    bad.params["Dense_0"]["kernel"] = kernel
    with pytest.raises(checkpoints.CorruptCheckpoint, match=r"Dense_0.*kernel.*\[3:4.*SHA-256"):
        checkpoints.verify_state(mngr, 2, bad)
    kernel[0, 0, 0] = np.nan
    with pytest.raises(checkpoints.CorruptCheckpoint, match=r"NaN/Inf in .*Dense_0"):
        checkpoints.verify_state(mngr, 2, bad)


def test_checkpoints_from_before_checksums_still_resume(tmp_path, caplog, capsys):
    work = str(tmp_path)
    train.train_and_evaluate(_ckpt_cfg(4), work)
    os.remove(os.path.join(work, "checkpoints", checkpoints.CHECKSUMS_MARKER))
    _remove_checksums(os.path.join(work, "checkpoints", "4"))
    with caplog.at_level("WARNING"):
        resumed = train.train_and_evaluate(_ckpt_cfg(6), work)
    assert "step 4 has no checksums (older format)" in caplog.text
    assert "resumed from the checkpoint of step 4 " in capsys.readouterr().out
    assert resumed.metrics[-1]["step"] == 6


def test_no_usable_checkpoint_is_a_clear_error(tmp_path):
    work = str(tmp_path)
    train.train_and_evaluate(_ckpt_cfg(4), work)
    for step in ("2", "4"):
        _empty_metadata(os.path.join(work, "checkpoints", step))
    with pytest.raises(
        checkpoints.CorruptCheckpoint, match=r"no usable checkpoint .*unreadable metadata"
    ):
        train.train_and_evaluate(_ckpt_cfg(6), work)


def test_nonfinite_state_is_not_saved_and_keeps_the_last_good(tmp_path, caplog):
    work = str(tmp_path)
    result = train.train_and_evaluate(_ckpt_cfg(4), work)
    mngr = checkpoints.checkpoint_manager(work)
    state = result.state
    kernel = np.array(state.params["Dense_0"]["kernel"])
    kernel[0, 0, 0] = np.inf
    params = {**state.params, "Dense_0": {**state.params["Dense_0"], "kernel": kernel}}
    with caplog.at_level("WARNING"):
        assert checkpoints.save_state(mngr, 6, state._replace(params=params)) is False
        assert checkpoints.save_state(mngr, 8, state._replace(params=params)) is False
    assert "NaN/Inf; checkpoint not saved" in caplog.text
    assert sorted(mngr.all_steps()) == [2, 4]  # nothing rotated out
    assert checkpoints.save_state(mngr, 6, state) is True
    assert sorted(mngr.all_steps()) == [4, 6]


def test_main_default_workdir_names_the_config_and_variant():
    from experiments import main

    assert main.default_workdir("experiments/configs/lm_shakespeare.py:bf16") == os.path.join(
        "runs", "lm_shakespeare_bf16"
    )
    assert main.default_workdir("experiments/configs/digits_mlp.py") == os.path.join(
        "runs", "digits_mlp"
    )


def _former_digits_loop(tx, *, steps, model, hidden, split):
    """experiments.digits' own loop before it ran train.make_train_call: the reference."""
    from experiments import digits

    n = split.x_train.shape[0]
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    params = digits.init_params(model, jax.random.key(0), hidden=hidden)
    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape), t)

    def run(state, x, y):
        params, opt_state = jax.tree.map(lambda a: a[0], state)
        x, y = x[0], y[0]

        def step(_, carry):
            params, opt_state = carry
            grads = jax.grad(digits.loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.fori_loop(0, steps, step, (params, opt_state))
        return jax.tree.map(lambda a: a[None], (params, opt_state))

    fn = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    state, x, y = jax.device_put(
        ((stack(params), stack(tx.init(params))), split.x_train, split.y_train),
        NamedSharding(mesh, P("data")),
    )
    return jax.device_get(fn(state, x, y))


@pytest.mark.parametrize("case", ["logreg_topk", "mlp_local_adam", "mlp_powersgd"])
def test_digits_runs_the_harness_step_bit_for_bit_as_its_former_loop(case, digits_split):
    """experiments.digits drives train.make_train_call (the one step, batch_size 0: the
    whole shard); params and optimizer state equal its former fori_loop's, bit for bit."""
    import jaxcomm
    from experiments import digits

    model, tx = {
        "logreg_topk": (
            "logreg",
            optax.chain(jaxcomm.topk(0.1, axis_name="data"), optax.sgd(0.5)),
        ),
        "mlp_local_adam": ("mlp", jaxcomm.local_sgd(optax.adam(1e-2), every=2, axis_name="data")),
        "mlp_powersgd": (
            "mlp",
            optax.chain(
                jaxcomm.powersgd(2, key=jax.random.key(0), axis_name="data"), optax.sgd(0.3)
            ),
        ),
    }[case]
    ref = _former_digits_loop(tx, steps=6, model=model, hidden=32, split=digits_split)
    res = digits.train_curve(
        tx, steps=6, eval_every=3, model=model, hidden=32, split=digits_split
    ).result
    assert_bit_equal(ref, (res.params, res.opt_state))


def test_auto_records_its_choice_and_a_resumed_run_replays_it(tmp_path):
    import json

    config = tiny(digits_mlp.get_config("auto"), steps=2, per_call=1)
    config.compressor.kwargs = {"repeats": 1}
    first = train.train_and_evaluate(config, str(tmp_path / "a"))
    text = (tmp_path / "a" / "auto_choice.json").read_text()
    assert "NaN" not in text  # strict JSON: dense's unknown wins is null
    record = json.loads(text)
    rows = {r["name"]: r for r in record["rows"]}
    assert rows["dense"]["wins"] is None
    assert record["choice"] in rows and set(rows) >= {"dense", "topk_1pct"}
    assert first.metrics[0]["wire_bytes"] == rows[record["choice"]]["wire_bytes"]
    assert sorted(record["rounds"]) == sorted(rows)  # the rounds the rule read (1 here)
    assert all(len(r) == 1 for r in record["rounds"].values())
    # recorded costs and rounds that make another candidate the choice: the run decides
    # from them
    other = "topk_1pct" if record["choice"] != "topk_1pct" else "int8_ef"
    for name, row in rows.items():
        row["seconds"] = 0.0 if name == other else 1.0
        record["rounds"][name] = [row["seconds"]]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "auto_choice.json").write_text(json.dumps(record))
    second = train.train_and_evaluate(config, str(tmp_path / "b"))
    assert second.metrics[0]["wire_bytes"] == rows[other]["wire_bytes"]
    assert rows[other]["wire_bytes"] != rows[record["choice"]]["wire_bytes"]
    # the same costs, but rounds in which it never beat dense: the replay keeps dense
    record["rounds"][other] = [2.0]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "auto_choice.json").write_text(json.dumps(record))
    third = train.train_and_evaluate(config, str(tmp_path / "c"))
    assert third.metrics[0]["wire_bytes"] == rows["dense"]["wire_bytes"]


@pytest.mark.parametrize("outer_lr", [None, 0.1])
def test_diloco_outer_learning_rate_from_the_wrapper_config(outer_lr):
    """DiLoCo's outer Nesterov step (momentum 0.9) at the wrapper's outer_learning_rate
    (0.7 when unset): H = 1 and plain inner SGD, so the first step's delta is lr * g and the
    update is -outer_lr * (1 + 0.9) * lr * g (closed form)."""
    c = common.base()
    c.optimizer.name, c.optimizer.learning_rate = "sgd", 0.5
    more = {} if outer_lr is None else {"outer_learning_rate": outer_lr}
    common.apply_variant(c, {"compressor": ("allreduce", {}), "wrapper": ("diloco", 1, more)})
    tx = optimizers.make_optimizer(c)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    g = jnp.array([1.0, -2.0, 4.0], jnp.float32)

    def step(params):
        u, _ = tx.update(g, tx.init(params), params)
        return u

    run = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    u = np.asarray(jax.jit(run)(jnp.zeros(3, jnp.float32)))
    want = -(outer_lr or 0.7) * 1.9 * 0.5 * np.asarray(g)
    np.testing.assert_allclose(u, want, rtol=1e-6)


def test_diloco_outer_learning_rate_must_be_positive():
    c = common.base()
    common.apply_variant(
        c, {"compressor": ("allreduce", {}), "wrapper": ("diloco", 1, {"outer_learning_rate": 0})}
    )
    with pytest.raises(ValueError, match="outer_learning_rate: must be > 0"):
        optimizers.make_optimizer(c)


def test_no_exchange_wrapper_is_each_workers_own_optimizer():
    """The compute floor's wrapper: each worker applies plain SGD to its own gradient
    (-lr g_w, closed form), the compiled step has no collective, and nothing is counted."""
    c = common.base()
    c.optimizer.name, c.optimizer.learning_rate = "sgd", 0.5
    common.apply_variant(c, {"compressor": ("allreduce", {}), "wrapper": ("no_exchange", 1)})
    assert optimizers.comm_steps(c, 100) == 0
    tx = optimizers.make_optimizer(c)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    g = jnp.array([[1.0, -2.0, 4.0], [3.0, 0.5, -1.0]], jnp.float32)  # one row a worker

    def step(params, grad):
        u, _ = tx.update(grad[0], tx.init(params[0]), params[0])
        return u[None]

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    rows = jax.sharding.NamedSharding(mesh, P("data"))
    params, g = jax.device_put(jnp.zeros((2, 3), jnp.float32), rows), jax.device_put(g, rows)
    np.testing.assert_array_equal(np.asarray(run(params, g)), -0.5 * np.asarray(g))
    hlo = run.lower(params, g).compile().as_text()
    assert not any(op in hlo for op in ("all-reduce", "all-gather", "collective-permute"))
    c.compressor.name = "topk"
    with pytest.raises(ValueError, match="'no_exchange' sends nothing"):
        optimizers.make_optimizer(c)
