"""How a call is sharded: the layouts of a sequence over ranks, and `ContextParallel`.

A layout owns everything that differs between layouts: the contiguous *walks* a shard is
made of (the pieces a sequential recurrence visits, in chain order), the global positions of
a shard's tokens, and the reordering of global arrays. Nothing outside this module asks
which layout it has.
"""

import abc
from typing import Any, cast, Generic, overload, TYPE_CHECKING, TypeAlias, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

from ._exchange import AbstractExchange, as_exchange, ExchangeName
from ._validate import as_index, as_positive_index


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


class AbstractLayout(eqx.Module):
    """How the tokens of a sequence are assigned to the ranks of a context-parallel axis.

    The sequence is cut into equal *pieces*; a layout says which pieces each rank holds,
    in its local order (`held`). Everything else follows from that and lives here: the
    contiguous walks a sequential recurrence makes over the shards, the global position of
    every local token, and the reordering of global arrays.
    """

    @abc.abstractmethod
    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        """Per rank of `cp`, the global pieces its shard holds, in local order. Piece `i`
        of every rank's shard, over all ranks, must be consecutive pieces of the sequence
        (in rank order or reverse rank order), and piece `i + 1`'s run must follow piece
        `i`'s."""

    @abc.abstractmethod
    def to_layout(self, x: Shaped[Array, "..."], cp: int, axis: int = 1) -> Array:
        """A global array in sequence order -> the order whose contiguous sharding over
        `cp` ranks gives each rank its shard."""

    @abc.abstractmethod
    def from_layout(self, x: Shaped[Array, "..."], cp: int, axis: int = 1) -> Array:
        """The inverse of `to_layout`."""

    def pieces(self, cp: int) -> int:
        """Into how many equal pieces the sequence is cut for `cp` ranks."""
        return sum(len(p) for p in self.held(cp))

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
        n = self.piece_length(length, cp)
        out = []
        for i, run in enumerate(zip(*self.held(cp))):
            reverse = cp > 1 and run[0] > run[-1]
            first = run[-1] if reverse else run[0]
            expected = tuple(range(first, first + cp))
            if (run[::-1] if reverse else run) != expected:
                raise ValueError(f"{self!r}: piece {i} of the shards is not one contiguous run.")
            out.append(Walk(slice(i * n, (i + 1) * n), first * n, reverse))
        return tuple(out)

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


class Contiguous(AbstractLayout):
    """Rank `r` of `cp` holds tokens `[r * S / cp, (r + 1) * S / cp)`: contiguous, in order.

    What sharding the time axis of an array with `PartitionSpec(None, axis_name)` gives.
    Takes no arguments: `Contiguous()`.
    """

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((r,) for r in range(cp))

    def to_layout(self, x, cp, axis=1):
        return jnp.asarray(x)

    def from_layout(self, x, cp, axis=1):
        return jnp.asarray(x)


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

    def to_layout(self, x, cp, axis=1):
        return to_zigzag(x, cp, axis)

    def from_layout(self, x, cp, axis=1):
        return from_zigzag(x, cp, axis)


Layout: TypeAlias = Contiguous | Zigzag
"""The layouts the public context-parallel functions accept: `Contiguous | Zigzag`."""

_L = TypeVar("_L", bound=AbstractLayout)


class ContextParallel(eqx.Module, Generic[_L]):
    """How a call is sharded over a context-parallel mesh axis: one static value.

    Pass it as `cp=` to [`deltanet_cp.run`][], the `chunk_*` and `recurrent_*` functions,
    the layers of `deltanet_cp.nn` and the models; `cp=None` (the default) runs on one
    device. What every `cp=` means:

    - The sequence axis is sharded over the mesh axis `axis_name`: axis 1 of every
        per-token argument of the functions (`(B, T, ...)`), axis 0 of a layer's or
        model's one sequence (`(seq, ...)`).
    - Without `mesh`, the call is made inside your own `jax.shard_map` and every
        per-token array, in and out, is this rank's shard, its pieces in `layout`'s order
        (`layout.to_layout` puts a global array in that order, `layout.from_layout` takes
        it back). An initial state is replicated, and the final state is the whole
        sequence's, the same on every rank.
    - With `mesh`, the arrays are global, in sequence order, and the function does the
        `shard_map` itself (and returns global arrays). The layers and models take a
        `ContextParallel` without `mesh` only.
    - The ranks exchange recurrent state by `exchange`; attention's keys and values go by
        the `kv_exchange=` of the layer's call instead.

    **Arguments:**

    - `axis_name`: the mesh axis the sequence is sharded over.
    - `layout`: [`deltanet_cp.Contiguous`][] (the default) or [`deltanet_cp.Zigzag`][].
    - `exchange`: how ranks exchange their maps: [`deltanet_cp.AllGather`][] (the
        default), [`deltanet_cp.PPermute`][], [`deltanet_cp.Ring`][],
        [`deltanet_cp.Auto`][], or the shorthands `"allgather"`, `"ppermute"`, `"ring"`,
        `"auto"`.
    - `mesh`: a `jax.sharding.Mesh` with an axis `axis_name`, for global arrays.
    - `batch_axis`: with `mesh`, optionally a mesh axis to shard the batch over (data
        parallelism).
    """

    axis_name: str = eqx.field(static=True)
    layout: _L = eqx.field(static=True)
    exchange: AbstractExchange = eqx.field(static=True)
    mesh: jax.sharding.Mesh | None = eqx.field(static=True)
    batch_axis: str | None = eqx.field(static=True)

    @overload
    def __init__(
        self: "ContextParallel[Contiguous]",
        axis_name: str,
        *,
        exchange: AbstractExchange | ExchangeName = ...,
        mesh: jax.sharding.Mesh | None = ...,
        batch_axis: str | None = ...,
    ): ...

    @overload
    def __init__(
        self,
        axis_name: str,
        *,
        layout: _L,
        exchange: AbstractExchange | ExchangeName = ...,
        mesh: jax.sharding.Mesh | None = ...,
        batch_axis: str | None = ...,
    ): ...

    def __init__(
        self,
        axis_name: str,
        *,
        layout: Any = Contiguous(),
        exchange: Any = "allgather",
        mesh: jax.sharding.Mesh | None = None,
        batch_axis: str | None = None,
    ):
        if not isinstance(axis_name, str):
            raise TypeError(f"`axis_name` must be a mesh axis name (a str); got {axis_name!r}.")
        if not isinstance(layout, (Contiguous, Zigzag)):
            raise ValueError(f"`layout` must be Contiguous() or Zigzag(); got {layout!r}.")
        if mesh is not None and axis_name not in mesh.shape:
            raise ValueError(
                f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}."
            )
        if batch_axis is not None and (mesh is None or batch_axis not in mesh.shape):
            raise ValueError(
                f"`batch_axis` ({batch_axis!r}) shards global arrays: pass a `mesh` that has it."
            )
        self.axis_name = axis_name
        self.layout = cast(Any, layout)
        self.exchange = as_exchange(exchange)
        self.mesh = mesh
        self.batch_axis = batch_axis


def check_cp(cp: object, where: str) -> None:
    """A `TypeError` naming `where` unless `cp` is a `ContextParallel` or `None`."""
    if cp is not None and not isinstance(cp, ContextParallel):
        raise TypeError(f"{where}: `cp` must be a deltanet_cp.ContextParallel or None; got {cp!r}.")


def axis_size(cp: "ContextParallel | None") -> int:
    """The number of ranks of `cp` (inside `jax.shard_map`); 1 without it."""
    return 1 if cp is None else jax.lax.axis_size(cp.axis_name)


def contiguous(cp: "ContextParallel") -> "ContextParallel[Contiguous]":
    """`cp` itself if its layout is [`deltanet_cp.Contiguous`][], else a `ValueError`."""
    check_cp(cp, "run_contiguous")
    if isinstance(cp.layout, Contiguous):
        return cp  # pyright: ignore[reportReturnType]
    raise ValueError(
        f"The engine's walk requires layout=Contiguous(), got {cp.layout!r}. It runs the "
        "three phases over one contiguous, in-order slice per rank (rank r holds tokens "
        "[r*S/cp, (r+1)*S/cp)); a zigzag shard interleaves pieces across ranks and, read as "
        "one slice, would silently compute the wrong result. Pass the ContextParallel to "
        "deltanet_cp.run or a chunk_* function instead: they hand the walk the zigzag "
        "shard's two contiguous pieces, in chain order."
    )


if TYPE_CHECKING:
    # For static type checkers the walk accepts `ContextParallel[Contiguous]` only...
    ContiguousParallel: TypeAlias = ContextParallel[Contiguous]
else:
    # ...while at run time any `ContextParallel` gets through the signature, so that
    # `contiguous` always answers with its explanatory `ValueError`.
    ContiguousParallel: TypeAlias = ContextParallel


def _zigzag_order(cp: int) -> list[int]:
    """The pieces in the order the ranks hold them: `0, 2cp-1, 1, 2cp-2, ...`."""
    return [p for r in range(cp) for p in (r, 2 * cp - 1 - r)]


def _reorder(x: Array | np.ndarray, cp: int, axis: int, order: list[int], name: str) -> Array:
    """Cut `axis` into `2 cp` equal pieces and concatenate them in `order` (static slices,
    so that it works on sharded arrays too)."""
    cp = as_positive_index(cp, "cp")
    x = jnp.asarray(x)
    axis = as_index(axis, "axis")
    if not -x.ndim <= axis < x.ndim:  # numpy's rule: negative axes count from the end
        raise np.exceptions.AxisError(axis, x.ndim, msg_prefix=f"{name}: `axis`")
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % (2 * cp):
        raise ValueError(
            f"{name}: the sequence length ({length}, axis {axis}) must be divisible by "
            f"2 * cp = {2 * cp}: pad the sequence to a multiple of {2 * cp}."
        )
    n = length // (2 * cp)
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
    `2 cp - 1 - r`: the [`deltanet_cp.Zigzag`][] layout.

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
    return _reorder(x, cp, axis, _zigzag_order(cp), "to_zigzag")


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
    order = _zigzag_order(cp)
    inverse = [order.index(p) for p in range(2 * cp)]
    return _reorder(x, cp, axis, inverse, "from_zigzag")
