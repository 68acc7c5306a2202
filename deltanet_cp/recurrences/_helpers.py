r"""What the recurrences share, below all of them: input checks, normalisation, and the
numerically careful pieces of chunk algebra (decay sums, decayed Gram matrices, the
unit-lower-triangular inverse). No recurrence module imports another; they all import this.
"""

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


_HI = jax.lax.Precision.HIGHEST
_L2NORM_EPS = 1e-6


def einsum(spec: str, *args: Array) -> Array:
    """`jnp.einsum` at the highest precision (float32 products stay float32 on every backend)."""
    return jnp.einsum(spec, *args, precision=_HI)


def lift(x: Array, ndim: int) -> Array:
    """Prepend unit axes so `x` has `ndim` axes (rank promotion is explicit here)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def compute_dtype(*xs: Any) -> jnp.dtype:
    """float32 for float32/16-bit inputs, float64 for float64 inputs; never promotes further."""
    wide = any(jnp.dtype(x.dtype) == jnp.float64 for x in xs if x is not None)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def l2norm(x: Float[Array, "... k"]) -> Float[Array, "... k"]:
    """`x * rsqrt(sum(x**2) + 1e-6)` over the last axis (the convention of every reference)."""
    eps = jnp.asarray(_L2NORM_EPS, x.dtype)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


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


@jax.custom_vjp
def unit_lower_inverse(a: Float[Array, "*batch c c"]) -> Float[Array, "*batch c c"]:
    r"""$(I + a)^{-1}$ for a strictly lower-triangular `a`, by recursive 2x2 blocking.

    $\begin{pmatrix} I + a_{11} & 0 \\ a_{21} & I + a_{22} \end{pmatrix}^{-1} =
    \begin{pmatrix} t_{11} & 0 \\ -t_{22} a_{21} t_{11} & t_{22} \end{pmatrix}$, with both
    diagonal halves inverted together (stacked on a new leading axis): $\log_2 c$ levels of
    batched matmuls, about $c^3 / 3$ flops, instead of a sequential triangular solve. Each
    level multiplies true inverses (no power series), so it is as accurate as substitution.
    A size that is not a power of two is padded with zeros (an identity block) and cut back.
    """
    c = a.shape[-1]
    p = 1 << (c - 1).bit_length()
    if p != c:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, p - c), (0, p - c)])
    return _inverse_pow2(a)[..., :c, :c]


def _unit_lower_inverse_fwd(a):
    t = unit_lower_inverse(a)
    return t, t


def _unit_lower_inverse_bwd(t, ct):
    # d(I + a)^-1 = -T da T, so the cotangent of `a` is -T^T ct T^T, on the strictly lower
    # triangle (the only entries of `a` that are read): two products instead of the
    # transpose of every level of the recursion.
    c = t.shape[-1]
    tt = jnp.swapaxes(t, -1, -2)
    da = -einsum("...ij,...jk->...ik", tt, einsum("...ij,...jk->...ik", ct, tt))
    strict = lift(jnp.tril(jnp.ones((c, c), dtype=bool), k=-1), da.ndim)
    return (jnp.where(strict, da, jnp.zeros((), da.dtype)),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _inverse_pow2(a: Array) -> Array:
    n = a.shape[-1]
    if n <= 2:  # exact: a strictly lower 2 x 2 `a` has a @ a = 0
        return lift(jnp.eye(n, dtype=a.dtype), a.ndim) - a
    h = n // 2
    halves = _inverse_pow2(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
    t11, t22 = halves[0], halves[1]
    t21 = -einsum("...ij,...jk->...ik", t22, einsum("...ij,...jk->...ik", a[..., h:, :h], t11))
    top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


def segment_sums(g: Float[Array, "... c"]) -> Float[Array, "... c c"]:
    """`L[i, j] = g[j+1] + ... + g[i]` for `i >= j` (0 on the diagonal), 0 above it.

    Summed directly rather than as a difference of cumulative sums, so a very negative
    gate early in the chunk costs no accuracy later in it.
    """
    c = g.shape[-1]
    strict = jnp.tril(jnp.ones((c, c), dtype=bool), k=-1)
    x = jnp.where(lift(strict, g.ndim + 1), g[..., :, None], jnp.zeros((), g.dtype))
    return jnp.cumsum(x, axis=-2)


def decayed_gram(
    x: Float[Array, "*batch c k"],
    y: Float[Array, "*batch c k"],
    g: Float[Array, "*batch c k"] | Float[Array, "*batch c"] | None,
    *,
    strict: bool,
) -> Float[Array, "*batch c c"]:
    r"""$P_{ij} = \sum_c x_{ic} y_{jc} \exp(\sum_{t=j+1}^{i} g_{tc})$ below the diagonal.

    Zero above the diagonal, and on it too if `strict`. `g` holds log decays (`<= 0`),
    either per channel `(..., C, K)` (see [`decayed_grams`]), per token `(..., C)`, or
    `None` (no decay).
    """
    c = x.shape[-2]
    dt = x.dtype
    if g is None or g.ndim == x.ndim - 1:
        mask = jnp.tril(jnp.ones((c, c), dtype=bool), k=-1 if strict else 0)
        gram = einsum("...ik,...jk->...ij", x, y)
        if g is not None:
            gram = gram * jnp.exp(segment_sums(g))
        return jnp.where(lift(mask, gram.ndim), gram, jnp.zeros((), dt))
    return decayed_grams(x[..., None, :, :], y[..., None, :, :], g, strict=strict)[..., 0, 0, :, :]


@ft.partial(jax.custom_vjp, nondiff_argnums=(3,))
def decayed_grams(
    x: Float[Array, "*batch p c k"],
    y: Float[Array, "*batch q c k"],
    g: Float[Array, "*batch c k"],
    strict: bool,
) -> Float[Array, "*batch p q c c"]:
    r"""Every decayed Gram of `P` left and `Q` right factors under one per-channel decay.

    $P^{(p, q)}_{ij} = \sum_c x^{(p)}_{ic} y^{(q)}_{jc} \exp(\sum_{t=j+1}^{i} g_{tc})$ for
    $i \ge j$ ($i > j$ if `strict`), zero above.

    $\exp(G_i - G_j)$ cannot be split into $e^{G_i} e^{-G_j}$ (overflows for very negative
    gates) nor formed from a difference of cumulative sums (a large decay early in the chunk
    leaves $G_i - G_j$ with an absolute error $\epsilon |G_j|$: a relative error in every
    later term), and the exact per-pair segment sum is a $(C, C, K)$ tensor. Instead, the
    chunk is halved recursively: a pair $i > j$ on either side of a midpoint $m$ factors
    exactly as $\exp(\sum_{t=m+1}^{i} g_t) \exp(\sum_{t=j+1}^{m} g_t)$, two sums of gates
    of one sign inside one half (exact to a relative $\epsilon$), each factor $\le 1$ (no
    overflow). Each of the $\log_2 C$ levels is one batched product of the decayed rows of
    the lower halves with those of the upper halves: the flops of one plain $C \times C$
    Gram, and $O(C K)$ memory per level. Differentiated by hand, recomputing each level:
    nothing but the arguments is kept for the backward.
    """
    return _grams(x, y, g, strict)


def _halves(x: Array, groups: int) -> tuple[Array, Array]:
    """`(..., C, K)` -> its `groups` groups' lower and upper halves, `(..., groups, C/2g, K)`."""
    x = x.reshape(*x.shape[:-2], groups, 2, x.shape[-2] // (2 * groups), x.shape[-1])
    return x[..., 0, :, :], x[..., 1, :, :]


def _level_decays(g: Array, groups: int) -> tuple[Array, Array]:
    """At one level: `exp(sum_{t=m+1}^{i} g_t)` for the upper halves' rows `i` and
    `exp(sum_{t=j+1}^{m} g_t)` for the lower halves' rows `j` (`m` the group's midpoint)."""
    lower, upper = _halves(g, groups)
    after = jnp.cumsum(jnp.flip(lower, -2), axis=-2)  # reversed: sums of the last 1, 2, ...
    after = jnp.flip(
        jnp.concatenate([jnp.zeros_like(after[..., :1, :]), after[..., :-1, :]], -2), -2
    )
    return jnp.exp(jnp.cumsum(upper, axis=-2)), jnp.exp(after)


def _pad_pow2(x: Array, axis: int) -> Array:
    n = x.shape[axis]
    p = 1 << (n - 1).bit_length()
    if p == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, p - n)
    return jnp.pad(x, pad)


def _grams(x, y, g, strict):
    c = x.shape[-2]
    x, y, g = _pad_pow2(x, -2), _pad_pow2(y, -2), _pad_pow2(g, -2)
    n = x.shape[-2]
    if strict:
        m = jnp.zeros((*x.shape[:-2], y.shape[-3], n, 1, 1), x.dtype)
    else:
        m = einsum("...pik,...qik->...pqi", x, y)[..., None, None]
    half = 1
    while half < n:
        groups = n // (2 * half)
        up_decay, low_decay = _level_decays(g, groups)
        xs = _halves(x, groups)[1] * up_decay[..., None, :, :, :]
        ys = _halves(y, groups)[0] * low_decay[..., None, :, :, :]
        cross = einsum("...pgik,...qgjk->...pqgij", xs, ys)  # (..., P, Q, groups, h, h)
        m = m.reshape(*m.shape[:-3], groups, 2, half, half)
        top = jnp.concatenate([m[..., 0, :, :], jnp.zeros_like(cross)], -1)
        bottom = jnp.concatenate([cross, m[..., 1, :, :]], -1)
        m = jnp.concatenate([top, bottom], -2)
        half *= 2
    return m[..., 0, :c, :c]


def _grams_fwd(x, y, g, strict):
    return _grams(x, y, g, strict), (x, y, g)


def _grams_bwd(strict, res, ct):
    x, y, g = res
    c = x.shape[-2]
    x, y, g = _pad_pow2(x, -2), _pad_pow2(y, -2), _pad_pow2(g, -2)
    ct = _pad_pow2(_pad_pow2(ct, -1), -2)
    n = x.shape[-2]
    batch = ct.shape[:-2]
    if strict:
        dx, dy = jnp.zeros_like(x), jnp.zeros_like(y)
    else:
        diag = jnp.diagonal(ct, axis1=-2, axis2=-1)  # (..., P, Q, n)
        dx = einsum("...pqi,...qik->...pik", diag, y)
        dy = einsum("...pqi,...pik->...qik", diag, x)
    dg = jnp.zeros_like(g)
    half = 1
    while half < n:
        groups = n // (2 * half)
        up_decay, low_decay = _level_decays(g, groups)
        x_up, y_low = _halves(x, groups)[1], _halves(y, groups)[0]
        xs, ys = x_up * up_decay[..., None, :, :, :], y_low * low_decay[..., None, :, :, :]
        # The cross blocks' cotangents: rows of the upper half, columns of the lower half.
        blocks = ct.reshape(*batch, groups, 2 * half, groups, 2 * half)
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)
        d_cross = blocks[..., half:, :half]  # (..., P, Q, groups, h, h)
        d_xs = einsum("...pqgij,...qgjk->...pgik", d_cross, ys)
        d_ys = einsum("...pqgij,...pgik->...qgjk", d_cross, xs)
        d_up = jnp.sum(d_xs * x_up, axis=-4) * up_decay  # d(sum_{m<t<=i} g_t)
        d_low = jnp.sum(d_ys * y_low, axis=-4) * low_decay  # d(sum_{j<t<=m} g_t)
        dg_up = jnp.flip(jnp.cumsum(jnp.flip(d_up, -2), axis=-2), -2)  # sum over i >= t
        dg_low = jnp.cumsum(d_low, axis=-2)
        dg_low = jnp.concatenate([jnp.zeros_like(dg_low[..., :1, :]), dg_low[..., :-1, :]], -2)
        dx = dx + _unhalves(jnp.zeros_like(d_xs), d_xs * up_decay[..., None, :, :, :])
        dy = dy + _unhalves(d_ys * low_decay[..., None, :, :, :], jnp.zeros_like(d_ys))
        dg = dg + _unhalves(dg_low, dg_up)
        half *= 2
    return dx[..., :c, :], dy[..., :c, :], dg[..., :c, :]


def _unhalves(lower: Array, upper: Array) -> Array:
    """Inverse of `_halves`: `(..., groups, h, K)` twice -> `(..., 2 groups h, K)`."""
    x = jnp.stack([lower, upper], axis=-3)
    return x.reshape(*x.shape[:-4], -1, x.shape[-1])


decayed_grams.defvjp(_grams_fwd, _grams_bwd)


def cumulative_decays(
    g: Float[Array, "*batch c"] | Float[Array, "*batch c k"], per_channel: bool
) -> tuple[Array, Array]:
    """`(exp(G_i), exp(G_C - G_i))` for a chunk of log decays, `G_i` summed from its start.

    Both are sums of same-sign terms taken directly (the second as a reverse cumulative
    sum), so neither loses accuracy to cancellation. Per-token gates get a trailing unit
    axis so the results broadcast against `(..., C, K)` features.
    """
    axis = -2 if per_channel else -1
    cum = jnp.cumsum(g, axis=axis)
    after = jnp.cumsum(jnp.flip(g, axis), axis=axis)  # reversed: sums of the last 1, 2, ...
    zero = jnp.zeros_like(jax.lax.slice_in_dim(after, 0, 1, axis=axis % g.ndim))
    after = jnp.flip(jnp.concatenate([zero, after], axis=axis), axis)  # sums of t > i, t >= i
    after = jax.lax.slice_in_dim(after, 1, None, axis=axis % g.ndim)  # sum_{t > i}
    if not per_channel:
        cum, after = cum[..., None], after[..., None]
    return jnp.exp(cum), jnp.exp(after)
