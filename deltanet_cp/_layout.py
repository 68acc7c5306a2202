"""The layouts of a sequence over the ranks of a context-parallel axis.

A layout says which pieces of the sequence each rank holds (`held`); everything else
follows from that, here and nowhere else: the contiguous *walks* a shard is made of (the
pieces a sequential recurrence visits, in chain order), each walk's direction and the ranks
in its order, where a rank's slice of a walk starts, the global positions of a shard's
tokens, and the reordering of global arrays. The engine, the exchanges, their cost model
and the layers ask the layout; none of them asks which layout it has.
"""

import abc
from typing import TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

from ._validate import as_index, as_positive_index


def position(axis_name: str, reverse: bool) -> Int[Array, ""]:
    """This rank's place along a walk over `axis_name` (inside `jax.shard_map`): its index,
    or, for a walk in reverse rank order, its index counted from the last rank."""
    rank = jax.lax.axis_index(axis_name)
    return jax.lax.axis_size(axis_name) - 1 - rank if reverse else rank


def rank_at(place: int, cp: int, reverse: bool) -> int:
    """The rank at `place` along a walk over `cp` ranks (the inverse of `position`)."""
    return cp - 1 - place if reverse else place


class Walk(eqx.Module):
    """One contiguous, in-order piece of every rank's shard, visited in one pass.

    The pieces of all ranks for one walk are consecutive tokens of the sequence: in rank
    order, or in reverse rank order with `reverse`. Walks are chained: each starts from the
    state the previous one ends in.

    - `local`: this piece's tokens in the local shard.
    - `start`: the sequence position of the walk's first token (`cp * length` multiples).
    - `reverse`: the last rank holds the walk's first piece.
    """

    local: slice = eqx.field(static=True)
    start: int = eqx.field(static=True)
    reverse: bool = eqx.field(static=True)

    def ranks(self, cp: int) -> tuple[int, ...]:
        """The `cp` ranks in the walk's order: `0, ..., cp - 1`, or reversed."""
        return tuple(rank_at(p, cp, self.reverse) for p in range(cp))

    def first_token(self, axis_name: str | None) -> Int[Array, ""] | int:
        """The sequence position of this rank's first token of the walk (inside
        `jax.shard_map` over `axis_name`; `start` if `axis_name` is `None`)."""
        if axis_name is None:
            return self.start
        return self.start + position(axis_name, self.reverse) * (self.local.stop - self.local.start)


class AbstractLayout(eqx.Module):
    """How the tokens of a sequence are assigned to the ranks of a context-parallel axis.

    The sequence is cut into equal *pieces*; a layout says which pieces each rank holds,
    in its local order ([`held`][deltanet_cp.AbstractLayout.held], its one abstract
    method). Everything else follows from that: the contiguous walks a sequential
    recurrence makes over the shards, the global position of every local token, and the
    reordering of global arrays.

    A layout of your own is one class with `held`. Every rank holds the same number of
    pieces, and piece `i` of the shards, over all ranks, must be pieces
    `i * cp, ..., (i + 1) * cp - 1` of the sequence, in rank order or in reverse rank order
    (walk `i`): [`deltanet_cp.Zigzag`][] is two walks, forwards then backwards. A layout
    that breaks the rule is refused with a `ValueError` when its walks are asked for.
    """

    @abc.abstractmethod
    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        """Per rank of `cp`, the global pieces its shard holds, in local order."""

    def pieces(self, cp: int) -> int:
        """Into how many equal pieces the sequence is cut for `cp` ranks."""
        return sum(len(p) for p in self.held(cp))

    def directions(self, cp: int) -> tuple[bool, ...]:
        """Per walk over `cp` ranks, in chain order, whether it goes in reverse rank order;
        a `ValueError` if `held` breaks the rule of [`deltanet_cp.AbstractLayout`][]."""
        held = self.held(cp)
        if len(held) != cp or len({len(p) for p in held}) != 1:
            raise ValueError(
                f"{self!r}: `held({cp})` must give each of the {cp} ranks the same number of "
                f"pieces; got {held!r}."
            )
        out = []
        for i, run in enumerate(zip(*held)):
            forwards = tuple(range(i * cp, (i + 1) * cp))
            if run not in (forwards, forwards[::-1]):
                raise ValueError(
                    f"{self!r}: piece {i} of the shards must be pieces {i * cp} .. "
                    f"{(i + 1) * cp - 1} of the sequence, one contiguous run in rank order "
                    f"or in reverse rank order; got {run} (held({cp}) = {held!r})."
                )
            out.append(cp > 1 and run[0] > run[-1])
        return tuple(out)

    def piece_length(self, length: int, cp: int) -> int:
        """The tokens in each piece of a `length`-token shard; a `ValueError` if the
        shard does not cut into whole pieces."""
        per_rank = len(self.held(cp)[0])
        if length % per_rank:
            multiple = "even" if per_rank == 2 else f"a multiple of {per_rank}"
            raise ValueError(
                f"Under layout={self!r} each rank holds {per_rank} equal pieces, so the local "
                f"sequence length must be {multiple}; got {length}. Make the global length a "
                f"multiple of {per_rank} * cp."
            )
        return length // per_rank

    def walks(self, length: int, cp: int) -> tuple[Walk, ...]:
        """A `length`-token shard as contiguous walks, in chain order (see `Walk`)."""
        directions = self.directions(cp)
        n = self.piece_length(length, cp)
        return tuple(
            Walk(slice(i * n, (i + 1) * n), i * cp * n, reverse)
            for i, reverse in enumerate(directions)
        )

    def position_table(self, length: int, cp: int) -> np.ndarray:
        """The global positions of every rank's `length` local tokens, `(cp, length)` int32."""
        n = self.piece_length(length, cp)
        local = np.arange(n)
        table = [np.concatenate([p * n + local for p in pieces]) for pieces in self.held(cp)]
        return np.stack(table).astype(np.int32)

    def positions(self, length: int, axis_name: str | None) -> Int[Array, " length"]:
        """The global sequence positions of this rank's `length` local tokens (inside
        `shard_map` over `axis_name`; `0 .. length - 1` if `axis_name` is `None`)."""
        local = jnp.arange(length, dtype=jnp.int32)
        if axis_name is None:
            return local
        cp = jax.lax.axis_size(axis_name)
        n = self.piece_length(length, cp)
        # Only the small table of pieces is a constant of the program, not one position per
        # token and rank.
        pieces = jnp.asarray(self.held(cp), jnp.int32)[jax.lax.axis_index(axis_name)]
        return pieces[local // n] * n + local % n

    def to_layout(self, x: Shaped[Array | np.ndarray, "..."], cp: int, axis: int = 1) -> Array:
        """A global array in sequence order -> the order whose contiguous sharding over
        `cp` ranks gives each rank its shard (`axis` the time axis)."""
        cp = as_positive_index(cp, "cp")
        order = _order(self, cp)
        if order == list(range(len(order))):
            return jnp.asarray(x)
        return reorder(x, len(order), axis, order, f"{self!r}.to_layout")

    def from_layout(self, x: Shaped[Array | np.ndarray, "..."], cp: int, axis: int = 1) -> Array:
        """The inverse of `to_layout`."""
        cp = as_positive_index(cp, "cp")
        order = _order(self, cp)
        if order == list(range(len(order))):
            return jnp.asarray(x)
        inverse = [order.index(p) for p in range(len(order))]
        return reorder(x, len(order), axis, inverse, f"{self!r}.from_layout")


def _order(layout: AbstractLayout, cp: int) -> list[int]:
    """The pieces in the order the ranks hold them (rank 0's, then rank 1's, ...)."""
    return [p for pieces in layout.held(cp) for p in pieces]


class Contiguous(AbstractLayout):
    """Rank `r` of `cp` holds tokens `[r * S / cp, (r + 1) * S / cp)`: contiguous, in order.

    What sharding the time axis of an array with `PartitionSpec(None, axis_name)` gives.
    Takes no arguments: `Contiguous()`.
    """

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((r,) for r in range(cp))


class Zigzag(AbstractLayout):
    """The load-balanced layout: rank `r` holds pieces `r` and `2 cp - 1 - r` of `2 cp`.

    The sequence is cut into `2 * cp` equal pieces; rank `r`'s shard is piece `r` (its
    *first* piece) followed by piece `2 cp - 1 - r` (its *second*). Every rank then holds
    one early and one late piece, which balances the causal triangle of softmax attention.
    [`deltanet_cp.to_zigzag`][] puts a global array in this order, so that sharding it
    contiguously gives each rank its two pieces; [`deltanet_cp.from_zigzag`][] undoes it.

    A recurrence runs on it as two walks: the first pieces in rank order, then the second
    pieces in reverse rank order, from the state the first walk ends in (see the concept
    page "Layouts"). The local sequence length must be even. Takes no arguments:
    `Zigzag()`.
    """

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((r, 2 * cp - 1 - r) for r in range(cp))


Layout: TypeAlias = Contiguous | Zigzag
"""The built-in layouts: `Contiguous | Zigzag` (any [`deltanet_cp.AbstractLayout`][] is
accepted where a layout is)."""


def reorder(
    x: Shaped[Array | np.ndarray, "..."],
    count: int,
    axis: int,
    order: list[int],
    name: str,
    what: str | None = None,
) -> Array:
    """Cut `axis` into `count` equal pieces and concatenate them in `order` (static
    slices, so that it works on sharded arrays too); an error names `name` and `count`
    (as `what`, if given)."""
    x = jnp.asarray(x)
    axis = as_index(axis, "axis")
    if not -x.ndim <= axis < x.ndim:  # numpy's rule: negative axes count from the end
        raise np.exceptions.AxisError(axis, x.ndim, msg_prefix=f"{name}: `axis`")
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % count:
        raise ValueError(
            f"{name}: the sequence length ({length}, axis {axis}) must be divisible by "
            f"{what or f'the number of pieces, {count}'}: pad the sequence to a multiple of "
            f"{count}."
        )
    n = length // count
    # Under explicit sharding the time axis may be sharded: slicing it is refused, so the
    # array is gathered along it for the reorder and sharded back as it was.
    sharding = jax.typeof(x).sharding
    spec = getattr(sharding, "spec", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and spec is not None:
        if len(spec) > axis and spec[axis] is not None:
            whole = [*spec, *[None] * (x.ndim - len(spec))]
            whole[axis] = None
            gathered = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*whole))
            return jax.reshard(_cut(jax.reshard(x, gathered), n, order, axis), sharding)
    return _cut(x, n, order, axis)


def _cut(x: Array, n: int, order: list[int], axis: int) -> Array:
    pieces = [jax.lax.slice_in_dim(x, p * n, (p + 1) * n, axis=axis) for p in order]
    return jnp.concatenate(pieces, axis=axis)


def to_zigzag(x: Shaped[Array | np.ndarray, "..."], cp: int, axis: int = 1) -> Shaped[Array, "..."]:
    """Reorder a global array's time axis into zigzag order.

    Cuts `axis` into `2 * cp` equal pieces and lays them out as
    `0, 2cp-1, 1, 2cp-2, ..., cp-1, cp`, so that sharding the result contiguously over
    `cp` ranks (`PartitionSpec(None, axis_name)`) gives rank `r` pieces `r` and
    `2 cp - 1 - r`: the [`deltanet_cp.Zigzag`][] layout (`Zigzag().to_layout`).

    **Arguments:**

    - `x`: the array, in natural (sequence) order.
    - `cp`: the number of ranks, a positive int (a NumPy integer too).
    - `axis`: the time axis (1 for `(batch, seq, ...)`); negative counts from the end.

    **Returns:**

    `x` with its time axis permuted; [`deltanet_cp.from_zigzag`][] is the inverse.

    **Raises:**

    `ValueError` if the length of `axis` is not a multiple of `2 * cp` or if `cp < 1`;
    `TypeError` if `cp` or `axis` is not an int; `numpy.exceptions.AxisError` (a
    `ValueError`) if `axis` is out of range.
    """
    cp = as_positive_index(cp, "cp")
    return reorder(x, 2 * cp, axis, _order(Zigzag(), cp), "to_zigzag", f"2 * cp = {2 * cp}")


def from_zigzag(
    x: Shaped[Array | np.ndarray, "..."], cp: int, axis: int = 1
) -> Shaped[Array, "..."]:
    """Put an array in zigzag order (see [`deltanet_cp.to_zigzag`][]) back in sequence order.

    **Arguments:**

    - `x`: the array, its time axis in zigzag order.
    - `cp`: the number of ranks.
    - `axis`: the time axis.

    **Returns:**

    `x` with its time axis in natural order.

    **Raises:**

    As [`deltanet_cp.to_zigzag`][].
    """
    cp = as_positive_index(cp, "cp")
    order = _order(Zigzag(), cp)
    inverse = [order.index(p) for p in range(2 * cp)]
    return reorder(x, 2 * cp, axis, inverse, "from_zigzag", f"2 * cp = {2 * cp}")
