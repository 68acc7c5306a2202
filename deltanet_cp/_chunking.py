"""Splitting the time axis into chunks and back, shared by every recurrence."""

import jax.numpy as jnp
from jaxtyping import Array, Shaped


def num_chunks(length: int, chunk_size: int) -> int:
    """The number of chunks of `chunk_size` needed to cover `length` tokens (at least one)."""
    return max(1, -(-length // chunk_size))


def to_chunks(x: Shaped[Array, "batch heads seq *rest"], chunk_size: int) -> Array:
    """Zero-pad the time axis (axis 2) to a multiple of `chunk_size` and split it.

    Zero padding is the identity for every recurrence here: padded tokens carry a zero log
    decay, zero keys, values and queries, and zero `beta`.

    **Returns:**

    An array of shape `(batch, heads, n_chunks, chunk_size, *rest)`.
    """
    b, h, t, *rest = x.shape
    n = num_chunks(t, chunk_size)
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, n * chunk_size - t)
    return jnp.pad(x, pad).reshape(b, h, n, chunk_size, *rest)


def from_chunks(x: Shaped[Array, "batch heads n c *rest"], length: int) -> Array:
    """Inverse of `to_chunks`: merge the chunk axes and strip the padding past `length`."""
    b, h, n, c, *rest = x.shape
    return x.reshape(b, h, n * c, *rest)[:, :, :length]


def to_chunk_major(
    x: Shaped[Array, "batch seq *rest"], chunk_size: int, features: int = 1
) -> Array:
    """Zero-pad the time axis (axis 1) to a multiple of `chunk_size` and split it, chunk first.

    `x` has layout `(batch, seq, *heads, *features)` with `features` trailing feature axes
    (`(B, T, H, K)` for keys, `(B, T, H)` for gates with `features=0`). The chunk index goes
    first and the position inside the chunk just before the features, so a scan over chunks
    reads contiguous slices and the per-chunk products are plain batched matmuls.

    **Returns:**

    An array of shape `(n_chunks, batch, *heads, chunk_size, *features)`.
    """
    b, t, *rest = x.shape
    n = num_chunks(t, chunk_size)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n * chunk_size - t)
    x = jnp.pad(x, pad).reshape(b, n, chunk_size, *rest)
    heads = len(rest) - features
    perm = (1, 0, *range(3, 3 + heads), 2, *range(3 + heads, x.ndim))
    return x.transpose(perm)


def from_chunk_major(x: Shaped[Array, "n batch *rest"], length: int, features: int = 1) -> Array:
    """Inverse of `to_chunk_major`: back to `(batch, seq, *heads, *features)`, padding cut."""
    n, b, *rest = x.shape
    heads = len(rest) - 1 - features
    c = rest[heads]
    perm = (1, 0, 2 + heads, *range(2, 2 + heads), *range(3 + heads, x.ndim))
    x = x.transpose(perm)
    return x.reshape(b, n * c, *x.shape[3:])[:, :length]
