"""The peers bench's tables: launches merged per cell, each step over its own framework's
no-communication step, and the cells kept in one JSON by (tag, model, processes, network).

Split from :mod:`experiments.bench.peers` (which runs the launches); pure Python.
"""

from __future__ import annotations

import json
import os

import numpy as np

# the jaxcomm side's configurations of the peers part, name -> the transform (before
# optax.sgd(0.01)); torch_peers.CONFIGS holds torch's, paired by name
JAX_CONFIGS = {
    "nocomm": "no exchange: optax.sgd alone on each worker's own gradient, params per worker",
    "allreduce": "jaxcomm.allreduce(axis_name='data')",
    "fp16": "jaxcomm.cast(jnp.float16, axis_name='data', accumulate='psum')",
    "bf16": "jaxcomm.cast(jnp.bfloat16, axis_name='data', accumulate='psum')",
    "fp16_default": "jaxcomm.cast(jnp.float16, axis_name='data') (defaults: accumulate='auto', "
    "on CPU uint16 words all-gathered and summed in fp32; min_size=1024)",
    "bf16_default": "jaxcomm.cast(jnp.bfloat16, axis_name='data') (defaults: accumulate='auto', "
    "on CPU uint16 words all-gathered and summed in fp32; min_size=1024)",
    "ef_sign": "jaxcomm.ef_sign(axis_name='data') (defaults: min_size=1024)",
    "topk": "jaxcomm.topk(0.01, axis_name='data') (defaults: min_size=1024)",
    "threshold": "jaxcomm.threshold(0.01, axis_name='data') (defaults: min_size=1024)",
    "powersgd": "jaxcomm.powersgd(2, key=jax.random.key(0), axis_name='data', start_iter=2, "
    "min_compression_rate=2.0)",
}
CONFIGS = tuple(JAX_CONFIGS)
JAX_BF16 = "bf16_default"  # the jaxcomm bf16 of the ratios: cast(bfloat16) as a user writes it


def merge_runs(runs: list[dict]) -> dict:
    """One framework's launches of a cell, merged: per configuration ``step_s`` holds the
    median of the per-launch median step times (s), their ``range`` [min, max], the
    ``run_medians``, the median of the per-launch IQRs, ``n_runs`` and ``n_steps`` (timed
    steps per launch); the other fields (bytes, collectives) are the first launch's. The
    launches' own spreads stay in ``runs``. No launches: ``{"configs": {}}``."""
    if not runs:
        return {"configs": {}, "runs": []}
    out = {k: v for k, v in runs[0].items() if k != "configs"}
    out["configs"], out["runs"] = {}, [r["configs"] for r in runs]
    for cfg, first in runs[0]["configs"].items():
        meds = [r["configs"][cfg]["step_s"]["median"] for r in runs]
        merged = dict(first)
        merged["step_s"] = dict(
            median=float(np.median(meds)),
            range=[float(min(meds)), float(max(meds))],
            run_medians=[float(m) for m in meds],
            iqr=float(np.median([r["configs"][cfg]["step_s"]["iqr"] for r in runs])),
            n_runs=len(runs),
            n_steps=first["step_s"]["n"],
        )
        out["configs"][cfg] = merged
    return out


def _ms(s: dict | None, width: int = 6) -> str:
    """``median [min-max]`` in ms of a ``step_s`` (one launch: ``[IQR]``); "—" if none."""
    if s is None:
        return f"{'—':>{width + 14}s}"
    lo, hi = s.get("range", (None, None))
    if lo is None:
        return f"{s['median'] * 1e3:{width}.1f} [IQR {s['iqr'] * 1e3:5.1f}]"
    return f"{s['median'] * 1e3:{width}.1f} [{lo * 1e3:5.1f}-{hi * 1e3:5.1f}]"


def _cell_title(cell: dict) -> str:
    tag = cell.get("tag")
    return f"{cell['model']}, {cell['processes']} processes, {cell['network']}" + (
        f", tag {tag}" if tag else ""
    )


def print_cell(cell: dict) -> None:
    t, j = cell["torch"]["configs"], cell["jaxcomm"]["configs"]
    runs = cell.get("repeats", 1)
    print(
        f"\n{_cell_title(cell)} (step ms: median of {runs} launches' medians [min-max], "
        f"bytes per step per worker, collectives in jaxcomm's compiled step)"
    )
    print(
        f"{'config':13s} {'torch DDP':>20s} {'jaxcomm':>20s} {'jax/torch':>9s} "
        f"{'torch B':>10s} {'jaxcomm B':>10s} {'coll':>4s}"
    )
    for cfg in CONFIGS:
        if cfg not in t and cfg not in j:
            continue
        ts, js = t.get(cfg, {}).get("step_s"), j.get(cfg, {}).get("step_s")
        ratio = f"{js['median'] / ts['median']:8.2f}x" if ts and js else f"{'—':>9s}"
        tb = f"{t[cfg]['wire_bytes']:10.0f}" if cfg in t else f"{'—':>10s}"
        jb = f"{j[cfg]['wire_bytes']:10.0f}" if cfg in j else f"{'—':>10s}"
        nc = j.get(cfg, {}).get("hlo_collectives")
        print(
            f"{cfg:13s} {_ms(ts)} {_ms(js)} {ratio} {tb} {jb} {'—' if nc is None else nc:>4}",
            flush=True,
        )


def _median(fw: dict, cfg: str) -> float | None:
    c = fw["configs"].get(cfg)
    return None if c is None else c["step_s"]["median"]


def step_table(cells: list[dict]) -> dict:
    """Per (tag, model, processes, network) and configuration: the step time of each
    framework (ms, median of the launches' medians, and their range) and the step minus
    that framework's own ``nocomm`` step (ms; None without a ``nocomm`` measurement);
    per cell the ratios jaxcomm ``bf16_default`` / jaxcomm ``allreduce`` and jaxcomm
    ``bf16_default`` / torch ``bf16`` (None where a side is missing)."""
    steps, ratios = [], []
    for cell in cells:
        key = {k: cell.get(k) for k in ("tag", "model", "processes", "network")}
        for cfg in CONFIGS:
            row = dict(key, config=cfg)
            for fw in ("jaxcomm", "torch"):
                s = cell[fw]["configs"].get(cfg, {}).get("step_s")
                base = _median(cell[fw], "nocomm")
                rng = s.get("range") if s else None
                row[f"{fw}_ms"] = None if s is None else 1e3 * s["median"]
                row[f"{fw}_range_ms"] = None if rng is None else [1e3 * v for v in rng]
                row[f"{fw}_minus_nocomm_ms"] = (
                    None if s is None or base is None else 1e3 * (s["median"] - base)
                )
            if row["jaxcomm_ms"] is not None or row["torch_ms"] is not None:
                steps.append(row)
        jb, jd = _median(cell["jaxcomm"], JAX_BF16), _median(cell["jaxcomm"], "allreduce")
        tb = _median(cell["torch"], "bf16")
        ratios.append(
            dict(
                key,
                jaxcomm_bf16_over_jaxcomm_dense=jb / jd if jb and jd else None,
                jaxcomm_bf16_over_torch_bf16=jb / tb if jb and tb else None,
            )
        )
    return {"steps": steps, "ratios": ratios}


def _f(v, fmt: str, width: int) -> str:
    """``v`` formatted ``fmt`` in ``width`` ("+" first: signed), or "—" for None."""
    sign, fmt = ("+", fmt[1:]) if fmt.startswith("+") else ("", fmt)
    return f"{'—':>{width}s}" if v is None else f"{v:{sign}{width}{fmt}}"


def _ms_range(ms, rng) -> str:
    """``ms [lo-hi]`` (20 wide); "—" without a measurement, no range for one launch."""
    if ms is None:
        return f"{'—':>20s}"
    return f"{ms:6.1f} " + (f"[{rng[0]:5.1f}-{rng[1]:5.1f}]" if rng else " " * 13)


def print_step_table(table: dict) -> None:
    """:func:`step_table`, one block per (model, processes, network), tags side by side."""
    tags = list(dict.fromkeys(r["tag"] for r in table["ratios"]))
    where = lambda r: (r["model"], r["processes"], r["network"])  # noqa: E731
    for g in dict.fromkeys(where(r) for r in table["ratios"]):
        print(
            f"\n{g[0]}, {g[1]} processes, {g[2]}: step ms, median of the launches' medians "
            f"[min-max]; Δ = step − that framework's nocomm step (ms)"
        )
        rows = {(r["tag"], r["config"]): r for r in table["steps"] if where(r) == g}
        g_tags = [t for t in tags if any(k[0] == t for k in rows)]
        print((f"{'':13s}" + "".join(f" | {'tag ' + str(t):<55s}" for t in g_tags)).rstrip())
        head = f" | {'jaxcomm':>20s} {'Δ':>6s} {'torch DDP':>20s} {'Δ':>6s}"
        print(f"{'config':13s}" + head * len(g_tags))
        for cfg in CONFIGS:
            if not any((t, cfg) in rows for t in g_tags):
                continue
            line = f"{cfg:13s}"
            for t in g_tags:
                r = rows.get((t, cfg), {})
                for fw in ("jaxcomm", "torch"):
                    ms = _ms_range(r.get(f"{fw}_ms"), r.get(f"{fw}_range_ms"))
                    sep = " | " if fw == "jaxcomm" else " "
                    line += f"{sep}{ms} {_f(r.get(f'{fw}_minus_nocomm_ms'), '+.1f', 6)}"
            print(line)
        x = lambda v: "—" if v is None else f"{v:.2f}x"  # noqa: E731
        for r in table["ratios"]:
            if where(r) == g:
                print(
                    f"tag {r['tag']}: jaxcomm {JAX_BF16} / jaxcomm allreduce "
                    f"{x(r['jaxcomm_bf16_over_jaxcomm_dense'])}, "
                    f"jaxcomm {JAX_BF16} / torch bf16 hook {x(r['jaxcomm_bf16_over_torch_bf16'])}"
                )


def summarise(cells: list[dict]) -> dict:
    """Speedups of each compressed configuration vs dense fp32 and vs bf16, per framework;
    and :func:`step_table` (``"steps"``)."""
    out = {"rows": [], "wins": {}}
    for fw in ("torch", "jaxcomm"):
        # a "clear" win is >= 10% faster: the step times' spread on shared cores is about that
        wins = {"vs_fp32": 0, "vs_bf16": 0, "clear_vs_fp32": 0, "clear_vs_bf16": 0, "total": 0}
        for cell in cells:
            c = cell[fw]["configs"]
            if "allreduce" not in c:
                continue
            dense, bf16 = (
                c["allreduce"]["step_s"]["median"],
                c.get("bf16", {}).get("step_s", {}).get("median"),
            )
            for cfg in ("fp16", "bf16", "powersgd"):
                if cfg not in c:
                    continue
                s = c[cfg]["step_s"]["median"]
                row = dict(
                    framework=fw,
                    tag=cell.get("tag"),
                    model=cell["model"],
                    processes=cell["processes"],
                    network=cell["network"],
                    config=cfg,
                    speedup_vs_fp32=dense / s,
                    speedup_vs_bf16=(bf16 / s) if bf16 else None,
                )
                out["rows"].append(row)
                if cfg != "bf16":
                    wins["total"] += 1
                    wins["vs_fp32"] += dense > s
                    wins["vs_bf16"] += bool(bf16) and bf16 > s
                    wins["clear_vs_fp32"] += dense > 1.1 * s
                    wins["clear_vs_bf16"] += bool(bf16) and bf16 > 1.1 * s
        out["wins"][fw] = wins
    out["steps"] = step_table(cells)
    return out


def print_summary(summary: dict) -> None:
    print("\nspeedup of the step (time of baseline / time of config), per framework")
    for r in summary["rows"]:
        b = r["speedup_vs_bf16"]
        tag = f" {r['tag']}" if r.get("tag") else ""
        print(
            f"{r['framework']:8s}{tag} {r['model']:9s} n={r['processes']} {r['network']:9s} "
            f"{r['config']:9s} "
            f"vs fp32 {r['speedup_vs_fp32']:5.2f}x  vs bf16 {_f(b, '.2f', 5)}x"
        )
    for fw, w in summary["wins"].items():
        print(
            f"{fw}: fp16/PowerSGD faster than dense fp32 in {w['vs_fp32']} of {w['total']} "
            f"configurations, faster than bf16 all-reduce in {w['vs_bf16']} of {w['total']}; "
            f"by >= 10%: {w['clear_vs_fp32']} and {w['clear_vs_bf16']}"
        )
    if "steps" in summary:
        print_step_table(summary["steps"])


# --- part c: what a 16-bit all-reduce costs -------------------------------------------------


def add_cell(results: dict, cell: dict) -> None:
    """Puts ``cell`` into ``results["peers"]``, in place of the cell of the same (tag, model,
    processes, network) if there is one (cells before tags have none: tag None), and
    recomputes ``results["peers_summary"]``."""
    key = lambda c: (c.get("tag"), c["model"], c["processes"], c["network"])  # noqa: E731
    results["peers"] = [c for c in results.get("peers", []) if key(c) != key(cell)]
    results["peers"].append(cell)
    results["peers_summary"] = summarise(results["peers"])


def write_json(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)
