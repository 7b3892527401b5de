"""Threefry-2x32 keys whose draws XLA:CPU compiles into a few fused kernels.

`fast(key)` wraps a raw `uint32[..., 2]` key (`jax.random.PRNGKey`) as a typed
key of the same Threefry-2x32 generator, written out round by round in
`jax.numpy`. Every `jax.random` function (split, fold_in, bits, uniform,
normal, gumbel, permutation, ...) then draws exactly the bits it draws from
the raw key (tests check it): jax's own `threefry_partitionable` scheme, jax's
default. Only the compiled program differs (so a float made from those bits
may round differently in its last bit where XLA fuses its arithmetic
differently). On CPU jax lowers
Threefry as a rolled loop of five iterations, a dozen small kernels a draw;
here a draw is one elementwise kernel that fuses with what uses it. On GPU and
TPU jax already unrolls it: nothing changes there but a larger graph.

Used where a program draws much randomness per step: a rollout's action noise
and environment draws, a minibatch shuffle, evolution strategies' noise.
`raw(key)` turns a typed key back into the raw data that checkpoints hold.
"""

from __future__ import annotations

import math

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x, distance: int):
    return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 block cipher (Salmon et al. 2011), 20 rounds: `(y1, y2)`.

    `k1, k2` are the key words (broadcast against the counters `x1, x2`), all uint32.
    """
    keys = (k1, k2, k1 ^ k2 ^ _PARITY)
    x1, x2 = x1 + keys[0], x2 + keys[1]
    for i in range(5):
        for rotation in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ _rotate_left(x2, rotation)
        x1 = x1 + keys[(i + 1) % 3]
        x2 = x2 + keys[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def _pair(y1, y2):
    # [..., 2] with a select: XLA:CPU emits a concatenate inside a fused kernel as a
    # branch per element, which keeps it from vectorising and recomputes the cipher.
    lane = lax.broadcasted_iota(jnp.uint32, y1.shape + (2,), y1.ndim)
    return jnp.where(lane == 0, y1[..., None], y2[..., None])


def _counters(shape):
    """(high, low) words of the row-major index of every element of `shape`."""
    size = math.prod(shape)
    if size >= 2**32:
        raise NotImplementedError(f"a draw of {size} values (2**32 or more)")
    low = lax.iota(jnp.uint32, size).reshape(shape)
    return jnp.zeros(shape, jnp.uint32), low


def _seed(seed):
    seed = jnp.asarray(seed)
    if seed.dtype.itemsize == 8:
        high = lax.convert_element_type(lax.shift_right_logical(seed, lax._const(seed, 32)), jnp.uint32)
    else:
        high = jnp.zeros((), jnp.uint32)
    low = lax.convert_element_type(seed, jnp.uint32) if seed.dtype.itemsize <= 4 else \
        lax.convert_element_type(seed & lax._const(seed, 0xFFFFFFFF), jnp.uint32)
    return jnp.stack([high, low])


def _split(key, shape):
    high, low = _counters(shape)
    return _pair(*threefry2x32(key[0], key[1], high, low))


def _fold_in(key, data):
    data = jnp.asarray(data, jnp.uint32)
    return _pair(*threefry2x32(key[0], key[1], jnp.zeros_like(data), data))


def _random_bits(key, bit_width, shape):
    high, low = _counters(shape)
    y1, y2 = threefry2x32(key[0], key[1], high, low)
    if bit_width == 64:
        return (y1.astype(jnp.uint64) << np.uint64(32)) | y2.astype(jnp.uint64)
    bits = y1 ^ y2
    return bits if bit_width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])


THREEFRY_FUSED = jex_random.define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in,
    name="threefry2x32_fused", tag="fry_fused")


def fast(key: jax.Array) -> jax.Array:
    """Raw Threefry key data `uint32[..., 2]` -> a typed key drawing the same numbers, faster on CPU."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key, impl=THREEFRY_FUSED)


def raw(tree):
    """Every typed key in `tree` as its raw `uint32[..., 2]` data; other leaves unchanged."""
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
