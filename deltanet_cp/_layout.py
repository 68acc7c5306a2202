"""How a sequence is laid out across the ranks of a context-parallel axis."""

from typing import TYPE_CHECKING, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

from ._validate import as_index, as_positive_index


class AbstractLayout(eqx.Module):
    """How the tokens of a sequence are assigned to the ranks of a context-parallel axis.

    The public context-parallel functions accept [`deltanet_cp.Contiguous`][] and
    [`deltanet_cp.Zigzag`][]. The engine underneath them,
    [`deltanet_cp.run_contiguous`][], consumes contiguous, in-order slices only: a zigzag
    shard reaches it as its two contiguous pieces.
    """


class Contiguous(AbstractLayout):
    """Rank `r` of `cp` holds tokens `[r * S / cp, (r + 1) * S / cp)`: contiguous, in order.

    What sharding the time axis of an array with `PartitionSpec(None, axis_name)` gives.
    Takes no arguments: `Contiguous()`.
    """


class Zigzag(AbstractLayout):
    """The load-balanced layout: rank `r` holds pieces `r` and `2 cp - 1 - r` of `2 cp`.

    The sequence is cut into `2 * cp` equal pieces; rank `r`'s shard is piece `r` (its
    *first* piece) followed by piece `2 cp - 1 - r` (its *second*). Every rank then holds
    one early and one late piece, which balances the causal triangle of softmax attention.
    [`deltanet_cp.to_zigzag`][] puts a global array in this order, so that sharding it
    contiguously gives each rank its two pieces; [`deltanet_cp.from_zigzag`][] undoes it.

    A recurrence runs on it as a chain of contiguous pieces: the first pieces in rank
    order, then the second pieces in reverse rank order (see the concept page "Layouts").
    The local sequence length must be even. Takes no arguments: `Zigzag()`.
    """


Layout: TypeAlias = Contiguous | Zigzag
"""The layouts the public context-parallel functions accept: `Contiguous | Zigzag`."""


if TYPE_CHECKING:
    # For static type checkers, the engine accepts `Contiguous` only, so passing a
    # `Zigzag` is a type error...
    ContiguousLayout: TypeAlias = Contiguous
else:
    # ...while at run time any layout gets through the signature, so that
    # `check_contiguous` always answers with its explanatory `ValueError`, with or
    # without a runtime type checker installed.
    ContiguousLayout: TypeAlias = AbstractLayout


def check_contiguous(layout: object, name: str = "the engine") -> None:
    """Raise a `ValueError` unless `layout` is [`deltanet_cp.Contiguous`][]."""
    if isinstance(layout, Contiguous):
        return
    raise ValueError(
        f"{name} requires layout=Contiguous(), got {layout!r}. It runs the three phases over "
        "one contiguous, in-order slice per rank (rank r holds tokens [r*S/cp, (r+1)*S/cp)); "
        "a zigzag shard interleaves pieces across ranks and, read as one slice, would "
        "silently compute the wrong result. Pass layout=Zigzag() to deltanet_cp.run or a "
        "chunk_*_cp function instead: they hand this function the zigzag shard's two "
        "contiguous pieces, in chain order."
    )


def check_layout(layout: object, name: str = "context parallelism") -> None:
    """Raise a `ValueError` unless `layout` is `Contiguous()` or `Zigzag()`."""
    if not isinstance(layout, (Contiguous, Zigzag)):
        raise ValueError(f"{name} takes layout=Contiguous() or layout=Zigzag(); got {layout!r}.")


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


def positions(layout: Layout, length: int, axis_name: str | None) -> Int[Array, " length"]:
    """The global sequence positions of this rank's `length` local tokens.

    **Arguments:**

    - `layout`: [`deltanet_cp.Contiguous`][] or [`deltanet_cp.Zigzag`][].
    - `length`: the local sequence length.
    - `axis_name`: the context-parallel mesh axis, or `None` on one device (positions
        `0 .. length - 1` whatever the layout).

    **Returns:**

    An int32 array of shape `(length,)`.
    """
    local = jnp.arange(length, dtype=jnp.int32)
    if axis_name is None:
        return local
    check_layout(layout)
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
    if isinstance(layout, Contiguous):
        return rank * length + local
    cp = jax.lax.axis_size(axis_name)
    half = zigzag_half(length)
    piece = jnp.where(local < half, rank, 2 * cp - 1 - rank)
    return piece * half + local % half


def zigzag_half(length: int) -> int:
    """The length of each of a zigzag shard's two pieces; a `ValueError` if odd."""
    if length % 2:
        raise ValueError(
            f"Under layout=Zigzag() each rank holds two equal pieces, so the local sequence "
            f"length must be even; got {length}. Make the global length a multiple of 2 * cp."
        )
    return length // 2
