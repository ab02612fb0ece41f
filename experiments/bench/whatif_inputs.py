"""The what-if's inputs: the models (parameter shapes, compute per step) and the schemes.

Split from :mod:`experiments.bench.whatif` (which runs the step-time model over
link speeds and writes its tables and plots). A :class:`Model` is a published
model's parameter shapes (torchvision / reference layouts) and its compute
time per step on a V100-class GPU, with where that time comes from; a
:class:`Scheme` is a way of exchanging gradients: its analytic wire bytes,
encode cost and the jaxcomm factory that implements it
(:func:`build_transform`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from jaxcomm import methods, netsim

FP32 = 4

# --- models: parameter shapes ---------------------------------------------------


def _conv(out: int, inp: int, k: int, bias: bool = False) -> list[tuple[int, ...]]:
    return [(out, inp, k, k)] + ([(out,)] if bias else [])


def _dense(out: int, inp: int) -> list[tuple[int, ...]]:
    return [(out, inp), (out,)]


def resnet50_body(batchnorm: bool = True) -> list[tuple[int, ...]]:
    """ResNet-50 without the classifier (torchvision layout; BN scale and shift)."""
    bn = (lambda c: [(c,), (c,)]) if batchnorm else (lambda c: [])
    shapes = _conv(64, 3, 7) + bn(64)
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += _conv(planes, inplanes, 1) + bn(planes)
            shapes += _conv(planes, planes, 3) + bn(planes)
            shapes += _conv(4 * planes, planes, 1) + bn(4 * planes)
            if b == 0:
                shapes += _conv(4 * planes, inplanes, 1) + bn(4 * planes)
            inplanes = 4 * planes
    return shapes


def resnet50() -> list[tuple[int, ...]]:
    """ResNet-50 (He et al. 2016): 25.56M parameters."""
    return resnet50_body() + _dense(1000, 2048)


def vgg16() -> list[tuple[int, ...]]:
    """VGG-16 (Simonyan & Zisserman 2015) with its 4096-wide classifier: 138.36M."""
    shapes, inp = [], 3
    for out in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        shapes += _conv(out, inp, 3, bias=True)
        inp = out
    return shapes + _dense(4096, 512 * 7 * 7) + _dense(4096, 4096) + _dense(1000, 4096)


def _transformer_layer(d: int, ff: int, fused_qkv: bool) -> list[tuple[int, ...]]:
    attn = _dense(3 * d, d) if fused_qkv else _dense(d, d) * 3
    return attn + _dense(d, d) + [(d,)] * 4 + _dense(ff, d) + _dense(d, ff)


def bert_large() -> list[tuple[int, ...]]:
    """BERT-Large (Devlin et al. 2019): 24 layers, d=1024, vocab 30522: 335M ("340M")."""
    d = 1024
    shapes = [(30522, d), (512, d), (2, d), (d,), (d,)]
    for _ in range(24):
        shapes += _transformer_layer(d, 4 * d, fused_qkv=False)
    return shapes + _dense(d, d)  # pooler


def gpt2_xl() -> list[tuple[int, ...]]:
    """GPT-2 XL (Radford et al. 2019): 48 layers, d=1600, vocab 50257: 1.56B ("1.5B")."""
    d = 1600
    shapes = [(50257, d), (1024, d)]
    for _ in range(48):
        shapes += _transformer_layer(d, 4 * d, fused_qkv=True)
    return shapes + [(d,), (d,)]


def fasterrcnn() -> list[tuple[int, ...]]:
    """Faster R-CNN R50-FPN (torchvision layout, frozen BN as buffers): 41.7M.

    ResNet-50 body, FPN (1x1 lateral + 3x3 output convs, 256 channels), RPN
    head (3 anchors), two-FC box head (1024) and a 91-class predictor.
    """
    shapes = resnet50_body(batchnorm=False)
    for c in (256, 512, 1024, 2048):
        shapes += _conv(256, c, 1, bias=True) + _conv(256, 256, 3, bias=True)
    shapes += _conv(256, 256, 3, bias=True) + _conv(3, 256, 1, bias=True)
    shapes += _conv(12, 256, 1, bias=True)
    shapes += _dense(1024, 256 * 7 * 7) + _dense(1024, 1024)
    return shapes + _dense(91, 1024) + _dense(91 * 4, 1024)


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of the what-if: its parameter shapes and compute time per step."""

    label: str
    shapes: Callable[[], list[tuple[int, ...]]]
    compute_s: float  # forward + backward on one GPU, seconds
    basis: str  # where compute_s comes from


# T_c estimates: 3 × forward FLOPs × batch / (peak × utilisation), V100-class.
MODELS = {
    "resnet50": Model(
        "ResNet-50", resnet50, 0.100,
        "V100 fp32, batch 32/GPU: 3 x 8.2 GFLOP x 32 / (15.7 TFLOP/s x 50%)",
    ),
    "vgg16": Model(
        "VGG-16", vgg16, 0.379,
        "V100 fp32, batch 32/GPU: 3 x 31 GFLOP x 32 / (15.7 TFLOP/s x 50%)",
    ),
    "bert_large": Model(
        "BERT-Large", bert_large, 0.223,
        "V100 fp16, seq 128, batch 32/GPU: 6 x 340M x 4096 tokens / (125 TFLOP/s x 30%)",
    ),
    "gpt2_xl": Model(
        "GPT-2 1.5B", gpt2_xl, 2.04,
        "V100 fp16, seq 1024, batch 8/GPU: 6 x 1.56B x 8192 tokens / (125 TFLOP/s x 30%)",
    ),
    "fasterrcnn": Model(
        "FasterRCNN", fasterrcnn, 0.210,
        "Detectron2 model zoo, R50-FPN 1x: 0.210 s/iter on 8 V100, 2 images/GPU",
    ),
}  # fmt: skip

# --- compressors: analytic wire bytes -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A way of exchanging gradients: analytic wire bytes and its jaxcomm factory.

    ``payload(d, shapes)`` is the bytes one worker contributes per step (an
    all-reduce's S or an all-gather's piece); ``encode_passes`` the encode
    cost in passes over the fp32 gradient (device-memory bound).
    """

    label: str
    kind: str
    payload: Callable[[int, list[tuple[int, ...]]], float]
    encode_passes: float
    rounds: int = 1
    factory: str | None = None
    factory_kwargs: dict = dataclasses.field(default_factory=dict)


def _sparse(ratio: float) -> Callable[[int, list], float]:
    return lambda d, shapes: math.ceil(ratio * d) * (4 + 4)  # fp32 value + int32 index


def _bits(bits: float, per: int = 0) -> Callable[[int, list], float]:
    # bit-packed codes plus one fp32 scale per `per` entries (0: one per leaf)
    return lambda d, shapes: (
        d * bits / 8 + 4 * (math.ceil(d / per) if per else len(shapes))
    )  # fmt: skip


def _powersgd(rank: int) -> Callable[[int, list], float]:
    return lambda d, shapes: sum(netsim.powersgd_bytes(shapes, rank))


# Wire formats: QSGD s=4 sends 3 level bits + 1 sign bit per entry and a norm per
# 512; TernGrad and majority vote sum int8 codes; int8 with per-bucket scales
# is all-gathered (an int8 sum would overflow); sign / 2-bit codes are bit-packed.
# encode_passes: top-k ~12 (exact lax.top_k), sampled threshold ~1 plus error
# feedback, DGC adds momentum correction and masking.
SCHEMES = [
    Scheme("dense fp32", "all_reduce", lambda d, s: FP32 * d, 0, factory="allreduce"),
    Scheme("bf16", "all_reduce", lambda d, s: 2 * d, 1, factory="cast"),
    Scheme("int8 (all-gather)", "all_gather", _bits(8, 512), 2, factory="int8"),
    Scheme("QSGD s=4", "all_gather", _bits(4, 512), 3, factory="qsgd",
           factory_kwargs={"levels": 4}),
    Scheme("TernGrad", "all_reduce", lambda d, s: d, 3, factory="terngrad"),
    Scheme("signSGD MV", "all_reduce", lambda d, s: d, 1, factory="sign_majority"),
    Scheme("EF-sign / 1-bit", "all_gather", _bits(1), 4, factory="ef_sign"),
    Scheme("2-bit", "all_gather", _bits(2), 3, factory="twobit"),
    Scheme("top-k 1%", "all_gather", _sparse(0.01), 12, factory="topk",
           factory_kwargs={"ratio": 0.01}),
    Scheme("top-k 0.1%", "all_gather", _sparse(0.001), 12, factory="topk",
           factory_kwargs={"ratio": 0.001}),
    Scheme("random-k 1% shared", "all_reduce", lambda d, s: FP32 * math.ceil(0.01 * d), 2,
           factory="randomk", factory_kwargs={"ratio": 0.01, "shared_indices": True}),
    Scheme("threshold 0.1%", "all_gather", _sparse(0.001), 3, factory="threshold",
           factory_kwargs={"ratio": 0.001}),
    Scheme("DGC 0.1%", "all_gather", _sparse(0.001), 5, factory="dgc",
           factory_kwargs={"ratio": 0.001}),
    Scheme("PowerSGD r=4", "all_reduce", _powersgd(4), 4, rounds=2, factory="powersgd",
           factory_kwargs={"rank": 4}),
]  # fmt: skip


def build_transform(scheme: Scheme) -> Any:
    """``jaxcomm.methods.make(scheme.factory, **scheme.factory_kwargs)`` over axis ``"data"``.

    A scheme whose factory is not a method of :mod:`jaxcomm.methods`, or whose
    keywords it does not take, raises here (naming the scheme) rather than drop
    out of the tables.
    """
    try:
        return methods.make(scheme.factory or "", **scheme.factory_kwargs, axis_name="data")
    except (TypeError, ValueError) as e:
        raise ValueError(f"whatif scheme {scheme.label!r}: {e}") from None
