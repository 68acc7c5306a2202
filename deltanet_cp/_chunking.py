"""Splitting the time axis into chunks and back."""

import jax.numpy as jnp
from jaxtyping import Array, Shaped


def num_chunks(length: int, chunk_size: int) -> int:
    """The number of chunks of `chunk_size` needed to cover `length` tokens (at least one)."""
    return max(1, -(-length // chunk_size))


def split_chunks(x: Shaped[Array, "batch seq *rest"], n: int, chunk_size: int) -> Array:
    """Zero-pad the time axis (axis 1) to `n * chunk_size` and split it: `(B, n, C, *rest)`.

    Zero padding must be the identity step of a recurrence: padded tokens carry a zero log
    decay, zero keys, values and queries, and zero `beta`.
    """
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n * chunk_size - x.shape[1])
    return jnp.pad(x, pad).reshape(x.shape[0], n, chunk_size, *x.shape[2:])


def chunk_major(x: Shaped[Array, "batch n c *rest"], features: int = 1) -> Array:
    """`(B, N, C, *heads, *features)` -> `(N, B, *heads, C, *features)`.

    With `features` trailing feature axes (`(B, N, C, H, K)` for keys, `(B, N, C, H)` for
    gates with `features=0`). The chunk index goes first and the position inside the chunk
    just before the features, so a scan over chunks reads contiguous slices and the
    per-chunk products are plain batched matmuls.
    """
    heads = x.ndim - 3 - features
    perm = (1, 0, *range(3, 3 + heads), 2, *range(3 + heads, x.ndim))
    return x.transpose(perm)


def from_chunk_major(x: Shaped[Array, "n batch *rest"], features: int = 1) -> Array:
    """Inverse of `chunk_major`, with the chunks merged: `(B, N * C, *heads, *features)`."""
    n, b, *rest = x.shape
    heads = len(rest) - 1 - features
    c = rest[heads]
    perm = (1, 0, 2 + heads, *range(2, 2 + heads), *range(3 + heads, x.ndim))
    x = x.transpose(perm)
    return x.reshape(b, n * c, *x.shape[3:])
