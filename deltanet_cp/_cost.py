"""The exchanges' cost model: payload (elements received per rank) and rounds, and the
alpha-beta time estimate that [`deltanet_cp.Auto`][] picks an exchange by.

Each concrete exchange states its own `received` and `rounds` next to its collective; what
follows from them for a layout (its walks) and a link (latency, bandwidth) is here.
"""

import abc
import functools as ft
import math
from typing import TYPE_CHECKING

import equinox as eqx


if TYPE_CHECKING:
    from ._parallel import AbstractLayout


class AbstractExchangeCost(eqx.Module):
    """The cost-model half of an exchange: elements received per rank and sequential
    rounds, for one walk over the ranks (`received`) and for a whole layout
    (`payload_elements`, `rounds`), and the estimated time."""

    @abc.abstractmethod
    def received(
        self,
        cp: int,
        *,
        map_elements: int,
        state_elements: int,
        final_state: bool = False,
        reverse: bool = False,
    ) -> tuple[int, ...]:
        """Elements each rank receives in one walk over the ranks, indexed by rank.

        **Arguments:**

        - `cp`, `map_elements`, `state_elements`, `final_state`: as in
            `payload_elements`.
        - `reverse`: the walk goes from the last rank to the first.

        **Returns:**

        A tuple of `cp` element counts.
        """

    @abc.abstractmethod
    def rounds(self, cp: int, *, layout: "AbstractLayout | None" = None) -> int:
        """Sequential communication rounds over `cp` ranks (the latency term), not counting
        the final state's broadcast.

        Under [`deltanet_cp.Zigzag`][], the two walks' exchanges of maps are independent of
        each other; what they wait for is the state leaving the first walk.
        """

    def payload_elements(
        self,
        cp: int,
        *,
        map_elements: int,
        state_elements: int,
        final_state: bool = False,
        layout: "AbstractLayout | None" = None,
    ) -> int:
        """Elements each rank receives (the largest over ranks).

        Under [`deltanet_cp.Zigzag`][] it is two walks (see [`deltanet_cp.run`][]): the
        first pieces in rank order, ending in a state every rank needs (so its final state
        is always broadcast), then the second pieces in reverse rank order.

        **Arguments:**

        - `cp`: the number of ranks on the context-parallel axis.
        - `map_elements`: the elements of one rank's map, e.g. $B H_V K (K + V)$ for a dense
            [`deltanet_cp.AffineMap`][], $B H_V (K + K V)$ for a
            [`deltanet_cp.DiagonalAffineMap`][].
        - `state_elements`: the elements of one state, $B H_V K V$.
        - `final_state`: whether the global final state is also returned on every rank.
        - `layout`: [`deltanet_cp.Contiguous`][] or [`deltanet_cp.Zigzag`][].

        **Returns:**

        The number of elements (multiply by the itemsize, 4 for float32, for bytes); 0 when
        `cp == 1`.
        """
        received = ft.partial(
            self.received, cp, map_elements=map_elements, state_elements=state_elements
        )
        directions = walks(cp, layout)
        total = [0] * cp
        for i, reverse in enumerate(directions):
            # Every walk but the last ends in a state the next one starts from, on every rank.
            final = final_state if i == len(directions) - 1 else True
            total = [a + b for a, b in zip(total, received(final_state=final, reverse=reverse))]
        return max(total)

    def estimated_seconds(
        self,
        cp: int,
        *,
        map_elements: int,
        state_elements: int,
        itemsize: int = 4,
        latency: float = 10e-6,
        bandwidth: float = 50e9,
        layout: "AbstractLayout | None" = None,
    ) -> float:
        r"""The alpha-beta cost model: `rounds * latency + bytes_received / bandwidth`.

        **Arguments:**

        - `cp`, `map_elements`, `state_elements`, `layout`: as in `payload_elements`.
        - `itemsize`: bytes per element (4 for float32 maps).
        - `latency`: seconds per communication round ($\alpha$).
        - `bandwidth`: bytes per second into one rank ($1/\beta$).
        """
        payload = self.payload_elements(
            cp, map_elements=map_elements, state_elements=state_elements, layout=layout
        )
        return self.rounds(cp, layout=layout) * latency + payload * itemsize / bandwidth


def walks(cp: int, layout: "AbstractLayout | None") -> tuple[bool, ...]:
    """Each walk's direction (`reverse`) of a shard under `layout` (one forward walk for
    `None`, the contiguous layout)."""
    if layout is None:
        return (False,)
    return tuple(w.reverse for w in layout.walks(layout.pieces(cp) // cp, cp))


def log2(cp: int) -> int:
    return math.ceil(math.log2(cp)) if cp > 1 else 0


def all_reduce(cp: int, state_elements: int, needed: bool) -> int:
    """Elements a rank receives in a bandwidth-optimal ring all-reduce of a state."""
    return (2 * (cp - 1) * state_elements) // cp if needed else 0
