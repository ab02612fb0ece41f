"""The goodput bench's accounting (from its replicas' logs) and its tables (from its JSON).

Goodput, as the issue and Decoupled DiLoCo (arXiv:2604.21428) use it: the
share of the replicas' time that turned into training the run keeps.

- A **useful inner step** is one a replica took in a round that committed for
  it, and that it contributed to: an inner step of a sync line with
  ``committed`` true and ``healed`` false. Lost: the steps of a rolled-back round,
  a killed replica's steps since its last committed sync, a restarted replica's
  steps before it healed (torchft's DiLoCo takes some; jaxcomm's join takes none)
  and the round it healed in (it sends the peer's copy, or nothing).
- **Useful steps per second** = useful inner steps summed over the replicas /
  wall seconds, from the run's start to the last replica's end (its final sync).
  The start: every replica of the job is up (built, compiled, at the start
  barrier; jaxcomm's also past its join, a sync with no inner steps where the
  replicas take one copy of the initial state and compile the outer step).
- **Goodput** = useful inner steps / (replicas x wall seconds): the useful steps
  per replica-second; the **goodput ratio** is that of the run under the failure
  schedule over that of the same run (same side, method, replicas, steps)
  without failures. A restarted replica's start-up is inside the wall time and
  does no useful step: it is part of what a failure costs.

Every run also gives rounds committed (distinct rounds in which some replica
committed useful steps), rollbacks (sync lines that did not commit), heal
times (per restart: spawn to ready, ready to the end of the sync it healed in),
and the final validation loss (the study's evaluation of the lowest-index
finished replica's params; with 3 seeds of dense in the study's JSON, whether it
is within the study's quality band of dense's median final).
"""

from __future__ import annotations

import statistics

from experiments.bench import goodput_workload as workload


def _syncs(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "committed" in x]


def heals(lines: list[dict], events: list[dict], replica: int) -> list[dict]:
    """Each restarted incarnation's heal: spawn -> ready -> the end of its healed sync (s)."""
    out = []
    for e in events:
        if e["event"] != "start" or e["replica"] != replica or e["incarnation"] == 0:
            continue
        inc = [x for x in lines if x["incarnation"] == e["incarnation"]]
        ready = [x["t"] for x in inc if x.get("event") == "ready"]
        healed = [x for x in _syncs(inc) if x["healed"]]
        row = {"replica": replica, "incarnation": e["incarnation"],
               "startup_s": ready[0] - e["t"] if ready else None,
               "heal_s": healed[0]["t"] - e["t"] if healed else None,
               "rejoin_s": healed[0]["t"] - ready[0] if healed and ready else None,
               "heal_sync_s": healed[0]["sync_s"] if healed else None,
               "healed_at_round": healed[0]["rounds"] if healed else None}  # fmt: skip
        out.append(row)
    return out


def account(run_dir: str, n: int, events: list[dict], t_start: float) -> dict:
    """One run's goodput and its parts, from ``run_dir``'s logs and the launcher's events."""
    lines = {i: workload.read(run_dir, i) for i in range(n)}
    syncs = [x for i in range(n) for x in _syncs(lines[i])]
    useful_by = {i: sum(x["steps"] for x in _syncs(lines[i]) if x["committed"] and not x["healed"])
                 for i in range(n)}  # fmt: skip
    finals = {i: [x for x in lines[i] if x.get("final")] for i in range(n)}
    finals = {i: f[-1] for i, f in finals.items() if f}
    if not finals:
        raise RuntimeError(f"{run_dir}: no replica finished")
    t_end = max(x["t"] for x in syncs)  # the last sync (the evaluation comes after)
    wall = t_end - t_start
    useful = sum(useful_by.values())
    first = finals[min(finals)]
    return {
        "replicas": n,
        "t_start": t_start,
        "t_end": t_end,
        "wall_s": wall,
        "useful_steps": useful,
        "useful_steps_by_replica": useful_by,
        "steps_taken": sum(x["steps"] for x in syncs),
        "useful_steps_per_s": useful / wall,
        "goodput": useful / (n * wall),
        "rounds_committed": len(
            {x["round"] for x in syncs if x["committed"] and x["steps"] and not x["healed"]}
        ),
        "rollbacks": sum(not x["committed"] for x in syncs),
        "kills": sum(e["event"] == "kill" for e in events),
        "restarts": sum(e["event"] == "start" and e["incarnation"] > 0 for e in events),
        "heals": [h for i in range(n) for h in heals(lines[i], events, i)],
        "finished": sorted(finals),
        "params_agree": len({f["params"] for f in finals.values()}) == 1,
        # the global copy (jaxcomm's replicas log it; with Streaming DiLoCo's mix > 0 the
        # params differ by each replica's own local part, the anchors may not)
        "anchors_agree": _agree([f.get("anchor") for f in finals.values()]),
        "final_params": {i: f["params"] for i, f in finals.items()},
        "position": first["position"],
        "positions": {i: f["position"] for i, f in finals.items()},
        "eval_loss": first["eval_loss"],
        "eval_loss_se": first["eval_loss_se"],
    }


def _agree(hashes: list) -> bool | None:
    """Whether every finished replica logged the same hash (None: some logged none)."""
    return None if None in hashes else len(set(hashes)) == 1


def dense_band(study: dict | None) -> dict | None:
    """Dense's finals (2 processes) in the LM study's JSON, once it has 3 seeds; else None."""
    if not study:
        return None
    finals = [r["curve"][-1]["eval_loss"] for r in study.get("runs", [])
              if r["method"] == "dense" and r.get("n", 2) == 2 and r.get("curve")]  # fmt: skip
    if len(finals) < 3:
        return {"seeds": len(finals), "median": None}
    return {"seeds": len(finals), "median": statistics.median(finals), "finals": finals}


def rows(results: dict) -> list[dict]:
    """One row per (side, method, replicas): clean and failure runs side by side."""
    from experiments.studies import verdict

    band = results.get("dense_band") or {}
    out = []
    for key, clean in results["runs"].items():
        if not key.endswith("/clean"):
            continue
        fail = results["runs"].get(key[: -len("clean")] + "failures")
        row = {k: clean[k] for k in ("side", "method", "replicas")}
        row.update(clean_goodput=clean["goodput"], clean_loss=clean["eval_loss"])
        if fail:
            heal = [h["heal_s"] for h in fail["heals"] if h["heal_s"] is not None]
            cost = fail["eval_loss"] / clean["eval_loss"] - 1
            ratio = fail["goodput"] / clean["goodput"]
            row.update(goodput=fail["goodput"], kills=fail["kills"],
                       rounds=fail["rounds_committed"], rollbacks=fail["rollbacks"],
                       loss=fail["eval_loss"], loss_cost=cost, measured_ratio=ratio,
                       ratio=ratio if cost <= verdict.QUALITY_BAND else None,
                       heal_s=statistics.median(heal) if heal else None)  # fmt: skip
            if band.get("median"):
                q = verdict.quality([fail["eval_loss"]], band["finals"])
                row["within_band"] = q["within_band"]
        out.append(row)
    return out


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _ratio_cell(r: dict) -> str:
    """The goodput ratio, or why it is withheld: the run under failures ended worse than its
    clean run by more than the study's band, so its "useful" steps were not all useful
    (rounds with a replica down average fewer batches)."""
    if "goodput" not in r:
        return "—"
    if r["ratio"] is not None:
        return f"{r['ratio']:.1%}"
    from experiments.studies import verdict

    cost = verdict.worse_text(r["loss_cost"])
    return f"— ({r['measured_ratio']:.1%}, but ends {cost} worse than clean)"


def side_by_side(results: dict) -> list[str]:
    """jaxcomm's goodput over torchft's per (method, replicas), clean and under failures,
    after each side's inner step alone and with as many copies at once as a run's replicas
    (``results["inner_step"]``: the compute before any exchange or failure)."""
    by = {(r["side"], r["method"], r["replicas"]): r for r in rows(results)}
    pairs = sorted({(m, n) for _, m, n in by if {("jaxcomm", m, n), ("torchft", m, n)} <= set(by)})
    inner = results.get("inner_step") or {}
    if not pairs:
        return []
    out = ["", "jaxcomm's goodput over torchft's (above 1: jaxcomm's is higher):"]
    sides = ("jaxcomm", "torchft")
    counts = sorted(set.intersection(*({k for k in inner.get(s, {}) if k.isdigit()}
                                       for s in sides)), key=int)  # fmt: skip
    if counts and not results["config"].get("step_s"):
        at = {s: " / ".join(f"{1e3 * inner[s][k]['step_s']:.0f}" for k in counts) for s in sides}
        one = inner["jaxcomm"][counts[0]]
        how = " / ".join("alone" if k == "1" else f"{k} at once" for k in counts)
        out[-1] = (
            f"Each side's inner step as its replicas run it (one thread, {one['steps']} steps "
            f"a call on both sides, median of {one['calls']} calls; {how} on the "
            f"{results['config'].get('cores', '?')} cores, nothing else running): jaxcomm "
            f"{at['jaxcomm']} ms, torchft {at['torchft']} ms: the compute before any "
            "exchange or failure. " + out[-1]
        )
    for m, n in pairs:
        j, t = by[("jaxcomm", m, n)], by[("torchft", m, n)]
        fail = (f", under failures {j['goodput'] / t['goodput']:.2f}×"
                if "goodput" in j and "goodput" in t else "")  # fmt: skip
        out.append(f"- {m}, {n} replicas: clean {j['clean_goodput'] / t['clean_goodput']:.2f}×"
                   f"{fail}.")  # fmt: skip
    return out


def report(results: dict) -> str:
    """The markdown table: goodput clean and under failures, its ratio, rounds, heals, losses."""
    from experiments.studies import verdict

    c = results["config"]
    band = results.get("dense_band") or {}
    stream = "delay 0, mix 0" if c.get("streaming") == "no_overlap" else "delay 1, mix 0.5"
    lines = [
        f"Kill a random replica every {c['kill_every']:g} s, restart it {c['restart_after']:g} s "
        f"later (seed {c['failure_seed']}); {c['steps']} inner steps a replica, "
        f"{c['link']}. Goodput: useful inner steps per replica-second "
        "(experiments/bench/goodput_report.py). Streaming DiLoCo (H=10, 2 fragments): "
        f"{stream} on both sides.",
        "",
        "| replicas | side | method | goodput clean | under failures | ratio | kills "
        "| rounds | rollbacks | heal s | loss clean | loss failures |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shared = c.get("cores") and any(r["replicas"] >= c["cores"] for r in rows(results))
    for r in rows(results):
        mark = " ‡" if shared and r["replicas"] >= c["cores"] else ""
        lines.append(
            f"| {r['replicas']}{mark} | {r['side']} | {r['method']} | {r['clean_goodput']:.3f} "
            f"| {_f(r.get('goodput'), '.3f')} | {_ratio_cell(r)} "
            f"| {r.get('kills', '—')} | {r.get('rounds', '—')} | {r.get('rollbacks', '—')} "
            f"| {_f(r.get('heal_s'), '.1f')} | {r['clean_loss']:.4f} "
            f"| {_f(r.get('loss'), '.4f')}{'' if r.get('within_band', True) else ' (worse)'} |"
        )
    lines += ["", f"A ratio is withheld where the run under failures ends more than "
              f"{verdict.QUALITY_BAND:.0%} worse than its own clean run (the steps it counts "
              "as useful include rounds a replica was down, which average fewer batches); "
              "the measured ratio stands beside the loss it cost."]  # fmt: skip
    if shared:
        lines += ["", f"‡ As many replicas as the machine has cores ({c['cores']}): a killed "
                  "replica frees a core, so the survivors' steps run faster while it is down. "
                  "Both sides get this, and it raises their ratios (above 100% where the "
                  "speed-up outweighs the lost steps); a replica on its own machine would not "
                  "see it."]  # fmt: skip
    lines += side_by_side(results)
    if band.get("median"):
        lines += ["", f"Dense's median final (2 processes, {band['seeds']} seeds): "
                  f"{band['median']:.4f}; band: within 2% of it."]  # fmt: skip
    else:
        lines += ["", "The study's dense band: fewer than 3 seeds of dense yet (not judged)."]
    return "\n".join(lines) + "\n"
