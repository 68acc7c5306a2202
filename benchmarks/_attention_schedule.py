"""What the attention benchmark needs to look inside `deltanet_cp.nn.CausalSelfAttention`:
its blockwise kernel (the part after the projections), the tiles each rank computes, the
busiest rank's share of the causal work, and its loops compiled unrolled. Measurement only:
the library's kernel knows nothing of it.

The tiles are counted from the layout (`layout.held`, `layout.piece_length`) and causality
alone: the queries of global piece `p` need every tile of an earlier piece `q < p`, the
causal diagonal of their own piece (`m (m + 1) / 2` of `m x m` tiles) and nothing of a later
one. The kernel computes exactly those tiles (`tests/test_attention.py` checks its schedule
against them)."""

import contextlib

import jax

import deltanet_cp as dcp
from deltanet_cp.nn import _flash


def blockwise_attention(q, k, v, pos_q, *, cp, kv_exchange: str, block_size: int):
    """The layer's causal attention of this rank's queries (RoPE applied, not yet scaled)
    against every earlier key: `(out, None)`. The kernel has no public form."""
    return _flash.blockwise_attention(
        q, k, v, pos_q, cp=cp, kv_schedule=kv_exchange, tile_size=block_size
    )


def _pair(p: int, q: int, m: int) -> int:
    """Tiles of the queries of global piece `p` against the keys of piece `q`."""
    return m * m if q < p else m * (m + 1) // 2 if q == p else 0


def schedules(
    seq_len: int, cp: int, layout: dcp.AbstractLayout, kv_exchange: str, block_size: int
) -> tuple[int, list[list[tuple[int, ...]]]]:
    """`(tile side, loops)`: the forward's loops over tiles of one attention over `seq_len`
    tokens on `cp` ranks, each as its runs, each run the tiles it computes per rank. The
    all-gather has one loop, run once; the ring a loop over the local diagonal, run once,
    and a loop over the tiles of one step, run at steps `1 .. cp - 1` (at step `s` rank `r`
    holds the keys of rank `(r - s) mod cp`)."""
    if seq_len % cp:
        raise ValueError(f"seq_len ({seq_len}) must be divisible by cp ({cp}).")
    piece = layout.piece_length(seq_len // cp, cp)
    b = min(block_size, piece)
    if piece % b:
        raise ValueError(f"block_size ({block_size}) must divide the pieces ({piece} tokens).")
    m, held = piece // b, layout.held(cp)
    if kv_exchange == "allgather":
        every = [q for pieces in held for q in pieces]
        return b, [[tuple(sum(_pair(p, q, m) for p in ps for q in every) for ps in held)]]
    steps = [
        tuple(
            sum(_pair(p, q, m) for p in ps for q in held[(r - s) % cp]) for r, ps in enumerate(held)
        )
        for s in range(cp)
    ]
    return b, [steps[:1], steps[1:]]


def busiest_rank_work(
    block_size: int, seq_len: int, cp: int, layout: dcp.AbstractLayout, kv_exchange: str
) -> float:
    """The attention work of the busiest rank over the causal ideal.

    Counts the `(block_size, block_size)` tiles each rank's compiled program computes
    (forward; the backward runs the same tiles) and divides the busiest rank's (query, key)
    pairs by the causal ideal per rank, `S (S + 1) / 2 / cp`: 1 is perfect balance with no
    wasted pair. About `(2 cp - 1) / cp` under `Contiguous()` and `1 + block_size / S`
    under `Zigzag()`.
    """
    b, loops = schedules(seq_len, cp, layout, kv_exchange, block_size)
    tiles = [sum(run[r] for loop in loops for run in loop) for r in range(cp)]
    return max(tiles) * b * b / (seq_len * (seq_len + 1) / 2 / cp)


def _unrolled(unroll: bool | int) -> bool:
    return unroll is True or (not isinstance(unroll, bool) and unroll > 1)


@contextlib.contextmanager
def unrolled(unroll: bool | int, loops: list[list[tuple[int, ...]]]):
    """Inside the block, the attention kernel traces its loops over tiles with a static
    trip count and `unroll` tiles per trip: `False` (or 1) leaves them as they are, an int
    `n > 1` runs `n` tiles per trip, `True` leaves no loop (and unrolls the ring's loop over
    steps too).

    `loops` are the forward's (`schedules(...)[1]`); unrolling needs each to run the same
    number of tiles on every rank and in every run. It replaces `jax.lax.fori_loop` while
    the kernel is traced: its ring's loop over steps runs from the int 1 to `cp`, and a loop
    over tiles traced inside it is the ring's loop over one step's tiles, any other the
    all-gather's or the ring's diagonal loop (forward or backward alike).
    """
    if not _unrolled(unroll):
        yield
        return
    trips = []
    for loop in loops:
        counts = {n for run in loop for n in run}
        if len(counts) != 1:
            raise ValueError("unroll needs the same, static number of tiles on every rank.")
        trips.append(counts.pop())
    fori_loop, in_ring = jax.lax.fori_loop, [0]

    def static_loop(lower, upper, body, init, **kwargs):
        if isinstance(lower, int):  # the ring's loop over steps

            def step(i, carry):
                in_ring[0] += 1
                try:
                    return body(i, carry)
                finally:
                    in_ring[0] -= 1

            return fori_loop(lower, upper, step, init, unroll=unroll is True or 1)
        return fori_loop(0, trips[-1] if in_ring[0] else trips[0], body, init, unroll=unroll)

    jax.lax.fori_loop = static_loop
    try:
        yield
    finally:
        jax.lax.fori_loop = fori_loop
