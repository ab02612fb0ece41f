"""The LM study's methods: their names, what each runs, and the facts the tables need.

A method is a variant of :mod:`experiments.configs.lm_shakespeare` (the JAX
harness) or one of :data:`TORCH` (the PyTorch twin,
:mod:`experiments.bench.torch_lm_train`): DDP with a communication hook, or
torchft's DiLoCo / Streaming DiLoCo, whose hook ``ft_<variant>`` runs the
schedule of the study's ``<variant>`` (:func:`variant`), or a Streaming DiLoCo
variant with its exchanges overlapped (:data:`OVERLAP`).
"""

from __future__ import annotations

from experiments.configs import common, lm_shakespeare

#: What a PyTorch user would run instead, on the same model, data, AdamW and schedule:
#: method -> ``torch_lm_train --hook``.
TORCH = {"torch_ddp": "none", "torch_fp16": "fp16", "torch_powersgd": "powersgd",
         "torchft_diloco": "ft_diloco", "torchft_streaming": "ft_streaming",
         "torch_nocomm": "nocomm", "torch_after": "after",
         "torch_after_fp16": "after_fp16"}  # fmt: skip
#: Each framework's compute floor: the same step with nothing exchanged, each worker its
#: own copy (probed only, never judged: its losses are one worker's). method -> framework.
FLOORS = {"nocomm": "jaxcomm", "torch_nocomm": "PyTorch"}
#: DDP's exchange without DDP's overlap: one all-reduce of the flat gradient after the
#: backward pass, fp32 / fp16, as jaxcomm's harness exchanges (a diagnostic of the step
#: over the floor, probed on every link, never judged): method -> the DDP method it mirrors.
UNOVERLAPPED = {"torch_after": "torch_ddp", "torch_after_fp16": "torch_fp16"}
#: Probed only, with no trajectories and no row in the verdict.
PROBE_ONLY = (*FLOORS, *UNOVERLAPPED)
#: Streaming DiLoCo as users run it, its exchanges overlapped with the inner steps
#: (:mod:`experiments.bench.overlap_lm_train`): method -> the variant it runs.
OVERLAP = {"streaming_overlap": "streaming", "streaming_int8_overlap": "streaming_int8",
           "streaming_q4_overlap": "streaming_q4"}  # fmt: skip
METHODS = ["dense", "bf16", "powersgd", "topk", "threshold", "ef_sign", "int8_2p", "diloco",
           "streaming", "streaming_int8", "streaming_q4", "sparseloco", "muloco", "muon", "demo",
           "demo_full", *OVERLAP, *(m for m in TORCH if m not in PROBE_ONLY)]  # fmt: skip
#: Variants tried and left out of the grid (their runs stay in the JSON, shown apart from
#: the table): method -> why. ``diloco_h1`` was DiLoCo's counterpart until it was seen not
#: to train: Nesterov momentum 0.9 on top of every AdamW step plateaus (seed 0 ended at
#: 2.5040 at outer rate 0.1, dense's median 1.7251; rate 0.3 was no better at step 400).
#: The counterpart DiLoCo's paper uses, and the study's, is dense: outer SGD at rate 1
#: without momentum after every inner step is exactly the inner AdamW.
TRIED = {
    "diloco_h1": "AdamW, Nesterov outer every step (momentum 0.9, outer rate 0.1): "
    "tried as DiLoCo's counterpart; plateaus, so dense is the counterpart"
}

#: What each method's update is, beside the shared AdamW + warm-up/cosine.
OPTIMIZER = {
    "diloco": "AdamW inner, Nesterov outer (H=10)",
    "streaming": "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments)",
    "streaming_int8": "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments)",
    "streaming_q4": "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments)",
    "sparseloco": "AdamW inner, outer step 1 on top-k + 2-bit codes with EF (H=10)",
    "muloco": "Muon inner (AdamW's RMS, schedule, decay), Nesterov outer (H=10)",
    "demo": "DeMo: sign of the decoded top-k DCT momentum (its own optimizer)",
    "demo_full": "DeMo's optimizer, every DCT coefficient kept (no compression)",
    "muon": "Muon (AdamW's RMS, schedule, decay), every step",
    **{
        m: "AdamW inner, Nesterov outer per fragment (H=10, 2 fragments), exchange overlapped"
        for m in OVERLAP
    },
    "torchft_diloco": "torchft DiLoCo: AdamW inner, Nesterov outer (H=10)",
    "torchft_streaming": "torchft Streaming DiLoCo: AdamW inner, Nesterov outer per fragment",
}
#: Methods that are optimizers or outer loops: their own dense baseline. The DiLoCo family's
#: is dense itself, the same AdamW every step (its paper's baseline; see :data:`TRIED`).
COUNTERPART: dict[str, str] = {
    "muloco": "muon",  # dense Muon
    "demo": "demo_full",  # DeMo's optimizer without its compression
    **{m: "dense" for m in ("diloco", "streaming", "streaming_int8", "streaming_q4",
                            "sparseloco", "torchft_diloco", "torchft_streaming", *OVERLAP)},
}  # fmt: skip


def variant(method: str) -> str:
    """The config variant whose schedule ``method`` runs (DDP's: ``dense``; an overlapped
    Streaming DiLoCo's: its in-step variant)."""
    if method in OVERLAP:
        return OVERLAP[method]
    hook = TORCH.get(method)
    if hook is None:
        return method
    return hook.removeprefix("ft_") if hook.startswith("ft_") else "dense"


def sync_period(method: str) -> int:
    """Inner steps between a method's rounds (1 for every-step methods)."""
    return common.comm_every(lm_shakespeare.get_config(variant(method)))


def peak_factor(method: str) -> float:
    """Peak bytes of one step / mean bytes per step.

    Methods that sync every ``H`` steps send everything at once (``H``); Streaming
    DiLoCo sends one of ``P`` fragments ``P`` times per ``H`` steps (``H / P``).
    """
    if variant(method) not in lm_shakespeare.VARIANTS:
        return 1.0  # a method of an older study
    c = lm_shakespeare.get_config(variant(method))
    return sync_period(method) / (c.wrapper.get("fragments", 1) if c.wrapper.name != "none" else 1)


def tried_lines(results: dict, n: int) -> list[str]:
    """Markdown lines naming each variant tried and left out of the grid
    (:data:`TRIED`) that ran on ``n`` processes: why,
    and its finals by seed."""
    by: dict[str, dict[int, float]] = {}
    for r in results["runs"]:
        if r.get("n", 2) == n and r["method"] in TRIED and r.get("curve"):
            by.setdefault(r["method"], {})[r["seed"]] = r["curve"][-1]["eval_loss"]
    lines = []
    for m, why in TRIED.items():
        if m in by:
            ends = " / ".join(f"{by[m][s]:.4f}" for s in sorted(by[m]))
            seeds = ", ".join(map(str, sorted(by[m])))
            lines += ["", f"Tried and left out of the grid: {m} ({why}), final {ends} "
                      f"(seed{'s' if len(by[m]) > 1 else ''} {seeds})."]  # fmt: skip
    return lines


def floor_of(method: str) -> str:
    """The compute floor (:data:`FLOORS`) of ``method``'s framework."""
    return "torch_nocomm" if method in TORCH else "nocomm"
