"""Causal softmax self-attention: blockwise (flash-style), context-parallel in both layouts.

This is the baseline the design note compares the gated delta rule against. The scores are
computed one `(block, block)` tile at a time with an online softmax, so no rank ever holds
more than one tile of them; the tiles computed are a static schedule of the block pairs the
causal mask needs, so the tiles wholly in the future of their queries cost nothing.

Under context parallelism each rank attends from its own queries to the keys and values of
the whole sequence, which it obtains by one all-gather or by passing them around a ring:
a payload of `(cp - 1) / cp * S * 2 * heads * head_dim` elements per rank and layer either
way, growing with the sequence length `S`. With the zigzag layout every rank does the same
causal work. The all-gather holds the whole sequence's keys and values on every rank; the
ring, one rank's piece at a time, forward and backward (`_ring`).
"""

import functools as ft
from typing import cast, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._layout import check_layout, Contiguous, Layout, positions, Zigzag, zigzag_half


_HI = jax.lax.Precision.HIGHEST
_KV_EXCHANGES = ("allgather", "ring")
KVExchange = Literal["allgather", "ring"]


def _rope(x: Float[Array, "seq heads dim"], positions: Array, theta: float) -> Array:
    """Rotary position embedding (the half-split convention of Llama / Qwen)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------------
# The block schedules: which (query block, key block) tiles to compute, per rank
# ---------------------------------------------------------------------------------------


def _triangle(m: int, q0: int = 0, k0: int = 0) -> list[tuple[int, int]]:
    """The tiles of a causal diagonal: query block `q0 + i` with key block `k0 + j`, j <= i."""
    return [(q0 + i, k0 + j) for i in range(m) for j in range(i + 1)]


def _rect(q0: int, nq: int, k0: int, nk: int) -> list[tuple[int, int]]:
    """Every tile of query blocks `q0 .. q0 + nq - 1` with key blocks `k0 .. k0 + nk - 1`."""
    return [(q0 + i, k0 + j) for i in range(nq) for j in range(nk)]


class _Schedule:
    """The tiles each rank computes, as one static table indexed by the (traced) rank.

    `tiles[r, :counts[r]]` lists rank `r`'s tiles as (query block, key block) pairs; shorter
    lists are padded with tile (0, 0), never run. The table is a constant of the compiled
    program, read one tile per step: no per-rank copy of it is made.
    """

    def __init__(self, tiles: np.ndarray, counts: tuple[int, ...]):
        self.tiles = tiles  # (ranks, pairs, 2) int32
        self.counts = counts

    @classmethod
    def of(cls, per_rank: list[list[tuple[int, int]]]) -> "_Schedule":
        width = max(1, max(len(tiles) for tiles in per_rank))
        table = np.zeros((len(per_rank), width, 2), np.int32)
        for r, tiles in enumerate(per_rank):
            if tiles:
                table[r, : len(tiles)] = sorted(tiles)
        return cls(table, tuple(len(tiles) for tiles in per_rank))

    @property
    def uniform(self) -> bool:
        """Whether every rank computes the same number of tiles (a static trip count)."""
        return len(set(self.counts)) == 1

    def listed(self, rank: int) -> list[tuple[int, int]]:
        """Rank `rank`'s tiles."""
        return [(int(i), int(j)) for i, j in self.tiles[rank, : self.counts[rank]]]

    def at(self, rank: Array | int) -> tuple[Array, Array, Array]:
        """`(table, row, count)` for this rank: its tiles are `table[row, :count]`."""
        row = jnp.asarray(0 if self.tiles.shape[0] == 1 else rank, jnp.int32)
        if self.uniform:
            count = jnp.asarray(self.counts[0], jnp.int32)
        else:
            count = jnp.asarray(np.asarray(self.counts, np.int32))[row]
        return jnp.asarray(self.tiles), row, count


def _zigzag_slot(piece: int, cp: int) -> int:
    """Where global piece `piece` of `2 cp` lies in the rank-order concatenation of shards."""
    return 2 * piece if piece < cp else 2 * (2 * cp - 1 - piece) + 1


def _allgather_schedule(layout: Layout, cp: int, m: int) -> _Schedule:
    """Tiles of local queries against the all-gathered keys, `m` blocks per piece.

    Contiguous: rank `r` needs the key blocks of ranks `0 .. r - 1` whole and a causal
    diagonal of its own, `m (m + 1) / 2 + r m^2` tiles. Zigzag: first piece `r` needs
    pieces `0 .. r - 1` whole and its own diagonal, second piece `2 cp - 1 - r` needs pieces
    `0 .. 2 cp - 2 - r` whole and its own diagonal: `(2 cp - 1) m^2 + m (m + 1)` tiles on
    every rank.
    """
    per_rank = []
    for r in range(cp):
        if isinstance(layout, Contiguous):
            tiles = _triangle(m, 0, r * m) + _rect(0, m, 0, r * m)
        else:
            tiles = []
            for slot, piece in ((0, r), (1, 2 * cp - 1 - r)):
                for p in range(piece):
                    tiles += _rect(slot * m, m, _zigzag_slot(p, cp) * m, m)
                tiles += _triangle(m, slot * m, _zigzag_slot(piece, cp) * m)
        per_rank.append(tiles)
    return _Schedule.of(per_rank)


def _ring_schedule(layout: Layout, cp: int, m: int, step: int) -> _Schedule:
    """Tiles of local queries against the keys held `step` ranks back around the ring.

    Step 0 is the local causal diagonal. At step `i > 0` rank `r` holds the keys of source
    `s = (r - i) mod cp`, all in its past if `s < r` (that is, `i <= r`), all in its future
    otherwise. Contiguous: `m^2` tiles if `s < r`, none otherwise. Zigzag (the schedule of
    ring-flash-attention): if `s < r` both local pieces attend to the source's first piece,
    otherwise the local second piece attends to both source pieces; `2 m^2` tiles either way.
    """
    contiguous = isinstance(layout, Contiguous)
    per_rank = []
    for r in range(cp):
        if step == 0:
            tiles = _triangle(m if contiguous else 2 * m)
        elif contiguous:
            tiles = _rect(0, m, 0, m) if step <= r else []
        else:
            tiles = _rect(0, 2 * m, 0, m) if step <= r else _rect(m, m, 0, 2 * m)
        per_rank.append(tiles)
    return _Schedule.of(per_rank)


def _position_table(layout: Layout, length: int, cp: int) -> np.ndarray:
    """The global positions of every rank's `length` local tokens, `(cp, length)` int32
    (what [`deltanet_cp._layout.positions`][] computes for one rank at run time)."""
    local = np.arange(length)
    if isinstance(layout, Contiguous):
        table = np.stack([r * length + local for r in range(cp)])
    else:
        half = length // 2
        table = np.stack(
            [np.where(local < half, r, 2 * cp - 1 - r) * half + local % half for r in range(cp)]
        )
    return table.astype(np.int32)


# ---------------------------------------------------------------------------------------
# The blockwise kernel
# ---------------------------------------------------------------------------------------


def _acc_dtype(dtype) -> type:
    """The accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _varying(tree, like):
    """Mark `tree`'s values as varying over every mesh axis `like`'s values vary over (a
    loop carry that starts replicated but is updated with per-rank data, inside
    `shard_map`)."""
    axes: set = set()
    for leaf in jax.tree.leaves(like):
        axes |= set(jax.typeof(leaf).manual_axis_type.varying)

    def cast(x):
        missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _unrolled(unroll: bool | int) -> bool:
    return unroll is True or (not isinstance(unroll, bool) and unroll > 1)


def _loop(count: Array, trips: int, body, init, unroll: bool | int):
    """`fori_loop(0, count, body, init)`: the loop over tiles.

    `unroll` (for measuring the compiled program: see `benchmarks/attention_balance.py`)
    is `False` (or 1) for a rolled loop, `True` for no loop (`trips` copies of the body),
    an int `n > 1` for a loop running `n` tiles per trip; `count` must then be `trips`.
    """
    if _unrolled(unroll):
        return jax.lax.fori_loop(0, trips, body, init, unroll=unroll)
    return jax.lax.fori_loop(jnp.zeros((), count.dtype), count, body, init)


def _tile(tiles: Array, row: Array, t: Array) -> tuple[Array, Array]:
    """Tile `t` of row `row` of the table: (query block, key block)."""
    ij = jax.lax.dynamic_slice(tiles, (row, t, jnp.zeros_like(t)), (1, 1, 2))
    return ij[0, 0, 0], ij[0, 0, 1]


def _take(x: Array, i: Array) -> Array:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(x: Array, y: Array, i: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), i, 0)


def _tile_scores(q, k, pos_q, pos_k, i, j, acc):
    """Scores of tile `(i, j)`, `(heads, block, block)`, and the causal mask of the tile."""
    s = jnp.einsum(
        "qhd,khd->hqk", _take(q, i), _take(k, j), precision=_HI, preferred_element_type=acc
    )
    mask = _take(pos_q, i)[:, None] >= _take(pos_k, j)[None, :]
    return s, mask[None]


def _flash_init(q: Array, like) -> tuple[Array, Array, Array]:
    """The empty online-softmax state of queries `q`: (unnormalised output, running max,
    running denominator), in the accumulation dtype, varying wherever `like` does."""
    nq, b, h, d = q.shape
    acc = _acc_dtype(q.dtype)
    init = (
        jnp.zeros((nq, b, h, d), acc),
        jnp.full((nq, h, b), jnp.finfo(acc).min, acc),
        jnp.zeros((nq, h, b), acc),
    )
    return _varying(init, like)


def _flash_steps(q, k, v, pos_q, pos_k, tiles, row, count, unroll, state):
    """Run the listed tiles into the online-softmax `state` (see `_flash_init`)."""
    acc = _acc_dtype(q.dtype)

    def body(t, carry):
        o, m, denom = carry
        i, j = _tile(tiles, row, t)
        s, mask = _tile_scores(q, k, pos_q, pos_k, i, j, acc)
        s = jnp.where(mask, s, -jnp.inf)
        m_old = _take(m, i)
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m_old - m_new)
        l_new = alpha * _take(denom, i) + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            "hqk,khd->qhd",
            p.astype(v.dtype),
            _take(v, j),
            precision=_HI,
            preferred_element_type=acc,
        )
        o_new = alpha.T[..., None] * _take(o, i) + pv
        return _put(o, o_new, i), _put(m, m_new, i), _put(denom, l_new, i)

    return _loop(count, tiles.shape[1], body, state, unroll)


def _flash_finish(state: tuple[Array, Array, Array]) -> tuple[Array, Array]:
    """`(out, lse)` from an online-softmax state: 0 and `-inf` where no key was seen."""
    o, m, denom = state
    seen = denom > 0
    safe_l = jnp.where(seen, denom, 1)
    out = o / safe_l.transpose(0, 2, 1)[..., None]
    lse = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
    return out, lse


def _flash_forward(q, k, v, pos_q, pos_k, tiles, row, count, unroll):
    state = _flash_init(q, (q, k, v, pos_q, pos_k, tiles, row, count))
    return _flash_finish(_flash_steps(q, k, v, pos_q, pos_k, tiles, row, count, unroll, state))


@ft.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, pos_q, pos_k, tiles, row, count, unroll):
    """Blockwise causal attention over a list of tiles, with an online softmax.

    **Arguments:**

    - `q`: the queries in blocks, `(nq, block, heads, dim)`, already scaled.
    - `k`, `v`: the keys and values in blocks, `(nk, block, heads, dim)`.
    - `pos_q`, `pos_k`: the global positions of the queries and keys, `(nq, block)` and
        `(nk, block)`; query `a` sees key `c` iff `pos_q[a] >= pos_k[c]`.
    - `tiles`, `row`: the tiles to compute are `tiles[row, t]` for `t < count`, each a
        (query block, key block) pair; `tiles` is `(rows, pairs, 2)` int32 (one row per
        rank), `row` an int32 scalar (may be traced). Tiles not listed are not computed.
    - `count`: how many of the listed tiles to compute (an int32 scalar, may be traced).
    - `unroll`: `False`, or (for measuring; `count` must then be `pairs`) `True` to unroll
        the loop over tiles, an int `n` to run `n` tiles per trip.

    **Returns:**

    `(out, lse)`: the normalised output `(nq, block, heads, dim)` and the log-sum-exp of
    each query's visible scores `(nq, heads, block)`, both in the accumulation dtype. A
    query that sees no key gets output 0 and log-sum-exp `-inf`. Partial results over
    disjoint keys merge with `logaddexp`; gradients flow through both outputs.
    """
    return _flash_forward(q, k, v, pos_q, pos_k, tiles, row, count, unroll)


def _flash_fwd(q, k, v, pos_q, pos_k, tiles, row, count, unroll):
    out, lse = _flash_forward(q, k, v, pos_q, pos_k, tiles, row, count, unroll)
    return (out, lse), (q, k, v, pos_q, pos_k, tiles, row, count, out, lse)


def _flash_grad_prep(out, lse, d_out, d_lse):
    """`(d_out, lse, delta)` for `_flash_grad_steps`: the output's cotangent in the
    accumulation dtype, the log-sum-exp with `-inf` (no key seen) made 0, and
    `delta = rowsum(d_out * out) - d_lse`, `(nq, heads, block)`."""
    acc = out.dtype
    d_out = d_out.astype(acc)
    delta = jnp.sum(d_out * out, axis=-1).transpose(0, 2, 1)
    if d_lse is not None:
        delta = delta - d_lse.astype(acc)
    return d_out, jnp.where(jnp.isfinite(lse), lse, 0), delta


def _flash_grad_steps(q, k, v, pos_q, pos_k, tiles, row, count, unroll, lse, delta, d_out, grads):
    """Add the listed tiles' gradients to `grads = (dq, dk, dv)` (accumulation dtype).

    The scores are recomputed tile by tile from the saved log-sum-exp:
    p = exp(s - lse), dp = dout v^T, ds = p * (dp - delta), delta = rowsum(dout * out) - dlse.
    """
    acc = _acc_dtype(q.dtype)

    def body(t, carry):
        dq, dk, dv = carry
        i, j = _tile(tiles, row, t)
        s, mask = _tile_scores(q, k, pos_q, pos_k, i, j, acc)
        p = jnp.where(mask, jnp.exp(s - _take(lse, i)[..., None]), 0)
        q_i, k_j = _take(q, i).astype(acc), _take(k, j).astype(acc)
        v_j, do_i = _take(v, j).astype(acc), _take(d_out, i)
        dp = jnp.einsum("qhd,khd->hqk", do_i, v_j, precision=_HI)
        ds = p * (dp - _take(delta, i)[..., None])
        dq_i = jnp.einsum("hqk,khd->qhd", ds, k_j, precision=_HI)
        dk_j = jnp.einsum("hqk,qhd->khd", ds, q_i, precision=_HI)
        dv_j = jnp.einsum("hqk,qhd->khd", p, do_i, precision=_HI)
        dq = _put(dq, _take(dq, i) + dq_i, i)
        dk = _put(dk, _take(dk, j) + dk_j, j)
        dv = _put(dv, _take(dv, j) + dv_j, j)
        return dq, dk, dv

    return _loop(count, tiles.shape[1], body, grads, unroll)


def _flash_bwd(unroll, res, cts):
    q, k, v, pos_q, pos_k, tiles, row, count, out, lse = res
    d_out, lse, delta = _flash_grad_prep(out, lse, *cts)
    acc = _acc_dtype(q.dtype)
    init = (jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
    init = _varying(init, (q, k, v, pos_q, pos_k, tiles, row, count, d_out, delta))
    dq, dk, dv = _flash_grad_steps(
        q, k, v, pos_q, pos_k, tiles, row, count, unroll, lse, delta, d_out, init
    )
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return grads + (None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _to_blocks(x: Array, b: int) -> Array:
    """`(seq, ...)` -> `(seq / b, b, ...)`: a reshape, no copy."""
    return x.reshape(-1, b, *x.shape[1:])


def _attend(q, k, v, pos_q, pos_k, tiles, b, unroll):
    """`_flash` on `(seq, heads, dim)` arrays: `(out (seq, heads, dim), lse (seq, heads))`."""
    tiles, row, count = tiles
    out, lse = cast(
        tuple[Array, Array],
        _flash(
            _to_blocks(q, b),
            _to_blocks(k, b),
            _to_blocks(v, b),
            _to_blocks(pos_q, b),
            _to_blocks(pos_k, b),
            tiles,
            row,
            count,
            unroll,
        ),
    )
    t = q.shape[0]
    return out.reshape(t, *q.shape[1:]), lse.transpose(0, 2, 1).reshape(t, -1)


class _Ring:
    """The static description of one ring attention (a non-differentiable argument of
    `_ring`): the mesh axis, its size `cp`, the kernel's `unroll`, the
    local diagonal's schedule (step 0), the schedules of steps `1 .. cp - 1` as one table
    (row `(step - 1) cp + rank`), and the global positions of every rank's keys in blocks,
    `(cp, blocks, b)`."""

    def __init__(self, axis_name, cp, unroll, diagonal, steps, positions):
        self.axis_name, self.cp, self.unroll = axis_name, cp, unroll
        self.diagonal: _Schedule = diagonal
        self.stacked = _Schedule.of(
            [s.listed(r) for s in steps for r in range(cp)] if steps else [[]]
        )
        self.positions: np.ndarray = positions

    def ring_loop(self, body, init):
        """`body(step, carry)` for steps `1 .. cp - 1`: a loop, unless the kernel's loops
        are all unrolled (`unroll=True`, for measuring), when it is straight-line code."""
        return jax.lax.fori_loop(1, self.cp, body, init, unroll=self.unroll is True or 1)

    def ppermute(self, x):
        """Pass `x` one rank on around the ring (rank `r` receives rank `r - 1`'s)."""
        perm = [(j, (j + 1) % self.cp) for j in range(self.cp)]
        return jax.lax.ppermute(x, self.axis_name, perm)

    def step(self, rank: Array, step: Array):
        """`(pos_k, tiles, row, count)` of ring step `step > 0` on rank `rank`: the
        positions of the keys it holds (those of rank `rank - step`) and its tiles."""
        pos_k = _take(jnp.asarray(self.positions), (rank - step) % self.cp)
        tiles, row, count = self.stacked.at((step - 1) * self.cp + rank)
        return pos_k, tiles, row, count


def _ring_forward(ring: _Ring, q, k, v, pos_q):
    rank = jax.lax.axis_index(ring.axis_name)
    state = _flash_init(q, (q, k, v, pos_q))
    state = _flash_steps(q, k, v, pos_q, pos_q, *ring.diagonal.at(rank), ring.unroll, state)

    def body(step, carry):
        k, v, state = carry
        k, v = ring.ppermute((k, v))
        pos_k, tiles, row, count = ring.step(rank, step)
        state = _flash_steps(q, k, v, pos_q, pos_k, tiles, row, count, ring.unroll, state)
        return k, v, state

    _, _, state = ring.ring_loop(body, (k, v, state))
    return _flash_finish(state)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, pos_q):
    """Causal attention of the local queries to the whole sequence's keys, passed around
    the ring: `out`, `(nq, block, heads, dim)` in the accumulation dtype (arguments in
    blocks as for `_flash`; `k` and `v` this rank's own).

    At step 0 the queries attend to the local keys (the causal diagonal); at each step
    `i = 1 .. cp - 1` of a loop the keys and values move one rank on (rank `r` then holds
    rank `r - i`'s) and the step's tiles run into the same online softmax. One piece of
    keys and values is held (and one in flight) at a time, so memory is `O(S / cp)`.

    The backward saves only `q, k, v, out` and the log-sum-exp, and runs the ring again:
    the keys and values go around with accumulators of their gradients, to which each rank
    adds its tiles' contributions (recomputed from the log-sum-exp, as `_flash` does); one
    last step brings the accumulators home, where each holds its rank's `dk`, `dv`.
    """
    return _ring_forward(ring, q, k, v, pos_q)[0]


def _ring_fwd(ring: _Ring, q, k, v, pos_q):
    out, lse = _ring_forward(ring, q, k, v, pos_q)
    return out, (q, k, v, pos_q, out, lse)


def _ring_bwd(ring: _Ring, res, d_out):
    q, k, v, pos_q, out, lse = res
    rank = jax.lax.axis_index(ring.axis_name)
    d_out, lse, delta = _flash_grad_prep(out, lse, d_out, None)
    acc = _acc_dtype(q.dtype)
    grads = (jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
    grads = _varying(grads, (q, k, v, pos_q, d_out, delta))
    tiles, row, count = ring.diagonal.at(rank)
    dq, dk, dv = _flash_grad_steps(
        q, k, v, pos_q, pos_q, tiles, row, count, ring.unroll, lse, delta, d_out, grads
    )

    def body(step, carry):
        k, v, dq, dk, dv = carry
        k, v, dk, dv = ring.ppermute((k, v, dk, dv))
        pos_k, tiles, row, count = ring.step(rank, step)
        dq, dk, dv = _flash_grad_steps(
            q, k, v, pos_q, pos_k, tiles, row, count, ring.unroll, lse, delta, d_out, (dq, dk, dv)
        )
        return k, v, dq, dk, dv

    _, _, dq, dk, dv = ring.ring_loop(body, (k, v, dq, dk, dv))
    if ring.cp > 1:
        dk, dv = ring.ppermute((dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _block(block_size: int, piece: int, what: str) -> int:
    """The tile size: `block_size`, or the piece length if shorter; it must divide it."""
    b = min(block_size, piece)
    if piece % b:
        fit = max(c for c in range(1, b + 1) if piece % c == 0)
        raise ValueError(
            f"CausalSelfAttention(block_size={block_size}) must divide {what} ({piece}), or be "
            f"at least as long: pass block_size={fit} (the largest divisor below it), or pad "
            f"the sequence so that {what} is a multiple of {block_size}."
        )
    return b


def _check_kv_exchange(kv_exchange: object) -> None:
    """Raise a `ValueError` unless `kv_exchange` is `"allgather"` or `"ring"`."""
    if kv_exchange not in _KV_EXCHANGES:
        raise ValueError(
            f"CausalSelfAttention takes kv_exchange='allgather' (one all-gather of the keys "
            f"and values) or kv_exchange='ring' (cp - 1 ppermute steps); got {kv_exchange!r}."
        )


def _tiles(layout: Layout, cp: int, m: int, kv_exchange: str) -> list[list[_Schedule]]:
    """The tile loops of one attention's forward, in program order, each as the schedules
    of its successive runs: the all-gather's one loop, run once; the ring's loop over the
    local diagonal, run once, and its loop over one step's tiles, run once per step
    `1 .. cp - 1` inside the loop over steps. (The backward has a loop for each.)"""
    if kv_exchange == "allgather":
        return [[_allgather_schedule(layout, cp, m)]]
    ring = [_ring_schedule(layout, cp, m, step) for step in range(cp)]
    return [ring[:1], ring[1:]]


def _check_unroll(loops: list[list[_Schedule]], unroll: bool | int) -> None:
    if _unrolled(unroll) and not all(
        s.uniform and s.counts[0] == s.tiles.shape[1] for loop in loops for s in loop
    ):
        raise ValueError("unroll needs the same, static number of tiles on every rank.")


def _tiling(layout: Layout, length: int, block_size: int) -> tuple[int, int]:
    """`(tile side, tiles per piece)` for `length` local tokens under `layout`."""
    if isinstance(layout, Zigzag):
        b = _block(block_size, zigzag_half(length), "each zigzag piece (half the local length)")
        return b, length // (2 * b)
    b = _block(block_size, length, "the local sequence length")
    return b, length // b


def _blockwise_attention(
    q: Float[Array, "seq heads dim"],
    k: Float[Array, "seq heads dim"],
    v: Float[Array, "seq heads dim"],
    pos_q: Int[Array, " seq"],
    *,
    axis_name: str | None,
    layout: Layout,
    kv_exchange: str,
    block_size: int,
    unroll: bool | int = False,
) -> Float[Array, "seq heads dim"]:
    """Causal softmax attention of this rank's queries (global positions `pos_q`, RoPE
    already applied, not yet scaled) against every earlier key of the sequence."""
    t, _, d = q.shape
    q = q * (d**-0.5)
    if axis_name is None:
        b = _block(block_size, t, "the sequence length")
        ((schedule,),) = loops = _tiles(Contiguous(), 1, t // b, "allgather")
        _check_unroll(loops, unroll)
        out, _ = _attend(q, k, v, pos_q, pos_q, schedule.at(0), b, unroll)
        return out.astype(v.dtype)
    check_layout(layout, "CausalSelfAttention")
    _check_kv_exchange(kv_exchange)
    cp = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    b, m = _tiling(layout, t, block_size)
    table = _position_table(layout, t, cp)
    loops = _tiles(layout, cp, m, kv_exchange)
    _check_unroll(loops, unroll)
    if kv_exchange == "allgather":
        k = jax.lax.all_gather(k, axis_name, axis=0, tiled=True)
        v = jax.lax.all_gather(v, axis_name, axis=0, tiled=True)
        pos_k = jnp.asarray(table.reshape(-1))
        out, _ = _attend(q, k, v, pos_q, pos_k, loops[0][0].at(rank), b, unroll)
        return out.astype(v.dtype)
    (diagonal,), steps = loops
    ring = _Ring(axis_name, cp, unroll, diagonal, steps, table.reshape(cp, -1, b))
    blocks = (_to_blocks(x, b) for x in (q, k, v, pos_q))
    out = cast(Array, _ring(ring, *blocks))
    return out.reshape(q.shape).astype(v.dtype)


class CausalSelfAttention(eqx.Module):
    """Multi-head causal softmax self-attention with rotary position embeddings.

    The scores are computed in `(block_size, block_size)` tiles with an online softmax
    (flash attention): memory grows linearly with the sequence length, forward and
    backward (which recomputes the tiles), and tiles wholly in the future of their queries
    are never computed.

    Inside `jax.shard_map` with time sharded over `axis_name`, every rank attends from its
    own queries (at their global positions) to the keys and values of the whole sequence,
    received by one all-gather or around a ring (`kv_exchange`): a payload of
    `(cp - 1) / cp * S * 2 * heads * head_dim` elements per rank and layer either way,
    growing with the sequence length `S`.

    Memory per rank is linear in the sequence length: no score matrix is ever held, only
    one tile of it. The all-gather holds the keys and values of the whole sequence,
    `O(S)` per rank. The ring holds one rank's piece of them at a time, `O(S / cp)` per
    rank, forward and backward: its steps are a loop, and its backward saves only the
    local queries, keys, values, output and log-sum-exp, then passes the keys and values
    around the ring again with accumulators of their gradients (which one more step
    brings home: the backward sends `cp - 1` pieces of keys and values and `cp` of their
    gradients, in the accumulation dtype).

    With `layout=Contiguous()` the causal work is unbalanced: rank `r` computes about
    `(2 r + 1) / cp` times the average rank's tiles, so the last rank does
    `(2 cp - 1) / cp` times the average (1.75 at `cp = 4`) and every step waits for it,
    with either exchange (the ring's steps skip the future ranks' keys, so the early ranks
    idle). With `layout=Zigzag()` every rank computes the same tiles' worth of work: the
    causal ideal plus half a tile per query block on the two diagonals, a fraction
    `block_size / S` more.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    block_size: int = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10_000.0,
        block_size: int = 128,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `num_heads`: the number of attention heads (queries, keys and values alike).
        - `head_dim`: the size of each head (even, for the rotary embedding).
        - `rope_theta`: the base of the rotary embedding's frequencies.
        - `block_size`: the side of the score tiles. A sequence (on one device), local
            sequence (`Contiguous`) or zigzag piece (`Zigzag`, half the local sequence)
            shorter than it is one tile; a longer one must be a multiple of it (a
            `ValueError` at call time says which value to pass otherwise).
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        if head_dim % 2:
            raise ValueError(f"`head_dim` must be even for rotary embeddings; got {head_dim}.")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"`block_size` must be a positive int; got {block_size!r}.")
        kq, kk, kv, ko = jr.split(key, 4)
        inner = num_heads * head_dim
        self.q_proj = eqx.nn.Linear(hidden_size, inner, use_bias=False, key=kq, dtype=dtype)
        self.k_proj = eqx.nn.Linear(hidden_size, inner, use_bias=False, key=kk, dtype=dtype)
        self.v_proj = eqx.nn.Linear(hidden_size, inner, use_bias=False, key=kv, dtype=dtype)
        self.o_proj = eqx.nn.Linear(inner, hidden_size, use_bias=False, key=ko, dtype=dtype)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.block_size = block_size

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        *,
        axis_name: str | None = None,
        layout: Layout = Contiguous(),
        kv_exchange: KVExchange = "allgather",
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: one sequence, `(seq, hidden)`; with `axis_name`, this rank's shard of it.
        - `axis_name`: the `shard_map` axis that time is sharded over, or `None`.
        - `layout`: how the sequence is sharded: [`deltanet_cp.Contiguous`][] (rank `r`
            holds the `r`-th slice) or [`deltanet_cp.Zigzag`][] (rank `r` holds pieces `r`
            and `2 cp - 1 - r` of `2 cp`; the causal work is then the same on every rank).
        - `kv_exchange`: how the keys and values reach every rank: `"allgather"` (one
            all-gather; each rank then computes only the tiles its queries need) or
            `"ring"` (`cp - 1` steps of `jax.lax.ppermute` in a loop, attending to one
            rank's keys per step in one online softmax, with `O(S / cp)` memory per rank;
            with `Zigzag` every rank computes the same number of tiles at every step).

        `layout` and `kv_exchange` are ignored without `axis_name`.

        **Returns:**

        The output, `(seq, hidden)`.
        """
        _check_kv_exchange(kv_exchange)
        t = x.shape[0]

        def heads(lin):
            return jax.vmap(lin)(x).reshape(t, self.num_heads, self.head_dim)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        if axis_name is not None:
            check_layout(layout, "CausalSelfAttention")
        pos = positions(layout, t, axis_name)
        q, k = _rope(q, pos, self.rope_theta), _rope(k, pos, self.rope_theta)
        o = _blockwise_attention(
            q,
            k,
            v,
            pos,
            axis_name=axis_name,
            layout=layout,
            kv_exchange=kv_exchange,
            block_size=self.block_size,
        )
        return jax.vmap(self.o_proj)(o.reshape(t, self.num_heads * self.head_dim))

    def busiest_rank_work(
        self,
        seq_len: int,
        cp: int,
        layout: Layout = Contiguous(),
        kv_exchange: KVExchange = "allgather",
    ) -> float:
        """The attention work of the busiest rank over the causal ideal, from the schedule.

        Counts the `(block_size, block_size)` tiles each rank's compiled program computes
        (forward; the backward runs the same tiles) and divides the busiest rank's
        (query, key) pairs by the causal ideal per rank, `S (S + 1) / 2 / cp`: 1 is perfect
        balance with no wasted pair. `benchmarks/attention_balance.py` checks the same
        ratio against XLA's FLOP count of the compiled per-rank module.

        **Arguments:**

        - `seq_len`: the global sequence length `S`.
        - `cp`: the number of ranks.
        - `layout`, `kv_exchange`: as in `__call__`.

        **Returns:**

        The ratio, e.g. about `(2 cp - 1) / cp` under `Contiguous()` and about
        `1 + block_size / S` under `Zigzag()`.
        """
        check_layout(layout, "CausalSelfAttention")
        _check_kv_exchange(kv_exchange)
        if seq_len % cp:
            raise ValueError(f"seq_len ({seq_len}) must be divisible by cp ({cp}).")
        b, m = _tiling(layout, seq_len // cp, self.block_size)
        loops = _tiles(layout, cp, m, kv_exchange)
        tiles = [sum(s.counts[r] for loop in loops for s in loop) for r in range(cp)]
        return max(tiles) * b * b / (seq_len * (seq_len + 1) / 2 / cp)
