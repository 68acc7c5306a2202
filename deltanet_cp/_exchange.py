"""Phase 2 of context parallelism: from each rank's map to the state entering each rank.

An exchange is a module that owns its collective (`__call__`, all the engine asks of it).
The built-in exchanges also state their cost, next to their collective: the elements each
rank receives and the sequential rounds (`AbstractCostedExchange`), which is what
[`deltanet_cp.Auto`][] picks one by. Every exchange is called inside `jax.shard_map`, with
one affine map per rank (the rank's slice of a walk) and the initial state replicated.
Payloads are counted as elements *received* per rank.
"""

import abc
import math
import numbers
from typing import Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._affine import AbstractAffineMap, prefix_scan
from ._cost import all_reduce, log2
from ._layout import AbstractLayout, position, rank_at


class AbstractExchange(eqx.Module):
    """How the ranks of a context-parallel axis turn their maps into incoming states.

    An exchange implements one method, the collective (`__call__`: one walk over the
    ranks, forwards or backwards). One of your own is that method alone; the built-in
    exchanges also state their cost (see [`deltanet_cp.AbstractCostedExchange`][]).
    """

    @abc.abstractmethod
    def __call__(
        self,
        local: AbstractAffineMap,
        h0: Float[Array, "*batch k v"],
        *,
        axis_name: str,
        reverse: bool = False,
    ) -> tuple[Array, Array]:
        """The state entering this rank and the state after the last rank.

        **Arguments:**

        - `local`: this rank's map, from the state entering its slice of the walk to the
            state leaving it.
        - `h0`: the state before the walk's first token (replicated).
        - `axis_name`: the context-parallel mesh axis.
        - `reverse`: walk the ranks from the last to the first (rank `cp - 1` comes first):
            what the second pieces of a [`deltanet_cp.Zigzag`][] shard need, and what the
            backward pass of a forward walk uses to carry cotangents from the end.

        **Returns:**

        `(h_in, h_final)`: the state entering this rank's slice, and the state leaving the
        walk's last slice, on every rank (the engine's forward pass leaves `h_final`
        unused unless the final state is asked for, and XLA then drops its work and its
        collectives).
        """


class AbstractCostedExchange(AbstractExchange):
    """An exchange that states its cost: elements received per rank in one walk over the
    ranks (`received`) and sequential rounds (`rounds`); from them, the payload under a
    layout (`payload_elements`) and the alpha-beta time estimate (`estimated_seconds`)
    that [`deltanet_cp.Auto`][] picks by. [`deltanet_cp.AllGather`][],
    [`deltanet_cp.PPermute`][] and [`deltanet_cp.Ring`][] are such exchanges.
    """

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
    def rounds(self, cp: int, *, layout: AbstractLayout | None = None) -> int:
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
        layout: AbstractLayout | None = None,
    ) -> int:
        """Elements each rank receives in the forward (the largest over ranks). A training
        step receives more, its backward running the exchange's transpose:
        `python benchmarks/cp_cost.py --only step` measures both.

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
        - `layout`: an [`deltanet_cp.AbstractLayout`][] ([`deltanet_cp.Contiguous`][] if
            `None`).

        **Returns:**

        The number of elements (multiply by the itemsize, 4 for float32, for bytes); 0 when
        `cp == 1`.
        """
        directions = _directions(cp, layout)
        total = [0] * cp
        for i, reverse in enumerate(directions):
            # Every walk but the last ends in a state the next one starts from, on every rank.
            final = final_state if i == len(directions) - 1 else True
            got = self.received(
                cp,
                map_elements=map_elements,
                state_elements=state_elements,
                final_state=final,
                reverse=reverse,
            )
            total = [a + b for a, b in zip(total, got)]
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
        layout: AbstractLayout | None = None,
    ) -> float:
        r"""The alpha-beta cost model: `rounds * latency + bytes_received / bandwidth`.

        **Arguments:**

        - `cp`, `map_elements`, `state_elements`, `layout`: as in `payload_elements`.
        - `itemsize`: bytes per element (4 for float32 maps).
        - `latency`: seconds per communication round ($\alpha$).
        - `bandwidth`: bytes per second into one rank ($1/\beta$).
        """
        check_cost_model(latency, bandwidth, "estimated_seconds")
        payload = self.payload_elements(
            cp, map_elements=map_elements, state_elements=state_elements, layout=layout
        )
        return self.rounds(cp, layout=layout) * latency + payload * itemsize / bandwidth


def _finite(value: object) -> float | None:
    """`value` as a finite Python float if it is a real number (not a bool), else `None`."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if math.isfinite(value := float(value)):
            return value
    return None


def check_cost_model(latency: object, bandwidth: object, where: str) -> None:
    """A `ValueError` naming `where` unless `latency` is a finite number at least 0 and
    `bandwidth` a finite number above 0 (Python or NumPy, not a bool)."""
    if (seconds := _finite(latency)) is None or seconds < 0:
        raise ValueError(
            f"{where}: `latency` must be a finite number of seconds, at least 0; got {latency!r}."
        )
    if (rate := _finite(bandwidth)) is None or rate <= 0:
        raise ValueError(
            f"{where}: `bandwidth` must be a finite number of bytes per second, above 0; got "
            f"{bandwidth!r}."
        )


def _directions(cp: int, layout: AbstractLayout | None) -> tuple[bool, ...]:
    """Each walk's direction under `layout` (one forward walk for `None`)."""
    return (False,) if layout is None else layout.directions(cp)


class AllGather(AbstractCostedExchange):
    r"""One `all_gather` of every rank's map, then the exclusive prefix locally, in log depth.

    One round; each rank receives $(cp - 1)$ maps. The final state needs nothing more.
    What the original design, flash-linear-attention's KCP and LASP-2 do.
    """

    def __call__(self, local, h0, *, axis_name, reverse=False):
        maps = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, to="invarying"), local)
        if reverse:
            maps = jax.tree.map(lambda x: jnp.flip(x, axis=0), maps)
        place = position(axis_name, reverse)
        exclusive = prefix_scan(maps, exclusive=True)
        h_in = jax.tree.map(lambda x: x[place], exclusive)(h0)
        # The state leaving the last rank: its own map after its exclusive prefix.
        last_map, last_entering = (jax.tree.map(lambda x: x[-1], m) for m in (maps, exclusive))
        return h_in, last_map(last_entering(h0))

    def rounds(self, cp: int, *, layout: AbstractLayout | None = None) -> int:
        # Both walks' gathers at once; the state between them is formed locally.
        return 0 if cp == 1 else 1

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        return ((cp - 1) * map_elements,) * cp


class PPermute(AbstractCostedExchange):
    r"""A log-depth (Hillis-Steele) prefix over `ppermute`.

    $\lceil \log_2 cp \rceil$ rounds, one map received per round. The final state costs one
    all-reduce of a state more (counted as a bandwidth-optimal ring all-reduce receives it,
    $\lfloor 2 (cp - 1) / cp \cdot B H_V K V \rfloor$). What MaxText's CP path does.
    """

    def __call__(self, local, h0, *, axis_name, reverse=False):
        # Round j: position p receives from p - 2^j the composition of the window of ranks
        # ending at p - 2^j, and prepends it both to its exclusive prefix (which never
        # contains its own map) and to its inclusive one (which is what it sends).
        cp = jax.lax.axis_size(axis_name)
        place = position(axis_name, reverse)
        exclusive = local.identity_like()
        inclusive = local
        shift = 1
        while shift < cp:
            perm = [
                (rank_at(i, cp, reverse), rank_at(i + shift, cp, reverse))
                for i in range(cp - shift)
            ]
            received = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), inclusive)
            has_sender = place >= shift
            exclusive = _select(has_sender, received.then(exclusive), exclusive)
            inclusive = _select(has_sender, received.then(inclusive), inclusive)
            shift *= 2
        h_in = exclusive(h0)
        return h_in, _from_last(local(h_in), place, cp, axis_name)

    def rounds(self, cp: int, *, layout: AbstractLayout | None = None) -> int:
        # Both walks' scans at once, then the state between them is broadcast.
        if cp == 1:
            return 0
        return log2(cp) + len(_directions(cp, layout)) - 1

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        # Position p receives in round j iff p >= 2^j.
        final = all_reduce(cp, state_elements, final_state)
        counts = [sum(1 for j in range(log2(cp)) if p >= 2**j) for p in range(cp)]
        per_position = [n * map_elements + final for n in counts]
        return tuple(per_position[rank_at(r, cp, reverse)] for r in range(cp))


class Ring(AbstractCostedExchange):
    r"""The state itself travels rank to rank: the smallest payload, the most rounds.

    In round $i$ only rank $i$ talks, to rank $i + 1$, so each rank receives exactly one
    state in $cp - 1$ sequential rounds. The final state costs one all-reduce of a state
    more. What LASP and ZeCO do.
    """

    def __call__(self, local, h0, *, axis_name, reverse=False):
        cp = jax.lax.axis_size(axis_name)
        place = position(axis_name, reverse)
        h_in = h0
        for i in range(cp - 1):
            perm = [(rank_at(i, cp, reverse), rank_at(i + 1, cp, reverse))]
            received = jax.lax.ppermute(local(h_in), axis_name, perm)
            h_in = jnp.where(place == i + 1, received, h_in)
        return h_in, _from_last(local(h_in), place, cp, axis_name)

    def rounds(self, cp: int, *, layout: AbstractLayout | None = None) -> int:
        # A forward wave, the state between the walks broadcast, a backward wave.
        n = len(_directions(cp, layout))
        return n * (cp - 1) + (n - 1 if cp > 1 else 0)

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        final = all_reduce(cp, state_elements, final_state)
        per_position = [(state_elements if p > 0 else 0) + final for p in range(cp)]
        return tuple(per_position[rank_at(r, cp, reverse)] for r in range(cp))


class Auto(AbstractExchange):
    """The exchange with the smallest estimated time under an alpha-beta model.

    Few ranks or small states favour [`deltanet_cp.AllGather`][] (one round); many ranks
    with large `K x K` maps favour [`deltanet_cp.PPermute`][] (log rounds, log payload) or,
    when bandwidth is scarce relative to latency, [`deltanet_cp.Ring`][].

    **Arguments:**

    - `latency`: seconds per communication round: a finite number, at least 0.
    - `bandwidth`: bytes per second into one rank: a finite number above 0.
    """

    latency: float = 10e-6
    bandwidth: float = 50e9

    def __check_init__(self):
        check_cost_model(self.latency, self.bandwidth, "Auto")

    def choose(
        self,
        cp: int,
        *,
        map_elements: int,
        state_elements: int,
        itemsize: int = 4,
        layout: AbstractLayout | None = None,
    ) -> AbstractCostedExchange:
        """The built-in exchange with the smallest `estimated_seconds` for these sizes."""
        return min(
            (AllGather(), PPermute(), Ring()),
            key=lambda ex: ex.estimated_seconds(
                cp,
                map_elements=map_elements,
                state_elements=state_elements,
                itemsize=itemsize,
                latency=self.latency,
                bandwidth=self.bandwidth,
                layout=layout,
            ),
        )

    def __call__(self, local, h0, *, axis_name, reverse=False):
        chosen = self.choose(
            jax.lax.axis_size(axis_name),
            map_elements=_size(local),
            state_elements=h0.size,
            itemsize=h0.dtype.itemsize,
        )
        return chosen(local, h0, axis_name=axis_name, reverse=reverse)


ExchangeName: TypeAlias = Literal["allgather", "ppermute", "ring", "auto"]
_BY_NAME: dict[str, type[AbstractExchange]] = {
    "allgather": AllGather,
    "ppermute": PPermute,
    "ring": Ring,
    "auto": Auto,
}


def as_exchange(exchange: "AbstractExchange | ExchangeName") -> AbstractExchange:
    """The exchange a string shorthand names (`"allgather"` is `AllGather()`, ...)."""
    if isinstance(exchange, AbstractExchange):
        return exchange
    if isinstance(exchange, str) and exchange in _BY_NAME:
        return _BY_NAME[exchange]()
    raise ValueError(
        f"Unknown exchange {exchange!r}; pass AllGather(), PPermute(), Ring() or Auto(...), "
        f"or one of the shorthands {tuple(_BY_NAME)}."
    )


def _size(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def _from_last(x, place, cp, axis_name):
    """Broadcast the last place's `x` to every rank (one all-reduce of a state)."""
    return jax.lax.psum(jnp.where(place == cp - 1, x, jnp.zeros_like(x)), axis_name)


def _select(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
