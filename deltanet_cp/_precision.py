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

One product mode sits below the policies: `"bfloat16x3"`, three bfloat16 products of the
operands split into bfloat16 halves, float32 to about $2^{-16}$ at three times a bfloat16
product's cost. [`state_policy`][] says where the `"bfloat16"` policy takes it.
"""

import functools as ft
from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array


PrecisionName: TypeAlias = Literal["highest", "bfloat16", "default"]
_NAMES: tuple[PrecisionName, ...] = ("highest", "bfloat16", "default")
# How one product multiplies: a policy, or the compensated bfloat16 product the policies
# choose for some products (`state_policy`).
ProductPrecision: TypeAlias = Literal["highest", "bfloat16", "bfloat16x3", "default"]


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


def state_policy(precision: PrecisionName, *, decays: bool) -> ProductPrecision:
    """How a chunk's forward products with the state multiply: `w h` and `q h`, and those
    with what is written back to it, `attn v_new` and `k~^T v_new`.

    `precision`, except that a recurrence without decay (`decays=False`: DeltaNet, an
    ungated Gated DeltaProduct) under `"bfloat16"` takes `"bfloat16x3"` there: with no
    decay the state forgets no rounding, and these three products carry the largest share
    of it (each alone about a tenth of DeltaNet's bfloat16 output error; the three
    compensated take its outputs at T = 4096 from 5.4e-3 to 3.8e-3 of their RMS). Their
    VJPs, through which the backward carries the state's cotangent, are compensated too;
    the factors' cotangents, the Grams and the WY products stay bfloat16.
    """
    return "bfloat16x3" if precision == "bfloat16" and not decays else precision


def einsum(spec: str, *operands: Array, precision: ProductPrecision = "highest") -> Array:
    """`jnp.einsum` under a precision policy.

    **Arguments:**

    - `spec`: the subscripts, as for `jnp.einsum`.
    - `operands`: the arrays.
    - `precision`: `"highest"` (the default): `Precision.HIGHEST`, the result in the
        operands' promoted dtype: float32 operands are multiplied and summed in float32 on
        every backend (the default precision rounds them to bfloat16 or TF32 on TPUs and
        GPUs, a relative error near $10^{-3}$). `"bfloat16"`: the operands rounded to
        bfloat16, the product accumulated and returned in float32 (float64 if an operand
        is float64); its VJP multiplies the same way (the cotangent rounded to bfloat16,
        float32 accumulation), and the operands' cotangents come back in their dtypes.
        `"bfloat16x3"`: each operand split into a bfloat16 high half and a bfloat16 low
        half (`x = x_hi + x_lo` to about $2^{-16}$), three bfloat16 products `x_hi y_hi +
        x_hi y_lo + x_lo y_hi` accumulated in float32: the float32 product to about
        $2^{-16}$ relative, at three bfloat16 products' cost; its VJP multiplies the same
        way.
        `"default"`: `jax.default_matmul_precision` decides, the result in the
        accumulation dtype.

    **Returns:**

    The product.
    """
    if precision == "highest":
        return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)
    acc = accumulation_dtype(*operands)
    if precision in ("bfloat16", "bfloat16x3"):
        if len(operands) != 2 or not _transposable(spec):
            raise ValueError(
                f"`einsum` under precision={precision!r} takes two operands and explicit "
                f"subscripts, none repeated inside one operand (e.g. 'bik,bkj->bij'); got "
                f"{spec!r} with {len(operands)} operands."
            )
        if precision == "bfloat16x3":
            return _bf16x3_einsum(spec, acc, *operands)
        return _bf16_einsum(spec, acc, *operands)
    if precision == "default":
        return jnp.einsum(spec, *operands, preferred_element_type=acc)
    raise ValueError(
        "`einsum`'s `precision` must be one of 'highest', 'bfloat16', 'bfloat16x3', "
        f"'default'; got {precision!r}."
    )


def _parse(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return lhs, rhs, out


def _transposable(spec: str) -> bool:
    """Whether `_bf16_einsum`'s VJP handles `spec`: two operands, an explicit output, no
    subscript repeated inside one term."""
    if spec.count("->") != 1 or spec.count(",") != 1:
        return False
    terms = _parse(spec)
    return all(len(set(t.replace("...", ""))) == len(t.replace("...", "")) for t in terms)


def _bf16_product(spec: str, acc: Any, x: Array, y: Array) -> Array:
    """bfloat16 operands, `acc` accumulation. On accelerators one product with
    `preferred_element_type`; on XLA:CPU, whose runtime dot has no bfloat16 x bfloat16 ->
    float32 kernel for every layout, the bfloat16-rounded operands multiplied in `acc` at
    `Precision.HIGHEST`: the same numbers (a product of two bfloat16 values is exact in
    float32), summed in `acc`."""
    x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)

    def native(x, y):
        return jnp.einsum(spec, x, y, preferred_element_type=acc)

    def emulated(x, y):
        highest = jax.lax.Precision.HIGHEST
        return jnp.einsum(spec, x.astype(acc), y.astype(acc), precision=highest)

    return jax.lax.platform_dependent(x, y, cpu=emulated, default=native)


def _operand_cotangent(
    out: str, other: str, mine: str, acc: Any, g: Array, y: Array, x: Array, product=None
) -> Array:
    """The cotangent of the operand `x` (subscripts `mine`) of `einsum(mine, other -> out)`
    from the result's cotangent `g`: `einsum(out, other -> mine)` by `product` (bfloat16
    with `acc` accumulation by default), its broadcast axes summed back to `x`'s shape."""
    letters = mine.replace("...", "")
    kept = "".join(c for c in letters if c in out or c in other)
    target = ("..." if "..." in mine else "") + kept
    d = (product or _bf16_product)(f"{out},{other}->{target}", acc, g, y)
    if kept != letters:  # subscripts summed inside `x` alone: the cotangent is broadcast
        rank = d.ndim - len(kept)
        lead, tail = d.shape[:rank], d.shape[rank:]
        sizes = dict(zip(kept, tail))
        for i, c in enumerate(letters):
            if c not in sizes:
                sizes[c] = x.shape[x.ndim - len(letters) + i]
        order = [kept.index(c) for c in letters if c in kept]
        d = jnp.transpose(d, (*range(rank), *(rank + i for i in order)))
        expand = tuple(rank + i for i, c in enumerate(letters) if c not in kept)
        d = jnp.broadcast_to(jnp.expand_dims(d, expand), (*lead, *(sizes[c] for c in letters)))
    lead = d.ndim - x.ndim
    if lead:
        d = jnp.sum(d, axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(x.shape) if n == 1 and d.shape[i] != 1)
    if axes:
        d = jnp.sum(d, axis=axes, keepdims=True)
    return d.astype(x.dtype)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bf16_einsum(spec: str, acc: Any, x: Array, y: Array) -> Array:
    return _bf16_product(spec, acc, x, y)


def _bf16_einsum_fwd(spec, acc, x, y):
    return _bf16_product(spec, acc, x, y), (x, y)


def _bf16_einsum_bwd(spec, acc, res, g):
    x, y = res
    lhs, rhs, out = _parse(spec)
    g = g.astype(jnp.bfloat16)
    dx = _operand_cotangent(out, rhs, lhs, acc, g, y, x)
    dy = _operand_cotangent(out, lhs, rhs, acc, g, x, y)
    return dx, dy


_bf16_einsum.defvjp(_bf16_einsum_fwd, _bf16_einsum_bwd)


def _halves(x: Array) -> tuple[Array, Array]:
    """`x` as two bfloat16 arrays, `x = hi + lo` to about $2^{-16}$ relative."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(x.dtype)).astype(jnp.bfloat16)


def _bf16x3_product(spec: str, acc: Any, x: Array, y: Array) -> Array:
    """`x y` as `x_hi y_hi + (x_hi y_lo + x_lo y_hi)`: three bfloat16 products, `acc`
    accumulation (the dropped `x_lo y_lo` is about $2^{-16}$ of the product)."""
    (x_hi, x_lo), (y_hi, y_lo) = _halves(x), _halves(y)
    small = _bf16_product(spec, acc, x_hi, y_lo) + _bf16_product(spec, acc, x_lo, y_hi)
    return _bf16_product(spec, acc, x_hi, y_hi) + small


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bf16x3_einsum(spec: str, acc: Any, x: Array, y: Array) -> Array:
    return _bf16x3_product(spec, acc, x, y)


def _bf16x3_einsum_fwd(spec, acc, x, y):
    return _bf16x3_product(spec, acc, x, y), (x, y)


def _bf16x3_einsum_bwd(spec, acc, res, g):
    x, y = res
    lhs, rhs, out = _parse(spec)
    dx = _operand_cotangent(out, rhs, lhs, acc, g, y, x, _bf16x3_product)
    dy = _operand_cotangent(out, lhs, rhs, acc, g, x, y, _bf16x3_product)
    return dx, dy


_bf16x3_einsum.defvjp(_bf16x3_einsum_fwd, _bf16x3_einsum_bwd)
