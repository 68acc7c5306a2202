"""What the attention benchmark needs to look inside `deltanet_cp.nn.CausalSelfAttention`:
its blockwise kernel (the part after the projections), its tile schedules, the busiest
rank's share of the causal work, and its loops compiled unrolled. Measurement only: the
library's kernel knows nothing of it. The one benchmark module that reads private names of
the library (the kernel's schedule and loops have no public form)."""

import contextlib

import jax

import deltanet_cp as dcp
from deltanet_cp.nn import _flash
from deltanet_cp.nn._schedule import _Schedule, _tiles, _tiling


def blockwise_attention(q, k, v, pos_q, *, cp, kv_exchange: str, block_size: int):
    """The layer's causal attention of this rank's queries (RoPE applied, not yet scaled)
    against every earlier key: `(out, None)`."""
    return _flash._blockwise_attention(
        q, k, v, pos_q, cp=cp, kv_exchange=kv_exchange, block_size=block_size
    )


def schedules(
    seq_len: int, cp: int, layout: dcp.AbstractLayout, kv_exchange: str, block_size: int
) -> tuple[int, list[list[_Schedule]]]:
    """`(tile side, loops)`: the forward's loops over tiles of one attention over `seq_len`
    tokens on `cp` ranks, each as the schedules of its runs (per rank)."""
    if seq_len % cp:
        raise ValueError(f"seq_len ({seq_len}) must be divisible by cp ({cp}).")
    b, m = _tiling(layout, seq_len // cp, cp, block_size)
    return b, _tiles(layout.held(cp), m, kv_exchange)


def busiest_rank_work(
    block_size: int, seq_len: int, cp: int, layout: dcp.AbstractLayout, kv_exchange: str
) -> float:
    """The attention work of the busiest rank over the causal ideal, from the schedule.

    Counts the `(block_size, block_size)` tiles each rank's compiled program computes
    (forward; the backward runs the same tiles) and divides the busiest rank's (query, key)
    pairs by the causal ideal per rank, `S (S + 1) / 2 / cp`: 1 is perfect balance with no
    wasted pair. About `(2 cp - 1) / cp` under `Contiguous()` and `1 + block_size / S`
    under `Zigzag()`.
    """
    b, loops = schedules(seq_len, cp, layout, kv_exchange, block_size)
    tiles = [sum(s.counts[r] for loop in loops for s in loop) for r in range(cp)]
    return max(tiles) * b * b / (seq_len * (seq_len + 1) / 2 / cp)


def _unrolled(unroll: bool | int) -> bool:
    return unroll is True or (not isinstance(unroll, bool) and unroll > 1)


def check_unroll(loops: list[list[_Schedule]], unroll: bool | int) -> None:
    """Unrolling needs the same, static number of tiles on every rank, in every run."""
    if _unrolled(unroll) and not all(
        s.uniform and s.counts[0] == s.tiles.shape[1] for loop in loops for s in loop
    ):
        raise ValueError("unroll needs the same, static number of tiles on every rank.")


@contextlib.contextmanager
def unrolled(unroll: bool | int):
    """Inside the block, the attention kernel traces its loops over tiles with a static
    trip count (check it with `check_unroll`) and `unroll` tiles per trip: `False` (or 1)
    leaves them as they are, an int `n > 1` runs `n` tiles per trip, `True` leaves no
    loop (and unrolls the ring's loop over steps too)."""
    if not _unrolled(unroll):
        yield
        return
    tile_loop, ring_loop = _flash._tile_loop, _flash._Ring.ring_loop

    def static_tile_loop(tiles, count, body, init):
        return jax.lax.fori_loop(0, tiles.shape[1], body, init, unroll=unroll)

    def static_ring_loop(self, body, init):
        return jax.lax.fori_loop(1, self.cp, body, init, unroll=unroll is True or 1)

    _flash._tile_loop, _flash._Ring.ring_loop = static_tile_loop, static_ring_loop
    try:
        yield
    finally:
        _flash._tile_loop, _flash._Ring.ring_loop = tile_loop, ring_loop
