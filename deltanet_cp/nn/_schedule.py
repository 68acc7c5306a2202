"""The tile schedules of blockwise causal attention: which (query block, key block) tiles
each rank computes, as static tables, for one device and both context-parallel layouts."""

from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._layout import Contiguous, Layout, Zigzag, zigzag_half


_KV_EXCHANGES = ("allgather", "ring")
KVExchange = Literal["allgather", "ring"]


def _unrolled(unroll: bool | int) -> bool:
    return unroll is True or (not isinstance(unroll, bool) and unroll > 1)


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
