"""Normalisation, chunk-major reshapes, the WY form's inverse."""

import functools as ft

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from .._precision import as_precision, einsum, PrecisionName


_L2NORM_EPS = 1e-6


def l2norm(x: Float[Array, "*batch k"]) -> Float[Array, "*batch k"]:
    r"""Normalise over the last axis: $x / \sqrt{\sum_k x_k^2 + 10^{-6}}$.

    The convention of flash-linear-attention's `use_qk_l2norm_in_kernel`.

    **Arguments:**

    - `x`: any array, normalised over its last axis.

    **Returns:**

    An array of `x`'s shape and dtype. Numerics: computed in `x`'s dtype (cast bfloat16 to
    float32 first); a zero vector stays zero, with a finite gradient.
    """
    eps = jnp.asarray(_L2NORM_EPS, x.dtype)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def chunk_major(x: Shaped[Array, "batch n c *rest"], features: int = 1) -> Array:
    """A block of chunks, chunk index first: `(B, N, C, *heads, *features)` ->
    `(N, B, *heads, C, *features)`.

    The chunk index goes first (what `prepare` must return: a scan over chunks then reads
    contiguous slices) and the position inside the chunk just before the features, so the
    per-chunk products are plain batched matmuls over the leading axes.

    **Arguments:**

    - `x`: `prepare`'s view of an input, e.g. keys `(B, N, C, H, K)` or per-head gates
        `(B, N, C, H)`.
    - `features`: how many trailing axes are features: 1 for keys and values, 0 for
        per-head gates, 2 for `(..., n_h, K)`.

    **Returns:**

    `x` transposed to `(N, B, *heads, C, *features)` (exact: no arithmetic).
    """
    heads = x.ndim - 3 - features
    if heads < 0:
        raise ValueError(
            f"`x` of shape {x.shape} has {x.ndim} axes: too few for (B, N, C) and "
            f"features={features} feature axes."
        )
    perm = (1, 0, *range(3, 3 + heads), 2, *range(3 + heads, x.ndim))
    return x.transpose(perm)


def from_chunk_major(x: Shaped[Array, "n batch *rest"], features: int = 1) -> Array:
    """The inverse of [`chunk_major`][deltanet_cp.chunkops.chunk_major]:
    `(N, B, *heads, C, *features)` -> `(B, N, C, *heads, *features)`.

    **Arguments:**

    - `x`: a chunk-major array.
    - `features`: how many trailing axes are features, as given to `chunk_major`.

    **Returns:**

    `x` transposed back to `(B, N, C, *heads, *features)` (exact: no arithmetic).
    """
    heads = x.ndim - 3 - features
    if heads < 0:
        raise ValueError(
            f"`x` of shape {x.shape} has {x.ndim} axes: too few for (N, B, C) and "
            f"features={features} feature axes."
        )
    perm = (1, 0, 2 + heads, *range(2, 2 + heads), *range(3 + heads, x.ndim))
    return x.transpose(perm)


@jax.custom_vjp
def unit_lower_inverse(a: Float[Array, "*batch c c"]) -> Float[Array, "*batch c c"]:
    r"""$(I + a)^{-1}$ for a strictly lower-triangular `a`: the WY form's $T$.

    By recursive 2x2 blocking,
    $\begin{pmatrix} I + a_{11} & 0 \\ a_{21} & I + a_{22} \end{pmatrix}^{-1} =
    \begin{pmatrix} t_{11} & 0 \\ -t_{22} a_{21} t_{11} & t_{22} \end{pmatrix}$, with both
    diagonal halves inverted together: $\log_2 C$ levels of batched matmuls, about
    $C^3 / 3$ flops, instead of a sequential triangular solve (`solve_triangular` walks the
    rows one by one and is several times slower on accelerators).

    **Arguments:**

    - `a`: strictly lower-triangular matrices `(*batch, C, C)`; the diagonal and above
        must be zero (they are not all ignored). Any `C` (padded to a power of two inside).

    **Returns:**

    $T = (I + a)^{-1}$, unit lower triangular, `(*batch, C, C)`. Numerics: each level
    multiplies true inverses (no power series), so it is as accurate as substitution,
    in `a`'s dtype with float32 products. Well conditioned when the rows of $a$ are small
    (the delta rule's $\beta_i k_i \cdot k_j$ with L2-normalised keys and
    $\beta \in [0, 1]$); entries of $T$ can grow like $2^C$ when they are not
    ($\beta$ near 2), an ill-conditioning of the system itself. The VJP is hand-written:
    $-T^\top \bar T T^\top$ on the strict lower triangle, two products.
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
    tt = jnp.swapaxes(t, -1, -2)
    da = -einsum("...ij,...jk->...ik", tt, einsum("...ij,...jk->...ik", ct, tt))
    return (jnp.tril(da, k=-1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def unit_lower_solve(
    a: Float[Array, "*abatch c c"],
    b: Float[Array, "*bbatch c d"],
    precision: PrecisionName = "highest",
) -> Float[Array, "*batch c d"]:
    r"""$(I + a)^{-1} b$ for a strictly lower-triangular `a`: the WY form's $T b$.

    The forward is [`unit_lower_inverse`][deltanet_cp.chunkops.unit_lower_inverse] and a
    product. The VJP never differentiates the inverse: with $x = (I + a)^{-1} b$ and its
    cotangent $\bar x$, $\bar b = T^\top \bar x$ and $\bar a = -\bar b\, x^\top$ on the
    strict lower triangle, two products of the forward product's size.

    **Arguments:**

    - `a`: strictly lower-triangular matrices `(*batch, C, C)`, as for
        `unit_lower_inverse`.
    - `b`: right-hand sides `(*batch, C, D)` (the batch axes broadcast against `a`'s).
    - `precision`: the policy of the product with $T$ and of the VJP's two products (see
        [`einsum`][deltanet_cp.chunkops.einsum]); $T$ itself is formed in `a`'s dtype at
        `Precision.HIGHEST` under every policy.

    **Returns:**

    $x = (I + a)^{-1} b$, `(*batch, C, D)`, in the operands' dtype (float32 for bfloat16
    products).
    """
    return _solve(a, b, as_precision(precision) or "highest")


@ft.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _solve(a: Array, b: Array, precision: PrecisionName) -> Array:
    return einsum("...ij,...jd->...id", unit_lower_inverse(a), b, precision=precision)


def _solve_fwd(a, b, precision):
    t = unit_lower_inverse(a)
    x = einsum("...ij,...jd->...id", t, b, precision=precision)
    return x, (t, x, b.shape, jnp.zeros((), b.dtype))  # (a dtype is no residual)


def _solve_bwd(precision, res, ct):
    t, x, b_shape, b_like = res
    db = einsum("...ji,...jd->...id", t, ct, precision=precision)
    da = -einsum("...id,...jd->...ij", db, x, precision=precision)
    return _reduce_to(jnp.tril(da, k=-1), t.shape), _reduce_to(db, b_shape).astype(b_like.dtype)


_solve.defvjp(_solve_fwd, _solve_bwd)


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
    """Sum a broadcast cotangent back to an operand's `shape`."""
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _inverse_pow2(a: Array) -> Array:
    n = a.shape[-1]
    if n <= 2:  # exact: a strictly lower 2 x 2 `a` has a @ a = 0
        return jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape) - a
    h = n // 2
    halves = _inverse_pow2(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
    t11, t22 = halves[0], halves[1]
    t21 = -einsum("...ij,...jk->...ik", t22, einsum("...ij,...jk->...ik", a[..., h:, :h], t11))
    top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)
