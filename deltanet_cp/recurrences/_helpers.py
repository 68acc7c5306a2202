r"""What the recurrences share, below all of them: input checks, normalisation, and the
numerically careful pieces of chunk algebra (decay sums, decayed Gram matrices, the
unit-lower-triangular inverse). No recurrence module imports another; they all import this.
"""

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


def _block_size(c: int) -> int:
    """The divisor `s` of `c` that minimises `s + c / s` (memory of `decayed_gram`)."""
    return min((s for s in range(1, c + 1) if c % s == 0), key=lambda s: (s + c // s, -s))


def decayed_gram(
    x: Float[Array, "*batch c k"],
    y: Float[Array, "*batch c k"],
    g: Float[Array, "*batch c k"] | Float[Array, "*batch c"] | None,
    *,
    strict: bool,
) -> Float[Array, "*batch c c"]:
    r"""$P_{ij} = \sum_c x_{ic} y_{jc} \exp(\sum_{t=j+1}^{i} g_{tc})$ below the diagonal.

    Zero above the diagonal, and on it too if `strict`. `g` holds log decays (`<= 0`),
    either per channel `(..., C, K)`, per token `(..., C)`, or `None` (no decay).

    Per channel, $\exp(G_i - G_j)$ cannot be split into $e^{G_i} e^{-G_j}$ (overflows for
    very negative gates) nor formed from a difference of cumulative sums (a large decay
    early in the chunk leaves $G_i - G_j$ with an absolute error $\epsilon |G_j|$: a
    relative error in every later term). The exact per-pair segment sum is a
    $(C, C, K)$ tensor. We split the chunk into blocks of $s \approx \sqrt{C}$ tokens
    instead: inside a block, a direct $(s, s, K)$ segment sum; across blocks $I > J$ the
    exponent is the sum of three runs that each sum gates of one sign directly, so each is
    exact to a relative $\epsilon$ and every factor is $\le 1$ (no overflow):

    $$\sum_{t=j+1}^{i} g_t = \underbrace{\sum_{t=j+1}^{\mathrm{end}(J)} g_t}_{\text{suffix of } j}
    + \underbrace{\sum_{\text{blocks } J < B < I} \textstyle\sum_B g}_{\text{between}}
    + \underbrace{\sum_{t=\mathrm{start}(I)}^{i} g_t}_{\text{prefix of } i}.$$

    Memory is $O(C K (s + C / s))$ per chunk instead of $O(C^2 K)$.
    """
    c = x.shape[-2]
    dt = x.dtype
    if g is None or g.ndim == x.ndim - 1:
        mask = jnp.tril(jnp.ones((c, c), dtype=bool), k=-1 if strict else 0)
        gram = einsum("...ik,...jk->...ij", x, y)
        if g is not None:
            gram = gram * jnp.exp(segment_sums(g))
        return jnp.where(lift(mask, gram.ndim), gram, jnp.zeros((), dt))

    s = _block_size(c)
    nb = c // s
    lead = x.shape[:-2]

    def blocks(a):  # (..., C, K) -> (..., nb, s, K)
        return a.reshape(*lead, nb, s, a.shape[-1])

    xb, yb, gb = blocks(x), blocks(y), blocks(g)
    # Inside each block: seg[..., n, c, i, j] = sum_{t=j+1}^{i} g_tc, summed directly.
    seg = segment_sums(jnp.swapaxes(gb, -1, -2))
    inner_mask = jnp.tril(jnp.ones((s, s), dtype=bool), k=-1 if strict else 0)
    inner_decay = jnp.where(lift(inner_mask, seg.ndim), jnp.exp(seg), jnp.zeros((), dt))
    inner = einsum("...nic,...ncij,...njc->...nij", xb, inner_decay, yb)

    # Across blocks: prefix of i (inclusive), suffix of j (exclusive), blocks in between.
    prefix = jnp.cumsum(gb, axis=-2)
    from_j = jnp.flip(jnp.cumsum(jnp.flip(gb, -2), axis=-2), -2)  # sum_{t >= j} in the block
    suffix = jnp.concatenate([from_j[..., 1:, :], jnp.zeros_like(from_j[..., :1, :])], axis=-2)
    totals = jnp.swapaxes(from_j[..., 0, :], -1, -2)  # (..., K, nb): each block's sum
    upto = segment_sums(totals)  # [I, J] = blocks J+1..I
    between = jnp.concatenate([jnp.zeros_like(upto[..., :1, :]), upto[..., :-1, :]], axis=-2)
    outer_mask = jnp.tril(jnp.ones((nb, nb), dtype=bool), k=-1)
    outer_decay = jnp.where(lift(outer_mask, between.ndim), jnp.exp(between), jnp.zeros((), dt))
    outer = einsum(
        "...Iic,...cIJ,...Jjc->...IiJj", xb * jnp.exp(prefix), outer_decay, yb * jnp.exp(suffix)
    )
    diagonal = einsum("...nij,nm->...nimj", inner, jnp.eye(nb, dtype=dt))
    return (outer + diagonal).reshape(*lead, c, c)


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
