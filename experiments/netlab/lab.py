"""Network lab: N hosts in their own network namespaces on a rate-shaped switch.

Each host is a network namespace with one veth port; the other ends of the
veths hang on a Linux bridge that lives in a private "hub" namespace, so
the root namespace gets no interface, address or route. Every egress is
shaped with ``tc qdisc ... tbf`` at the lab's rate: the host-side veth
(upload) and the hub-side veth toward that host (download), like a switch
with full-duplex ports.

Latency cannot be added: this kernel has no ``sch_netem``. The lab shapes
bandwidth only; latency (alpha) stays in ``jaxcomm.netsim``'s cost model.

gloo takes a process's own address from ``gethostname()``. ``ip netns exec
NAME`` bind-mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``, so the
lab writes one there mapping this machine's hostname to the host's address.

Names: namespaces are ``jcnl<pid>-<k>-hub`` and ``jcnl<pid>-<k>-h<i>`` (pid
of the creating process, k counts labs in that process). Interfaces live
only inside those namespaces and cannot collide with anything else:
``br0`` and ``p<i>`` in the hub, ``lab0`` in each host. Everything is
removed on leaving the ``with`` block, at exit, and on SIGTERM / SIGINT /
SIGHUP; ``cleanup()`` (CLI: ``python -m experiments.netlab down``) removes
the leftovers of runs whose process died, touching only ``jcnl`` names.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

PREFIX = "jcnl"
NETNS_ETC = Path("/etc/netns")
HOST_IFACE = "lab0"
SUBNET = "10.211.0"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(hub|h\d+)$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*$", re.IGNORECASE)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|kb|kib|m|mb|mib)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_SIZE_UNITS = {"b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 2**20, "mb": 2**20, "mib": 2**20}
_counter = itertools.count()


class LabError(RuntimeError):
    """The lab cannot be built here, or a command building it failed."""


def parse_rate(rate: str) -> int:
    """Parses a tc-style rate into bits per second.

    Args:
      rate: a number and one of ``kbit``, ``mbit``, ``gbit`` (SI, as tc:
        1 kbit = 1000 bit), case-insensitive.

    Returns:
      Bits per second.

    Example:
      >>> parse_rate("100mbit")
      100000000
    """
    m = _RATE_RE.match(rate) if isinstance(rate, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(
            f"rate={rate!r}: expected a positive number followed by kbit, mbit or gbit "
            "(tc syntax), e.g. '100mbit'"
        )
    return int(round(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]))


def parse_size(size: str | int) -> int:
    """Parses a byte size (``32kb``, ``64k``, ``1mb``, plain bytes; 1 k = 1024, as tc).

    Args:
      size: an int (bytes) or a number with an optional unit b, k/kb/kib, m/mb/mib.

    Returns:
      Bytes.

    Example:
      >>> parse_size("32kb")
      32768
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"burst={size!r}: expected bytes, e.g. '32kb', '64k' or 65536")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])


def default_burst(rate_bps: int) -> int:
    """The tbf bucket size used when none is given: max(32 KiB, 2 ms at the rate).

    Small next to the messages so short exchanges cannot pass at line rate
    (32 KiB at 10 Mbit/s is 26 ms of sending, 64 KiB would let a 64 KiB
    message through in no time), but large enough that the token timer
    keeps up at 1 Gbit/s: there a 4-16 MiB all-reduce used 47-53% of the
    rate with 64 KiB, 90-93% with 128 KiB, 99-100% with 250 kB and 1 MB
    (2 hosts). At 10 and 100 Mbit/s 32 KiB gives 93-100%.

    Args:
      rate_bps: shaped rate in bits per second.

    Returns:
      Bucket size in bytes.

    Example:
      >>> default_burst(10**9)
      250000
    """
    return max(32 * 1024, rate_bps // 8 * 2 // 1000)


def default_gso(rate_bps: int) -> bool:
    """Whether veth GSO/TSO stays on by default: only above 100 Mbit/s.

    With GSO, TCP hands tbf 64 KiB packets that it must split against a
    32 KiB bucket; at 10 Mbit/s that dropped hundreds of segments per
    exchange and the dense exchange used 82-91% of the rate; one MSS per
    packet gave 0 drops and 99-100% at 10 and 100 Mbit/s, and makes the
    interface byte counters exact. At 1 Gbit/s per-packet work is the
    bottleneck (29-33% without GSO, 99% with), so GSO stays on there.

    Args:
      rate_bps: shaped rate in bits per second.

    Returns:
      True to keep GSO.

    Example:
      >>> default_gso(10**7), default_gso(10**9)
      (False, True)
    """
    return rate_bps > 100 * 10**6


def default_limit(rate_bps: int, burst: int) -> int:
    """The tbf queue limit in bytes: max(1 MiB, 4 buckets, 100 ms at the rate).

    A queue only forms where traffic fans in (a port fed by several hosts).
    With 4 hosts at 10 Mbit/s a 128 KiB limit dropped 54 packets in a run of
    4 MiB all-reduces (94% of the rate); 1 MiB dropped none (96%).

    Args:
      rate_bps: shaped rate in bits per second.
      burst: the tbf bucket in bytes.

    Returns:
      Queue limit in bytes.

    Example:
      >>> default_limit(10**7, 32768)
      1048576
    """
    return max(2**20, 4 * burst, rate_bps // 8 // 10)


def _run(argv: str | list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Runs a command (a string is split on spaces); raises LabError on failure."""
    argv = argv.split() if isinstance(argv, str) else argv
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_netns(name: str) -> None:
    """Kills what still runs in our namespace ``name``, deletes it and its /etc/netns dir."""
    if not _NAME_RE.match(name):
        raise ValueError(f"refusing to remove {name!r}: not a netlab name")
    if name in _netns_list():
        pids = [int(p) for p in _run(["ip", "netns", "pids", name], check=False).stdout.split()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 2.0
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
                time.sleep(0.05)
            if not pids:
                break
        _run(["ip", "netns", "del", name], check=False)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def cleanup(prefix: str | None = None) -> list[str]:
    """Removes namespaces and /etc/netns directories left by netlab runs.

    Only names of the form ``jcnl<pid>-<k>-hub|h<i>`` are ever touched.

    Args:
      prefix: remove the names starting with this (must start with ``jcnl``);
        None removes those of every run whose creating process is dead.

    Returns:
      The names removed.

    Example:
      >>> cleanup()  # after a `kill -9` of a training run  # doctest: +SKIP
      ['jcnl4242-0-h0', 'jcnl4242-0-h1', 'jcnl4242-0-hub']
    """
    if prefix is not None and not prefix.startswith(PREFIX):
        raise ValueError(f"prefix={prefix!r}: netlab only removes names starting with {PREFIX!r}")
    names = set(_netns_list())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    doomed = []
    for name in sorted(names):
        m = _NAME_RE.match(name)
        if m is None:
            continue
        if prefix is not None and not name.startswith(prefix):
            continue
        if prefix is None and (_pid_alive(int(m.group(1))) and int(m.group(1)) != 0):
            continue
        doomed.append(name)
    # hosts before hubs: a host's veth dies with it, the hub goes last.
    for name in sorted(doomed, key=lambda n: n.endswith("-hub")):
        _remove_netns(name)
    return doomed


class Lab:
    """N hosts in network namespaces on a switch whose ports are shaped with tbf.

    Args:
      n_hosts: number of host namespaces (1 .. 253).
      rate: port rate in tc syntax (``"10mbit"``, ``"1gbit"``), each direction.
      burst: tbf bucket (``"32kb"``, bytes); default ``default_burst(rate)``.
      limit: tbf queue in bytes; default ``default_limit(rate, burst)``.
      gso: keep veth GSO/TSO (True) or send one MSS per packet (False);
        default ``default_gso(rate)``.

    Returns:
      A context manager; inside it the lab exists.

    Example:
      >>> with Lab(2, "100mbit") as lab:  # doctest: +SKIP
      ...     subprocess.run(lab.command(1, ["ip", "-br", "addr"]))
    """

    def __init__(
        self,
        n_hosts: int,
        rate: str,
        *,
        burst: str | int | None = None,
        limit: str | int | None = None,
        gso: bool | None = None,
    ) -> None:
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= 253:
            raise ValueError(f"n_hosts={n_hosts!r}: expected an int in 1..253")
        self.n_hosts = n_hosts
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.burst_bytes = default_burst(self.rate_bps) if burst is None else parse_size(burst)
        self.limit_bytes = (
            default_limit(self.rate_bps, self.burst_bytes) if limit is None else parse_size(limit)
        )
        self.gso = default_gso(self.rate_bps) if gso is None else gso
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
        self.hub = self.prefix + "hub"
        self.names = [f"{self.prefix}h{i}" for i in range(n_hosts)]
        self._created: list[str] = []
        self._prev_handlers: dict[int, object] = {}
        self._open = False
        self._owner = os.getpid()

    # ---- public ----------------------------------------------------------
    @staticmethod
    def check() -> None:
        """Raises LabError saying exactly why the lab cannot run here, else returns None."""
        if os.geteuid() != 0:
            raise LabError(f"netlab needs root to create network namespaces (uid {os.geteuid()})")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LabError(f"netlab needs iproute2: `{tool}` not found on PATH")
        if not Path("/proc/self/ns/net").exists():
            raise LabError("kernel has no network namespaces (/proc/self/ns/net missing)")
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}-hub"
        try:
            _run(["ip", "netns", "add", name])
            _run(["ip", "-n", name, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "q0"])
            _run(f"tc -n {name} qdisc add dev p0 root tbf rate 10mbit burst 32kb limit 64kb")
        except LabError as e:
            raise LabError(f"network namespaces, veth, bridge or tbf unusable here: {e}") from e
        finally:
            _remove_netns(name)

    def address(self, i: int) -> str:
        """IPv4 address of host ``i``'s interface, e.g. ``"10.211.0.1"``."""
        self._index(i)
        return f"{SUBNET}.{i + 1}"

    def interface(self, i: int) -> str:
        """Name of host ``i``'s interface inside its namespace (``"lab0"``)."""
        self._index(i)
        return HOST_IFACE

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        self._index(i)
        return ["ip", "netns", "exec", self.names[i], *argv]

    def __enter__(self) -> Lab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Builds the lab (the ``with`` statement calls this)."""
        if self._open:
            return
        self.check()
        self._open = True
        atexit.register(self.close)
        self._install_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Removes everything the lab created; safe to call twice."""
        if not self._open or os.getpid() != self._owner:  # a forked child owns nothing
            return
        self._open = False
        atexit.unregister(self.close)
        self._restore_handlers()
        for name in reversed(self._created):
            _remove_netns(name)
        self._created = []

    # ---- internals -------------------------------------------------------
    def _index(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host {i} out of range 0..{self.n_hosts - 1}")

    def _add_netns(self, name: str) -> None:
        self._created.append(name)
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _tbf(self, ns: str, dev: str) -> None:
        _run(
            f"tc -n {ns} qdisc add dev {dev} root tbf rate {self.rate_bps}bit "
            f"burst {self.burst_bytes} limit {self.limit_bytes}"
        )

    def _build(self) -> None:
        hub = self.hub
        self._add_netns(hub)
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        hostname = socket.gethostname()
        for i, name in enumerate(self.names):
            self._add_netns(name)
            port = f"p{i}"
            _run(f"ip -n {hub} link add {port} type veth peer name {HOST_IFACE} netns {name}")
            _run(["ip", "-n", hub, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", HOST_IFACE])
            _run(["ip", "-n", name, "link", "set", HOST_IFACE, "up"])
            if not self.gso:
                for ns, dev in ((name, HOST_IFACE), (hub, port)):
                    _run(["ip", "-n", ns, "link", "set", dev, "gso_max_segs", "1"])
            self._tbf(name, HOST_IFACE)
            self._tbf(hub, port)
            etc = NETNS_ETC / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"
                f"{self.address(i)}\t{hostname}\n"
            )

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev)
        self._prev_handlers = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.close()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
