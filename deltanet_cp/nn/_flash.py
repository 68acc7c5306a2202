"""The blockwise (flash-style) causal attention kernel, on one device and context parallel.

The scores are computed one `(block, block)` tile at a time with an online softmax, so no
rank ever holds more than one tile of them; the tiles computed are a static schedule of the
block pairs the causal mask needs (`_schedule.py`), so the tiles wholly in the future of
their queries cost nothing.

Under context parallelism each rank attends from its own queries to the keys and values of
the whole sequence, which it obtains by one all-gather or by passing them around a ring:
a payload of `(cp - 1) / cp * S * 2 * kv_heads * head_dim` elements per rank and layer
either way, growing with the sequence length `S`. With the zigzag layout every rank does
the same causal work. The all-gather holds the whole sequence's keys and values on every
rank; the ring, one rank's piece at a time, forward and backward (`_ring`).

Every entry point takes a resolved precision policy (`.._precision`): the tile products
(`q k^T` and `p v`, in the backward `do v^T`, `ds k`, `ds^T q` and `p^T do`) multiply under
it, while the softmax statistics (running max, denominator, log-sum-exp), the accumulators
and the gradients' sums stay in the accumulation dtype whatever the policy.

With packed documents (`cu_seqlens`) a query sees the keys of its own document only, and
the tiles that leaves without a visible pair are dropped from the list (`document_tiles`).

A non-finite query, key or value reaches only the queries that see it (`mark_non_finite`):
a masked score gives a zero weight, and `0 * nan` in the weights' product with the values
would otherwise carry a NaN to every query of the tile, forward and backward. Likewise a
non-finite cotangent of one query's output (a later layer's NaN) reaches only that query's
`dq` and the `dk`, `dv` of the keys it sees (`_flash_grad_prep`).
"""

import functools as ft
from collections.abc import Callable
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._parallel import ContextParallel, Contiguous
from .._precision import accumulation_dtype, as_precision, einsum, PrecisionName
from .._sharding import cotangent_like, varying
from ._context import document_starts
from ._schedule import check_kv_schedule, Schedule, tile_loops, tile_side, tiling


_HI = jax.lax.Precision.HIGHEST

# ---------------------------------------------------------------------------------------
# The blockwise kernel
# ---------------------------------------------------------------------------------------


def check_precision(precision: object) -> PrecisionName:
    """`precision` if it is a policy name; a `ValueError` otherwise (`None` included: the
    layer resolves it from its inputs before calling the kernel)."""
    name = as_precision(precision)
    if name is None:
        raise ValueError(
            "the attention kernel takes a resolved `precision` ('highest', 'bfloat16' or "
            "'default'); resolve None with `resolve_precision` first."
        )
    return name


def _dot(spec: str, x: Array, y: Array, precision: PrecisionName, acc) -> Array:
    """A tile product in the accumulation dtype `acc`: under `"highest"` at
    `Precision.HIGHEST` on the operands as given; otherwise `einsum` under the policy
    (`"bfloat16"`: bfloat16 operands, accumulated in `acc`)."""
    if precision == "highest":
        return jnp.einsum(spec, x, y, precision=_HI, preferred_element_type=acc)
    return einsum(spec, x, y, precision=precision).astype(acc)


def _tile_loop(tiles: Array, count: Array, body, init):
    """`fori_loop(0, count, body, init)`: the loop over the tiles of one row of `tiles`."""
    return jax.lax.fori_loop(jnp.zeros((), count.dtype), count, body, init)


def _tile(tiles: Array, row: Array, t: Array) -> tuple[Array, Array]:
    """Tile `t` of row `row` of the table: (query block, key block)."""
    ij = jax.lax.dynamic_slice(tiles, (row, t, jnp.zeros_like(t)), (1, 1, 2))
    return ij[0, 0, 0], ij[0, 0, 1]


def _take(x: Array, i: Array) -> Array:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(x: Array, y: Array, i: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), i, 0)


def _rows_finite(x: Array) -> Array:
    """Whether each row (the last axis: one token's vector for one head) is finite."""
    return jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)


def mark_non_finite(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    """`(q, k, v)` with their non-finite rows made harmless to the queries that do not see
    them: a query row holding a NaN or infinity becomes NaN, and so does the key of a key
    or value row that does, whose value becomes 0.

    A masked score gives a weight of exactly 0, which times a NaN value would still be NaN
    in the weights' product with the values. Zero values make it 0, and the NaN key makes
    the score NaN for the queries that do see the key, whose running maximum, and so
    output, then turn NaN (their log-sum-exp too; see `_flash_finish`). The backward drops
    the rows whose output is NaN (`_flash_grad_prep`) and multiplies finite copies of the
    queries and keys (`_finite`), so that a NaN reaches no other query's gradients either.
    Finite inputs pass unchanged.
    """
    ok = _rows_finite(k) & _rows_finite(v)
    q = jnp.where(_rows_finite(q), q, jnp.nan)
    return q, jnp.where(ok, k, jnp.nan), jnp.where(ok, v, 0)


def _finite(x: Array) -> Array:
    """`x` with its non-finite entries (the rows `mark_non_finite` made NaN) read as 0."""
    return jnp.where(jnp.isfinite(x), x, 0)


def _tile_scores(q, k, pos_q, pos_k, starts, i, j, acc, precision):
    """Scores of tile `(i, j)`, `(heads, block, block)`, and the mask of the tile: causal,
    and with `starts` (per query, its document's first position) within each document."""
    s = _dot("qhd,khd->hqk", _take(q, i), _take(k, j), precision, acc)
    pos_k_j = _take(pos_k, j)[None, :]
    mask = _take(pos_q, i)[:, None] >= pos_k_j
    if starts is not None:
        mask = mask & (_take(starts, i)[:, None] <= pos_k_j)
    return s, mask[None]


def document_tiles(
    schedule: tuple[Array, Array, Array], starts: Array | None, pos_k: Array
) -> tuple[Array, Array, Array]:
    """The listed tiles `(tiles, row, count)` less those whose keys all precede the
    document start of every query of the tile (`starts`, `(nq, block)`, or `None`: all of
    them), as a table of one row: the kept tiles first, in their order, and their count.

    A kept tile holds a visible (query, key) pair: its last key is at or after the first
    query's document start, and (a listed tile holds a causal pair; a block's positions
    are consecutive) before that query, or one of the tile's queries itself. So the loop
    over tiles runs exactly the tiles the document mask leaves: a packed row costs what
    its documents cost apart, up to the tiles that straddle a document boundary.
    """
    if starts is None:
        return schedule
    tiles, row, count = schedule
    listed = jax.lax.dynamic_index_in_dim(tiles, row, 0, keepdims=False)  # (pairs, 2)
    first_q = jnp.min(starts, axis=1)
    last_k = jnp.max(pos_k, axis=1)
    listed_here = jnp.arange(listed.shape[0], dtype=count.dtype) < count
    need = (first_q[listed[:, 0]] <= last_k[listed[:, 1]]) & listed_here
    order = jnp.argsort(~need, stable=True)
    return listed[order][None], jnp.zeros((), row.dtype), jnp.sum(need, dtype=count.dtype)


def _flash_init(q: Array, v: Array, like) -> tuple[Array, Array, Array]:
    """The empty online-softmax state of queries `q` attending to values `v` (of their own
    head dimension): (unnormalised output, running max, running denominator), in the
    accumulation dtype, varying wherever `like` does."""
    nq, b, h, _ = q.shape
    acc = accumulation_dtype(q)
    init = (
        jnp.zeros((nq, b, h, v.shape[-1]), acc),
        jnp.full((nq, h, b), jnp.finfo(acc).min, acc),
        jnp.zeros((nq, h, b), acc),
    )
    return varying(init, like)


def _flash_steps(q, k, v, pos_q, pos_k, starts, tiles, row, count, state, precision):
    """Run the listed tiles into the online-softmax `state` (see `_flash_init`), the tile
    products under `precision`."""
    acc = accumulation_dtype(q)

    def body(t, carry):
        o, m, denom = carry
        i, j = _tile(tiles, row, t)
        s, mask = _tile_scores(q, k, pos_q, pos_k, starts, i, j, acc, precision)
        s = jnp.where(mask, s, -jnp.inf)
        m_old = _take(m, i)
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m_old - m_new)
        l_new = alpha * _take(denom, i) + jnp.sum(p, axis=-1)
        pv = _dot("hqk,khd->qhd", p.astype(v.dtype), _take(v, j), precision, acc)
        o_new = alpha.T[..., None] * _take(o, i) + pv
        return _put(o, o_new, i), _put(m, m_new, i), _put(denom, l_new, i)

    return _tile_loop(tiles, count, body, state)


def _flash_finish(state: tuple[Array, Array, Array]) -> tuple[Array, Array]:
    """`(out, lse)` from an online-softmax state: 0 and `-inf` where no key was seen, NaN
    and NaN where a NaN score was (a query that saw a non-finite key, or is one)."""
    o, m, denom = state
    seen = denom > 0
    safe_l = jnp.where(seen, denom, 1)
    out = o / safe_l.transpose(0, 2, 1)[..., None]
    unseen = jnp.where(jnp.isnan(denom), jnp.nan, -jnp.inf)
    lse = jnp.where(seen, m + jnp.log(safe_l), unseen)
    return out, lse


def _flash_forward(precision, q, k, v, pos_q, pos_k, starts, tiles, row, count):
    state = _flash_init(q, v, (q, k, v, pos_q, pos_k, starts, tiles, row, count))
    state = _flash_steps(q, k, v, pos_q, pos_k, starts, tiles, row, count, state, precision)
    return _flash_finish(state)


def flash(
    q,
    k,
    v,
    pos_q,
    pos_k,
    tiles,
    row,
    count,
    *,
    precision: PrecisionName = "highest",
    gather: str | None = None,
    starts=None,
):
    """Blockwise causal attention over a list of tiles, with an online softmax.

    **Arguments:**

    - `q`: the queries in blocks, `(nq, block, heads, dim)`, already scaled.
    - `k`, `v`: the keys and values in blocks, `(nk, block, heads, dim)` and
        `(nk, block, heads, v_dim)` (the values' head dimension may differ).
    - `pos_q`, `pos_k`: the global positions of the queries and keys, `(nq, block)` and
        `(nk, block)`; query `a` sees key `c` iff `pos_q[a] >= pos_k[c]`.
    - `tiles`, `row`: the tiles to compute are `tiles[row, t]` for `t < count`, each a
        (query block, key block) pair; `tiles` is `(rows, pairs, 2)` int32 (one row per
        rank), `row` an int32 scalar (may be traced). Tiles not listed are not computed.
    - `count`: how many of the listed tiles to compute (an int32 scalar, may be traced).
    - `precision`: the policy of the tile products, forward and backward (`"highest"`,
        `"bfloat16"` or `"default"`); the softmax statistics and accumulators stay in the
        accumulation dtype.
    - `gather`: a mesh axis name, or `None`. With a name, `k` and `v` are this rank's
        blocks, all-gathered (tiled, in their own dtype) over that axis into the whole
        sequence's before the tiles run (`pos_k` then the gathered keys' positions); in
        the backward their gradients are reduce-scattered back in the accumulation dtype
        and only then cast to the inputs' dtype, so the sum over the ranks' queries is
        not rounded to bfloat16.
    - `starts`: per query, the first position it sees, `(nq, block)` (its document's
        start, for packed documents: query `a` then sees key `c` iff
        `starts[a] <= pos_k[c] <= pos_q[a]`), or `None` (no such bound).

    **Returns:**

    `(out, lse)`: the normalised output `(nq, block, heads, v_dim)` and the log-sum-exp of
    each query's visible scores `(nq, heads, block)`, both in the accumulation dtype. A
    query that sees no key gets output 0 and log-sum-exp `-inf`. Partial results over
    disjoint keys merge with `logaddexp`; gradients flow through both outputs.

    A query that sees a non-finite key or value row (a head of one token), or holds a
    non-finite value itself, gets output and log-sum-exp NaN in that head, and takes no
    part in the backward (its cotangent is not read); no other query's output or gradient
    changes (`mark_non_finite`).
    """
    precision = check_precision(precision)
    return _flash_vjp(precision, gather, q, k, v, pos_q, pos_k, starts, tiles, row, count)


def _gathered(x: Array, gather: str | None) -> Array:
    """`x` all-gathered (tiled) over the mesh axis `gather`; `x` itself if `None`."""
    return x if gather is None else jax.lax.all_gather(x, gather, axis=0, tiled=True)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_vjp(precision, gather, q, k, v, pos_q, pos_k, starts, tiles, row, count):
    q, k, v = mark_non_finite(q, k, v)
    k, v = _gathered(k, gather), _gathered(v, gather)
    return _flash_forward(precision, q, k, v, pos_q, pos_k, starts, tiles, row, count)


def _flash_fwd(precision, gather, q, k, v, pos_q, pos_k, starts, tiles, row, count):
    q, k, v = mark_non_finite(q, k, v)
    k, v = _gathered(k, gather), _gathered(v, gather)
    out, lse = _flash_forward(precision, q, k, v, pos_q, pos_k, starts, tiles, row, count)
    return (out, lse), (q, k, v, pos_q, pos_k, starts, tiles, row, count, out, lse)


def _flash_grad_prep(out, lse, d_out, d_lse):
    """`(d_out, lse, delta, keep, bad)` for `_flash_grad_steps`: the output's cotangent in
    the accumulation dtype, the log-sum-exp with `-inf` (no key seen) made 0,
    `delta = rowsum(d_out * out) - d_lse`, `(nq, heads, block)`, where the output is not
    NaN (`keep`, `(nq, heads, block)`), and where, among those, the cotangent is not
    finite (`bad`, the same shape).

    A query whose output is NaN (it saw a non-finite key, or is one: `mark_non_finite`)
    takes no part in the backward: its cotangent and `delta` are made 0 and its tiles'
    weights are masked, so that `0 * nan` carries no NaN to the keys it shares a tile with.
    A query with a non-finite cotangent (of `d_out` or `d_lse`: a later layer's NaN) is
    multiplied as if its cotangent were 0, for the same reason; `_flash_grad_steps` then
    makes its own `dq` NaN, and the `dk` and `dv` of every key it sees, as attending per
    document would.
    """
    acc = out.dtype
    keep = ~jnp.isnan(lse)
    finite = _rows_finite(d_out)[..., 0].transpose(0, 2, 1)
    if d_lse is not None:
        finite = finite & jnp.isfinite(d_lse)
    d_out = jnp.where((keep & finite).transpose(0, 2, 1)[..., None], d_out.astype(acc), 0)
    delta = jnp.sum(d_out * out, axis=-1).transpose(0, 2, 1)
    if d_lse is not None:
        delta = delta - jnp.where(finite, d_lse, 0).astype(acc)
    delta = jnp.where(keep, delta, 0)
    return d_out, jnp.where(jnp.isfinite(lse), lse, 0), delta, keep, keep & ~finite


def _flash_grad_steps(q, k, v, pos_q, pos_k, starts, tiles, row, count, prep, grads, precision):
    """Add the listed tiles' gradients to `grads = (dq, dk, dv)` (accumulation dtype), the
    tile products under `precision`; `prep = (d_out, lse, delta, keep, bad)` from
    `_flash_grad_prep`, `q` and `k` finite (`_finite`).

    The scores are recomputed tile by tile from the saved log-sum-exp:
    p = exp(s - lse), dp = dout v^T, ds = p * (dp - delta), delta = rowsum(dout * out) - dlse.
    A query with a non-finite cotangent (`bad`) makes its own `dq` NaN, and the `dk` and
    `dv` of the keys it sees (the mask, not `p`: `p` may underflow to 0).
    """
    acc = accumulation_dtype(q)
    d_out, lse, delta, keep, bad = prep

    def body(t, carry):
        dq, dk, dv = carry
        i, j = _tile(tiles, row, t)
        s, mask = _tile_scores(q, k, pos_q, pos_k, starts, i, j, acc, precision)
        mask = mask & _take(keep, i)[..., None]
        p = jnp.where(mask, jnp.exp(s - _take(lse, i)[..., None]), 0)
        q_i, k_j = _take(q, i).astype(acc), _take(k, j).astype(acc)
        v_j, do_i = _take(v, j).astype(acc), _take(d_out, i)
        dp = _dot("qhd,khd->hqk", do_i, v_j, precision, acc)
        ds = p * (dp - _take(delta, i)[..., None])
        dq_i = _dot("hqk,khd->qhd", ds, k_j, precision, acc)
        dk_j = _dot("hqk,qhd->khd", ds, q_i, precision, acc)
        dv_j = _dot("hqk,qhd->khd", p, do_i, precision, acc)
        bad_i = _take(bad, i)
        hit = jnp.any(mask & bad_i[..., None], axis=1).T[..., None]  # (block, heads, 1)
        dq_i = jnp.where(bad_i.T[..., None], jnp.nan, dq_i)
        dk_j, dv_j = jnp.where(hit, jnp.nan, dk_j), jnp.where(hit, jnp.nan, dv_j)
        dq = _put(dq, _take(dq, i) + dq_i, i)
        dk = _put(dk, _take(dk, j) + dk_j, j)
        dv = _put(dv, _take(dv, j) + dv_j, j)
        return dq, dk, dv

    return _tile_loop(tiles, count, body, grads)


def _flash_bwd(precision, gather, res, cts):
    q, k, v, pos_q, pos_k, starts, tiles, row, count, out, lse = res
    # Residuals known when the backward is traced (the backward of a `jax.lax.scan` body)
    # come back as NumPy constants.
    tiles, row, count = jnp.asarray(tiles), jnp.asarray(row), jnp.asarray(count)
    prep = _flash_grad_prep(out, lse, *cts)
    acc = accumulation_dtype(q)
    init = (jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
    init = varying(init, (q, k, v, pos_q, pos_k, starts, tiles, row, count, prep))
    q, k = _finite(q), _finite(k)
    dq, dk, dv = _flash_grad_steps(
        q, k, v, pos_q, pos_k, starts, tiles, row, count, prep, init, precision
    )
    if gather is not None:
        # The transpose of the all-gather, summed over the ranks in the accumulation dtype.
        dk, dv = (
            jax.lax.psum_scatter(g, gather, scatter_dimension=0, tiled=True) for g in (dk, dv)
        )
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return grads + (None, None, None, None, None, None)


_flash_vjp.defvjp(_flash_fwd, _flash_bwd)


def to_blocks(x: Array, b: int) -> Array:
    """`(seq, ...)` -> `(seq / b, b, ...)`: a reshape, no copy."""
    return x.reshape(-1, b, *x.shape[1:])


def _attend(
    q,
    k,
    v,
    pos_q,
    pos_k,
    tiles,
    b,
    group,
    *,
    precision: PrecisionName = "highest",
    gather: str | None = None,
    starts: Array | None = None,
):
    """`flash` on `(rows, heads, dim)` arrays, `b` keys and `b * group` query rows a tile,
    the tile products under `precision` (`k`, `v` gathered over the axis `gather` if
    given; `pos_k` the positions of the keys after it), each query seeing no key before
    its entry of `starts` if given (the tiles that leaves empty not run):
    `(out (rows, heads, dim), lse (rows, heads))`."""
    pos_k = to_blocks(pos_k, b)
    starts = None if starts is None else to_blocks(starts, b * group)
    tiles, row, count = document_tiles(tiles, starts, pos_k)
    out, lse = cast(
        tuple[Array, Array],
        flash(
            to_blocks(q, b * group),
            to_blocks(k, b),
            to_blocks(v, b),
            to_blocks(pos_q, b * group),
            pos_k,
            tiles,
            row,
            count,
            precision=precision,
            gather=gather,
            starts=starts,
        ),
    )
    t = q.shape[0]
    return out.reshape(t, q.shape[1], -1), lse.transpose(0, 2, 1).reshape(t, -1)


class _Ring:
    """The static description of one ring attention (a non-differentiable argument of
    `_ring`): the mesh axis, its size `cp`, the local diagonal's schedule (step 0), the
    schedules of steps `1 .. cp - 1` as one table (row `(step - 1) cp + rank`), and the
    global positions of every rank's keys in blocks, `(cp, blocks, b)`."""

    def __init__(self, axis_name, cp, diagonal, steps, positions):
        self.axis_name, self.cp = axis_name, cp
        self.diagonal: Schedule = diagonal
        self.stacked = Schedule.of(
            [s.listed(r) for s in steps for r in range(cp)] if steps else [[]]
        )
        self.positions: np.ndarray = positions

    def ring_loop(self, body, init):
        """`body(step, carry)` for steps `1 .. cp - 1`."""
        return jax.lax.fori_loop(1, self.cp, body, init)

    def ppermute(self, x):
        """Pass `x` one rank on around the ring (rank `r` receives rank `r - 1`'s)."""
        perm = [(j, (j + 1) % self.cp) for j in range(self.cp)]
        return jax.lax.ppermute(x, self.axis_name, perm)

    def step(self, rank: Array, step: Array, starts: Array | None):
        """`(pos_k, tiles, row, count)` of ring step `step > 0` on rank `rank`: the
        positions of the keys it holds (those of rank `rank - step`) and its tiles (those
        `starts` leaves: `document_tiles`)."""
        pos_k = _take(jnp.asarray(self.positions), (rank - step) % self.cp)
        schedule = self.stacked.at((step - 1) * self.cp + rank)
        return (pos_k, *document_tiles(schedule, starts, pos_k))


def _ring_forward(
    ring: _Ring, q, k, v, pos_q, pos_k, starts=None, *, precision: PrecisionName = "highest"
):
    precision = check_precision(precision)
    rank = jax.lax.axis_index(ring.axis_name)
    q, k, v = mark_non_finite(q, k, v)
    state = _flash_init(q, v, (q, k, v, pos_q, pos_k, starts))
    diagonal = document_tiles(ring.diagonal.at(rank), starts, pos_k)
    state = _flash_steps(q, k, v, pos_q, pos_k, starts, *diagonal, state, precision)

    def body(step, carry):
        k, v, state = carry
        k, v = ring.ppermute((k, v))
        pos_k, tiles, row, count = ring.step(rank, step, starts)
        state = _flash_steps(q, k, v, pos_q, pos_k, starts, tiles, row, count, state, precision)
        return k, v, state

    _, _, state = ring.ring_loop(body, (k, v, state))
    return _flash_finish(state)


def _ring(ring: _Ring, q, k, v, pos_q, pos_k, starts=None, *, precision: PrecisionName = "highest"):
    """Causal attention of the local queries to the whole sequence's keys, passed around
    the ring: `out`, `(nq, block, heads, dim)` in the accumulation dtype (arguments in
    blocks as for `flash`, `precision` and `starts` too; `k`, `v` and their positions
    `pos_k` this rank's own).

    At step 0 the queries attend to the local keys (the causal diagonal); at each step
    `i = 1 .. cp - 1` of a loop the keys and values move one rank on (rank `r` then holds
    rank `r - i`'s) and the step's tiles run into the same online softmax. One piece of
    keys and values is held (and one in flight) at a time, so memory is `O(S / cp)`.

    The backward saves only `q, k, v, out` and the log-sum-exp, and runs the ring again:
    the keys and values go around with accumulators of their gradients, to which each rank
    adds its tiles' contributions (recomputed from the log-sum-exp, as `flash` does); one
    last step brings the accumulators home, where each holds its rank's `dk`, `dv`.
    """
    return _ring_vjp(ring, check_precision(precision), q, k, v, pos_q, pos_k, starts)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring_vjp(ring: _Ring, precision, q, k, v, pos_q, pos_k, starts):
    return _ring_forward(ring, q, k, v, pos_q, pos_k, starts, precision=precision)[0]


def _ring_fwd(ring: _Ring, precision, q, k, v, pos_q, pos_k, starts):
    out, lse = _ring_forward(ring, q, k, v, pos_q, pos_k, starts, precision=precision)
    return out, (q, k, v, pos_q, pos_k, starts, out, lse)


def _ring_bwd(ring: _Ring, precision, res, d_out):
    q, k, v, pos_q, pos_k, starts, out, lse = res
    rank = jax.lax.axis_index(ring.axis_name)
    prep = _flash_grad_prep(out, lse, d_out, None)
    # The marked rows of the forward (`mark_non_finite`), finite: the values are already.
    q, k, v = mark_non_finite(q, k, v)
    q, k = _finite(q), _finite(k)
    acc = accumulation_dtype(q)
    grads = (jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
    grads = varying(grads, (q, k, v, pos_q, pos_k, starts, prep))
    tiles, row, count = document_tiles(ring.diagonal.at(rank), starts, pos_k)
    dq, dk, dv = _flash_grad_steps(
        q, k, v, pos_q, pos_k, starts, tiles, row, count, prep, grads, precision
    )

    def body(step, carry):
        k, v, dq, dk, dv = carry
        k, v, dk, dv = ring.ppermute((k, v, dk, dv))
        pos_k, tiles, row, count = ring.step(rank, step, starts)
        dq, dk, dv = _flash_grad_steps(
            q, k, v, pos_q, pos_k, starts, tiles, row, count, prep, (dq, dk, dv), precision
        )
        return k, v, dq, dk, dv

    _, _, dq, dk, dv = ring.ring_loop(body, (k, v, dq, dk, dv))
    if ring.cp > 1:
        dk, dv = ring.ppermute((dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring_vjp.defvjp(_ring_fwd, _ring_bwd)


def _expand_blocks(static, params, c: Array) -> tuple[Array, Array]:
    """The keys and values of latents in blocks, `(n, block, latent)` -> `(n, block, heads,
    dim)` and `(n, block, heads, v_dim)`, marked as `mark_non_finite` marks them: `expand`
    (`eqx.combine(params, static)`) is applied per token."""
    n, b = c.shape[:2]
    k, v = eqx.combine(params, static)(c.reshape(n * b, *c.shape[2:]))
    _, k, v = mark_non_finite(k[:, :, :1], k, v)
    return to_blocks(k, b), to_blocks(v, b)


def _latent_ring_forward(
    ring: _Ring,
    static,
    q,
    c,
    params,
    pos_q,
    pos_k,
    starts=None,
    *,
    precision: PrecisionName = "highest",
):
    """`_ring_forward` with the latents `c` (`(nk, block, latent)`) passed around the ring
    instead of keys and values, each step expanding the piece it holds: `(out, lse)`."""
    precision = check_precision(precision)
    rank = jax.lax.axis_index(ring.axis_name)
    q = jnp.where(_rows_finite(q), q, jnp.nan)
    k, v = _expand_blocks(static, params, c)
    state = _flash_init(q, v, (q, k, v, pos_q, pos_k, starts))
    diagonal = document_tiles(ring.diagonal.at(rank), starts, pos_k)
    state = _flash_steps(q, k, v, pos_q, pos_k, starts, *diagonal, state, precision)

    def body(step, carry):
        c, state = carry
        c = ring.ppermute(c)
        k, v = _expand_blocks(static, params, c)
        pos_k, tiles, row, count = ring.step(rank, step, starts)
        state = _flash_steps(q, k, v, pos_q, pos_k, starts, tiles, row, count, state, precision)
        return c, state

    _, state = ring.ring_loop(body, (c, state))
    return _flash_finish(state)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _latent_ring_vjp(ring: _Ring, precision, static, q, c, params, pos_q, pos_k, starts):
    """The ring of `_latent_ring_forward`, with the backward of `_ring_bwd` over latents:
    `out`."""
    return _latent_ring_forward(
        ring, static, q, c, params, pos_q, pos_k, starts, precision=precision
    )[0]


def _latent_ring_fwd(ring: _Ring, precision, static, q, c, params, pos_q, pos_k, starts):
    out, lse = _latent_ring_forward(
        ring, static, q, c, params, pos_q, pos_k, starts, precision=precision
    )
    return out, (q, c, params, pos_q, pos_k, starts, out, lse)


def _latent_ring_bwd(ring: _Ring, precision, static, res, d_out):
    """The ring again: the latents go around with accumulators of their gradients (in the
    accumulation dtype); at each step the piece held is expanded again, its tiles' key and
    value gradients formed (as `_ring_bwd` does), rounded to the keys' dtype and taken
    through the expansion's transpose, into the piece's latent gradient and this rank's
    sum of the expansion's parameter gradients (summed over the ranks at the end). One
    last step brings the latents' accumulators home."""
    q, c, params, pos_q, pos_k, starts, out, lse = res
    rank = jax.lax.axis_index(ring.axis_name)
    prep = _flash_grad_prep(out, lse, d_out, None)
    q = _finite(jnp.where(_rows_finite(q), q, jnp.nan))
    acc = accumulation_dtype(q)
    like = (q, c, pos_q, pos_k, starts, prep)
    # Per-rank copies: each step's parameter gradients stay on their rank, summed once at
    # the end (not all-reduced at every step by the transpose of an implicit cast).
    local_params = varying(params, like)

    def piece(c, pos_k, tiles, row, count, dq):
        """`(dq, d_params, d_c)` of the tiles against latent piece `c`."""
        (k, v), vjp = jax.vjp(ft.partial(_expand_blocks, static), local_params, c)
        zeros = varying((jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)), like)
        dq, dk, dv = _flash_grad_steps(
            q,
            _finite(k),
            v,
            pos_q,
            pos_k,
            starts,
            tiles,
            row,
            count,
            prep,
            (dq, *zeros),
            precision,
        )
        d_params, d_c = vjp((dk.astype(k.dtype), dv.astype(v.dtype)))
        return dq, d_params, d_c

    dq = varying(jnp.zeros(q.shape, acc), like)
    tiles, row, count = document_tiles(ring.diagonal.at(rank), starts, pos_k)
    dq, d_params, d_c = piece(c, pos_k, tiles, row, count, dq)
    d_params = jax.tree.map(lambda g: g.astype(acc), d_params)
    d_c = d_c.astype(acc)

    def body(step, carry):
        c, dq, d_params, d_c = carry
        c, d_c = ring.ppermute((c, d_c))
        pos_k, tiles, row, count = ring.step(rank, step, starts)
        dq, dp, dc = piece(c, pos_k, tiles, row, count, dq)
        d_params = jax.tree.map(lambda a, g: a + g.astype(acc), d_params, dp)
        return c, dq, d_params, d_c + dc.astype(acc)

    _, dq, d_params, d_c = ring.ring_loop(body, (c, dq, d_params, d_c))
    if ring.cp > 1:
        d_c = ring.ppermute(d_c)
    d_params = jax.tree.map(lambda g, p: g.astype(p.dtype), d_params, params)
    d_params = cotangent_like(d_params, params)
    return dq.astype(q.dtype), d_c.astype(c.dtype), d_params, None, None, None


_latent_ring_vjp.defvjp(_latent_ring_fwd, _latent_ring_bwd)


def group_queries(x: Array, group: int) -> Array:
    """`(seq, kv_heads * group, ...)` -> `(seq * group, kv_heads, ...)`: the queries that
    share a key head become rows of the same head (query head `h` reads key head
    `h // group`), so a tile of `block` tokens holds `block * group` query rows."""
    t, h = x.shape[:2]
    x = x.reshape(t, h // group, group, *x.shape[2:])
    return jnp.swapaxes(x, 1, 2).reshape(t * group, h // group, *x.shape[3:])


def ungroup_queries(x: Array, group: int) -> Array:
    """The inverse of `group_queries`."""
    tg, kvh = x.shape[:2]
    x = x.reshape(tg // group, group, kvh, *x.shape[2:])
    return jnp.swapaxes(x, 1, 2).reshape(tg // group, kvh * group, *x.shape[3:])


def blockwise_attention(
    q: Float[Array, "seq heads dim"],
    k: Float[Array, "seq kv_heads dim"],
    v: Float[Array, "seq kv_heads v_dim"],
    pos_q: Int[Array, " seq"],
    *,
    cp: ContextParallel | None,
    kv_schedule: str,
    tile_size: int,
    return_lse: bool = False,
    precision: PrecisionName = "highest",
    cu_seqlens: Int[Array, " docs_plus_one"] | None = None,
) -> tuple[Array, Array | None]:
    """Causal softmax attention of this rank's queries (global positions `pos_q`, RoPE
    already applied, not yet scaled) against every earlier key of the sequence (of the
    query's document, with `cu_seqlens`).

    With `cu_seqlens` (packed documents: the global offsets `[0, ..., T]`, an int32
    array checked by the caller, as `documents` in `_context.py` does), a query sees the
    keys of its own document only, at or before it; the tiles that leaves without a
    visible pair are not run (`document_tiles`), under either schedule and layout, so a
    packed row costs about what its documents cost apart. (The rotary positions, which
    restart at each document, are the caller's: `Documents.positions`.)

    Query head `h` reads key/value head `h // (heads // kv_heads)` (grouped-query
    attention); the keys and values travel with `kv_heads` heads. The values' head
    dimension `v_dim` may differ from the queries' and keys' `dim`; the scores are scaled
    by `dim ** -0.5`.

    The tile products multiply under `precision` (`"highest"`: float32 operands at
    `Precision.HIGHEST`, or the inputs' dtype where that is narrower in the forward;
    `"bfloat16"`: bfloat16 operands accumulated in float32; `"default"`: JAX's default
    matmul precision), forward and backward; the softmax statistics, the accumulators and
    the log-sum-exp stay in the accumulation dtype.

    **Returns:**

    `(out, None)`: the output `(seq, heads, v_dim)` in `v`'s dtype; with `return_lse`,
    `(out, lse)`: the output and the log-sum-exp of each query's scores `(seq, heads)`, both
    in the accumulation dtype (for merging with attention to other keys; the ring then runs
    without its memory-saving backward).
    """
    return _blockwise(
        q,
        k,
        v,
        pos_q,
        cp=cp,
        kv_schedule=kv_schedule,
        tile_size=tile_size,
        return_lse=return_lse,
        precision=precision,
        cu_seqlens=cu_seqlens,
    )


def _blockwise(
    q,
    k,
    v,
    pos_q,
    *,
    cp,
    kv_schedule,
    tile_size,
    return_lse,
    precision,
    cu_seqlens,
    gathered=False,
    latent=None,
):
    """`blockwise_attention`; with `gathered` (context parallel, `"allgather"` only), `k`
    and `v` are already the whole sequence's, in the layout's order (rank `r`'s keys at
    rows `r T / cp ..`), and are not gathered again; with `latent = (c, expand)` (context
    parallel, `"ring"` only) the ring passes the latents `c` and expands each piece
    (`_latent_ring`), `k` and `v` then only their shapes (`jax.eval_shape(expand, c)`)."""
    check_kv_schedule(kv_schedule)
    precision = check_precision(precision)
    t, h, d = q.shape
    group = h // k.shape[1]
    q = group_queries(q * (d**-0.5), group)
    pos_q_rows = jnp.repeat(pos_q, group)
    starts = None if cu_seqlens is None else document_starts(cu_seqlens, pos_q)
    starts_rows = None if starts is None else jnp.repeat(starts, group)

    def finish(out, lse):
        out = ungroup_queries(out.reshape(t * group, *out.shape[-2:]), group)
        if not return_lse:
            return out.astype(v.dtype), None
        return out, ungroup_queries(lse.reshape(t * group, -1), group)

    if cp is None:
        b = tile_side(tile_size, t, "the sequence length")
        ((schedule,),) = tile_loops(Contiguous().held(1), t // b, "allgather")
        att = _attend(
            q,
            k,
            v,
            pos_q_rows,
            pos_q,
            schedule.at(0),
            b,
            group,
            precision=precision,
            starts=starts_rows,
        )
        return finish(*att)
    n = jax.lax.axis_size(cp.axis_name)
    rank = jax.lax.axis_index(cp.axis_name)
    b, m = tiling(cp.layout, t, n, tile_size)
    table = cp.layout.position_table(t, n)
    loops = tile_loops(cp.layout.held(n), m, kv_schedule)
    if kv_schedule == "allgather":
        pos_k, tiles = jnp.asarray(table.reshape(-1)), loops[0][0].at(rank)
        att = _attend(
            q,
            k,
            v,
            pos_q_rows,
            pos_k,
            tiles,
            b,
            group,
            precision=precision,
            gather=None if gathered else cp.axis_name,
            starts=starts_rows,
        )
        return finish(*att)
    (diagonal,), steps = loops
    ring = _Ring(cp.axis_name, n, diagonal, steps, table.reshape(n, -1, b))
    qb, pos_qb = to_blocks(q, b * group), to_blocks(pos_q_rows, b * group)
    pos_kb = to_blocks(pos_q, b)
    sb = None if starts_rows is None else to_blocks(starts_rows, b * group)
    if latent is not None:
        c, expand = latent
        cb, (params, static) = to_blocks(c, b), eqx.partition(expand, eqx.is_array)
        if return_lse:
            out, lse = _latent_ring_forward(
                ring, static, qb, cb, params, pos_qb, pos_kb, sb, precision=precision
            )
            return finish(out, lse.transpose(0, 2, 1))
        out = _latent_ring_vjp(ring, precision, static, qb, cb, params, pos_qb, pos_kb, sb)
        return finish(out, None)
    kb, vb = to_blocks(k, b), to_blocks(v, b)
    if return_lse:
        out, lse = _ring_forward(ring, qb, kb, vb, pos_qb, pos_kb, sb, precision=precision)
        return finish(out, lse.transpose(0, 2, 1))
    return finish(_ring(ring, qb, kb, vb, pos_qb, pos_kb, sb, precision=precision), None)


# ---------------------------------------------------------------------------------------
# Attention to a cache of earlier keys and values (prefill and decoding)
# ---------------------------------------------------------------------------------------


def cached_attention(
    q: Float[Array, "seq heads dim"],
    k: Float[Array, "capacity kv_heads dim"],
    v: Float[Array, "capacity kv_heads v_dim"],
    length: Int[Array, ""] | int,
    tile_size: int,
    *,
    precision: PrecisionName = "highest",
) -> tuple[Array, Array]:
    """Attention of queries (RoPE applied, not yet scaled) to the first `length` entries of
    a key/value cache, all of which precede every query: `(out, lse)`, `(seq, heads, v_dim)`
    and `(seq, heads)` in the accumulation dtype; output 0 and log-sum-exp `-inf` where
    `length` is 0. One tile per block of queries, against the whole cache, the tile
    products under `precision` (as in the kernel)."""
    t, h, d = q.shape
    group = h // k.shape[1]
    b = max(c for c in range(1, min(tile_size, t) + 1) if t % c == 0)
    rows = to_blocks(group_queries(q * (d**-0.5), group), b * group)
    length = jnp.asarray(length, jnp.int32)
    index = jnp.arange(k.shape[0], dtype=jnp.int32)
    pos_k = jnp.where(index < length, index, jnp.iinfo(jnp.int32).max)
    pos_q = jnp.broadcast_to(length, rows.shape[:2])
    tiles = Schedule.of([[(i, 0) for i in range(t // b)]]).at(0)
    out, lse = cast(
        tuple[Array, Array],
        flash(rows, k[None], v[None], pos_q, pos_k[None], *tiles, precision=precision),
    )
    out = ungroup_queries(out.reshape(t * group, h // group, v.shape[-1]), group)
    return out, ungroup_queries(lse.transpose(0, 2, 1).reshape(t * group, -1), group)


def decode_attention(
    q: Float[Array, "heads dim"],
    k: Float[Array, "capacity kv_heads dim"],
    v: Float[Array, "capacity kv_heads v_dim"],
    position: Int[Array, ""],
    *,
    precision: PrecisionName = "highest",
) -> Float[Array, "heads v_dim"]:
    """Attention of one query (RoPE applied, not yet scaled) at `position` to the cache
    entries `0 .. position` (its own included): the output in the accumulation dtype.

    The two products (`q k^T` over the cache, `p v`) multiply under `precision`: under
    `"highest"` float32 operands at `Precision.HIGHEST` (float64 for float64 inputs),
    under `"bfloat16"` bfloat16 operands accumulated in float32, under `"default"` at JAX's
    default matmul precision. The softmax is taken in the accumulation dtype whatever the
    policy."""
    precision = check_precision(precision)
    kvh, d = k.shape[1], q.shape[-1]
    acc = accumulation_dtype(q)
    qg = q.reshape(kvh, q.shape[0] // kvh, d).astype(acc) * (d**-0.5)
    if precision != "bfloat16":
        k, v = k.astype(acc), v.astype(acc)
    s = einsum("hgd,chd->hgc", qg, k, precision=precision).astype(acc)
    visible = jnp.arange(k.shape[0]) <= position
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    o = einsum("hgc,chd->hgd", p, v, precision=precision).astype(acc)
    return o.reshape(q.shape[0], v.shape[-1])


def merge_attention(a: tuple[Array, Array], b: tuple[Array, Array]) -> Array:
    """Attention over two disjoint sets of keys, from each one's `(out, lse)`."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0)
    wa, wb = jnp.exp(lse_a - safe)[..., None], jnp.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb


# ---------------------------------------------------------------------------------------
# Latent keys and values: exchanged compressed, expanded per token on arrival
# ---------------------------------------------------------------------------------------


def latent_attention(
    q: Float[Array, "seq heads dim"],
    c: Float[Array, "seq latent"],
    expand: Callable[[Array], tuple[Array, Array]],
    pos_q: Int[Array, " seq"],
    *,
    cp: ContextParallel | None,
    kv_schedule: str,
    tile_size: int,
    return_lse: bool = False,
    precision: PrecisionName = "highest",
    cu_seqlens: Int[Array, " docs_plus_one"] | None = None,
) -> tuple[Array, Array | None]:
    """`blockwise_attention(q, *expand(c), pos_q, ...)` where the keys and values are
    expanded token by token from the compressed latents `c` (multi-head latent attention):
    `expand` maps `(n, latent)` to keys `(n, kv_heads, dim)` and values
    `(n, kv_heads, v_dim)`, each token's from its own latent row only.

    Under context parallelism the latents, not the keys and values, cross the ranks: with
    `kv_schedule="allgather"` they are all-gathered and the whole sequence's are expanded
    on every rank (the backward reduce-scatters the latents' gradients, in their dtype);
    with `"ring"` the latents go around the ring and each step expands the piece it holds,
    forward and backward (`_latent_ring_vjp`: the backward passes the latents around again
    with accumulators of their gradients, formed through the expansion's transpose, and
    sums the expansion's parameter gradients over the ranks).

    Arguments and returns as for `blockwise_attention`; `expand` is a pytree (an
    `equinox.Module`) whose arrays are differentiated through.
    """
    attend = ft.partial(
        _blockwise,
        kv_schedule=kv_schedule,
        tile_size=tile_size,
        return_lse=return_lse,
        precision=precision,
        cu_seqlens=cu_seqlens,
    )
    if cp is None:
        k, v = expand(c)
        return attend(q, k, v, pos_q, cp=None)
    check_kv_schedule(kv_schedule)
    if kv_schedule == "allgather":
        k, v = expand(jax.lax.all_gather(c, cp.axis_name, axis=0, tiled=True))
        return attend(q, k, v, pos_q, cp=cp, gathered=True)
    k, v = jax.eval_shape(expand, c)
    return attend(q, k, v, pos_q, cp=cp, latent=(c, expand))
