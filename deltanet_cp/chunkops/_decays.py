"""Sums of log decays and the decayed Gram matrices they weigh."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._precision import as_precision, PrecisionName
from ._ops import einsum


# Log decays at or below this are a decay of exactly zero in float32 and float64 (exp(-1e4)
# underflows in both); clamping there keeps -inf out of sums and products (0 * -inf = NaN).
_LOG_ZERO = -1e4


def cumsum(x: Array, axis: int, reverse: bool = False) -> Array:
    r"""Inclusive cumulative sums along `axis` (from the end if `reverse`), fast.

    XLA's `cumsum` is a reduction window as long as the axis for every element ($n^2$ adds);
    here an axis longer than 8 is cut into blocks of 8, summed inside each block and then
    across the blocks' totals (about $2 \cdot 8$ adds per element).

    **Arguments:**

    - `x`: any array.
    - `axis`: the axis to sum along.
    - `reverse`: sum from the end: `out[i] = x[i] + ... + x[n - 1]`.

    **Returns:**

    An array of `x`'s shape. Numerics: every sum adds its terms directly (no differences),
    so sums of terms of one sign (log decays) are accurate to a relative $n\epsilon$ however
    large; a $-\infty$ term makes the sums that contain it $-\infty$ (NaN only with a
    $+\infty$ beside it).
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


def segment_sums(g: Float[Array, "*batch c"]) -> Float[Array, "*batch c c"]:
    r"""The log decay between every two tokens of a chunk: $L_{ij} = g_{j+1} + \dots + g_i$.

    So $e^{L_{ij}}$ is the decay from token $j$ to token $i$, $e^{G_i - G_j}$.

    **Arguments:**

    - `g`: log decays $\le 0$ over the last axis, e.g. per head `(N, B, H, C)`.

    **Returns:**

    `L` of shape `(*batch, C, C)`: $L_{ij}$ for $i \ge j$ (0 on the diagonal), 0 above it
    (mask it before `exp` where the upper triangle must vanish). Numerics: each segment is
    summed directly (one product with a constant 0/1 tensor, $O(C^3)$ flops: meant for
    chunks of up to a few hundred), so a very negative gate before $j$ costs no accuracy
    in $L_{ij}$; gates below $-10^4$ ($-\infty$ included) count as $-10^4$, a decay of
    exactly zero in float32 and float64, with a zero gradient.
    """
    c = g.shape[-1]
    t, i, j = np.ogrid[:c, :c, :c]
    inside = jnp.asarray((j < t) & (t <= i), g.dtype)  # (t, i, j)
    return einsum("...t,tij->...ij", jnp.maximum(g, jnp.asarray(_LOG_ZERO, g.dtype)), inside)


def cumulative_decays(
    g: Float[Array, "*batch c"] | Float[Array, "*batch c k"], per_channel: bool
) -> tuple[Array, Array]:
    r"""The decays into and out of a chunk: $(e^{G_i}, e^{G_C - G_i})$, $G_i = \sum_{t \le i} g_t$.

    $e^{G_i}$ carries the chunk's incoming state to token $i$ ($q_i e^{G_i}$ reads it) and
    $e^{G_C - G_i}$ carries token $i$'s write to the chunk's end ($k_i e^{G_C - G_i}$);
    the chunk's own decay $e^{G_C}$ is the first one's last row.

    **Arguments:**

    - `g`: log decays $\le 0$, per head `(*batch, C)` or per key channel `(*batch, C, K)`.
    - `per_channel`: whether `g` has the trailing key axis.

    **Returns:**

    Two arrays `(*batch, C, K)` for per-channel gates, `(*batch, C, 1)` for per-head ones
    (to broadcast against `(*batch, C, K)` rows). Numerics: $G_i$ and $G_C - G_i$ are both
    sums of gates taken directly (the second from the end, by
    [`cumsum`][deltanet_cp.chunkops.cumsum]), so neither loses accuracy to cancellation;
    both decays are at most 1, and $-\infty$ gates give decays of exactly 0.
    """
    if not per_channel:
        g = g[..., None]
    total = cumsum(g, -2)
    after = shift_up(cumsum(g, -2, reverse=True))  # sum_{t > i}
    return jnp.exp(total), jnp.exp(after)


def exclusive_decays(
    g: Float[Array, "*batch c"] | Float[Array, "*batch c k"], per_channel: bool
) -> Array:
    r"""The decays from the chunk start to just before each token: $e^{G_{i-1}}$.

    $G_{i-1} = \sum_{t < i} g_t$ (so the first row is 1): what carries the chunk's
    incoming state to token $i$ when token $i$ reads the state *before* its own update
    (a momentum or a delta term formed from $h_{i-1}$), where
    [`cumulative_decays`][deltanet_cp.chunkops.cumulative_decays] gives $e^{G_i}$.

    **Arguments:**

    - `g`: log decays $\le 0$, per head `(*batch, C)` or per key channel `(*batch, C, K)`.
    - `per_channel`: whether `g` has the trailing key axis.

    **Returns:**

    An array `(*batch, C, K)` for per-channel gates, `(*batch, C, 1)` for per-head ones.
    Numerics: each exponent is a direct sum of gates (no differences), every decay is at
    most 1, and $-\infty$ gates give decays of exactly 0 from the next token on.
    """
    if not per_channel:
        g = g[..., None]
    return jnp.exp(shift_down(cumsum(g, -2)))


def decay_matrix(g: Float[Array, "*batch c"], strict: bool = False) -> Float[Array, "*batch c c"]:
    r"""The decays between every two tokens of a chunk: $D_{ij} = e^{G_i - G_j}$ below the
    diagonal, 0 above it.

    $e^{L}$ of [`segment_sums`][deltanet_cp.chunkops.segment_sums] with the upper triangle
    set to $-\infty$ *before* the `exp` (masking after it would multiply overflowing or
    NaN entries by 0). Per-head decays; for per-channel ones use
    [`decayed_gram`][deltanet_cp.chunkops.decayed_gram], which never forms a
    $(C, C, K)$ tensor.

    **Arguments:**

    - `g`: log decays $\le 0$ over the last axis, e.g. per head `(N, B, H, C)`.
    - `strict`: zero the diagonal too ($i > j$ only); by default it is 1.

    **Returns:**

    `D` of shape `(*batch, C, C)`: $e^{g_{j+1} + \dots + g_i}$ for $i \ge j$ ($i > j$ if
    `strict`), 0 elsewhere. Numerics: as `segment_sums`; every entry is at most 1, and its
    gradient is finite for any gates, $-\infty$ included.
    """
    c = g.shape[-1]
    i, j = np.ogrid[:c, :c]
    keep = (i > j) if strict else (i >= j)
    return jnp.exp(jnp.where(keep, segment_sums(g), jnp.asarray(-jnp.inf, g.dtype)))


def decayed_gram(
    x: Float[Array, "*batch c k"],
    y: Float[Array, "*batch c k"],
    g: Float[Array, "*batch c k"] | Float[Array, "*batch c"] | None,
    strict: bool = False,
    precision: PrecisionName = "highest",
) -> Float[Array, "*batch c c"]:
    r"""The decayed products of two sets of rows, $\sum_c x_{ic} y_{jc} e^{G_{ic} - G_{jc}}$.

    For queries and keys, $P$ is the chunk's causal decayed attention; for keys and keys
    (strictly lower, times $\beta_i$), the delta rule's $A$ of the WY form.

    **Arguments:**

    - `x`, `y`: rows `(*batch, C, K)`.
    - `g`: log decays $\le 0$: per key channel `(*batch, C, K)`, per head `(*batch, C)`,
        or `None` (no decay).
    - `strict`: zero the diagonal too (for $A$); by default it is kept (for attention).
    - `precision`: the policy of the products of `x` and `y` (see
        [`einsum`][deltanet_cp.chunkops.einsum]); the decays are formed in `g`'s dtype at
        `Precision.HIGHEST` under every policy.

    **Returns:**

    `P` of shape `(*batch, C, C)`, zero above the diagonal. Numerics: exact to float32
    rounding for any gates, $-\infty$ included (see the module's notes): per head, the
    Gram times $e^{L}$ with $L$ from [`segment_sums`][deltanet_cp.chunkops.segment_sums];
    per channel, [`decayed_grams`][deltanet_cp.chunkops.decayed_grams] (hand-written VJP).
    """
    c = x.shape[-2]
    if g is None or g.ndim == x.ndim - 1:
        gram = einsum("...ik,...jk->...ij", x, y, precision=precision)
        if g is not None:
            gram = gram * jnp.exp(segment_sums(g))
        return jnp.tril(gram, k=-1 if strict else 0)
    if g.shape[-2:] != (c, x.shape[-1]):
        raise ValueError(
            f"`g` must be per head (*batch, C) or per key channel (*batch, C, K) with "
            f"(C, K) = {x.shape[-2:]}; got shape {g.shape}."
        )
    grams = decayed_grams(x[..., None, :], y[..., None, :], g, strict, precision)
    return grams[..., :, 0, :, 0]


def decayed_grams(
    x: Float[Array, "*xbatch c p k"],
    y: Float[Array, "*ybatch c q k"],
    g: Float[Array, "*batch c k"],
    strict: bool = False,
    precision: PrecisionName = "highest",
) -> Float[Array, "*batch c p c q"]:
    r"""Every decayed Gram of `P` left and `Q` right factors under one per-channel decay.

    `out[..., i, p, j, q]` $= \sum_c x_{ipc}\, y_{jqc}\, e^{\sum_{t=j+1}^{i} g_{tc}}$ for
    $i \ge j$ ($i > j$ if `strict`), zero above. One call forms, say, the delta rule's
    $\beta k k^\top$ and $q k^\top$ together: `x = stack([beta * k, q], -2)`,
    `y = k[..., None, :]`.

    **Arguments:**

    - `x`: left rows `(*xbatch, C, P, K)`, the `P` factors interleaved with the rows.
    - `y`: right rows `(*ybatch, C, Q, K)`.
    - `g`: log decays $\le 0$ per key channel, `(*batch, C, K)`. The batch axes of `x`,
        `y` and `g` broadcast together (one key head's rows for all the value heads that
        read it, each with its own decay).
    - `strict`: zero the diagonal too.
    - `precision`: the policy of the level products of the decayed rows, forward and VJP
        (see [`einsum`][deltanet_cp.chunkops.einsum]); the decays and their sums are
        formed in `g`'s dtype under every policy.

    **Returns:**

    An array `(*batch, C, P, C, Q)`, `*batch` the broadcast batch axes.

    **Numerics.** $e^{G_i - G_j}$ cannot be split into $e^{G_i} e^{-G_j}$ (overflows for
    strong decays) nor formed from a difference of cumulative sums, and the exact per-pair
    segment sum is a $(C, C, K)$ tensor. Instead the chunk is halved recursively: a pair
    $i > j$ on either side of a midpoint $m$ factors exactly as
    $e^{\sum_{t=m+1}^{i} g_t} e^{\sum_{t=j+1}^{m} g_t}$, two direct sums of gates of one
    sign (accurate to a relative $\epsilon$), each factor at most 1 (no overflow). So the
    result is exact to float32 rounding for any gates, $-\infty$ included. Each of the
    $\log_2 C$ levels is one batched product: the flops of one plain Gram and $O(CK)$
    memory per level ($C$ need not be a power of two). The VJP is hand-written and
    recomputes each level: nothing but the arguments is kept for the backward; its
    gradients are finite for any gates, $-\infty$ included (such a gate's own gradient is 0).
    """
    # The batch axes broadcast together and flattened into one, so that no array inside is of
    # rank above 6: XLA:CPU's YNNPACK reduce fusions (jaxlib 0.10) return wrong numbers or
    # crash on sums over small axes of rank-7 and rank-8 products (see tests/test_default_flags.py).
    batch = _batch(x, y, g)
    size = int(np.prod(batch, dtype=np.int64))

    def flat(a, trailing):
        a = jnp.broadcast_to(a, (*batch, *a.shape[a.ndim - trailing :]))
        return a.reshape(size, *a.shape[a.ndim - trailing :])

    out = grams_vjp(
        flat(x, 3), flat(y, 3), flat(g, 2), strict, as_precision(precision) or "highest"
    )
    return out.reshape(*batch, *out.shape[1:])


# The recursive-halving Gram and its VJP. On a CPU every level is bound by memory traffic and by
# how XLA:CPU runs small pieces: every product is a batched matmul, however small (a multiply and
# a sum over K is several times slower), and the sums over the few factors are unrolled adds
# (XLA:CPU's reduce fusion is slow on them).


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


def _small_sum(x: Array, axis: int) -> Array:
    """`x` summed over a short `axis` (a few factors) by unrolled adds."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    return ft.reduce(jnp.add, parts)


def _level_decays(g: Array, groups: int) -> tuple[Array, Array]:
    """At one level: `exp(sum_{t=m+1}^{i} g_t)` for the upper halves' rows `i` and
    `exp(sum_{t=j+1}^{m} g_t)` for the lower halves' rows `j` (`m` the group's midpoint),
    each `(..., groups, h, 1, K)` (to broadcast over the factors)."""
    lower, upper = _halves(g, groups, 1)
    after = shift_up(cumsum(lower, -2, reverse=True))  # sum_{t > j} inside the lower half
    return jnp.exp(cumsum(upper, -2))[..., None, :], jnp.exp(after)[..., None, :]


def shift_up(x: Array) -> Array:
    """Rows of `x` `(..., n, K)` moved up by one, a zero row at the bottom."""
    return jnp.concatenate([x[..., 1:, :], jnp.zeros_like(x[..., :1, :])], -2)


def shift_down(x: Array, fill: float = 0.0) -> Array:
    """Rows of `x` `(..., n, K)` moved down by one, a row of `fill` on top."""
    return jnp.concatenate([jnp.full_like(x[..., :1, :], fill), x[..., :-1, :]], -2)


def _pad_rows(x: Array, n: int, *axes: int) -> Array:
    pad = [(0, 0)] * x.ndim
    for axis in axes:
        pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad) if any(p != (0, 0) for p in pad) else x


def _level(x, y, g, half, n):
    """The decays of the upper and lower rows at the level whose groups are `2 half` rows,
    and those rows decayed: upper `(..., G, h, P, K)`, lower `(..., G, h, Q, K)`."""
    groups = n // (2 * half)
    up, low = _level_decays(g, groups)
    return up, low, _halves(x, groups, 2)[1] * up, _halves(y, groups, 2)[0] * low


def _grams(x, y, g, strict, precision):
    c = x.shape[-3]
    n = 1 << (c - 1).bit_length()
    x, y, g = _pad_rows(x, n, -3), _pad_rows(y, n, -3), _pad_rows(g, n, -2)
    p, q = x.shape[-2], y.shape[-2]
    shape = (*_batch(x, y, g), n, 1, p, 1, q)
    if strict:
        m = jnp.zeros(shape, x.dtype)
    else:
        m = jnp.broadcast_to(_diagonal(x, y, precision)[..., :, None, :, None, :], shape)
    half = 1
    while half < n:
        *_, xs, ys = _level(x, y, g, half, n)
        lead = xs.shape[:-3]
        rows, cols = xs.reshape(*lead, -1, xs.shape[-1]), ys.reshape(*lead, -1, ys.shape[-1])
        cross = _products(rows, cols, precision)
        cross = cross.reshape(*lead, half, p, half, q)
        m = m.reshape(*lead, 2, *m.shape[-4:])  # the previous level's blocks, in pairs
        m0, m1 = m[..., 0, :, :, :, :], m[..., 1, :, :, :, :]  # (..., G, h, P, h, Q) each
        top = jnp.concatenate([m0, jnp.zeros_like(cross)], -2)
        bottom = jnp.concatenate([cross, m1], -2)
        m = jnp.concatenate([top, bottom], -4)
        half *= 2
    return m[..., 0, :c, :, :c, :]


def _products(a: Array, b: Array, precision: PrecisionName) -> Array:
    """`a @ b^T` for rows `(..., A, K)` and `(..., B, K)`."""
    return einsum("...ak,...bk->...ab", a, b, precision=precision)


def _combine(w: Array, b: Array, precision: PrecisionName) -> Array:
    """`w @ b` for `(..., A, B)` and rows `(..., B, K)`."""
    return einsum("...ab,...bk->...ak", w, b, precision=precision)


def _diagonal(x: Array, y: Array, precision: PrecisionName) -> Array:
    """Every row's own products, `x_i y_i^T` `(..., n, P, Q)` for rows `(..., n, P, K)` and
    `(..., n, Q, K)`. For `P, Q >= 2` as the products of pairs of rows, one `(2P, K) x
    (K, 2Q)` product per pair whose two diagonal blocks are kept: on a CPU a batch of
    `2 x 2` products takes about twice as long as one of `4 x 4`."""
    if x.shape[-3] % 2 or min(x.shape[-2], y.shape[-2]) < 2:
        return _products(x, y, precision)
    p, q = x.shape[-2], y.shape[-2]
    pairs = _products(_pairs(x), _pairs(y), precision)  # (..., n / 2, 2P, 2Q)
    return jnp.stack([pairs[..., :p, :q], pairs[..., p:, q:]], -3).reshape(
        *pairs.shape[:-3], -1, p, q
    )


def _pairs(x: Array) -> Array:
    """Rows `(..., n, P, K)` -> pairs of rows `(..., n / 2, 2P, K)` (no copy)."""
    return x.reshape(*x.shape[:-3], x.shape[-3] // 2, 2 * x.shape[-2], x.shape[-1])


def _grams_fwd(x, y, g, strict, precision):
    return _grams(x, y, g, strict, precision), (x, y, g)


def _grams_bwd(strict, precision, res, ct):
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
        diag = jnp.moveaxis(jnp.diagonal(ct, axis1=-4, axis2=-2), -1, -3)  # (..., n, P, Q)
        dx = _sum_to(_combine(diag, y, precision), x.shape)
        dy = _sum_to(_combine(jnp.swapaxes(diag, -1, -2), x, precision), y.shape)
    dg = jnp.zeros((*full, *g.shape[-2:]), g.dtype)

    def level(half, carry):
        dx, dy, dg = carry
        up, low, xs, ys = _level(x, y, g, half, n)
        groups = n // (2 * half)
        # The cross blocks' cotangents: rows of the upper half, columns of the lower half.
        rows = [slice((2 * i + 1) * half, (2 * i + 2) * half) for i in range(groups)]
        cols = [slice(2 * i * half, (2 * i + 1) * half) for i in range(groups)]
        d_cross = jnp.stack([ct[..., r, :, c, :] for r, c in zip(rows, cols)], axis=-5)
        d_cross = d_cross.reshape(*d_cross.shape[:-4], half * p, half * q)
        lead = d_cross.shape[:-2]
        d_xs = _combine(d_cross, ys.reshape(*lead, -1, ys.shape[-1]), precision)
        d_ys = _combine(
            jnp.swapaxes(d_cross, -1, -2), xs.reshape(*lead, -1, xs.shape[-1]), precision
        )
        d_xs, d_ys = d_xs.reshape(xs.shape), d_ys.reshape(ys.shape)
        d_up = _small_sum(d_xs * xs, -2)  # d(sum_{m<t<=i} g_t)
        d_low = _small_sum(d_ys * ys, -2)  # d(sum_{j<t<=m} g_t)
        dg_up = cumsum(d_up, -2, reverse=True)  # sum over i >= t
        dg_low = shift_down(cumsum(d_low, -2))  # sum over j < t
        dx = dx + _sum_to(_unhalves(jnp.zeros_like(d_xs), d_xs * up, 2), x.shape)
        dy = dy + _sum_to(_unhalves(d_ys * low, jnp.zeros_like(d_ys), 2), y.shape)
        return dx, dy, dg + _unhalves(dg_low, dg_up, 1)

    # The levels one after another in a loop (each a branch of a switch): unrolled, XLA
    # schedules every level's decays and products before their sums and holds them all.
    # The first level outside it, so the carry has the types (and, under `shard_map`, the
    # varying axes) of everything that flows into it.
    levels = [ft.partial(level, 1 << i) for i in range(n.bit_length() - 1)]
    if levels:
        dx, dy, dg = levels[0]((dx, dy, dg))
    if len(levels) > 1:  # (a switch needs at least one branch)
        dx, dy, dg = jax.lax.fori_loop(
            1, len(levels), lambda i, carry: jax.lax.switch(i - 1, levels[1:], carry), (dx, dy, dg)
        )
    return dx[..., :c, :, :], dy[..., :c, :, :], _sum_to(dg[..., :c, :], res[2].shape)


def _batch(x: Array, y: Array, g: Array) -> tuple[int, ...]:
    """The batch shape of `decayed_grams`: its arguments' batch axes broadcast together."""
    return jnp.broadcast_shapes(x.shape[:-3], y.shape[:-3], g.shape[:-2])


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """`x` summed over the axes that `shape` broadcasts (size 1 there, not in `x`)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


grams_vjp = jax.custom_vjp(_grams, nondiff_argnums=(3, 4))
grams_vjp.defvjp(_grams_fwd, _grams_bwd)
