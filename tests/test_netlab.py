"""experiments.netlab: real network namespaces shaped with tbf (needs root and iproute2)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.netlab import Lab, LabError, cleanup, parse_rate
from experiments.netlab.lab import NETNS_ETC
from experiments.netlab.probe import allreduce_lower_bound, parse_sizes, run_probe, utilisation

ROOT = Path(__file__).resolve().parents[1]


def _unavailable() -> str | None:
    try:
        Lab.check()
    except LabError as e:
        print(f"netlab tests skipped: {e}")
        return str(e)
    return None


REASON = _unavailable()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"netlab unavailable: {REASON}")


def _leftovers(prefix: str) -> list[str]:
    """Namespaces and /etc/netns directories whose name starts with ``prefix``."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]
    if NETNS_ETC.is_dir():
        names += [f"/etc/netns/{p.name}" for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return names


def _root_netns_state() -> str:
    return "".join(
        subprocess.run(["ip", "-o", *a], capture_output=True, text=True).stdout
        for a in (["link"], ["addr"], ["route"])
    )


def test_parse_rate():
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("1GBIT") == 10**9
    assert parse_rate("2.5kbit") == 2500
    for bad in ["100", "mbit", "-5mbit", "0mbit", "10mbps", "10 mb", "", None, 100]:
        with pytest.raises(ValueError, match="rate="):
            parse_rate(bad)


def test_probe_maths():
    assert allreduce_lower_bound(1000, 2) == 1000
    assert allreduce_lower_bound(1000, 4) == 1500
    assert utilisation(1_250_000, 1.0, 10**7) == pytest.approx(1.0)
    assert utilisation(625_000, 1.0, 10**7) == pytest.approx(0.5)
    assert parse_sizes("0.25,4") == [0.25, 4.0]
    for bad in ["", "x", "0", "-1,2"]:
        with pytest.raises(ValueError, match="--mb="):
            parse_sizes(bad)


@needs_lab
def test_dense_exchange_runs_at_the_shaped_rate():
    rate = 50 * 10**6
    (rec,) = run_probe(2, "50mbit", [4], reps=4, timeout_s=120)
    assert rec["wire_tx_bytes"] >= rec["lower_bound_bytes"]  # gloo sends at least 2(n-1)/n S
    measured_bps = rec["wire_tx_bytes"] * 8 / rec["median_s"]
    assert 0.8 * rate <= measured_bps <= 1.2 * rate, rec
    assert 0.8 <= rec["bound_utilisation"] <= 1.2, rec
    assert _leftovers(f"jcnl{os.getpid()}-") == []


@needs_lab
def test_teardown_when_the_block_raises():
    root_before = _root_netns_state()
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(2, "10mbit") as lab:
            assert len(_leftovers(lab.prefix)) == 5  # hub + 2 hosts, 2 /etc/netns dirs
            assert _root_netns_state() == root_before  # the root namespace is untouched
            resolve = [
                "python3",
                "-c",
                "import socket; print(socket.gethostbyname(socket.gethostname()))",
            ]
            out = subprocess.run(lab.command(1, resolve), capture_output=True, text=True)
            assert out.stdout.strip() == lab.address(1)  # gloo will bind this address
            assert socket.gethostbyname(socket.gethostname()) != lab.address(1)
            raise RuntimeError("boom")
    assert _leftovers(lab.prefix) == []
    assert signal.getsignal(signal.SIGTERM) == handler_before


@needs_lab
def test_teardown_on_sigterm_and_cleanup_after_kill():
    script = (
        "import time\nfrom experiments.netlab import Lab\n"
        "with Lab(2, '10mbit') as lab:\n    print(lab.prefix, flush=True)\n    time.sleep(60)\n"
    )

    def start() -> tuple[subprocess.Popen, str]:
        p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        prefix = p.stdout.readline().strip()
        assert prefix.startswith("jcnl") and _leftovers(prefix)
        return p, prefix

    p, prefix = start()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert _leftovers(prefix) == []

    p, prefix = start()
    p.kill()
    p.wait(timeout=30)
    assert _leftovers(prefix)  # SIGKILL cannot be caught: leftovers stay ...
    removed = cleanup()  # ... until `python -m experiments.netlab down`
    assert {n for n in removed if n.startswith(prefix)} and _leftovers(prefix) == []
