"""How a sequence is laid out across the ranks of a context-parallel axis."""

from typing import TYPE_CHECKING, TypeAlias

import equinox as eqx


class AbstractLayout(eqx.Module):
    """How the tokens of a sequence are assigned to the ranks of a context-parallel axis.

    Every context-parallel function takes a `layout` and accepts only
    [`deltanet_cp.Contiguous`][].
    """


class Contiguous(AbstractLayout):
    """Rank `r` of `cp` holds tokens `[r * S / cp, (r + 1) * S / cp)`: contiguous, in order.

    The only layout a sequential recurrence can consume: the prefix scan over ranks
    assumes rank order is sequence order. It is what sharding the time axis of an array with
    `PartitionSpec(None, axis_name)` gives. Takes no arguments: `Contiguous()`.
    """


class Zigzag(AbstractLayout):
    """The load-balanced order used for causal softmax attention.

    The sequence is cut into `2 * cp` chunks and rank `r` holds chunks `r` and
    `2 * cp - 1 - r`: two non-contiguous pieces. It balances the causal-mask triangle of
    softmax attention; recurrences have no triangle (their per-rank cost is uniform) and
    cannot use it. Passing it to a context-parallel recurrence is an error: a type error
    for a static type checker, and a `ValueError` at run time. Takes no arguments:
    `Zigzag()`.
    """


if TYPE_CHECKING:
    # For static type checkers, the recurrences accept `Contiguous` only, so passing a
    # `Zigzag` is a type error...
    ContiguousLayout: TypeAlias = Contiguous
else:
    # ...while at run time any layout gets through the signature, so that
    # `check_contiguous` always answers with its explanatory `ValueError`, with or
    # without a runtime type checker installed.
    ContiguousLayout: TypeAlias = AbstractLayout


def check_contiguous(layout: object, name: str = "context parallelism") -> None:
    """Raise a `ValueError` unless `layout` is [`deltanet_cp.Contiguous`][]."""
    if isinstance(layout, Contiguous):
        return
    raise ValueError(
        f"{name} requires layout=Contiguous(), got {layout!r}: load balancing must be off. "
        "The recurrence is sequential, so each rank must own a contiguous, in-order slice "
        "of the sequence (rank r holds tokens [r*S/cp, (r+1)*S/cp)); a load-balancing "
        "reorder such as zigzag interleaves chunks across ranks and would silently compute "
        "the wrong result. Recurrences have no causal-mask triangle, so their per-rank cost "
        "is uniform and they gain nothing from load balancing."
    )
