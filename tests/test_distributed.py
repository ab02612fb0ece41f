"""Several real processes (jax.distributed, gloo over loopback), started by experiments.launch.

Each test starts fresh Python processes: the pytest process itself already
initialised JAX with 8 fake devices and cannot join a distributed run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxcomm import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    e.pop("XLA_FLAGS", None)
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return e


def launch(processes, devices, *command, timeout=240):
    argv = [
        sys.executable, "-m", "experiments.launch", f"--processes={processes}",
        f"--devices_per_process={devices}", "--", sys.executable, *command,
    ]  # fmt: skip
    return subprocess.run(
        argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )


def test_same_params_one_process_or_two(tmp_path):
    """2 processes x 2 devices == 1 process x 4 devices, same global data and transforms.

    top-k all-gathers payloads and every worker decodes them in worker order:
    bit-identical. Dense all-reduce and PowerSGD's sums are small: across
    processes they are all-gathered and added on each worker
    (``jaxcomm.buckets.sum_over``), in one process XLA's all-reduce adds them:
    equal to float rounding.
    """
    one = subprocess.run(
        [sys.executable, "-m", "tests.mp_worker", str(tmp_path / "one.npz")],
        cwd=ROOT,
        env=env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    two = launch(2, 2, "-m", "tests.mp_worker", str(tmp_path / "two.npz"))
    assert two.returncode == 0, two.stdout + two.stderr
    assert "[p1]" in two.stdout  # the launcher prefixes each process's output
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert int(a["processes"]) == 1 and int(b["processes"]) == 2
    for name in ("allreduce", "topk", "powersgd"):
        x, y = a[name], b[name]
        assert x.shape == y.shape == (4, 20 * 48 + 48 + 48 * 10)
        assert np.array_equal(y[0], y[3]), f"{name}: workers disagree across processes"
        if name == "topk":
            assert np.array_equal(x, y), name
        else:
            np.testing.assert_allclose(y, x, rtol=0, atol=1e-6, err_msg=name)
    assert not np.allclose(a["topk"], a["allreduce"], atol=1e-3)  # the methods differ
    # small sums: all-reduces in one process, all-gathers + local adds across processes
    # (jaxcomm.buckets.sum_over); the results above agree either way
    for name in ("allreduce", "powersgd"):
        assert str(a[f"{name}_kinds"]) == "all_reduce", name
        assert "all_reduce" not in str(b[f"{name}_kinds"]), (name, str(b[f"{name}_kinds"]))


def _load_params(workdir, step):
    import jax
    import orbax.checkpoint as ocp

    from experiments import checkpoints

    mngr = checkpoints.checkpoint_manager(str(workdir))
    meta = mngr.item_metadata(step).tree
    template = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
    tree = mngr.restore(step, args=ocp.args.StandardRestore(template))
    mngr.close()
    return tree


def test_kill9_then_resume_equals_uninterrupted(tmp_path):
    main = [
        "-m", "experiments.main", "--config=experiments/configs/digits_mlp.py:topk",
        "--config.num_train_steps=600", "--config.steps_per_call=10",
        "--config.checkpoint_every=50", "--config.eval_every=300",
        "--config.progress=False", "--config.plot=False",
    ]  # fmt: skip
    full = launch(2, 1, *main, f"--workdir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stdout[-3000:]

    # Kill process 1 with SIGKILL as soon as the checkpoint of step 100 is complete: orbax's
    # directory and both processes' checksum files (written after orbax finishes).
    complete = lambda step: all(
        os.path.isfile(work / "checkpoints" / str(step) / f"jaxcomm_checksums.p{i}.json")
        for i in range(2)
    )
    work = tmp_path / "killed"
    argv = [
        sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1",
        "--", sys.executable, *main, f"--workdir={work}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    pid = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = [m for line in list(lines) for m in re.findall(r"p1 started \(pid (\d+)\)", line)]
        if found and complete(100):
            pid = int(found[0])
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    assert pid is not None, "".join(lines)[-3000:]
    assert proc.wait(60) == 128 + signal.SIGKILL
    reader.join(5)
    out = "".join(lines)
    assert "p1 died (signal 9); stopping the other processes" in out
    done = sorted(int(s) for s in os.listdir(work / "checkpoints") if s.isdigit() and complete(s))
    assert done and max(done) < 600, f"the kill landed after the run finished: {done}"

    resumed = launch(2, 1, *main, f"--workdir={work}")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    # it resumed from a checkpoint the killed run wrote (the newest complete one), not from
    # step 0, which would also end equal
    (step,) = map(int, re.findall(r"resumed from the checkpoint of step (\d+) ", resumed.stdout))
    assert step == max(done) and step >= 100, (step, done)
    assert "resumed from" not in full.stdout
    a, b = _load_params(tmp_path / "full", 600), _load_params(work, 600)
    import jax

    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


def _init_script(*args, **kwargs):
    call = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    return (
        "from jaxcomm import distributed\n"
        "try:\n"
        f"    distributed.initialize({call})\n"
        "    print('STARTED')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__ + ': ' + str(e))\n"
    )


def _py(code, timeout=60):
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_unreachable_coordinator_is_a_clear_timeout():
    port = distributed_port()
    t0 = time.monotonic()
    p = _py(_init_script(f"127.0.0.1:{port}", 2, 1, timeout_s=3.0))
    out, _ = p.communicate(timeout=60)
    assert "TimeoutError: jaxcomm.distributed.initialize: could not reach the coordinator" in out
    assert time.monotonic() - t0 < 40


def test_coordinator_host_that_does_not_resolve():
    p = _py(_init_script("no-such-host.invalid:1234", 2, 1, timeout_s=3.0))
    out, _ = p.communicate(timeout=60)
    assert "ValueError: coordinator_address: host 'no-such-host.invalid' does not resolve" in out


def test_processes_started_with_different_counts_are_told_so():
    port = distributed_port()
    p0 = _py(_init_script(f"127.0.0.1:{port}", 2, 0, timeout_s=20.0))
    p1 = _py(_init_script(f"127.0.0.1:{port}", 3, 1, timeout_s=20.0))
    outs = [p.communicate(timeout=90)[0] for p in (p0, p1)]
    for out in outs:
        assert "ValueError: jaxcomm.distributed.initialize: processes disagree" in out, out
        assert "STARTED" not in out


def test_missing_process_times_out_with_a_message_not_a_hang():
    port = distributed_port()
    p0 = _py(_init_script(f"127.0.0.1:{port}", 2, 0, timeout_s=4.0))
    out, _ = p0.communicate(timeout=90)
    assert p0.returncode == distributed.TIMEOUT_EXIT_CODE, out
    assert "timed out after" in out and "not every process registered" in out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"process_id: .*\[0, 1\]"),
        (dict(coordinator_address="nohost", num_processes=2, process_id=0), r"'host:port'"),
        (dict(num_processes=2, process_id=0), r"coordinator_address: required"),
        (dict(coordinator_address="h:1", num_processes=0, process_id=0), r"num_processes"),
    ],
)
def test_bad_settings(kwargs, match, monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=match):
        distributed.initialize(**kwargs)


def test_settings_from_env_and_slurm(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-09,12],cpu1")
    assert distributed._resolve(None, None, None) == ("gpu07:12355", 4, 3, "SLURM")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:999")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert distributed._resolve(None, None, None)[:3] == ("10.0.0.1:999", 2, 1)
    assert distributed._resolve("a:1", 8, 5)[:3] == ("a:1", 8, 5)  # arguments first


def test_single_process_without_settings_starts_nothing(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    info = distributed.initialize()
    assert info.num_processes == 1 and info.process_id == 0 and info.device_count == 8


def test_launcher_fails_fast_when_one_process_dies():
    code = (
        "import os, time\n"
        "if os.environ['JAX_PROCESS_ID'] == '1':\n"
        "    raise SystemExit(7)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    r = launch(3, 1, "-c", code, timeout=60)
    assert r.returncode == 7, r.stdout
    assert "p1 died (exit status 7); stopping the other processes" in r.stdout
    assert time.monotonic() - t0 < 30  # the sleeping processes were stopped


def distributed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_other_processes_wait_for_process_0s_evaluation(tmp_path):
    """With nothing exchanged (no_exchange: each call's one collective is its loss mean at
    the end), process 1 used to run its next call while process 0 evaluated, so process 0's
    next timed call had the CPU to itself (the LM study's compute floor read 69 ms a step
    against 108-112 with the processes in step). Now every process waits for the evaluation:
    process 1 starts no call before process 0's evaluation of the call before has ended."""
    work = tmp_path / "run"
    main = [
        "-m", "experiments.main", "--config=experiments/configs/digits_mlp.py:dense",
        "--config.wrapper.name=no_exchange", "--config.num_train_steps=60",
        "--config.steps_per_call=5", "--config.eval_every=5", "--config.checkpoint_every=0",
        "--config.progress=False", "--config.plot=False", "--config.timeline=True",
        f"--workdir={work}",
    ]  # fmt: skip
    run = launch(2, 1, *main)
    assert run.returncode == 0, run.stdout[-3000:]
    read = lambda i: [json.loads(line) for line in open(work / f"timeline.p{i}.jsonl")]
    p0, p1 = read(0), read(1)
    assert [r["step"] for r in p0] == [r["step"] for r in p1] == list(range(5, 65, 5))
    assert all("evaluated" in r for r in p0) and not any("evaluated" in r for r in p1)
    for before, after in zip(p0[:-1], p1[1:]):
        assert after["call_start"] >= before["evaluated"], (before, after)
    # and each process is free only once the evaluation is done
    assert all(r1["free"] >= r0["evaluated"] for r0, r1 in zip(p0, p1))
