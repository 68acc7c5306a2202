r"""Pieces shared by the recurrences: input checks, decayed Gram matrices, and the chunk
algebra of the delta-rule family (DeltaNet, KDA, Gated DeltaProduct).

The delta-rule family differs only in its decays: none (DeltaNet), one per head and token
(Gated DeltaNet, Gated DeltaProduct) or one per key channel (KDA). With per-channel decays
$\Gamma_i = \mathrm{diag}(e^{G_i})$, $G_i = \sum_{t \le i} g_t$ from the chunk start, one chunk
is still an affine map of the incoming state:

    A_ij   = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (i > j)
    w      = (I + A)^-1 (beta * exp(G) * k),   u = (I + A)^-1 (beta * v)
    attn   = tril_inclusive(sum_c q_ic k_jc exp(G_ic - G_jc)),   q_g = q * exp(G)
    v_new  = u - w h
    o      = q_g h + attn v_new
    h_next = diag(gamma) h + k~^T v_new,   gamma = exp(G_C),   k~ = k * exp(G_C - G)
"""

from typing import Any, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import AffineMap
from ._gated_delta import _einsum, _lift


# A log decay per key channel, for every token and value head (KDA, GLA).
KeyGateTensor: TypeAlias = Float[Array, "batch seq vheads k"]


def _segsum(g: Float[Array, "... c"]) -> Float[Array, "... c c"]:
    """`L[i, j] = g[j+1] + ... + g[i]` for `i >= j` (0 on the diagonal), 0 above it.

    Summed directly rather than as a difference of cumulative sums, so a very negative
    gate early in the chunk costs no accuracy later in it.
    """
    c = g.shape[-1]
    strict = jnp.tril(jnp.ones((c, c), dtype=bool), k=-1)
    x = jnp.where(_lift(strict, g.ndim + 1), g[..., :, None], jnp.zeros((), g.dtype))
    return jnp.cumsum(x, axis=-2)


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
    return sizes


def check_grouped_heads(heads: int, value_heads: int) -> None:
    """Value head `j` reads key head `j // (HV // H)`: `HV` must be a multiple of `H`."""
    if value_heads % heads != 0:
        raise ValueError(
            f"The number of value heads ({value_heads}, from `v`) must be a multiple of the "
            f"number of key heads ({heads}, from `q`/`k`): value head j reads key head "
            "j // (HV // H)."
        )


def check_chunk_size(chunk_size: object) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int; got {chunk_size!r}.")


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
        gram = _einsum("...ik,...jk->...ij", x, y)
        if g is not None:
            gram = gram * jnp.exp(_segsum(g))
        return jnp.where(_lift(mask, gram.ndim), gram, jnp.zeros((), dt))

    s = _block_size(c)
    nb = c // s
    lead = x.shape[:-2]

    def blocks(a):  # (..., C, K) -> (..., nb, s, K)
        return a.reshape(*lead, nb, s, a.shape[-1])

    xb, yb, gb = blocks(x), blocks(y), blocks(g)
    # Inside each block: seg[..., n, c, i, j] = sum_{t=j+1}^{i} g_tc, summed directly.
    seg = _segsum(jnp.swapaxes(gb, -1, -2))
    inner_mask = jnp.tril(jnp.ones((s, s), dtype=bool), k=-1 if strict else 0)
    inner_decay = jnp.where(_lift(inner_mask, seg.ndim), jnp.exp(seg), jnp.zeros((), dt))
    inner = _einsum("...nic,...ncij,...njc->...nij", xb, inner_decay, yb)

    # Across blocks: prefix of i (inclusive), suffix of j (exclusive), blocks in between.
    prefix = jnp.cumsum(gb, axis=-2)
    from_j = jnp.flip(jnp.cumsum(jnp.flip(gb, -2), axis=-2), -2)  # sum_{t >= j} in the block
    suffix = jnp.concatenate([from_j[..., 1:, :], jnp.zeros_like(from_j[..., :1, :])], axis=-2)
    totals = jnp.swapaxes(from_j[..., 0, :], -1, -2)  # (..., K, nb): each block's sum
    upto = _segsum(totals)  # [I, J] = blocks J+1..I
    between = jnp.concatenate([jnp.zeros_like(upto[..., :1, :]), upto[..., :-1, :]], axis=-2)
    outer_mask = jnp.tril(jnp.ones((nb, nb), dtype=bool), k=-1)
    outer_decay = jnp.where(_lift(outer_mask, between.ndim), jnp.exp(between), jnp.zeros((), dt))
    outer = _einsum(
        "...Iic,...cIJ,...Jjc->...IiJj", xb * jnp.exp(prefix), outer_decay, yb * jnp.exp(suffix)
    )
    diagonal = _einsum("...nij,nm->...nimj", inner, jnp.eye(nb, dtype=dt))
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


class DeltaFactors(eqx.Module):
    r"""The per-chunk quantities of a delta-rule recurrence that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`. A chunk makes `s` delta
    updates (its tokens; for Gated DeltaProduct, `n_h` per token) and emits `c` outputs.

    - `w`, `u`: the WY factors, $v_\text{new} = u - w h$.
    - `attn`: the decayed causal attention from outputs to updates.
    - `q_decayed`, `k_decayed`: $q e^{G}$ and $k e^{G_C - G}$.
    - `gamma`: the decay over the whole chunk, per key channel; `None` without decay.
    """

    w: Float[Array, "n b h s k"]
    u: Float[Array, "n b h s v"]
    attn: Float[Array, "n b h c s"]
    q_decayed: Float[Array, "n b h c k"]
    k_decayed: Float[Array, "n b h s k"]
    gamma: Float[Array, "n b h k"] | None


def delta_factors(
    q: Float[Array, "*batch c k"],
    k: Float[Array, "*batch c k"],
    v: Float[Array, "*batch c v"],
    beta: Float[Array, "*batch c"],
    g: Float[Array, "*batch c"] | Float[Array, "*batch c k"] | None,
    *,
    output_rows: slice = slice(None),
) -> DeltaFactors:
    """The delta-rule chunk factors from chunked, head-major inputs `(B, HV, N, C, ...)`.

    `g` is `None` (no decay), per token `(..., C)` or per key channel `(..., C, K)`.
    `output_rows` selects the rows of `q` that produce outputs (all by default).
    """
    dt = k.dtype
    c = k.shape[-2]
    a = beta[..., :, None] * decayed_gram(k, k, g, strict=True)
    attn = decayed_gram(q, k, g, strict=False)[..., output_rows, :]
    if g is None:
        q_decayed, k_decayed, bk, gamma = q, k, beta[..., None] * k, None
    else:
        per_channel = g.ndim == k.ndim
        decay_in, decay_out = cumulative_decays(g, per_channel)
        q_decayed, k_decayed = q * decay_in, k * decay_out
        bk = beta[..., None] * decay_in * k
        gamma = jnp.broadcast_to(decay_in[..., -1, :], k.shape[:-2] + k.shape[-1:])
    eye = _lift(jnp.eye(c, dtype=dt), a.ndim)
    rhs = jnp.concatenate([bk, beta[..., None] * v], axis=-1)
    wu = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
    dk = k.shape[-1]

    def chunk_first(x: Array) -> Array:  # (B, HV, N, ...) -> (N, B, HV, ...)
        return jnp.moveaxis(x, 2, 0)

    return DeltaFactors(
        w=chunk_first(wu[..., :dk]),
        u=chunk_first(wu[..., dk:]),
        attn=chunk_first(attn),
        q_decayed=chunk_first(q_decayed[..., output_rows, :]),
        k_decayed=chunk_first(k_decayed),
        gamma=None if gamma is None else chunk_first(gamma),
    )


def _decay_state(gamma: Array | None, h: Array) -> Array:
    return h if gamma is None else gamma[..., :, None] * h


def delta_advance(f: DeltaFactors, h: Float[Array, "b h k v"]) -> Float[Array, "b h k v"]:
    """The state after one chunk, without outputs."""
    v_new = f.u - _einsum("bhsk,bhkv->bhsv", f.w, h)
    return _decay_state(f.gamma, h) + _einsum("bhsk,bhsv->bhkv", f.k_decayed, v_new)


def delta_step(f: DeltaFactors, h: Float[Array, "b h k v"]) -> tuple[Array, Array]:
    """The state after one chunk, and the chunk's outputs `(B, HV, c, V)`."""
    v_new = f.u - _einsum("bhsk,bhkv->bhsv", f.w, h)
    o = _einsum("bhck,bhkv->bhcv", f.q_decayed, h) + _einsum("bhcs,bhsv->bhcv", f.attn, v_new)
    h_next = _decay_state(f.gamma, h) + _einsum("bhsk,bhsv->bhkv", f.k_decayed, v_new)
    return h_next, o


def delta_chunk_map(f: DeltaFactors) -> AffineMap:
    """One chunk as a dense map: `M = diag(gamma) - k~^T w`, `U = k~^T u`."""
    dk = f.w.shape[-1]
    eye = _lift(jnp.eye(dk, dtype=f.w.dtype), f.w.ndim)
    m = _decay_state(f.gamma, eye) - _einsum("bhsk,bhsj->bhkj", f.k_decayed, f.w)
    return AffineMap(m, _einsum("bhsk,bhsv->bhkv", f.k_decayed, f.u))


def delta_compose(f: DeltaFactors, running: AffineMap) -> AffineMap:
    """`running.then(delta_chunk_map(f))` in low-rank form: `M <- diag(gamma) M - k~^T (w M)`,
    `2 K^2 s` per chunk instead of a dense `K^3` product."""
    wm = _einsum("bhsk,bhkj->bhsj", f.w, running.M)
    m = _decay_state(f.gamma, running.M) - _einsum("bhsk,bhsj->bhkj", f.k_decayed, wm)
    return AffineMap(m, delta_advance(f, running.U))
