"""jaxcomm beside PyTorch DDP and torchft (experiments/studies/lm_peers.py): each
framework's best method on each link under the study's rules, on synthetic curves
with closed-form times (no training runs)."""

import pytest

from experiments.studies import lm_peers, lm_progress, report
from tests.test_verdict import curve, decay, probe

# dense's seeds end at 2.0, 2.1, 2.05: target 2.1 * 1.02, first reached at steps 180, 200,
# 190 (test_verdict); a method with the same curves and a probed step s reaches it at
# 1 + k s seconds (the probe's first call: 10 steps in 10 s + 1)
STEPS = (180, 200, 190)
STEP_10MBIT = {"dense": 2.0, "bf16": 1.0, "torch_ddp": 2.5, "torch_powersgd": 0.4,
               "torchft_streaming": 1.6, "torchft_diloco": 0.5}  # fmt: skip
WORSE = {"torch_powersgd", "torchft_diloco"}  # end 3% above dense's median: no time counts


def study(without=()):
    runs, probes = [], []
    for m, step in STEP_10MBIT.items():
        for seed, f in enumerate((2.0, 2.1, 2.05)):
            final = 2.05 * 1.03 if m in WORSE else f
            runs.append({"n": 2, "method": m, "seed": seed, "curve": curve(decay(final))})
        for rate, s in (("loopback", 0.1), ("100mbit", step / 2), ("10mbit", step)):
            if (m, rate) not in without:
                probes.append(probe(m, s, rate=rate))
    return {"steps": 200, "runs": runs, "probes": probes}


def times(step):
    return sorted(1 + k * step for k in STEPS)  # min, median, max


def test_each_frameworks_best_counts_only_times_within_the_band():
    v = lm_peers.verdicts(study())
    b = lm_peers.best(v, "10mbit")
    assert b["jaxcomm"]["method"] == "bf16"  # faster than dense, same finals
    assert b["PyTorch DDP"]["method"] == "torch_ddp"  # powersgd is faster but ends worse
    assert b["torchft"]["method"] == "torchft_streaming"  # so is torchft's DiLoCo
    lo, med, hi = times(STEP_10MBIT["bf16"])
    cell = b["jaxcomm"]["cell"]
    assert (cell["min"], cell["median"], cell["max"]) == pytest.approx((lo, med, hi))
    ddp = times(STEP_10MBIT["torch_ddp"])[1]
    row = next(x for x in lm_peers.lines(study()) if x.startswith("| 10 Mbit/s |"))
    assert f"| {ddp / med:.2f}× ({ddp / hi:.2f}–{ddp / lo:.2f}) |" in row
    ft = times(STEP_10MBIT["torchft_streaming"])[1]
    assert row.endswith(f"| {ft / med:.2f}× ({ft / hi:.2f}–{ft / lo:.2f}) |")


def test_a_framework_without_a_time_that_counts_is_said_so():
    s = study()
    s["runs"] = [r for r in s["runs"] if r["method"] != "torch_ddp"]
    s["probes"] = [p for p in s["probes"] if p["method"] != "torch_ddp"]
    row = next(x for x in lm_peers.lines(s) if x.startswith("| 10 Mbit/s |"))
    assert "| none counts (fastest: torch_powersgd, faster, but ends worse by 3.0%) |" in row
    assert row.count("| — |") == 1  # no ratio against DDP


def test_only_methods_probed_on_every_link_enter():
    s = study(without={("torch_ddp", "100mbit")})
    assert "torch_ddp" not in lm_peers.verdicts(s)["methods"]
    assert "bf16" in lm_peers.verdicts(s)["methods"]
    no_peer = study(without={(m, "loopback") for m in STEP_10MBIT if m.startswith("torch")})
    assert lm_peers.lines(no_peer) == []
    assert lm_peers.verdicts(study(without={("dense", "10mbit")})) is None
    no_ft = study(without={(m, "10mbit") for m in ("torchft_streaming", "torchft_diloco")})
    row = next(x for x in lm_peers.lines(no_ft) if x.startswith("| 10 Mbit/s |"))
    assert "| none with 3 seeds and every link probed |" in row and row.endswith("| — |")


def test_step_over_each_frameworks_own_floor():
    s = study()
    s["probes"] += [probe("nocomm", 0.05, rate="loopback"),
                    probe("torch_nocomm", 0.08, rate="loopback")]  # fmt: skip
    text = lm_peers.lines(s)
    # dense at 10 Mbit/s: 2000 ms probed, jaxcomm's floor 50 ms: +1950 (40.0x)
    last = lambda m: [x for x in text if x.startswith(f"| {m} |")][-1]  # the floor table's
    assert last("dense").endswith("| 2000: +1950 (40.0×) |")
    # torch_ddp against torch's own floor (80 ms), not jaxcomm's: 2500 - 80
    assert last("torch_ddp").endswith("| 2500: +2420 (31.2×) |")
    pair = next(x for x in text if x.startswith("- dense against torch_ddp"))
    assert pair.endswith("10 Mbit/s 1950 against 2420.")
    assert "jaxcomm's 50 ms" in "\n".join(text) and "PyTorch's 80 ms" in "\n".join(text)
    assert lm_peers.floor_lines(study(), lm_peers.verdicts(study()), 2) == []


def test_floors_are_never_rows_nor_gaps_even_with_seeds_and_every_link():
    s = study()
    for seed in range(3):
        s["runs"].append({"n": 2, "method": "nocomm", "seed": seed, "curve": curve(decay(2.0))})
    s["runs"].append({"n": 2, "method": "torch_nocomm", "seed": 0, "curve": curve(decay(2.0))})
    s["probes"] += [
        probe(f, 0.05, rate=r) for f in ("nocomm", "torch_nocomm") for r in lm_peers.RATES
    ]
    done, missing = report.complete_groups(s)
    assert not {"nocomm", "torch_nocomm"} & set(done[2]) and 2 not in missing
    assert "nocomm" not in report.lm_verdicts(s)[2]["methods"]
    assert not {"nocomm", "torch_nocomm"} & {r["method"] for r in lm_progress.rows(s)}


def test_another_optimizer_is_neither_best_nor_set_against_a_floor_nor_is_a_superseded_method():
    s = study()
    for seed, f in enumerate((2.0, 2.1, 2.05)):  # Muon: its own optimizer's compute
        s["runs"].append({"n": 2, "method": "muon", "seed": seed, "curve": curve(decay(f))})
    s["probes"] += [probe("muon", 0.2, rate=r) for r in lm_peers.RATES]
    s["probes"] += [probe("nocomm", 0.05, rate="loopback"),
                    probe("torch_nocomm", 0.08, rate="loopback")]  # fmt: skip
    v = lm_peers.verdicts(s)
    # Muon is the fastest that counts, but not on the peers' optimizer: not jaxcomm's best
    assert v["methods"]["muon"]["links"]["10mbit"]["speedup"] is not None
    assert lm_peers.best(v, "10mbit")["jaxcomm"]["method"] == "bf16"
    assert "muon" not in lm_peers.over_floor(s, v, 2) and "dense" in lm_peers.over_floor(s, v, 2)
    # a superseded method is never the best either
    s["superseded"] = {"bf16": "ran older code"}
    assert lm_peers.best(lm_peers.verdicts(s), "10mbit")["jaxcomm"]["method"] == "dense"


def test_readme_headline_names_each_frameworks_best_and_the_dense_excess():
    s = study()
    text = lm_peers.headline(s)
    # closed form: 1 + 190 s per second of step (the median seed's 190 steps)
    assert "at 10 Mbit/s jaxcomm's bf16 191 s, DDP's torch_ddp 476 s (2.49×), torchft's " \
           "torchft_streaming 305 s (1.60×)" in text  # fmt: skip
    assert "floor" not in text
    s["probes"] += [probe("nocomm", 0.05, rate="loopback"),
                    probe("torch_nocomm", 0.08, rate="loopback")]  # fmt: skip
    assert "+1950 against +2420 ms" in lm_peers.headline(s)
    no_peer = study(without={(m, "loopback") for m in STEP_10MBIT if m.startswith("torch")})
    assert lm_peers.headline(no_peer) is None


def test_a_peer_ahead_is_explained_by_how_jaxcomm_s_run_of_the_same_method_ends():
    s = study()
    s["probes"] = [
        p for p in s["probes"] if (p["method"], p["rate"]) != ("torchft_streaming", "10mbit")
    ]
    s["probes"].append(probe("torchft_streaming", 0.5))  # ahead of bf16's 1.0 at 10 Mbit/s
    for seed, f in enumerate((2.0, 2.3, 2.05)):  # seed 1 misses the target 2.142
        s["runs"].append({"n": 2, "method": "streaming", "seed": seed, "curve": curve(decay(f))})
    s["probes"] += [probe("streaming", 0.3, rate=r) for r in lm_peers.RATES]
    text = lm_peers.headline(s)
    assert "torchft's torchft_streaming 96.0 s (0.50×)" in text  # 1 + 190 x 0.5 against 191
    assert text.endswith(
        "; torchft_streaming is ahead: jaxcomm's streaming (the same settings) reaches the "
        "target on 2 of 3 seeds, finals 2.0000 / 2.3000 / 2.0500 against 2.0000 / 2.1000 / "
        "2.0500."
    )
    assert "is ahead" not in lm_peers.headline(study())


def test_ddp_without_its_overlap_is_a_row_beside_its_pair_and_never_a_best():
    s = study()
    s["probes"] += [probe("nocomm", 0.05, rate="loopback"),
                    probe("torch_nocomm", 0.08, rate="loopback")]  # fmt: skip
    # DDP's exchange after the backward pass: 2.9 s a step at 10 Mbit/s
    after = (("loopback", 0.12), ("100mbit", 0.3), ("10mbit", 2.9))
    s["probes"] += [probe("torch_after", step, rate=r) for r, step in after]
    text = lm_peers.lines(s)
    row = next(x for x in text if x.startswith("| torch_after |"))
    assert row.endswith("| 2900: +2820 (36.2×) |")  # against torch's floor, 80 ms
    pair = next(x for x in text if x.startswith("- dense against torch_ddp"))
    assert pair.endswith("10 Mbit/s 1950 against 2420 (2820 without overlap).")
    # probed on every link (and 3 seeds, were any ever run), faster than DDP's every hook,
    # yet no time to target, no best, no verdict row, no row of the finals
    for seed, f in enumerate((2.0, 2.1, 2.05)):
        s["runs"].append({"n": 2, "method": "torch_after", "seed": seed, "curve": curve(decay(f))})
    s["probes"] = [p for p in s["probes"] if p["method"] != "torch_after"]
    s["probes"] += [probe("torch_after", 0.01, rate=r) for r in lm_peers.RATES]
    text = lm_peers.lines(s)
    assert "torch_after" not in lm_peers.probed_everywhere(s, 2)
    assert all("torch_after" not in x for x in text if x.startswith("| 10 Mbit/s |"))
    assert "torch_after" not in lm_peers.verdicts(s)["methods"]
    assert "torch_after" not in report.complete_groups(s)[0][2]
    assert "torch_after" not in {r["method"] for r in lm_progress.rows(s)}


def test_a_whole_run_is_set_against_its_estimate_in_the_block_and_the_headline():
    from tests.test_verdict import TOTAL

    s = study()
    # bf16's seed 0 reaches the target at step 180: estimated 1 + 180 x 1.0 s at 10 Mbit/s;
    # its whole run there takes 1.2 s a step: 216 s, 1.19x the estimate (outside 10%)
    steps = [TOTAL * (i + 1) // 20 for i in range(20)]
    whole = curve(decay(2.0), times=[1.2 * k for k in steps])
    s["validation"] = [{"n": 2, "rate": "10mbit", "method": "bf16", "seed": 0, "curve": whole}]
    text = "\n".join(lm_peers.lines(s))
    assert "| bf16 | 10 Mbit/s | 0 | 181 | 216 | 1.19 | no |" in text
    assert "whole runs against their estimates (measured / estimated): bf16 at 10 Mbit/s " \
           "1.19" in lm_peers.headline(s)  # fmt: skip
    assert "whole runs against" not in lm_peers.headline(study())


def test_a_ddp_hook_ahead_is_explained_by_its_steps_step_and_bytes():
    s = study()
    s["probes"] = [p for p in s["probes"] if (p["method"], p["rate"]) != ("torch_ddp", "10mbit")]
    s["probes"] += [probe("torch_ddp", 0.8), probe("torch_after", 0.9),  # ahead of bf16's 1.0
                    probe("nocomm", 0.05, rate="loopback"),
                    probe("torch_nocomm", 0.08, rate="loopback")]  # fmt: skip
    text = lm_peers.headline(s)
    assert "DDP's torch_ddp 153 s (0.80×)" in text  # 1 + 190 x 0.8 against 191
    mb = lm_peers.verdicts(s)["methods"]["bf16"]["mb_per_step"]
    assert text.endswith(
        "; at 10 Mbit/s torch_ddp is ahead: 190 steps to target at 800 ms a step (+720 over "
        "its floor, +820 without DDP's overlap) against bf16's 190 at 1000 ms a step (+950 "
        f"over its floor), {mb:.2f} against {mb:.2f} MB a step."
    )
    assert "torch_ddp is ahead" not in lm_peers.headline(study())
