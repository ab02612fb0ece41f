"""Bit packing: k-bit unsigned codes into uint8 / uint16 / uint32 words, and back.

Pure ``jnp`` with static shapes, so packed payloads are real arrays that go
through the collectives (an all-gather of ``uint32`` words moves 4 bytes per
word, not 4 bytes per code). Codes are packed along the last axis; leading
axes (e.g. the worker axis of an all-gathered payload) are batch axes.

Layout (little-endian in bits): code ``i`` occupies bits ``[i·k, (i+1)·k)`` of
the stream, and bit ``j`` of the stream is bit ``j mod W`` of word ``j // W``
(W = 8, 16 or 32). Two modes:

* ``aligned=False`` (default, a dense bit stream): ``ceil(n·k / W)`` words; a
  code may straddle two words when ``k`` does not divide ``W``
  (e.g. QSGD's 6-bit codes: 16 codes in 3 uint32 words).
* ``aligned=True``: ``⌊W/k⌋`` codes per word, none straddling:
  ``ceil(n / ⌊W/k⌋)`` words. Needed when the *words* are summed by an
  all-reduce: each k-bit field then adds up on its own, as long as the sum of
  a field over the workers stays below ``2**k`` (no carry into the next field).

When ``k`` divides ``W`` both modes are the same.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import checks

__all__ = ["pack", "unpack", "packed_size", "word_bits", "field_bits"]

_WORDS = {"uint8": 8, "uint16": 16, "uint32": 32}


def word_bits(dtype: Any) -> int:
    """Bits per word of ``dtype`` (uint8, uint16 or uint32); TypeError otherwise."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _WORDS:
        raise TypeError(f"dtype: expected one of {sorted(_WORDS)} for packed words, got {name}")
    return _WORDS[name]


def _check_bits(bits: Any) -> int:
    return checks.check_int(bits, "bits", 1, 32)


def _dense(bits: int, w: int, aligned: bool) -> bool:
    """Whether codes are laid out ``w // bits`` per word (no straddling)."""
    return aligned or w % bits == 0


def packed_size(n: int, bits: int, *, dtype: Any = jnp.uint32, aligned: bool = False) -> int:
    """Number of words that :func:`pack` makes of ``n`` codes of ``bits`` bits."""
    bits, w = _check_bits(bits), word_bits(dtype)
    if bits > w:
        raise ValueError(f"bits: {bits}-bit codes do not fit {w}-bit words; use a wider dtype")
    if _dense(bits, w, aligned):
        return math.ceil(n / (w // bits))
    return math.ceil(n * bits / w)


def field_bits(max_value: int) -> int:
    """Smallest field width (bits) that holds every integer in ``[0, max_value]``."""
    return max(1, int(max_value).bit_length())


def _pad_last(x: jax.Array, size: int) -> jax.Array:
    extra = size - x.shape[-1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def pack(
    codes: jax.Array, bits: int, *, dtype: Any = jnp.uint32, aligned: bool = False
) -> jax.Array:
    """Pack unsigned ``bits``-bit codes (last axis) into words of ``dtype``.

    Args:
      codes: integer or bool array ``(..., n)``; a 0-d array is taken as one
        code. Only the low ``bits`` bits of each code are kept.
      bits: code width, 1..32 (at most the word width).
      dtype: word dtype: ``jnp.uint8``, ``jnp.uint16`` or ``jnp.uint32``.
      aligned: never let a code straddle two words (see the module docstring).

    Returns:
      Words of shape ``(..., packed_size(n, bits, dtype=dtype, aligned=aligned))``.

    Example:
      >>> w = pack(jnp.array([1, 0, 1, 1]), 1, dtype=jnp.uint8)   # [0b1101] = [13]
      >>> unpack(w, 1, 4)
      Array([1, 0, 1, 1], dtype=uint32)
    """
    bits, w = _check_bits(bits), word_bits(dtype)
    codes = jnp.asarray(codes)
    if codes.ndim == 0:
        codes = codes.reshape(1)
    lead, n = codes.shape[:-1], codes.shape[-1]
    nw = packed_size(n, bits, dtype=dtype, aligned=aligned)
    mask = np.uint32((1 << bits) - 1) if bits < 32 else np.uint32(0xFFFFFFFF)
    c = codes.astype(jnp.uint32) & mask
    if _dense(bits, w, aligned):
        per = w // bits
        c = _pad_last(c, nw * per).reshape(lead + (nw, per))
        shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
        # The shifted codes occupy disjoint bits: their sum is their bitwise or.
        words = jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32)
        return words.astype(dtype)
    # Dense stream: a chunk of `per_chunk` codes fills exactly `words_per_chunk` words.
    g = math.gcd(bits, w)
    per_chunk, words_per_chunk = w // g, bits // g
    m = math.ceil(n / per_chunk)
    c = _pad_last(c, m * per_chunk).reshape(lead + (m, per_chunk))
    start = np.arange(per_chunk) * bits  # first bit of each code in the chunk
    out = []
    for j in range(words_per_chunk):
        lo, hi = j * w, (j + 1) * w
        inside = np.nonzero((start >= lo) & (start < hi))[0]  # codes starting in word j
        shifts = (start[inside] - lo).astype(np.uint32)
        word = jnp.sum(c[..., inside[0] : inside[-1] + 1] << shifts, axis=-1, dtype=jnp.uint32)
        prev = np.nonzero((start < lo) & (start + bits > lo))[0]  # a code straddling in
        if prev.size:
            i = int(prev[0])
            word = word | (c[..., i] >> np.uint32(lo - start[i]))
        if w < 32:
            word = word & np.uint32((1 << w) - 1)  # drop the straddler's spill
        out.append(word)
    words = jnp.stack(out, axis=-1).reshape(lead + (m * words_per_chunk,))
    return words[..., :nw].astype(dtype)


def unpack(words: jax.Array, bits: int, n: int, *, aligned: bool = False) -> jax.Array:
    """Inverse of :func:`pack`: the first ``n`` codes (last axis), as ``uint32``.

    Args:
      words: ``uint8``/``uint16``/``uint32`` array ``(..., nw)`` made by
        :func:`pack` (or a sum of such arrays, for ``aligned`` fields).
      bits: code width used to pack.
      n: number of codes to return (static).
      aligned: the mode used to pack.

    Returns:
      ``uint32`` array ``(..., n)``.
    """
    bits = _check_bits(bits)
    words = jnp.asarray(words)
    w = word_bits(words.dtype)
    lead = words.shape[:-1]
    nw = packed_size(n, bits, dtype=words.dtype, aligned=aligned)
    if words.shape[-1] != nw:
        raise ValueError(
            f"words: expected {nw} words of {w} bits for {n} codes of {bits} bits, "
            f"got {words.shape[-1]}"
        )
    mask = np.uint32((1 << bits) - 1) if bits < 32 else np.uint32(0xFFFFFFFF)
    x = words.astype(jnp.uint32)
    if _dense(bits, w, aligned):
        per = w // bits
        shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
        c = (x[..., :, None] >> shifts) & mask
        return c.reshape(lead + (nw * per,))[..., :n]
    g = math.gcd(bits, w)
    per_chunk, words_per_chunk = w // g, bits // g
    m = math.ceil(n / per_chunk)
    x = _pad_last(x, m * words_per_chunk).reshape(lead + (m, words_per_chunk))
    cols = []
    for i in range(per_chunk):  # static slices (a gather with an index array is slower)
        j, offset = divmod(i * bits, w)
        c = x[..., j] >> np.uint32(offset)
        if offset + bits > w:  # the code continues in the next word
            c = c | (x[..., j + 1] << np.uint32(w - offset))
        cols.append(c & mask)
    return jnp.stack(cols, axis=-1).reshape(lead + (m * per_chunk,))[..., :n]
