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
