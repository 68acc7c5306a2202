"""The tile schedules of blockwise causal attention: which (query block, key block) tiles
each rank computes, as static tables, derived from the pieces each rank holds (one device is
one rank holding one piece)."""

from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._parallel import AbstractLayout


_KV_SCHEDULES = ("allgather", "ring")
KVSchedule = Literal["allgather", "ring"]


def _triangle(m: int, q0: int = 0, k0: int = 0) -> list[tuple[int, int]]:
    """The tiles of a causal diagonal: query block `q0 + i` with key block `k0 + j`, j <= i."""
    return [(q0 + i, k0 + j) for i in range(m) for j in range(i + 1)]


def _rect(q0: int, nq: int, k0: int, nk: int) -> list[tuple[int, int]]:
    """Every tile of query blocks `q0 .. q0 + nq - 1` with key blocks `k0 .. k0 + nk - 1`."""
    return [(q0 + i, k0 + j) for i in range(nq) for j in range(nk)]


class Schedule:
    """The tiles each rank computes, as one static table indexed by the (traced) rank.

    `tiles[r, :counts[r]]` lists rank `r`'s tiles as (query block, key block) pairs; shorter
    lists are padded with tile (0, 0), never run. The table is a constant of the compiled
    program, read one tile per step: no per-rank copy of it is made.
    """

    def __init__(self, tiles: np.ndarray, counts: tuple[int, ...]):
        self.tiles = tiles  # (ranks, pairs, 2) int32
        self.counts = counts

    @classmethod
    def of(cls, per_rank: list[list[tuple[int, int]]]) -> "Schedule":
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


Held = tuple[tuple[int, ...], ...]
"""Per rank, the global pieces its shard holds, in local order (`AbstractLayout.held`)."""


def _piece_tiles(p: int, q: int, qi: int, kj: int, m: int) -> list[tuple[int, int]]:
    """The tiles of queries of global piece `p` (local blocks from `qi`) against keys of
    global piece `q` (key blocks from `kj`), `m` blocks a piece: all of them if `q` is
    wholly in `p`'s past, a causal diagonal if it is the same piece, none if in its future."""
    if q < p:
        return _rect(qi, m, kj, m)
    if q == p:
        return _triangle(m, qi, kj)
    return []


def _allgather_schedule(held: Held, m: int) -> Schedule:
    """Tiles of local queries against the all-gathered keys, `m` blocks per piece.

    The gathered keys are every rank's shard in rank order, so global piece `q` lies at
    its slot in the concatenation of `held`. The local piece in slot `i` attends every
    earlier piece whole and its own causally. Contiguous: rank `r` runs
    `m (m + 1) / 2 + r m^2` tiles. Zigzag: `(2 cp - 1) m^2 + m (m + 1)` on every rank.
    """
    slots = [q for pieces in held for q in pieces]
    per_rank = [
        [
            tile
            for i, p in enumerate(pieces)
            for j, q in enumerate(slots)
            for tile in _piece_tiles(p, q, i * m, j * m, m)
        ]
        for pieces in held
    ]
    return Schedule.of(per_rank)


def _ring_schedule(held: Held, m: int, step: int) -> Schedule:
    """Tiles of local queries against the keys held `step` ranks back around the ring.

    At step `i` rank `r` holds the shard of source `s = (r - i) mod cp` (step 0: its own,
    the causal diagonals). Contiguous: `m^2` tiles if `s < r`, none otherwise. Zigzag (the
    schedule of ring-flash-attention): if `s < r` both local pieces attend to the
    source's first piece, otherwise the local second piece attends to both source pieces;
    `2 m^2` tiles either way.
    """
    cp = len(held)
    per_rank = [
        [
            tile
            for i, p in enumerate(pieces)
            for j, q in enumerate(held[(r - step) % cp])
            for tile in _piece_tiles(p, q, i * m, j * m, m)
        ]
        for r, pieces in enumerate(held)
    ]
    return Schedule.of(per_rank)


def tile_side(tile_size: int, piece: int, what: str) -> int:
    """The tile size: `tile_size`, or the piece length if shorter; it must divide it."""
    b = min(tile_size, piece)
    if piece % b:
        fit = max(c for c in range(1, b + 1) if piece % c == 0)
        raise ValueError(
            f"The attention layer's tile_size={tile_size} must divide {what} ({piece}), or be "
            f"at least as long: pass tile_size={fit} (the largest divisor below it), or pad "
            f"the sequence so that {what} is a multiple of {tile_size}."
        )
    return b


def check_kv_schedule(kv_schedule: object) -> None:
    """Raise a `ValueError` unless `kv_schedule` is `"allgather"` or `"ring"`."""
    if kv_schedule not in _KV_SCHEDULES:
        raise ValueError(
            f"CausalSelfAttention takes kv_schedule='allgather' (one all-gather of the keys "
            f"and values) or kv_schedule='ring' (cp - 1 ppermute steps); got {kv_schedule!r}."
        )


def tile_loops(held: Held, m: int, kv_schedule: str) -> list[list[Schedule]]:
    """The tile loops of one attention's forward, in program order, each as the schedules
    of its successive runs: the all-gather's one loop, run once; the ring's loop over the
    local diagonal, run once, and its loop over one step's tiles, run once per step
    `1 .. cp - 1` inside the loop over steps. (The backward has a loop for each.)"""
    if kv_schedule == "allgather":
        return [[_allgather_schedule(held, m)]]
    ring = [_ring_schedule(held, m, step) for step in range(len(held))]
    return [ring[:1], ring[1:]]


def tiling(layout: AbstractLayout, length: int, cp: int, tile_size: int) -> tuple[int, int]:
    """`(tile side, tiles per piece)` for `length` local tokens under `layout`."""
    piece = layout.piece_length(length, cp)
    per_rank = length // piece
    what = (
        "the local sequence length"
        if per_rank == 1
        else f"each of a rank's {per_rank} pieces (the local length / {per_rank})"
    )
    b = tile_side(tile_size, piece, what)
    return b, piece // b
