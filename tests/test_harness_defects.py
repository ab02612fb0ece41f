"""The harness's failure paths: divergence, another method's checkpoints, SIGTERM, bad input.

Each test holds one defect of the training harness (experiments/train.py,
main.py, launch.py) or of DiLoCo's input checks to its fix: a diverging run
stops with a clear error and saves nothing non-finite; metrics.jsonl is strict
JSON; a workdir of another method is not "corruption"; SIGTERM checkpoints a
multi-process run and the launcher stops its processes; integer leaves,
learning rates, unknown --config keys and unwritable workdirs get clear errors.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from experiments import checkpoints, train
from experiments import data as data_lib
from experiments.configs import digits_mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(variant=None, steps=2, per_call=2, lr=None):
    """digits_mlp (``variant``) shrunk to a 16-unit MLP and ``steps`` steps."""
    c = digits_mlp.get_config(variant)
    c.num_train_steps = steps
    c.steps_per_call = c.eval_every = c.checkpoint_every = per_call
    c.progress = c.plot = False
    c.model.kwargs = {"hidden": 16, "depth": 1}
    if lr is not None:
        c.optimizer.learning_rate = lr
    return c


def _no_compile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("reached data loading / compilation")

    monkeypatch.setattr(train, "make_train_call", boom)
    monkeypatch.setattr(data_lib, "load", boom)


def _strict_rows(path):
    """metrics.jsonl read by a strict parser (no NaN / Infinity literals)."""

    def reject(name):
        raise ValueError(f"non-standard JSON literal {name}")

    with open(path) as f:
        return [json.loads(line, parse_constant=reject) for line in f if line.strip()]


def _steps(work):
    return sorted(checkpoints.checkpoint_manager(str(work)).all_steps())


def _env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    e.pop("XLA_FLAGS", None)
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return e


# --- 1. divergence -------------------------------------------------------------------------


def test_on_nonfinite_must_be_abort_or_continue(monkeypatch, tmp_path):
    config = tiny()
    assert config.on_nonfinite == "abort"  # every config gets it from common.base()
    config.on_nonfinite = "ignore"
    _no_compile(monkeypatch)
    with pytest.raises(
        ValueError, match=r"config\.on_nonfinite: unknown 'ignore'; choose from \['abort', 'con"
    ):
        train.train_and_evaluate(config, str(tmp_path))


def test_a_run_diverging_from_the_start_stops_and_saves_nothing(tmp_path):
    with pytest.raises(train.NonFiniteError) as e:
        train.train_and_evaluate(tiny(steps=6, lr=1e30), str(tmp_path))
    msg = str(e.value)
    # the loss of step 2 may still be finite (a huge number) while the state is not
    assert re.match(r"step 2: the training (loss|state) is NaN/Inf: the run diverged", msg), msg
    assert "last good checkpoint: none saved" in msg and "None" not in msg
    for fix in ("config.optimizer.learning_rate", "jaxcomm.skip_nonfinite", "on_nonfinite="):
        assert fix in msg, msg
    assert _steps(tmp_path) == []


def test_a_resumed_run_that_diverges_names_the_last_good_checkpoint(tmp_path):
    train.train_and_evaluate(tiny(steps=2), str(tmp_path))
    with pytest.raises(train.NonFiniteError, match=r"step 4: .*last good checkpoint: step 2 in "):
        train.train_and_evaluate(tiny(steps=8, lr=1e30), str(tmp_path))
    assert _steps(tmp_path) == [2]  # the NaN state was not saved over it
    # the diverged step's row is kept, for the record (strict JSON: NaN/Inf as null)
    assert [r["step"] for r in _strict_rows(tmp_path / "metrics.jsonl")] == [2, 4]


def test_the_nonfinite_warning_names_no_step_none(tmp_path, caplog):
    mngr = checkpoints.checkpoint_manager(str(tmp_path))
    w = np.full((8, 3), np.nan, np.float32)
    state = train.TrainState(np.zeros(8, np.int32), {"w": w}, {}, ())
    with caplog.at_level("WARNING"):
        assert checkpoints.save_state(mngr, 2, state) is False
    assert "last good checkpoint is kept (none saved)" in caplog.text
    assert "None" not in caplog.text
    mngr.close()


def test_continue_trains_on_and_writes_strict_json(tmp_path):
    config = tiny(steps=4, lr=1e30)
    config.on_nonfinite = "continue"
    result = train.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in result.metrics] == [2, 4]
    rows = _strict_rows(tmp_path / "metrics.jsonl")  # bare NaN before the fix
    assert [r["step"] for r in rows] == [2, 4] and rows[-1]["loss"] is None
    assert _steps(tmp_path) == []  # a non-finite state is never checkpointed


def test_the_command_line_exits_non_zero_with_the_message_only(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "experiments.main", "--config=experiments/configs/digits_mlp.py",
         "--config.optimizer.learning_rate=1e30", "--config.num_train_steps=4",
         "--config.steps_per_call=2", "--config.progress=False", "--config.plot=False",
         f"--workdir={tmp_path}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"^error: step \d: the training (loss|state) is NaN/Inf", r.stderr, re.M)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


# --- 2. checkpoints of another method ------------------------------------------------------


def test_resuming_another_methods_workdir_is_a_mismatch_not_corruption(tmp_path):
    train.train_and_evaluate(tiny("topk"), str(tmp_path))
    with pytest.raises(checkpoints.CheckpointMismatch) as e:
        train.train_and_evaluate(tiny("powersgd", steps=4), str(tmp_path))
    msg = str(e.value)
    assert "holds checkpoints of a different configuration" in msg, msg
    assert "compressor.name='topk' (this run: 'powersgd')" in msg, msg
    assert "2 leaves only in this run (e.g. opt_state/0/q/0)" in msg, msg  # PowerSGD's Q
    assert "compressor.kwargs.rank=unset (this run: 2)" in msg, msg
    assert "fresh --workdir" in msg and "intact" in msg and "Move them away" not in msg
    assert _steps(tmp_path) == [2]  # nothing moved or deleted
    assert not os.path.exists(tmp_path / "corrupt_checkpoints")
    resumed = train.train_and_evaluate(tiny("topk", steps=4), str(tmp_path))
    assert resumed.metrics[-1]["step"] == 4  # and the workdir still resumes with top-k


# --- 3. SIGTERM and dead peers -------------------------------------------------------------


def _launcher(*command, extra=()):
    argv = [sys.executable, "-m", "experiments.launch", "--processes=2", *extra, "--", *command]
    return subprocess.Popen(
        argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _sigterm_after(proc, seconds):
    time.sleep(seconds)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    return out, time.monotonic() - t0


def test_launcher_gives_its_processes_time_to_checkpoint_on_sigterm(tmp_path):
    # each process takes 6 s to "save" after SIGTERM (the former launcher killed at 5 s)
    child = (
        "import os, signal, sys, time\n"
        "def save(*_):\n"
        "    time.sleep(6)\n"
        f"    open(os.path.join({str(tmp_path)!r}, os.environ['JAX_PROCESS_ID']), 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    out, took = _sigterm_after(_launcher(sys.executable, "-c", child), 3)
    assert sorted(os.listdir(tmp_path)) == ["0", "1"], out
    assert "SIGTERM: stopping every process" in out and took < 30, (took, out)


def test_launcher_kills_processes_that_ignore_sigterm_after_the_grace(tmp_path):
    child = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)\n"
    proc = _launcher(sys.executable, "-c", child, extra=["--stop_grace_s=1"])
    out, took = _sigterm_after(proc, 3)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert took < 20, (took, out)


MAIN = [
    "-m", "experiments.main", "--config=experiments/configs/digits_mlp.py:topk",
    "--config.steps_per_call=10", "--config.checkpoint_every=500", "--config.eval_every=500",
    "--config.progress=False", "--config.plot=False",
]  # fmt: skip


def _stream(proc):
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    return lines, reader


def _complete(work, step, processes=2):
    return all(
        os.path.isfile(os.path.join(work, "checkpoints", str(step), f"jaxcomm_checksums.p{i}.json"))
        for i in range(processes)
    )


def test_sigterm_checkpoints_a_two_process_run_which_then_resumes(tmp_path):
    work = str(tmp_path / "run")
    proc = _launcher(sys.executable, *MAIN, "--config.num_train_steps=1000000", f"--workdir={work}")
    lines, reader = _stream(proc)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not _complete(work, 500):
        time.sleep(0.05)
    assert _complete(work, 500), "".join(lines)[-3000:]
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(120) == 128 + signal.SIGTERM
    took = time.monotonic() - t0
    reader.join(5)
    out = "".join(lines)
    said = re.findall(r"preempted \(SIGTERM\) at step (\d+): saved its checkpoint", out)
    (step,) = map(int, said)
    assert step > 500 and _complete(work, step), out[-3000:]  # mostly off the schedule
    assert "died" not in out and took < 60, (took, out[-3000:])
    resumed = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--processes=2", "--", sys.executable,
         *MAIN, f"--config.num_train_steps={step + 20}", f"--workdir={work}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resumed from the checkpoint of step {step} " in resumed.stdout


def test_the_survivor_of_a_dead_peer_exits_at_once_not_after_the_shutdown_barrier(tmp_path):
    """Started by hand (no launcher to stop it): process 1 is killed mid-run; process 0's
    collective fails and it exits with a message, instead of waiting ~70 s in jax.distributed's
    shutdown barrier and aborting (SIGABRT)."""
    from experiments import launch

    work = str(tmp_path / "run")
    coordinator = f"127.0.0.1:{launch.free_port()}"
    # no checkpoint in reach: a kill during a save's barrier is a wait in JAX's coordination
    # service (its heartbeat timeout), not the failed collective this test is about
    argv = [sys.executable, *MAIN, "--config.num_train_steps=1000000", f"--workdir={work}",
            "--config.checkpoint_every=100000"]  # fmt: skip
    procs = [
        subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=launch.process_env(_env(), i, 2, 1, coordinator),
        )  # fmt: skip
        for i in range(2)
    ]
    lines, reader = _stream(procs[0])
    try:
        deadline = time.monotonic() + 240
        evaluated = lambda: any(line.startswith("step 1000: ") for line in list(lines))
        while time.monotonic() < deadline and procs[0].poll() is None and not evaluated():
            time.sleep(0.02)
        assert evaluated(), "".join(lines)[-3000:]  # process 0 goes on training after it
        procs[1].kill()
        t0 = time.monotonic()
        code = procs[0].wait(120)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    reader.join(5)
    out = "".join(lines)
    assert code == 1, (code, out[-3000:])
    assert "process 0: the run failed (JaxRuntimeError)" in out, out[-3000:]
    assert "another process died" in out and "shutdown barrier" in out, out[-3000:]
    assert took < 40, (took, out[-3000:])


# --- 4. DiLoCo's input checks --------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.diloco(optax.sgd(0.1), every=2, axis_name=None),
        lambda: jaxcomm.streaming_diloco(optax.sgd(0.1), every=2, fragments=2, axis_name=None),
        lambda: jaxcomm.muloco(0.1, every=2, axis_name=None),
        lambda: jaxcomm.sparseloco(optax.sgd(0.1), every=2, axis_name=None),
        lambda: jaxcomm.delayed_averaging(optax.sgd(0.1), delay=1, axis_name=None),
    ],
    ids=["diloco", "streaming_diloco", "muloco", "sparseloco", "delayed_averaging"],
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_diloco_family_names_an_integer_or_bool_leaf(make, dtype):
    params = {"w": jnp.ones((2, 3)), "count": jnp.zeros(3, dtype)}
    name = jnp.dtype(dtype).name
    with pytest.raises(
        TypeError, match=rf"params: leaf \['count'\] has dtype {name};.*optax\.partition"
    ):
        make().init(params)


# --- 5. smaller ----------------------------------------------------------------------------


def test_a_truncated_checkpoint_prints_no_closed_event_loop_tracebacks(tmp_path, monkeypatch):
    """Orbax closes its event loop when a read fails; tensorstore's other reads of the same
    restore then hit the closed loop, and each printed a stray traceback."""
    result = train.train_and_evaluate(tiny(), str(tmp_path))
    step_dir = tmp_path / "checkpoints" / "2"
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if "/d" in r]
    biggest = max(files, key=os.path.getsize)
    data = open(biggest, "rb").read()
    open(biggest, "wb").write(data[: len(data) // 2])
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    mngr = checkpoints.checkpoint_manager(str(tmp_path))
    for _ in range(10):  # the stray callbacks race with the failure: try it a few times
        with pytest.raises(checkpoints.CorruptCheckpoint, match="no usable checkpoint"):
            checkpoints.restore_latest_good(mngr, result.state, 8, str(tmp_path))
    time.sleep(0.5)
    mngr.close()
    closed = [u for u in seen if "Event loop is closed" in str(u.exc_value)]
    assert not closed, f"{len(closed)} stray 'Event loop is closed' errors"


@pytest.mark.parametrize("lr", [-0.1, 0.0, math.nan, math.inf])
def test_a_learning_rate_must_be_finite_and_positive(lr, monkeypatch, tmp_path):
    _no_compile(monkeypatch)
    with pytest.raises(
        ValueError, match=r"config\.optimizer\.learning_rate: expected a finite number > 0"
    ):
        train.train_and_evaluate(tiny(lr=lr), str(tmp_path))


def test_an_unknown_config_key_on_the_command_line_is_named_with_close_matches(tmp_path):
    r = subprocess.run(
        [sys.executable, *MAIN[:3], "--config.stop_after=4", f"--workdir={tmp_path}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--config.stop_after: the config experiments/configs/digits_mlp.py:topk has no key " in (
        r.stderr
    )
    assert "num_train_steps" in r.stderr  # the keys it has
    from experiments import main

    argv = ["main", "--config", "experiments/configs/digits_mlp.py", "--config.wrapper.evry=3"]
    msg = main.unknown_override(argv)
    assert "did you mean wrapper.every" in msg and "config.wrapper has: " in msg, msg
    assert main.unknown_override(argv[:3] + ["--config.wrapper.every=3"]) is None


def test_an_unwritable_workdir_is_reported_before_data_is_loaded(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _no_compile(monkeypatch)
    with pytest.raises(ValueError, match=r"--workdir .*a_file/run.*: cannot write there"):
        train.train_and_evaluate(tiny(), str(blocker / "run"))


def test_launcher_reports_the_killed_process_before_a_peer_that_exited_for_it():
    # a peer that saw its neighbour die exits 1, and one poll may see both: the launcher
    # reports the signal (128 + 9), not the peer's status, whatever their order
    from experiments import launch

    assert launch.culprit([1, -9]) == (1, -9) and launch.culprit([-9, 1]) == (0, -9)
    assert launch.culprit([None, 1, 2]) == (1, 1) and launch.culprit([0, None]) is None
    assert launch.exit_code(launch.culprit([1, -9])[1]) == 128 + 9
