"""The precision policy of the library's products, and the accumulation dtype: one rule, here.

A policy says how the large products (the chunk Grams, the WY products, `q h`, `w h`,
`k~^T v`, the attention tiles) multiply:

- `"highest"`: float32 operands at `Precision.HIGHEST` (float64 for float64 inputs):
    exact to float32 rounding on every backend.
- `"bfloat16"`: bfloat16 operands, float32 accumulation (`preferred_element_type`): the
    matrix units' native rate on TPUs and GPUs.
- `"default"`: the operands as they are, at JAX's own precision
    (`jax.default_matmul_precision`), accumulated in the accumulation dtype.

Whatever the policy, the state, its recursion, the log decays and their sums, the chunk
maps and their exchange stay in the accumulation dtype ([`accumulation_dtype`][]).
"""

from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array


PrecisionName: TypeAlias = Literal["highest", "bfloat16", "default"]
_NAMES: tuple[PrecisionName, ...] = ("highest", "bfloat16", "default")


def as_precision(value: object) -> PrecisionName | None:
    """The converter of every `precision` field and argument: one of the policy names, or
    `None` (chosen from the inputs' dtype by [`resolve_precision`][]).

    **Raises:**

    `ValueError` naming the accepted values for anything else (a `jax.lax.Precision` too:
    the policy also fixes the operand dtype, which `jax.lax.Precision` does not say).
    """
    if value is None:
        return None
    if isinstance(value, str) and value in _NAMES:
        return value  # pyright: ignore[reportReturnType]
    raise ValueError(
        f"`precision` must be one of {', '.join(repr(n) for n in _NAMES)} or None (from the "
        f"inputs' dtype: bfloat16 inputs -> 'bfloat16', others -> 'highest'); got {value!r}."
    )


def resolve_precision(precision: PrecisionName | None, *xs: Any) -> PrecisionName:
    """The policy a call runs under: `precision` if given, else `"bfloat16"` when any of
    `xs` (the inputs; `None` entries skipped) is bfloat16 and none is float64, else
    `"highest"` (float32 and float64 inputs keep exact products)."""
    if precision is not None:
        return precision
    dtypes = [jnp.dtype(x.dtype) for x in xs if x is not None]
    if jnp.dtype(jnp.float64) in dtypes:
        return "highest"
    return "bfloat16" if jnp.dtype(jnp.bfloat16) in dtypes else "highest"


def accumulation_dtype(*xs: Any) -> jnp.dtype:
    """float64 if any of `xs` (arrays or dtypes; `None` skipped) is float64, else float32:
    the dtype of the state, the decays, the chunk maps and every accumulation, whatever
    the policy. Never promotes further."""
    wide = any(jnp.dtype(getattr(x, "dtype", x)) == jnp.float64 for x in xs if x is not None)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def einsum(spec: str, *operands: Array, precision: PrecisionName = "highest") -> Array:
    """`jnp.einsum` under a precision policy.

    **Arguments:**

    - `spec`: the subscripts, as for `jnp.einsum`.
    - `operands`: the arrays.
    - `precision`: `"highest"` (the default): `Precision.HIGHEST`, the result in the
        operands' promoted dtype: float32 operands are multiplied and summed in float32 on
        every backend (the default precision rounds them to bfloat16 or TF32 on TPUs and
        GPUs, a relative error near $10^{-3}$). `"bfloat16"`: the operands rounded to
        bfloat16, the product accumulated and returned in float32 (float64 if an operand
        is float64). `"default"`: `jax.default_matmul_precision` decides, the result in
        the accumulation dtype.

    **Returns:**

    The product.
    """
    if precision == "highest":
        return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)
    acc = accumulation_dtype(*operands)
    if precision == "bfloat16":
        operands = tuple(x.astype(jnp.bfloat16) for x in operands)
        return jnp.einsum(spec, *operands, preferred_element_type=acc)
    if precision == "default":
        return jnp.einsum(spec, *operands, preferred_element_type=acc)
    as_precision(precision)  # raises the ValueError for a name that is not a policy
    raise AssertionError(precision)
