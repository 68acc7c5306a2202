"""The context-parallel argument of the layers: one `ContextParallel`, without a mesh; and
where a rank's tokens lie in the sequence and in its packed documents."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._packing import as_cu_seqlens
from .._parallel import ContextParallel, Contiguous, local_cp


# The layers' and the models' rule for `cp` is the library's one rule for a call on this
# rank's shard.
layer_cp = local_cp


def local_positions(cp: ContextParallel | None, length: int) -> Int[Array, " length"]:
    """The global sequence positions of this rank's `length` local tokens (`0 ..` without
    `cp`)."""
    if cp is None:
        return Contiguous().positions(length, None)
    return cp.layout.positions(length, cp.axis_name)


def document_starts(
    cu_seqlens: Int[Array, " docs_plus_one"], positions: Int[Array, " seq"]
) -> Int[Array, " seq"]:
    """Per token at global `positions`, the global position of its document's first token
    (`cu_seqlens` checked: `[0, ..., T]`, int32; empty documents hold no token)."""
    ids = jnp.searchsorted(cu_seqlens, positions, side="right") - 1
    return cu_seqlens[ids]


class Documents(eqx.Module):
    """Where a rank's tokens lie in their packed documents (`documents`).

    **Fields:**

    - `cu_seqlens`: the global document offsets `[0, ..., T]`, int32, checked.
    - `ids`: per local token, its document, `(seq,)` int32.
    - `positions`: per local token, its position within its document (0 at the
        document's first token), `(seq,)` int32: the rotary positions of packed documents.
    """

    cu_seqlens: Int[Array, " docs_plus_one"]
    ids: Int[Array, " seq"]
    positions: Int[Array, " seq"]


def documents(cp: ContextParallel | None, length: int, cu_seqlens: object) -> Documents:
    """The documents of this rank's `length` local tokens (in `cp.layout`'s order, global
    positions from `local_positions`), from the global `cu_seqlens` (a list or an integer
    array, as the recurrent layers take it). Checked like theirs: a `ValueError` names
    what to change (under `jax.jit`, through `equinox.error_if`, on every rank at once).

    A layer with packed documents calls it once, rotates its queries and keys by
    `positions` and passes `cu_seqlens` on to `blockwise_attention`.
    """
    axis_name = None if cp is None else cp.axis_name
    total = length if cp is None else length * jax.lax.axis_size(cp.axis_name)
    cu = as_cu_seqlens(cu_seqlens, 1, total, axis_name=axis_name)
    global_positions = local_positions(cp, length)
    ids = (jnp.searchsorted(cu, global_positions, side="right") - 1).astype(jnp.int32)
    return Documents(cu, ids, global_positions - cu[ids])
