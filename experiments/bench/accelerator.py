r"""On a GPU/TPU: every transform against the CPU, and the codecs' cost on the chip.

Three parts, each a program of its own (run in a subprocess, so one that
fails or runs out of time leaves the others' results):

* ``agree``: ``tests/test_accelerator.py`` (every transform, float32 and
  bf16, 8 vmapped workers, against the CPU in the same process); each
  case's largest relative error, its entries beyond the tolerance, and
  passed / failed / xfail;
* ``floor``: :mod:`experiments.bench.floor` on one chip (``--floor_d``
  float32 entries, default 2^26), threshold and exact top-k over a copy;
* ``codecs``: :mod:`experiments.bench.compressors` on GPT-2-small shapes
  (``--gpt2_layers`` blocks, 144 leaves, 85M parameters at 12), each codec's
  step over a copy of the gradient tree. On one chip the collectives are
  no-ops: what is left is encode, decode and the error-feedback memory.

  JAX_PLATFORMS=cuda,cpu python -m experiments.bench.accelerator --out=/tmp/accelerator.json

The table (``report``) is generated into ``experiments/results/accelerator.md``
by ``python -m experiments.studies.tables``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODECS = ("allreduce,cast_bf16,topk,threshold,threshold_noef,int8,ef_sign,twobit,dgc,"
          "powersgd_r2,powersgd_r4")  # fmt: skip
LINE = re.compile(r"^(\S+) (float32|bfloat16): largest relative error (\S+), (\d+) flips$", re.M)
OUTCOME = re.compile(
    r"^(PASSED|FAILED|XFAIL|XPASS) \S+::test_accelerator_agrees_with_cpu\[(\S+)-(f32|bf16)\]", re.M
)


def define_flags() -> None:
    flags.DEFINE_list("parts", ["agree", "floor", "codecs"], "which parts to run")
    flags.DEFINE_integer("floor_d", 2**26, "float32 entries of the floor's vector")
    flags.DEFINE_integer("gpt2_layers", 12, "blocks of the GPT-2 tree")
    flags.DEFINE_string("codecs", CODECS, "experiments.bench.compressors cases")
    flags.DEFINE_integer("reps", 21, "timed rounds")
    flags.DEFINE_integer("timeout", 300, "seconds each part may run")
    flags.DEFINE_string("out", "experiments/results/accelerator.json", "JSON written")


def parse_agree(text: str) -> list[dict]:
    """Rows of ``pytest -s -rA`` output of tests/test_accelerator.py."""
    tag = {"float32": "f32", "bfloat16": "bf16"}
    rows = {(m[1], tag[m[2]]): {"transform": m[1], "dtype": tag[m[2]], "rel_error": float(m[3]),
                                "flips": int(m[4])} for m in LINE.finditer(text)}  # fmt: skip
    for m in OUTCOME.finditer(text):
        row = rows.setdefault((m[2], m[3]), {"transform": m[2], "dtype": m[3]})
        row["outcome"] = m[1].lower()
    return sorted(rows.values(), key=lambda r: (r["transform"], r["dtype"]))


def platforms(platform: str, device_kind: str) -> str:
    """``JAX_PLATFORMS`` for the agreement test: the chip's backend and the CPU.

    ``jax.devices()[0].platform`` says ``"gpu"``, which ``JAX_PLATFORMS`` takes
    as "cuda or rocm" and fails on when one of them is not installed: name it.
    """
    if platform == "gpu":
        platform = "cuda" if "nvidia" in device_kind.lower() else "rocm"
    return f"{platform},cpu"


def _run(cmd: list[str], timeout: int, env: dict | None = None) -> str:
    print("$", " ".join(cmd), flush=True)
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        return done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        return (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")


def main(argv: list[str]) -> None:
    del argv
    import jax

    f = flags.FLAGS
    results: dict = {"platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
                     "jax": jax.__version__, "note": __doc__.split("\n\n")[1]}  # fmt: skip
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        if "agree" in f.parts and results["platform"] == "cpu":
            print("agree: skipped, JAX sees no accelerator (the CPU against itself proves nothing)")
        elif "agree" in f.parts:
            env = dict(os.environ, JAX_PLATFORMS=platforms(results["platform"],
                                                           results["device"]))  # fmt: skip
            text = _run([py, "-m", "pytest", "tests/test_accelerator.py", "-n", "0", "-s", "-rA",
                         "-q"], f.timeout, env)  # fmt: skip
            results["agree"] = parse_agree(text)
            if not results["agree"]:  # pytest did not get to run the cases: say why
                print(text[-3000:], flush=True)

        def part(module: str, *args: str) -> dict | None:
            """``python -m module *args --out=...``'s JSON (None if it wrote none)."""
            out = os.path.join(tmp, module.rsplit(".", 1)[-1] + ".json")
            _run([py, "-m", module, *args, f"--reps={f.reps}", f"--out={out}"], f.timeout)
            if not os.path.exists(out):
                return None
            with open(out) as fh:
                return json.load(fh)

        if "floor" in f.parts:
            floor = part("experiments.bench.floor", f"--layouts=1x{f.floor_d}")
            if floor is not None:
                results["floor"] = floor
        if "codecs" in f.parts:
            codecs = part("experiments.bench.compressors", "--tree=gpt2",
                          f"--gpt2_layers={f.gpt2_layers}", f"--cases={f.codecs}")  # fmt: skip
            if codecs is not None:
                results["codecs"] = codecs["rows"]
    os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
    with open(f.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(report(results))


def report(results: dict) -> str:
    """Markdown of the three parts (those present)."""
    lines = [f"One {results['device']} ({results['platform']}), jax {results['jax']}.", ""]
    agree = results.get("agree", [])
    if agree:
        bad = [r for r in agree if r.get("outcome") not in ("passed", None)]
        lines += [
            f"**Agreement with the CPU** (`tests/test_accelerator.py`): {len(agree)} cases, "
            f"{sum(r.get('outcome') == 'passed' for r in agree)} passed. Largest relative "
            "error of a leaf over three steps (the third with a NaN on one worker):",
            "",
            "| transform | float32 | bf16 |",
            "|---|---|---|",
        ]
        by = {(r["transform"], r["dtype"]): r for r in agree}
        for name in sorted({r["transform"] for r in agree}):
            cells = []
            for dt in ("f32", "bf16"):
                r = by.get((name, dt))
                if r is None or "rel_error" not in r:
                    cells.append(r.get("outcome", "-") if r else "-")
                    continue
                mark = "" if r.get("outcome", "passed") == "passed" else f" ({r['outcome']})"
                flips = f", {r['flips']} flips" if r["flips"] else ""
                cells.append(f"{r['rel_error']:.1e}{flips}{mark}")
            lines.append(f"| `{name}` | {cells[0]} | {cells[1]} |")
        if bad:
            named = [f"`{r['transform']}` {r['dtype']} ({r.get('outcome')})" for r in bad]
            lines += ["", "Not passed: " + ", ".join(named) + "."]
        lines.append("")
    if "floor" in results:
        from experiments.bench import floor

        lines += ["**Sparsifiers at the floor** (`experiments.bench.floor`):", "",
                  floor.report(results["floor"])]  # fmt: skip
    codecs = results.get("codecs", [])
    if codecs:
        r0 = codecs[0]
        lines += [
            f"**Codecs on GPT-2 shapes** ({r0['params'] / 1e6:.1f}M parameters; one chip, so "
            "the collectives are no-ops): a step of each over a copy of the gradient tree, "
            "median of interleaved ratios" + (", rows from two runs" if "run" in r0 else "") + ".",
            "",
            "| codec | step / copy | bytes / fp32 |" + (" run |" if "run" in r0 else ""),
            "|---|---|---|" + ("---|" if "run" in r0 else ""),
        ]
        lines += [f"| `{r['compressor']}` | {r['time_over_copy']:.2f} | "
                  f"{r['payload_over_dense_fp32']:.4f} |"
                  + (f" {r['run']} |" if "run" in r else "") for r in codecs]  # fmt: skip
    if results.get("history"):
        lines += ["", results["history"]]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    define_flags()
    app.run(main)
