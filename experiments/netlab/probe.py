"""Throughput probe: time a dense all-reduce (``psum``) across N processes in the lab.

One JAX process per host namespace, gloo CPU collectives, one device per
process. Each worker times repetitions of a ``psum`` of S bytes and reads
its interface's byte counters before and after, so the bytes on the wire
(headers, ACKs and whatever gloo actually sends) are measured, not assumed.
Utilisation is ``bytes sent per host / (median time x rate / 8)``.

Example:
  python -m experiments.netlab probe --hosts=2 --rate=50mbit --mb=4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.netlab.lab import Lab, parse_rate

ROOT = Path(__file__).resolve().parents[2]
PORT = 12355
TAG = "NETLAB_RESULT "


def allreduce_lower_bound(nbytes: int, n: int) -> float:
    """Bytes each host must send in an all-reduce of ``nbytes`` over ``n`` hosts: 2(n-1)/n·S."""
    return 2 * (n - 1) / n * nbytes


def utilisation(bytes_sent: float, seconds: float, rate_bps: int) -> float:
    """Fraction of the shaped rate used: ``bytes_sent / (seconds * rate_bps / 8)``.

    Example:
      >>> utilisation(1_250_000, 1.0, 10**7)
      1.0
    """
    if seconds <= 0 or rate_bps <= 0:
        raise ValueError(f"seconds={seconds} and rate_bps={rate_bps} must be positive")
    return bytes_sent / (seconds * rate_bps / 8)


def plan_reps(nbytes: int, n: int, rate_bps: int, budget_s: float) -> int:
    """Timed repetitions for one size: fill ``budget_s`` at the line rate, 3 to 30."""
    expected = max(allreduce_lower_bound(nbytes, n) * 8 / rate_bps, 1e-3)
    return int(min(30, max(3, math.floor(budget_s / expected))))


def parse_sizes(text: str) -> list[float]:
    """``"0.25,4,16"`` -> ``[0.25, 4.0, 16.0]`` (megabytes, positive)."""
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--mb={text!r}: expected positive megabytes, e.g. '0.25,4,16'")
    return sizes


def _counters(iface: str) -> dict[str, int]:
    """Interface counters and the root tbf's counters (what tbf charged: headers of every
    segment, even where GSO hands the interface one 64 KiB packet)."""
    stats = Path("/sys/class/net") / iface / "statistics"
    out = {k: int((stats / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets")}
    tc = subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", iface], capture_output=True)
    tbf = [q for q in json.loads(tc.stdout or b"[]") if q.get("kind") == "tbf"]
    out["tbf_bytes"] = sum(q["bytes"] for q in tbf)
    out["tbf_drops"] = sum(q["drops"] for q in tbf)
    return out


def worker(args: argparse.Namespace) -> None:
    """Runs inside a host namespace: times psums, prints one JSON line per size."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    jax.distributed.initialize(
        args.coordinator, args.nproc, args.process_id, initialization_timeout=60
    )
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    f = jax.jit(
        jax.shard_map(
            lambda a: jax.lax.psum(a, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    for mb in parse_sizes(args.mb):
        count = max(1, int(mb * 2**20) // 4)
        local = np.full((count,), args.process_id + 1, np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
        for _ in range(2):
            jax.block_until_ready(f(x))
        reps = args.reps or plan_reps(4 * count, args.nproc, args.rate_bps, args.budget_s)
        before = _counters(args.iface)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t0)
        after = _counters(args.iface)
        record = {"process": args.process_id, "bytes": 4 * count, "reps": reps, "times": times}
        record.update({k: (after[k] - before[k]) / reps for k in before})
        print(TAG + json.dumps(record), flush=True)
    jax.distributed.shutdown()


def _qdisc_drops(lab: Lab) -> int:
    drops = 0
    for ns in [lab.hub, *lab.names]:
        out = subprocess.run(
            ["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True
        ).stdout
        drops += sum(q.get("drops", 0) for q in json.loads(out or "[]") if q.get("kind") == "tbf")
    return drops


def run_probe(
    hosts: int,
    rate: str,
    sizes_mb: list[float],
    *,
    burst: str | int | None = None,
    limit: str | int | None = None,
    gso: bool | None = None,
    reps: int = 0,
    budget_s: float = 4.0,
    timeout_s: float = 900.0,
) -> list[dict]:
    """Builds a lab, runs one probe worker per host, returns one record per size.

    Args:
      hosts: number of processes (one per namespace).
      rate: tc rate, e.g. ``"100mbit"``.
      sizes_mb: all-reduce sizes in MiB.
      burst: tbf bucket (default: the lab's rule).
      limit: tbf queue (default: the lab's rule).
      gso: keep veth GSO/TSO (default: the lab's rule).
      reps: timed repetitions per size (0: fill ``budget_s`` at line rate).
      budget_s: seconds of sending to aim for per size.
      timeout_s: kill the workers after this long.

    Returns:
      Records with ``median_s``, ``wire_tx_bytes`` (per host per all-reduce,
      from the interface counters), ``utilisation`` and the lab settings.

    Example:
      >>> run_probe(2, "50mbit", [4])[0]["utilisation"]  # doctest: +SKIP
      0.96
    """
    rate_bps = parse_rate(rate)
    sizes = ",".join(str(s) for s in sizes_mb)
    with Lab(hosts, rate, burst=burst, limit=limit, gso=gso) as lab:
        procs = []
        for i in range(hosts):
            argv = [
                sys.executable,
                "-m",
                "experiments.netlab.probe",
                "--worker",
                f"--coordinator={lab.address(0)}:{PORT}",
                f"--nproc={hosts}",
                f"--process-id={i}",
                f"--mb={sizes}",
                f"--iface={lab.interface(i)}",
                f"--rate-bps={rate_bps}",
                f"--reps={reps}",
                f"--budget-s={budget_s}",
            ]
            procs.append(
                subprocess.Popen(
                    lab.command(i, argv),
                    cwd=ROOT,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        outs, deadline = [], time.monotonic() + timeout_s
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        finally:
            for p in procs:
                p.kill()
        for p, (_, err) in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"probe worker failed ({p.returncode}):\n{err[-3000:]}")
        drops = _qdisc_drops(lab)
        per_size: dict[int, list[dict]] = {}
        for out, _ in outs:
            for line in out.splitlines():
                if line.startswith(TAG):
                    rec = json.loads(line[len(TAG) :])
                    per_size.setdefault(rec["bytes"], []).append(rec)
        return [_summary(recs, hosts, rate, rate_bps, lab, drops) for recs in per_size.values()]


def _summary(recs: list[dict], n: int, rate: str, rate_bps: int, lab: Lab, drops: int) -> dict:
    nbytes = recs[0]["bytes"]
    median_s = max(statistics.median(r["times"]) for r in recs)
    wire = statistics.mean(r["tbf_bytes"] or r["tx_bytes"] for r in recs)
    bound = allreduce_lower_bound(nbytes, n)
    return {
        "rate": rate,
        "rate_bps": rate_bps,
        "n": n,
        "bytes": nbytes,
        "reps": recs[0]["reps"],
        "median_s": median_s,
        "min_s": max(min(r["times"]) for r in recs),
        "wire_tx_bytes": wire,
        "if_tx_bytes": statistics.mean(r["tx_bytes"] for r in recs),
        "lower_bound_bytes": bound,
        "wire_over_bound": wire / bound if bound else None,
        "utilisation": utilisation(wire, median_s, rate_bps),
        "bound_utilisation": utilisation(bound, median_s, rate_bps),
        "burst_bytes": lab.burst_bytes,
        "limit_bytes": lab.limit_bytes,
        "gso": lab.gso,
        "tbf_drops": round(sum(r["tbf_drops"] for r in recs) * recs[0]["reps"]),
        "lab_drops": drops,
    }


def format_table(records: list[dict]) -> str:
    """Markdown table of probe records."""
    head = "| rate | n | MiB | median s | wire B/host | wire/bound | util | burst | drops |"
    lines = [head, "|" + "---|" * 9]
    for r in records:
        lines.append(
            f"| {r['rate']} | {r['n']} | {r['bytes'] / 2**20:g} | {r['median_s']:.4f} | "
            f"{r['wire_tx_bytes']:.0f} | {r['wire_over_bound']:.3f} | {r['utilisation']:.3f} | "
            f"{r['burst_bytes']} | {r['tbf_drops']} |"
        )
    return "\n".join(lines)


def worker_parser() -> argparse.ArgumentParser:
    """Arguments of a probe worker (``python -m experiments.netlab.probe --worker ...``)."""
    p = argparse.ArgumentParser(prog="python -m experiments.netlab.probe")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--mb", required=True)
    p.add_argument("--iface", required=True)
    p.add_argument("--rate-bps", type=int, required=True)
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=4.0)
    return p


if __name__ == "__main__":
    worker(worker_parser().parse_args())
