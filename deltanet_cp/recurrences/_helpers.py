"""What the recurrences share, below all of them and private: input checks, the accumulation
dtype and policy of a recurrence's products, the prologue of `prepare` and explicit rank
promotion. The public chunk algebra they are built from is `deltanet_cp.chunkops`.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._precision import accumulation_dtype, PrecisionName, resolve_precision
from ..chunkops import einsum, l2norm


def lift(x: Array, ndim: int) -> Array:
    """Prepend unit axes so `x` has `ndim` axes (rank promotion is explicit here)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def policy(precision: PrecisionName | None, inputs: Any) -> tuple[jnp.dtype, PrecisionName]:
    """The accumulation dtype of `inputs` (float64 for float64, else float32) and the
    products' policy: `precision`, or from the inputs' dtype if `None`."""
    leaves = jax.tree.leaves(inputs)
    return accumulation_dtype(*leaves), resolve_precision(precision, *leaves)


def prologue(
    q: Array, k: Array, dtype: Any, scale: float | None, normalize: bool
) -> tuple[Array, Array]:
    """The queries and keys as every `prepare` starts from: cast to `dtype` (the
    accumulation dtype: norms and scales run there whatever the policy), L2-normalised over
    the last axis if `normalize`, the queries times `scale` (`K ** -0.5` if `None`)."""
    q, k = q.astype(dtype), k.astype(dtype)
    if normalize:
        q, k = l2norm(q), l2norm(k)
    dk = q.shape[-1]
    return q * jnp.asarray(dk**-0.5 if scale is None else scale, dtype), k


def check_arrays(arrays: dict[str, tuple[Any, tuple[str, ...]]]) -> dict[str, int]:
    """Check named arrays against named axes and raise a `ValueError` naming the problem.

    **Arguments:**

    - `arrays`: maps each argument name to `(array, axis_names)`, e.g.
        `{"q": (q, ("batch", "seq", "heads", "K"))}`; `None` arrays are skipped. An axis
        name used by several arrays must have one size, fixed by its first use.

    **Returns:**

    The size of every axis name.
    """
    for name, (x, _) in arrays.items():
        if x is None:
            continue
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"`{name}` must be an array; got {type(x).__name__}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"`{name}` must be a floating-point array (float32, bfloat16, ...); got "
                f"dtype {x.dtype}. Cast it with `.astype(jnp.float32)`."
            )
    for name, (x, axes) in arrays.items():
        if x is not None and x.ndim != len(axes):
            raise ValueError(
                f"`{name}` must have rank {len(axes)} with layout ({', '.join(axes)}); got "
                f"shape {x.shape}."
            )
    sizes: dict[str, int] = {}
    owner: dict[str, str] = {}
    for name, (x, axes) in arrays.items():
        if x is None:
            continue
        for axis, size in zip(axes, x.shape):
            if axis in sizes and sizes[axis] != size:
                expected = tuple(sizes.get(a, s) for a, s in zip(axes, x.shape))
                raise ValueError(
                    f"`{name}` must have shape ({', '.join(axes)}) = {expected}; got {x.shape}: "
                    f"its {axis} axis has size {size} but `{owner[axis]}` has {sizes[axis]}."
                )
            sizes.setdefault(axis, size)
            owner.setdefault(axis, name)
    if "heads" in sizes and "value_heads" in sizes and sizes["value_heads"] % sizes["heads"]:
        raise ValueError(
            f"The number of value heads ({sizes['value_heads']}, from `v`) must be a multiple "
            f"of the number of key heads ({sizes['heads']}, from `q`/`k`): value head j reads "
            "key head j // (HV // H)."
        )
    return sizes


def decay_cotangent(d_next: Array, states: Array) -> Array:
    """The cotangent of a chunk's decay per key channel, `sum_v d_next[k, v] h[k, v]`, from
    the states `(..., K, V)` entering the chunks and the cotangents of the states leaving
    them: in the state's dtype (float32, or float64) under every policy, as a product
    (XLA:CPU's reduce fusion takes about 35 times as long on it at Qwen3-Next's heads)."""
    return einsum("...kv,...kv->...k", d_next, states)


def flat_heads(x: Array) -> Array:
    """`(N, B, H, *rest)` -> `(N B H, *rest)`: the chunk, batch and key-head axes as one.

    A recurrence's `prepare` broadcasts a key head's quantities over its `r` value heads.
    On arrays of rank 6, `(N, B, H, r, C, K)`, the VJP of that broadcast is a reduce that
    XLA:CPU's YNNPACK fusions (jaxlib 0.10) run about 30 times slower than at rank 4 (35
    against 1.2 ms per block at Qwen3-Next's heads), and on rank-7 products under a `vmap`
    they crash or return wrong numbers (see tests/test_default_flags.py)."""
    return x.reshape(math.prod(x.shape[:3]), *x.shape[3:])


def value_heads(x: Array, n: int, b: int) -> Array:
    """`(N B H, r, *rest)` -> `(N, B, H r, *rest)`, the inverse of `flat_heads` with the
    value heads merged: value head `j` reads key head `j // r`."""
    return x.reshape(n, b, (x.shape[0] // (n * b)) * x.shape[1], *x.shape[2:])
