"""CLI of the network lab.

Example:
  python -m experiments.netlab check
  python -m experiments.netlab down
  python -m experiments.netlab probe --hosts=2 --rate=50mbit --mb=4
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from experiments.netlab.lab import Lab, LabError, cleanup, parse_rate, parse_size
from experiments.netlab.probe import format_table, parse_sizes, run_probe


def build_parser() -> argparse.ArgumentParser:
    """The ``check`` / ``down`` / ``probe`` sub-commands."""
    p = argparse.ArgumentParser(
        prog="python -m experiments.netlab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="print OK, or exactly why the lab cannot run here")
    down = sub.add_parser("down", help="remove namespaces left by dead netlab runs")
    down.add_argument("--prefix", default=None, help="remove this run's names (jcnl<pid>-<k>-)")
    pr = sub.add_parser("probe", help="time a dense all-reduce across N namespaced processes")
    pr.add_argument("--hosts", type=int, default=2)
    pr.add_argument("--rate", type=str, default="100mbit", help="tc rate, e.g. 10mbit")
    pr.add_argument("--mb", type=str, default="0.25,4", help="sizes in MiB, comma-separated")
    pr.add_argument("--burst", type=str, default=None, help="tbf bucket, e.g. 32kb")
    pr.add_argument("--limit", type=str, default=None, help="tbf queue, e.g. 1mb")
    gso = pr.add_mutually_exclusive_group()
    gso.add_argument("--gso", dest="gso", action="store_true", default=None, help="GSO on")
    gso.add_argument("--no-gso", dest="gso", action="store_false", help="one MSS per packet")
    pr.add_argument("--reps", type=int, default=0, help="timed reps (0: ~budget at line rate)")
    pr.add_argument("--budget-s", type=float, default=4.0)
    pr.add_argument("--json", type=Path, default=None, help="append records to this JSON list")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        Lab.check()
    except LabError as e:
        print(e, file=sys.stderr)
        return 2
    if args.cmd == "check":
        print("OK")
        return 0
    if args.cmd == "down":
        removed = cleanup(args.prefix)
        print("removed: " + (" ".join(removed) if removed else "nothing"))
        return 0
    try:
        parse_rate(args.rate)
        sizes = parse_sizes(args.mb)
        if args.burst is not None:
            parse_size(args.burst)
    except ValueError as e:
        print(f"netlab: {e}", file=sys.stderr)
        return 2
    records = run_probe(
        args.hosts,
        args.rate,
        sizes,
        burst=args.burst,
        limit=args.limit,
        gso=args.gso,
        reps=args.reps,
        budget_s=args.budget_s,
    )
    command = shlex.join(["python", "-m", "experiments.netlab", *argv])
    for r in records:
        r["command"] = command
    print(format_table(records))
    if args.json is not None:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps(old + records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
