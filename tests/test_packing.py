"""Bit packing against a plain-NumPy bit-stream reference; random shapes, edge sizes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compressors import packing

# One compiled program per case (instead of one dispatch per op): faster on CPU.
pack = jax.jit(packing.pack, static_argnames=("bits", "dtype", "aligned"))
unpack = jax.jit(packing.unpack, static_argnames=("bits", "n", "aligned"))

WORD_BITS = {jnp.uint8: 8, jnp.uint16: 16, jnp.uint32: 32}


def np_pack(codes: np.ndarray, bits: int, w: int, aligned: bool) -> np.ndarray:
    """Reference: lay every code's bits out one by one, then read words off the stream."""
    codes = np.asarray(codes, np.uint64).reshape(-1)
    if aligned or w % bits == 0:
        per = w // bits
        nw = math.ceil(codes.size / per)
        words = np.zeros(nw, np.uint64)
        for i, c in enumerate(codes):
            words[i // per] |= (int(c) & ((1 << bits) - 1)) << (bits * (i % per))
        return words
    stream = [(int(c) >> b) & 1 for c in codes for b in range(bits)]
    nw = math.ceil(len(stream) / w)
    stream += [0] * (nw * w - len(stream))
    return np.array(
        [sum(stream[k * w + j] << j for j in range(w)) for k in range(nw)], np.uint64
    ).reshape(nw)


def random_cases(seed: int, count: int):
    """Random (bits, word dtype, aligned, shape) cases, sizes around multiples of 8/16/32."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 100, 257]
    cases = []
    for _ in range(count):
        dtype = [jnp.uint8, jnp.uint16, jnp.uint32][rng.integers(3)]
        bits = int(rng.integers(1, WORD_BITS[dtype] + 1))
        lead = [(), (3,), (2, 2)][rng.integers(3)]
        cases.append((bits, dtype, bool(rng.integers(2)), lead + (int(rng.choice(sizes)),)))
    return cases


@pytest.mark.parametrize("bits, dtype, aligned, shape", random_cases(0, 30))
def test_pack_matches_numpy_stream_and_round_trips(bits, dtype, aligned, shape):
    rng = np.random.default_rng(bits * 1000 + shape[-1])
    codes = rng.integers(0, 2**bits, size=shape, dtype=np.uint64).astype(np.uint32)
    w = WORD_BITS[dtype]
    words = pack(jnp.asarray(codes), bits=bits, dtype=dtype, aligned=aligned)
    n = shape[-1]
    assert words.dtype == dtype
    nw = packing.packed_size(n, bits, dtype=dtype, aligned=aligned)
    assert words.shape == shape[:-1] + (nw,)
    rows = math.prod(shape[:-1])
    flat_codes = codes.reshape(rows, n)
    flat_words = np.asarray(words, np.uint64).reshape(rows, words.shape[-1])
    for c, wd in zip(flat_codes, flat_words):
        np.testing.assert_array_equal(wd, np_pack(c, bits, w, aligned))
    back = unpack(words, bits=bits, n=n, aligned=aligned)
    assert back.dtype == jnp.uint32 and back.shape == shape
    np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 6, 13, 31])
@pytest.mark.parametrize("n", [0, 33, 1000])
def test_uint32_stream_uses_ceil_n_bits_over_32_words(bits, n):
    codes = (np.arange(n, dtype=np.uint64) * 2654435761 % (2**bits)).astype(np.uint32)
    words = pack(codes, bits=bits)
    assert words.shape == (math.ceil(n * bits / 32),)
    np.testing.assert_array_equal(np.asarray(unpack(words, bits=bits, n=n)), codes)


def test_known_layout():
    # little-endian bits: code i at bits [i*k, (i+1)*k)
    np.testing.assert_array_equal(packing.pack(jnp.array([1, 0, 1, 1]), 1, dtype=jnp.uint8), [13])
    np.testing.assert_array_equal(packing.pack(jnp.array([1, 2, 3]), 2, dtype=jnp.uint8), [57])
    # 3-bit codes straddle bytes: 0b111 at bits 6..8
    np.testing.assert_array_equal(
        packing.pack(jnp.array([0, 0, 7]), 3, dtype=jnp.uint8), [0b11000000, 0b1]
    )
    # aligned: 2 codes per byte, the third starts the next word
    np.testing.assert_array_equal(
        packing.pack(jnp.array([0, 0, 7]), 3, dtype=jnp.uint8, aligned=True), [0, 7]
    )


def test_scalar_and_empty_codes():
    w = packing.pack(jnp.asarray(5, jnp.int32), 3)
    assert w.shape == (1,)
    np.testing.assert_array_equal(packing.unpack(w, 3, 1), [5])
    e = packing.pack(jnp.zeros((0,), jnp.uint32), 6)
    assert e.shape == (0,) and e.dtype == jnp.uint32
    assert packing.unpack(e, 6, 0).shape == (0,)


def test_bool_codes_and_high_bits_are_masked():
    signs = jnp.array([True, False, True] * 11)
    np.testing.assert_array_equal(packing.unpack(packing.pack(signs, 1), 1, 33), signs)
    # a code wider than `bits` must not corrupt its neighbours
    w = packing.pack(jnp.array([0xFF, 0, 0xFF], jnp.uint32), 2)
    np.testing.assert_array_equal(packing.unpack(w, 2, 3), [3, 0, 3])


@pytest.mark.parametrize("n_workers", [1, 8, 15, 16, 127, 300])
def test_aligned_fields_sum_without_carry(n_workers):
    """The psum property: a sum of packed words unpacks to the sum of the codes."""
    bits = packing.field_bits(2 * n_workers)
    rng = np.random.default_rng(n_workers)
    codes = rng.integers(0, 3, size=(n_workers, 77)).astype(np.uint32)
    codes[:, :5] = 2  # the extreme: every worker at the maximum
    words = packing.pack(jnp.asarray(codes), bits, aligned=True)
    total = jnp.sum(words, axis=0, dtype=jnp.uint32)  # what an all-reduce computes
    np.testing.assert_array_equal(
        np.asarray(packing.unpack(total, bits, 77, aligned=True)), codes.sum(0)
    )
    # one bit narrower would overflow (the width is the smallest that works)
    if bits > 1:
        narrow = packing.pack(jnp.asarray(codes), bits - 1, aligned=True)
        got = packing.unpack(jnp.sum(narrow, axis=0, dtype=jnp.uint32), bits - 1, 77, aligned=True)
        assert not np.array_equal(np.asarray(got), codes.sum(0))


def test_field_bits():
    values = (0, 1, 2, 3, 4, 16, 254, 255, 256)
    assert [packing.field_bits(v) for v in values] == [1, 1, 2, 2, 3, 5, 8, 8, 9]


def test_pack_is_jittable_with_static_shapes():
    f = jax.jit(lambda c: packing.unpack(packing.pack(c, 6), 6, 50))
    c = jnp.arange(50, dtype=jnp.uint32) % 64
    np.testing.assert_array_equal(f(c), c)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"bits: expected an int in \[1, 32\]"):
        packing.pack(jnp.zeros(4), 0)
    with pytest.raises(ValueError, match="bits"):
        packing.pack(jnp.zeros(4), 33)
    with pytest.raises(TypeError, match="bits"):
        packing.pack(jnp.zeros(4), 2.0)
    with pytest.raises(ValueError, match="bits: 9-bit codes do not fit 8-bit words"):
        packing.pack(jnp.zeros(4), 9, dtype=jnp.uint8)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        packing.pack(jnp.zeros(4), 2, dtype=jnp.int32)
    with pytest.raises(ValueError, match="words: expected 1 words"):
        packing.unpack(jnp.zeros((2,), jnp.uint32), 1, 10)
