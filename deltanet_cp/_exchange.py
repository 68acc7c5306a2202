"""Phase 2 of context parallelism: from each rank's map to the state entering each rank.

Three strategies, and the cost model behind `"auto"`. All of them are called inside
`jax.shard_map`, with one affine map per rank (the rank's whole shard) and the initial
state replicated. Payloads are counted as elements *received* per rank.
"""

import math
from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._affine import AbstractAffineMap, prefix_scan


Strategy: TypeAlias = Literal["allgather", "ppermute", "ring", "auto"]
STRATEGIES: tuple[str, ...] = ("allgather", "ppermute", "ring")


def exchange(
    local: AbstractAffineMap,
    h0: Float[Array, "*batch k v"],
    *,
    axis_name: str,
    strategy: str,
    need_final_state: bool,
) -> tuple[Array, Array | None]:
    """The state entering this rank and (if asked) the global final state.

    **Arguments:**

    - `local`: this rank's map, from the state entering its shard to the state leaving it.
    - `h0`: the state before the first token of the whole sequence (replicated).
    - `axis_name`: the context-parallel mesh axis.
    - `strategy`: `"allgather"`, `"ppermute"` or `"ring"` (resolve `"auto"` first).
    - `need_final_state`: also return the state after the last token, on every rank.

    **Returns:**

    `(h_in, h_final)`, `h_final` being `None` unless `need_final_state`.
    """
    if strategy == "allgather":
        return _allgather(local, h0, axis_name, need_final_state)
    if strategy == "ppermute":
        return _hillis_steele(local, h0, axis_name, need_final_state)
    if strategy == "ring":
        return _ring(local, h0, axis_name, need_final_state)
    raise ValueError(
        f"Unknown exchange strategy {strategy!r}; use one of {STRATEGIES + ('auto',)}."
    )


def _allgather(local, h0, axis_name, need_final_state):
    # One all_gather of every rank's (M, U); then the exclusive prefix locally, in log depth.
    maps = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, to="invarying"), local)
    rank = jax.lax.axis_index(axis_name)
    exclusive = prefix_scan(maps, exclusive=True)
    entering = jax.tree.map(lambda x: x[rank], exclusive)
    h_in = entering(h0)
    if not need_final_state:
        return h_in, None
    # The state leaving the last rank: its own map after its exclusive prefix.
    last_map, last_entering = (jax.tree.map(lambda x: x[-1], m) for m in (maps, exclusive))
    return h_in, last_map(last_entering(h0))


def _hillis_steele(local, h0, axis_name, need_final_state):
    # Log-depth prefix over ppermute. Round j: rank r receives from r - 2^j the composition
    # of the window of ranks ending at r - 2^j, and prepends it both to its exclusive prefix
    # (which never contains its own map) and to its inclusive one (which is what it sends).
    cp = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    exclusive = local.identity_like()
    inclusive = local
    shift = 1
    while shift < cp:
        perm = [(i, i + shift) for i in range(cp - shift)]
        received = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), inclusive)
        has_sender = rank >= shift
        exclusive = _select(has_sender, received.then(exclusive), exclusive)
        inclusive = _select(has_sender, received.then(inclusive), inclusive)
        shift *= 2
    h_in = exclusive(h0)
    if not need_final_state:
        return h_in, None
    return h_in, _from_last_rank(local(h_in), rank, cp, axis_name)


def _ring(local, h0, axis_name, need_final_state):
    # The state itself travels rank to rank: in round i only rank i talks, to rank i + 1,
    # so each rank receives exactly one state (the minimum payload) in cp - 1 sequential
    # rounds.
    cp = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    h_in = h0
    for i in range(cp - 1):
        received = jax.lax.ppermute(local(h_in), axis_name, [(i, i + 1)])
        h_in = jnp.where(rank == i + 1, received, h_in)
    if not need_final_state:
        return h_in, None
    return h_in, _from_last_rank(local(h_in), rank, cp, axis_name)


def _from_last_rank(x, rank, cp, axis_name):
    """Broadcast the last rank's `x` to every rank (one all-reduce of a state)."""
    return jax.lax.psum(jnp.where(rank == cp - 1, x, jnp.zeros_like(x)), axis_name)


def _select(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def payload_elements(
    strategy: str, cp: int, batch_heads: int, k: int, v: int, *, final_state: bool = False
) -> int:
    r"""Elements each rank receives in phase 2 (the largest over ranks), for dense maps.

    With `batch_heads` $= B \cdot H_V$:

    | strategy | rounds | elements received per rank |
    |---|---|---|
    | `"allgather"` | 1 | $(cp - 1) B H_V K (K + V)$ |
    | `"ppermute"` | $\lceil \log_2 cp \rceil$ | $\lceil \log_2 cp \rceil B H_V K (K + V)$ |
    | `"ring"` | $cp - 1$ (sequential) | $B H_V K V$ |

    With `final_state=True`, `"ppermute"` and `"ring"` add one all-reduce of a state,
    counted as a bandwidth-optimal ring all-reduce receives it:
    $2 (cp - 1) / cp \cdot B H_V K V$ (rounded down). `"allgather"` needs nothing more.

    **Arguments:**

    - `strategy`: `"allgather"`, `"ppermute"` or `"ring"`.
    - `cp`: the number of ranks on the context-parallel axis.
    - `batch_heads`: $B \cdot H_V$, the number of `(K, V)` states per rank.
    - `k`, `v`: the state's sizes $K$ and $V$.
    - `final_state`: whether the global final state is also returned on every rank.

    **Returns:**

    The number of elements (multiply by the itemsize, 4 for float32, for bytes); 0 when
    `cp == 1`.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown exchange strategy {strategy!r}; use one of {STRATEGIES}.")
    if cp == 1:
        return 0
    state = batch_heads * k * v
    pair = batch_heads * k * (k + v)
    extra = (2 * (cp - 1) * state) // cp if final_state and strategy != "allgather" else 0
    if strategy == "allgather":
        return (cp - 1) * pair
    if strategy == "ppermute":
        return math.ceil(math.log2(cp)) * pair + extra
    return state + extra


def rounds(strategy: str, cp: int) -> int:
    """Sequential communication rounds of a strategy (latency terms in the cost model)."""
    if cp == 1:
        return 0
    return {"allgather": 1, "ppermute": math.ceil(math.log2(cp)), "ring": cp - 1}[strategy]


def estimated_seconds(
    strategy: str,
    cp: int,
    batch_heads: int,
    k: int,
    v: int,
    *,
    itemsize: int = 4,
    latency: float = 10e-6,
    bandwidth: float = 50e9,
) -> float:
    r"""The alpha-beta cost model: `rounds * latency + bytes_received / bandwidth`.

    **Arguments:**

    - `strategy`, `cp`, `batch_heads`, `k`, `v`: as in [`deltanet_cp.payload_elements`][].
    - `itemsize`: bytes per element (4 for float32 maps).
    - `latency`: seconds per communication round ($\alpha$).
    - `bandwidth`: bytes per second into one rank ($1/\beta$).

    **Returns:**

    The estimated seconds of phase 2.
    """
    payload = payload_elements(strategy, cp, batch_heads, k, v) * itemsize
    return rounds(strategy, cp) * latency + payload / bandwidth


def choose_strategy(
    cp: int,
    batch_heads: int,
    k: int,
    v: int,
    *,
    itemsize: int = 4,
    latency: float = 10e-6,
    bandwidth: float = 50e9,
) -> str:
    """The strategy with the smallest [`deltanet_cp.estimated_seconds`][] (what `"auto"` uses).

    Few ranks or small states favour `"allgather"` (one round); many ranks with large
    `K x K` maps favour `"ppermute"` (log rounds, log payload) or, when bandwidth is scarce
    relative to latency, `"ring"` (one state, but `cp - 1` sequential rounds).

    **Arguments:** as for [`deltanet_cp.estimated_seconds`][], without `strategy`.

    **Returns:**

    `"allgather"`, `"ppermute"` or `"ring"`.
    """
    costs = {
        s: estimated_seconds(
            s, cp, batch_heads, k, v, itemsize=itemsize, latency=latency, bandwidth=bandwidth
        )
        for s in STRATEGIES
    }
    return min(STRATEGIES, key=lambda s: costs[s])
