"""Replica processes around torchft's lighthouse: start, kill, restart and reap them.

The machinery shared by :mod:`experiments.elastic_demo` (a replica killed at a
round, restarted once) and :mod:`experiments.bench.goodput` (a seeded schedule
of kills by wall time). Each replica is its own program (its own JAX or torch
process, one torchft replica group); the launcher holds torchft's lighthouse in
process (``torchft_lighthouse`` is the same server as a command) and tells the
replicas its address.

Pieces:
  * :func:`lighthouse`: the lighthouse as a context manager, yielding the address
    the (local) replicas reach it at;
  * :class:`Replicas`: the processes, one incarnation after another per replica,
    with an event log (start, kill, exit, each with its wall time);
  * :func:`supervise`: the loop that reaps exits and calls the caller's policy
    (restart, kill) until every replica is done or a deadline passes;
  * :func:`mark_ready` / :func:`wait_ready`: the start barrier of the first
    incarnations (a job starts with every replica up; a restart joins alone);
  * :func:`sha256`: a pytree's bytes hashed, how replicas show they agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

# one XLA and torch thread per replica: several replicas share few cores
CHILD_ENV = {
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "JAX_PLATFORMS": "cpu",
    "OMP_NUM_THREADS": "1",
    "RUST_LOG": "error",  # torchft's servers log every quorum at info
}


@contextlib.contextmanager
def lighthouse(
    min_replicas: int, *, join_timeout_ms: int, heartbeat_timeout_ms: int
) -> Iterator[str]:
    """torchft's lighthouse in this process; yields ``http://localhost:PORT``.

    The replicas are local: they reach it at localhost (it names the machine's
    hostname, which a container may not resolve). Shut down on leaving.
    """
    os.environ.setdefault("RUST_LOG", "error")  # before torchft starts its servers' logger
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        yield "http://localhost:" + server.address().rsplit(":", 1)[1]
    finally:
        server.shutdown()


@contextlib.contextmanager
def lighthouse_process(
    wrap: Callable[[list[str]], list[str]],
    host: str,
    *,
    min_replicas: int,
    join_timeout_ms: int,
    heartbeat_timeout_ms: int,
    start_timeout_s: float = 60.0,
) -> Iterator[str]:
    """torchft's lighthouse as a process of its own, started as ``wrap(argv)``; yields
    ``http://HOST:PORT``.

    For replicas this process cannot share a network with: in a shaped-link lab
    (:mod:`experiments.netlab`) ``wrap`` is ``lambda argv: lab.command(k, argv)``,
    and the lighthouse serves on ``host`` (host ``k``'s address) in that
    namespace. Stopped on leaving.
    """
    argv = [sys.executable, "-m", "experiments.elastic_launch", f"--bind={host}",
            f"--min_replicas={min_replicas}", f"--join_timeout_ms={join_timeout_ms}",
            f"--heartbeat_timeout_ms={heartbeat_timeout_ms}"]  # fmt: skip
    env = {**os.environ, "RUST_LOG": "error"}
    proc = subprocess.Popen(wrap(argv), stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        if not ready or not ready[0].startswith("http://"):
            raise RuntimeError(
                f"the lighthouse ({' '.join(wrap(argv))}) did not start in {start_timeout_s:g} s"
                f" (exit code {proc.poll()})"
            )
        yield ready[0].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(argv: list[str]) -> None:
    """``python -m experiments.elastic_launch --bind=HOST ...``: a lighthouse on ``HOST``
    (any free port) until SIGTERM; prints ``http://HOST:PORT`` when it serves."""
    import argparse

    p = argparse.ArgumentParser(description="torchft's lighthouse, its address printed")
    p.add_argument("--bind", required=True)
    p.add_argument("--min_replicas", type=int, default=1)
    p.add_argument("--join_timeout_ms", type=int, default=10000)
    p.add_argument("--heartbeat_timeout_ms", type=int, default=2000)
    args = p.parse_args(argv)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{args.bind}:0",
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"http://{args.bind}:{server.address().rsplit(':', 1)[1]}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


def sha256(tree) -> str:
    """SHA-256 of a pytree's leaves' bytes, in tree order (NumPy, JAX or torch leaves)."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        x = x.detach().numpy() if hasattr(x, "detach") else x
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()


def mark_ready(out: pathlib.Path, replica: int) -> None:
    """This replica is up (compiled, manager built): ``out/ready_<replica>`` holds the time."""
    path = out / f"ready_{replica}"
    path.with_suffix(".tmp").write_text(repr(time.time()))
    path.with_suffix(".tmp").replace(path)


def wait_ready(out: pathlib.Path, replicas: int, poll_s: float = 0.05) -> float:
    """Block until every replica is ready; the wall time the last one got ready."""
    paths = [out / f"ready_{i}" for i in range(replicas)]
    while not all(p.exists() for p in paths):
        time.sleep(poll_s)
    return max(float(p.read_text()) for p in paths)


class Replicas:
    """Replica processes started by this launcher; ``events`` logs what happened to them.

    Args:
      command: ``(replica, incarnation) -> argv`` of that replica's program.
      n: how many replicas.
      env: the environment of every replica (:data:`CHILD_ENV` over this one's).

    ``codes[i]`` lists replica ``i``'s exit codes, one per incarnation that
    ended (``-9``: SIGKILLed); ``events`` holds ``{"t", "event": "start" |
    "kill" | "exit", "replica", "incarnation"[, "code"]}`` with wall times.
    """

    def __init__(self, command: Callable[[int, int], list[str]], n: int, env: dict) -> None:
        self._command, self._env = command, env
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, list[int]] = {i: [] for i in range(n)}
        self.events: list[dict] = []

    def incarnation(self, i: int) -> int:
        """Replica ``i``'s current (or next) incarnation: how many of its runs ended."""
        return len(self.codes[i])

    def _log(self, event: str, i: int, **kw) -> None:
        self.events.append({"t": time.time(), "event": event, "replica": i,
                            "incarnation": self.incarnation(i), **kw})  # fmt: skip

    def start(self, i: int) -> None:
        if i in self.procs:
            raise RuntimeError(f"replica {i} is running")
        self._log("start", i)
        self.procs[i] = subprocess.Popen(self._command(i, self.incarnation(i)), env=self._env)

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (it is reaped, and its exit logged, by :meth:`poll`)."""
        self._log("kill", i)
        self.procs[i].send_signal(signal.SIGKILL)

    def poll(self) -> list[int]:
        """Reap the replicas that ended: their indices (their codes appended)."""
        ended = []
        for i, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            self._log("exit", i, code=p.returncode)
            self.codes[i].append(p.returncode)
            del self.procs[i]
            ended.append(i)
        return ended

    def close(self) -> None:
        """Kill and reap every replica still running (only those this launcher started)."""
        for p in self.procs.values():
            p.kill()
            p.wait()
        self.procs.clear()


def supervise(
    replicas: Replicas,
    policy: Callable[[float, list[int]], None],
    *,
    deadline_s: float,
    poll_s: float = 0.05,
) -> None:
    """Reap exits and call ``policy(now, ended)`` until no replica runs, or raise at the deadline.

    ``policy`` may start (restart) or kill replicas; pending restarts keep the
    loop alive only while ``policy`` starts them before the others are done.
    Every replica still running is killed on leaving, error or not.
    """
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replicas {sorted(replicas.procs)} still running after {deadline_s:g} s"
                )
            ended = replicas.poll()
            policy(time.time(), ended)
            if not replicas.procs:
                return
            time.sleep(poll_s)
    finally:
        replicas.close()


if __name__ == "__main__":
    _serve(sys.argv[1:])
