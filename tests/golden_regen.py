"""Write ``tests/data/golden.npz`` (what it holds and why: ``tests/test_golden.py``).

For each transform, tries input seeds 0, 1, ... until its three steps agree
under XLA natively, with LLVM's full optimisation (``JAXCOMM_TEST_FULL_OPT=1``)
and, on x86-64, with ``--xla_cpu_max_isa=AVX2``, ``AVX`` and ``SSE4_2``: integer
leaves exactly, floats within a sixteenth of the test's tolerances. A seed that
puts some value within a last bit of a rounding, sign or selection boundary
differs between these settings and is passed over. The native run of the chosen
seed is saved, and the entry's line in ``tests/data/golden_digests.json``
with it. Regenerate only when a change of numbers is intended, and say so in
the commit:

    python -m tests.golden_regen --only fp8        # a new transform; the others stay
    python -m tests.golden_regen --only qsgd int8  # these; the others stay as saved
    python -m tests.golden_regen --all             # every transform

An entry that was not named keeps its saved outputs bit for bit: the run stops
before writing if its digest would change (``test_golden.unnamed_changes``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

VARIANTS = {
    "native": {"XLA_FLAGS": ""},
    "full-opt": {"XLA_FLAGS": "", "JAXCOMM_TEST_FULL_OPT": "1"},
}
if platform.machine() in ("x86_64", "AMD64"):
    VARIANTS |= {
        isa: {"XLA_FLAGS": f"--xla_cpu_max_isa={isa}"} for isa in ("AVX2", "AVX", "SSE4_2")
    }


def compute(out: str, names: list[str], seed: int) -> None:
    """In a fresh process: the steps of ``names`` from input ``seed``, saved to ``out``."""
    import tests.conftest  # noqa: F401  (8 fake devices and the tests' XLA flags, before jax)
    from tests import test_golden as G

    arrays, ran = {}, []
    for name in names:
        try:
            arrays.update(G.run(name, seed))
            ran.append(name)
        except G.jax.errors.JaxRuntimeError as e:  # XLA capped at SSE4_2: no fp16 conversions
            print(f"{name}: does not run under XLA_FLAGS={os.environ['XLA_FLAGS']!r}: {e}")
    G.save(out, arrays, dict.fromkeys(ran, seed))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="transforms to write (new or changed)")
    ap.add_argument("--all", action="store_true", help="rewrite every transform")
    ap.add_argument("--seeds", type=int, default=8, help="input seeds to try per transform")
    ap.add_argument("--compute", help=argparse.SUPPRESS)
    ap.add_argument("--names", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compute:
        return compute(args.compute, args.names.split(","), args.seed)

    from tests import test_golden as G

    if not args.only and not args.all:
        ap.error("name the entries to write (--only NAME ...) or rewrite them --all")
    unknown = set(args.only or ()) - set(G.TRANSFORMS)
    if unknown:
        ap.error(f"--only: unknown transforms {sorted(unknown)}; known: {sorted(G.TRANSFORMS)}")
    pending = sorted(args.only or G.TRANSFORMS)
    pending_named = set(pending)
    old = G.load() if args.only and os.path.exists(G.GOLDEN) else ({}, {})
    arrays, seeds = {}, {}  # the entries written now
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            if not pending:
                break
            runs = {}
            for variant, env in VARIANTS.items():
                out = os.path.join(tmp, f"{variant}-{seed}.npz")
                cmd = [sys.executable, "-m", "tests.golden_regen", "--compute", out]
                cmd += ["--names", ",".join(pending), "--seed", str(seed)]
                env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
                if variant == "native":
                    env.pop("JAXCOMM_TEST_FULL_OPT", None)
                subprocess.run(cmd, env=env, check=True)
                runs[variant] = G.load(out)[0]  # without the transforms that did not run
            for name in list(pending):
                mine = {k: v for k, v in runs["native"].items() if k.split("|")[0] == name}
                differ = {
                    variant: bad
                    for variant, run in runs.items()
                    if any(k in run for k in mine)
                    and (bad := G.mismatches({k: run[k] for k in mine if k in run}, mine,
                                             rtol=G.RTOL / 16, atol=G.ATOL / 16))
                }  # fmt: skip
                if differ:
                    print(f"{name}: input seed {seed} passed over: {differ}", flush=True)
                    continue
                arrays.update(mine)
                seeds[name] = seed
                pending.remove(name)
                print(f"{name}: input seed {seed}", flush=True)
    if pending:
        sys.exit(f"no input seed of {args.seeds} agrees across XLA settings for {pending}")
    arrays, seeds = write(*old, arrays, seeds, pending_named)
    print(f"wrote {G.GOLDEN} and {G.DIGESTS}: {len(seeds)} transforms")


def write(old, old_seeds, new, new_seeds, named, golden=None, digests=None):
    """Save ``old``'s entries but ``named``, plus ``new``'s, and their digests (one line each).

    Refuses (``SystemExit``, nothing written) where an entry that was not named
    would come out of the file with other outputs than it has now.
    """
    from tests import test_golden as G

    keep = {k: v for k, v in old.items() if k.split("|")[0] not in named}
    arrays = {**keep, **new}
    seeds = {**{k: v for k, v in old_seeds.items() if k not in named}, **new_seeds}
    with tempfile.TemporaryDirectory() as tmp:  # what the file will hold, read back
        G.save(os.path.join(tmp, "golden.npz"), arrays, seeds)
        after = G.entry_digests(*G.load(os.path.join(tmp, "golden.npz")))
    changed = G.unnamed_changes(G.entry_digests(old, old_seeds), after, named)
    if changed:
        sys.exit(f"refusing to write: the saved outputs of {changed} would change unnamed")
    G.save(golden or G.GOLDEN, arrays, seeds)
    G.write_digests(after, digests or G.DIGESTS)
    return arrays, seeds


if __name__ == "__main__":
    main()
