r"""What the recurrences share, below all of them: input checks, normalisation, and the
numerically careful pieces of chunk algebra (decay sums, decayed Gram matrices, the
unit-lower-triangular inverse). No recurrence module imports another; they all import this.
"""

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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


# Log decays at or below this are a decay of exactly zero in float32 and float64 (exp(-1e4)
# underflows in both); clamping there keeps -inf out of sums and products (0 * -inf = NaN).
_LOG_ZERO = -1e4


def segment_sums(g: Float[Array, "... c"]) -> Float[Array, "... c c"]:
    """`L[i, j] = g[j+1] + ... + g[i]` for `i >= j` (0 on the diagonal), 0 above it.

    Summed directly over each segment rather than as a difference of cumulative sums, so a
    very negative gate early in the chunk costs no accuracy later in it: one product with
    a constant 0/1 tensor (the terms outside the segment are exact zeros), whose derivative
    is one product too. Gates below `-1e4` (`-inf` included) are a decay of zero and are
    taken as `-1e4`.
    """
    c = g.shape[-1]
    t, i, j = np.ogrid[:c, :c, :c]
    inside = jnp.asarray((j < t) & (t <= i), g.dtype)  # (t, i, j)
    return einsum("...t,tij->...ij", jnp.maximum(g, jnp.asarray(_LOG_ZERO, g.dtype)), inside)


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
    return decayed_grams(x[..., None, :], y[..., None, :], g, strict)[..., :, 0, :, 0]


def decayed_grams(
    x: Float[Array, "*xbatch c p k"],
    y: Float[Array, "*ybatch c q k"],
    g: Float[Array, "*batch c k"],
    strict: bool,
) -> Float[Array, "*batch c p c q"]:
    r"""Every decayed Gram of `P` left and `Q` right factors under one per-channel decay.

    `out[..., i, p, j, q]` $= \sum_c x_{ipc} y_{jqc} \exp(\sum_{t=j+1}^{i} g_{tc})$ for
    $i \ge j$ ($i > j$ if `strict`), zero above. The factors are interleaved with the rows
    (`x[..., i, p, :]`), so every product below is a plain batched matmul. The batch axes of
    `x` and `y` broadcast against those of `g` (a key head's rows for all the value heads
    that read it).

    $\exp(G_i - G_j)$ cannot be split into $e^{G_i} e^{-G_j}$ (overflows for very negative
    gates) nor formed from a difference of cumulative sums (a large decay early in the chunk
    leaves $G_i - G_j$ with an absolute error $\epsilon |G_j|$: a relative error in every
    later term), and the exact per-pair segment sum is a $(C, C, K)$ tensor. Instead, the
    chunk is halved recursively: a pair $i > j$ on either side of a midpoint $m$ factors
    exactly as $\exp(\sum_{t=m+1}^{i} g_t) \exp(\sum_{t=j+1}^{m} g_t)$, two sums of gates
    of one sign inside one half (exact to a relative $\epsilon$), each factor $\le 1$ (no
    overflow). Each of the $\log_2 C$ levels is one batched product of the decayed rows of
    the upper halves with those of the lower halves: the flops of one plain $C \times C$
    Gram, and $O(C K)$ memory per level. Differentiated by hand, recomputing each level:
    nothing but the arguments is kept for the backward.
    """
    return _grams_vjp(x, y, g, strict)


def _halves(x: Array, groups: int, trailing: int) -> tuple[Array, Array]:
    """`(..., n, *rest)` with `trailing` axes after the rows -> the lower and upper halves of
    its `groups` groups of rows, `(..., groups, n / 2 groups, *rest)` each."""
    lead, n, rest = x.shape[: -trailing - 1], x.shape[-trailing - 1], x.shape[x.ndim - trailing :]
    x = x.reshape(*lead, groups, 2, n // (2 * groups), *rest)
    axis = len(lead) + 1
    lower = jax.lax.index_in_dim(x, 0, axis, keepdims=False)
    return lower, jax.lax.index_in_dim(x, 1, axis, keepdims=False)


def _unhalves(lower: Array, upper: Array, trailing: int) -> Array:
    """Inverse of `_halves`."""
    x = jnp.stack([lower, upper], axis=lower.ndim - trailing - 1)
    lead = x.shape[: x.ndim - trailing - 3]
    return x.reshape(*lead, -1, *x.shape[x.ndim - trailing :])


def _level_decays(g: Array, groups: int) -> tuple[Array, Array]:
    """At one level: `exp(sum_{t=m+1}^{i} g_t)` for the upper halves' rows `i` and
    `exp(sum_{t=j+1}^{m} g_t)` for the lower halves' rows `j` (`m` the group's midpoint),
    each `(..., groups, h, 1, K)` (to broadcast over the factors)."""
    lower, upper = _halves(g, groups, 1)
    after = _up(cumsum(lower, -2, reverse=True))  # sum_{t > j} inside the lower half
    return jnp.exp(cumsum(upper, -2))[..., None, :], jnp.exp(after)[..., None, :]


def _up(x: Array) -> Array:
    """Rows of `x` `(..., n, K)` moved up by one, a zero row at the bottom."""
    return jnp.concatenate([x[..., 1:, :], jnp.zeros_like(x[..., :1, :])], -2)


def _down(x: Array) -> Array:
    """Rows of `x` `(..., n, K)` moved down by one, a zero row on top."""
    return jnp.concatenate([jnp.zeros_like(x[..., :1, :]), x[..., :-1, :]], -2)


def cumsum(x: Array, axis: int, reverse: bool = False) -> Array:
    r"""Inclusive cumulative sums along `axis` (from the end if `reverse`).

    XLA's `cumsum` is a reduction window as long as the axis for every element ($n^2$ adds);
    here an axis longer than 8 is cut into blocks of 8, summed inside each block and then
    across the blocks' totals ($\approx 2 \cdot 8$ adds per element). Every sum still adds
    terms directly (no differences), so sums of gates of one sign stay accurate to a
    relative $\epsilon$ whatever their size.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    if n <= 8 or n % 8:
        return jax.lax.cumsum(x, axis, reverse=reverse)
    blocks = x.reshape(*x.shape[:axis], n // 8, 8, *x.shape[axis + 1 :])
    inner = jax.lax.cumsum(blocks, axis + 1, reverse=reverse)
    totals = jax.lax.index_in_dim(inner, 0 if reverse else 7, axis + 1)  # (..., n/8, 1, ...)
    zero = jnp.zeros_like(jax.lax.index_in_dim(totals, 0, axis))
    if reverse:  # the blocks after each one, then before it: exclusive, summed directly
        before = jnp.concatenate([jax.lax.slice_in_dim(totals, 1, None, axis=axis), zero], axis)
    else:
        before = jnp.concatenate([zero, jax.lax.slice_in_dim(totals, 0, -1, axis=axis)], axis)
    return (inner + cumsum(before, axis, reverse=reverse)).reshape(x.shape)


def _pad_rows(x: Array, n: int, *axes: int) -> Array:
    pad = [(0, 0)] * x.ndim
    for axis in axes:
        pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad) if any(p != (0, 0) for p in pad) else x


def _level(x, y, g, half, n):
    """The decayed upper rows `(..., G, h, P, K)`, lower rows `(..., G, h, Q, K)` and their
    decays at the level whose groups are `2 half` rows."""
    groups = n // (2 * half)
    up, low = _level_decays(g, groups)
    x_up, y_low = _halves(x, groups, 2)[1], _halves(y, groups, 2)[0]
    return x_up, y_low, up, low, x_up * up, y_low * low


def _grams(x, y, g, strict):
    c = x.shape[-3]
    n = 1 << (c - 1).bit_length()
    x, y, g = _pad_rows(x, n, -3), _pad_rows(y, n, -3), _pad_rows(g, n, -2)
    p, q = x.shape[-2], y.shape[-2]
    shape = (*_batch(x, y, g), n, 1, p, 1, q)
    if strict:
        m = jnp.zeros(shape, x.dtype)
    else:
        diag = _products(x, y)[..., :, None, :, None, :]
        m = jnp.broadcast_to(diag, shape)
    half = 1
    while half < n:
        *_, xs, ys = _level(x, y, g, half, n)
        lead = xs.shape[:-3]
        cross = _products(xs.reshape(*lead, -1, xs.shape[-1]), ys.reshape(*lead, -1, ys.shape[-1]))
        cross = cross.reshape(*lead, half, p, half, q)
        m = m.reshape(*lead, 2, *m.shape[-4:])  # the previous level's blocks, in pairs
        m0, m1 = m[..., 0, :, :, :, :], m[..., 1, :, :, :, :]  # (..., G, h, P, h, Q) each
        top = jnp.concatenate([m0, jnp.zeros_like(cross)], -2)
        bottom = jnp.concatenate([cross, m1], -2)
        m = jnp.concatenate([top, bottom], -4)
        half *= 2
    return m[..., 0, :c, :, :c, :]


def _products(a: Array, b: Array) -> Array:
    """`a @ b^T` for rows `(..., A, K)` and `(..., B, K)`; tiny ones (`A B <= 16`, where a
    batched matmul is mostly overhead) as a fused multiply and sum."""
    if a.shape[-2] * b.shape[-2] <= 16:
        return jnp.sum(a[..., :, None, :] * b[..., None, :, :], axis=-1)
    return einsum("...ak,...bk->...ab", a, b)


def _combine(w: Array, b: Array) -> Array:
    """`w @ b` for `(..., A, B)` and rows `(..., B, K)`, tiny ones as in `_products`."""
    if w.shape[-2] * w.shape[-1] <= 16:
        return jnp.sum(w[..., :, :, None] * b[..., None, :, :], axis=-2)
    return einsum("...ab,...bk->...ak", w, b)


def _grams_fwd(x, y, g, strict):
    return _grams(x, y, g, strict), (x, y, g)


def _grams_bwd(strict, res, ct):
    x, y, g = res
    c = x.shape[-3]
    n = 1 << (c - 1).bit_length()
    x, y, g = _pad_rows(x, n, -3), _pad_rows(y, n, -3), _pad_rows(g, n, -2)
    ct = _pad_rows(ct, n, -4, -2)
    p, q = x.shape[-2], y.shape[-2]
    full = _batch(x, y, g)
    if strict:
        dx, dy = jnp.zeros_like(x), jnp.zeros_like(y)
    else:
        eye = jnp.eye(n, dtype=bool)[:, None, :, None]
        diag = jnp.sum(jnp.where(eye, ct, jnp.zeros((), ct.dtype)), axis=-2)  # (..., n, P, Q)
        dx = _sum_to(_combine(diag, y), x.shape)
        dy = _sum_to(_combine(jnp.swapaxes(diag, -1, -2), x), y.shape)
    dg = jnp.zeros((*full, *g.shape[-2:]), g.dtype)

    def level(half, carry):
        dx, dy, dg = carry
        x_up, y_low, up, low, xs, ys = _level(x, y, g, half, n)
        groups = n // (2 * half)
        # The cross blocks' cotangents: rows of the upper half, columns of the lower half.
        rows = [slice((2 * i + 1) * half, (2 * i + 2) * half) for i in range(groups)]
        cols = [slice(2 * i * half, (2 * i + 1) * half) for i in range(groups)]
        d_cross = jnp.stack([ct[..., r, :, c, :] for r, c in zip(rows, cols)], axis=-5)
        d_cross = d_cross.reshape(*d_cross.shape[:-4], half * p, half * q)
        lead = d_cross.shape[:-2]
        d_xs = _combine(d_cross, ys.reshape(*lead, -1, ys.shape[-1]))
        d_ys = _combine(jnp.swapaxes(d_cross, -1, -2), xs.reshape(*lead, -1, xs.shape[-1]))
        d_xs, d_ys = d_xs.reshape(xs.shape), d_ys.reshape(ys.shape)
        d_up = jnp.sum(d_xs * x_up, axis=-2) * up[..., 0, :]  # d(sum_{m<t<=i} g_t)
        d_low = jnp.sum(d_ys * y_low, axis=-2) * low[..., 0, :]  # d(sum_{j<t<=m} g_t)
        dg_up = cumsum(d_up, -2, reverse=True)  # sum over i >= t
        dg_low = _down(cumsum(d_low, -2))  # sum over j < t
        dx = dx + _sum_to(_unhalves(jnp.zeros_like(d_xs), d_xs * up, 2), x.shape)
        dy = dy + _sum_to(_unhalves(d_ys * low, jnp.zeros_like(d_ys), 2), y.shape)
        return dx, dy, dg + _unhalves(dg_low, dg_up, 1)

    # The levels one after another in a loop (each a branch of a switch): unrolled, XLA
    # schedules every level's decays and products before their sums and holds them all.
    # The first level outside it, so the carry has the types (and, under `shard_map`, the
    # varying axes) of everything that flows into it.
    levels = [ft.partial(level, 1 << i) for i in range(n.bit_length() - 1)]
    if levels:
        carry = levels[0]((dx, dy, dg))
        dx, dy, dg = jax.lax.fori_loop(
            1, len(levels), lambda i, carry: jax.lax.switch(i - 1, levels[1:], carry), carry
        )
    return dx[..., :c, :, :], dy[..., :c, :, :], _sum_to(dg[..., :c, :], res[2].shape)


def _batch(x: Array, y: Array, g: Array) -> tuple[int, ...]:
    """The batch shape of `decayed_grams`: its arguments' batch axes broadcast together."""
    return jnp.broadcast_shapes(x.shape[:-3], y.shape[:-3], g.shape[:-2])


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """`x` summed over the axes that `shape` broadcasts (size 1 there, not in `x`)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


_grams_vjp = jax.custom_vjp(_grams, nondiff_argnums=(3,))
_grams_vjp.defvjp(_grams_fwd, _grams_bwd)


def cumulative_decays(
    g: Float[Array, "*batch c"] | Float[Array, "*batch c k"], per_channel: bool
) -> tuple[Array, Array]:
    """`(exp(G_i), exp(G_C - G_i))` for a chunk of log decays, `G_i` summed from its start.

    Both are sums of same-sign terms taken directly (the second as a reverse cumulative
    sum), so neither loses accuracy to cancellation. Per-token gates get a trailing unit
    axis so the results broadcast against `(..., C, K)` features.
    """
    if not per_channel:
        g = g[..., None]
    cum = cumsum(g, -2)
    after = _up(cumsum(g, -2, reverse=True))  # sum_{t > i}
    return jnp.exp(cum), jnp.exp(after)
