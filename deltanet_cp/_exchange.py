"""Phase 2 of context parallelism: from each rank's map to the state entering each rank.

An exchange is a module that owns its collective and states its payload and its number of
rounds. Every exchange is called inside `jax.shard_map`, with one affine map per rank (the
rank's whole shard) and the initial state replicated. Payloads are counted as elements
*received* per rank.
"""

import abc
from typing import Literal, TYPE_CHECKING, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._affine import AbstractAffineMap, prefix_scan
from ._cost import AbstractExchangeCost, all_reduce, log2, walks


if TYPE_CHECKING:
    from ._parallel import AbstractLayout


class AbstractExchange(AbstractExchangeCost):
    """How the ranks of a context-parallel axis turn their maps into incoming states.

    A concrete exchange implements the collective (`__call__`: one walk over the ranks,
    forwards or backwards) and states its cost: how many elements each rank receives in
    one walk (`received`, from which `payload_elements` follows for either layout) and in
    how many sequential rounds (`rounds`); the rest of the cost model is inherited.
    """

    @abc.abstractmethod
    def __call__(
        self,
        local: AbstractAffineMap,
        h0: Float[Array, "*batch k v"],
        *,
        axis_name: str,
        need_final_state: bool,
        reverse: bool = False,
    ) -> tuple[Array, Array | None]:
        """The state entering this rank and, if asked, the state after the last rank.

        **Arguments:**

        - `local`: this rank's map, from the state entering its shard to the state leaving it.
        - `h0`: the state before the first token of the whole sequence (replicated).
        - `axis_name`: the context-parallel mesh axis.
        - `need_final_state`: also return the state after the last token, on every rank.
        - `reverse`: walk the ranks from the last to the first (rank `cp - 1` comes first):
            what the second pieces of a [`deltanet_cp.Zigzag`][] shard need, and what the
            backward pass of a forward walk uses to carry cotangents from the end.

        **Returns:**

        `(h_in, h_final)`, `h_final` being `None` unless `need_final_state`.
        """


class AllGather(AbstractExchange):
    r"""One `all_gather` of every rank's map, then the exclusive prefix locally, in log depth.

    One round; each rank receives $(cp - 1)$ maps. The final state needs nothing more.
    What the original design, flash-linear-attention's KCP and LASP-2 do.
    """

    def __call__(self, local, h0, *, axis_name, need_final_state, reverse=False):
        maps = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, to="invarying"), local)
        if reverse:
            maps = jax.tree.map(lambda x: jnp.flip(x, axis=0), maps)
        position = _position(axis_name, reverse)
        exclusive = prefix_scan(maps, exclusive=True)
        h_in = jax.tree.map(lambda x: x[position], exclusive)(h0)
        if not need_final_state:
            return h_in, None
        # The state leaving the last rank: its own map after its exclusive prefix.
        last_map, last_entering = (jax.tree.map(lambda x: x[-1], m) for m in (maps, exclusive))
        return h_in, last_map(last_entering(h0))

    def rounds(self, cp: int, *, layout: "AbstractLayout | None" = None) -> int:
        # Both walks' gathers at once; the state between them is formed locally.
        return 0 if cp == 1 else 1

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        return ((cp - 1) * map_elements,) * cp


class PPermute(AbstractExchange):
    r"""A log-depth (Hillis-Steele) prefix over `ppermute`.

    $\lceil \log_2 cp \rceil$ rounds, one map received per round. The final state costs one
    all-reduce of a state more (counted as a bandwidth-optimal ring all-reduce receives it,
    $\lfloor 2 (cp - 1) / cp \cdot B H_V K V \rfloor$). What MaxText's CP path does.
    """

    def __call__(self, local, h0, *, axis_name, need_final_state, reverse=False):
        # Round j: position p receives from p - 2^j the composition of the window of ranks
        # ending at p - 2^j, and prepends it both to its exclusive prefix (which never
        # contains its own map) and to its inclusive one (which is what it sends).
        cp = jax.lax.axis_size(axis_name)
        position = _position(axis_name, reverse)
        exclusive = local.identity_like()
        inclusive = local
        shift = 1
        while shift < cp:
            perm = [
                (_rank(i, cp, reverse), _rank(i + shift, cp, reverse)) for i in range(cp - shift)
            ]
            received = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), inclusive)
            has_sender = position >= shift
            exclusive = _select(has_sender, received.then(exclusive), exclusive)
            inclusive = _select(has_sender, received.then(inclusive), inclusive)
            shift *= 2
        h_in = exclusive(h0)
        if not need_final_state:
            return h_in, None
        return h_in, _from_last(local(h_in), position, cp, axis_name)

    def rounds(self, cp: int, *, layout: "AbstractLayout | None" = None) -> int:
        # Both walks' scans at once, then the state between them is broadcast.
        if cp == 1:
            return 0
        return log2(cp) + len(walks(cp, layout)) - 1

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        # Position p receives in round j iff p >= 2^j.
        final = all_reduce(cp, state_elements, final_state)
        counts = [sum(1 for j in range(log2(cp)) if p >= 2**j) for p in range(cp)]
        per_position = [n * map_elements + final for n in counts]
        return tuple(per_position[_rank(r, cp, reverse)] for r in range(cp))


class Ring(AbstractExchange):
    r"""The state itself travels rank to rank: the smallest payload, the most rounds.

    In round $i$ only rank $i$ talks, to rank $i + 1$, so each rank receives exactly one
    state in $cp - 1$ sequential rounds. The final state costs one all-reduce of a state
    more. What LASP and ZeCO do.
    """

    def __call__(self, local, h0, *, axis_name, need_final_state, reverse=False):
        cp = jax.lax.axis_size(axis_name)
        position = _position(axis_name, reverse)
        h_in = h0
        for i in range(cp - 1):
            perm = [(_rank(i, cp, reverse), _rank(i + 1, cp, reverse))]
            received = jax.lax.ppermute(local(h_in), axis_name, perm)
            h_in = jnp.where(position == i + 1, received, h_in)
        if not need_final_state:
            return h_in, None
        return h_in, _from_last(local(h_in), position, cp, axis_name)

    def rounds(self, cp: int, *, layout: "AbstractLayout | None" = None) -> int:
        # A forward wave, the state between the walks broadcast, a backward wave.
        n = len(walks(cp, layout))
        return n * (cp - 1) + (n - 1 if cp > 1 else 0)

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        final = all_reduce(cp, state_elements, final_state)
        per_position = [(state_elements if p > 0 else 0) + final for p in range(cp)]
        return tuple(per_position[_rank(r, cp, reverse)] for r in range(cp))


class Auto(AbstractExchange):
    """The exchange with the smallest estimated time under an alpha-beta model.

    Few ranks or small states favour [`deltanet_cp.AllGather`][] (one round); many ranks
    with large `K x K` maps favour [`deltanet_cp.PPermute`][] (log rounds, log payload) or,
    when bandwidth is scarce relative to latency, [`deltanet_cp.Ring`][].

    **Arguments:**

    - `latency`: seconds per communication round.
    - `bandwidth`: bytes per second into one rank.
    """

    latency: float = 10e-6
    bandwidth: float = 50e9

    def choose(
        self,
        cp: int,
        *,
        map_elements: int,
        state_elements: int,
        itemsize: int = 4,
        layout: "AbstractLayout | None" = None,
    ) -> AbstractExchange:
        """The concrete exchange this model picks for these sizes."""
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

    def __call__(self, local, h0, *, axis_name, need_final_state, reverse=False):
        chosen = self.choose(
            jax.lax.axis_size(axis_name),
            map_elements=_size(local),
            state_elements=h0.size,
            itemsize=h0.dtype.itemsize,
        )
        return chosen(
            local,
            h0,
            axis_name=axis_name,
            need_final_state=need_final_state,
            reverse=reverse,
        )

    def rounds(self, cp: int, *, layout: "AbstractLayout | None" = None) -> int:
        raise TypeError("Auto() has no fixed number of rounds: ask `Auto().choose(...)`.")

    def received(self, cp, *, map_elements, state_elements, final_state=False, reverse=False):
        chosen = self.choose(cp, map_elements=map_elements, state_elements=state_elements)
        return chosen.received(
            cp,
            map_elements=map_elements,
            state_elements=state_elements,
            final_state=final_state,
            reverse=reverse,
        )

    def payload_elements(
        self,
        cp,
        *,
        map_elements,
        state_elements,
        final_state=False,
        layout: "AbstractLayout | None" = None,
    ):
        chosen = self.choose(
            cp, map_elements=map_elements, state_elements=state_elements, layout=layout
        )
        return chosen.payload_elements(
            cp,
            map_elements=map_elements,
            state_elements=state_elements,
            final_state=final_state,
            layout=layout,
        )


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


def _position(axis_name: str, reverse: bool) -> Array:
    """This rank's place in the walk: its index, or counted from the last rank."""
    rank = jax.lax.axis_index(axis_name)
    return jax.lax.axis_size(axis_name) - 1 - rank if reverse else rank


def _rank(position: int, cp: int, reverse: bool) -> int:
    return cp - 1 - position if reverse else position


def _from_last(x, position, cp, axis_name):
    """Broadcast the last position's `x` to every rank (one all-reduce of a state)."""
    return jax.lax.psum(jnp.where(position == cp - 1, x, jnp.zeros_like(x)), axis_name)


def _select(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
