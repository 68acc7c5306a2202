"""The token before each token, across ranks and documents: `previous_tokens`."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from ._custom_types import CuSeqlens
from ._packing import as_cu_seqlens
from ._parallel import check_bound, check_cp, ContextParallel


def previous_tokens(
    x: Shaped[Array, "batch seq *rest"],
    *,
    cp: ContextParallel | None = None,
    cu_seqlens: CuSeqlens | None = None,
    initial: Shaped[Array, " batch *rest"] | None = None,
) -> Shaped[Array, "batch seq *rest"]:
    """Every token's predecessor: `y[:, t] = x[:, t - 1]`, shifted along the sequence by one
    token, for a recurrence whose inputs read the token before (a trapezoidal rule, a token
    shift, a short convolution written by hand).

    The first token of the sequence, and with `cu_seqlens` the first token of every packed
    document, gets `initial` (zeros if `None`; for a document other than the first, always
    zeros): a document never reads its neighbour's last token. Under context parallelism
    the first token of each piece of a rank's shard gets the last token of the piece before
    it in the sequence, from the rank that holds it (one token per piece crosses ranks, a
    `jax.lax.ppermute`), in either layout. Values are moved, never multiplied: a NaN
    reaches only the token after it.

    **Arguments:**

    - `x`: `(batch, seq, ...)`; with `cp`, this rank's shard of time in `cp.layout`'s order
        (inside `jax.shard_map`).
    - `cp`: a [`deltanet_cp.ContextParallel`][] without `mesh`, or `None` on one device.
    - `cu_seqlens`: packed documents, as for the public functions and `run` (`batch` 1; a
        list or an int array): the documents' boundaries in the whole sequence,
        `[0, ..., total]`, checked as they check it.
    - `initial`: what the sequence's first token reads, `(batch, ...)`; replicated with
        `cp`.

    **Returns:**

    `x`'s shape and dtype, in the same layout.

    **Raises:**

    `ValueError` for `x` without a time axis, a `cp` with a `mesh`, an `initial` of the
    wrong shape, or a `cu_seqlens` with more than one batch row.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"`x` must be (batch, seq, ...) with time on axis 1; got shape {x.shape}.")
    check_cp(cp, "previous_tokens")
    if cp is not None:
        if cp.mesh is not None:
            raise ValueError(
                "previous_tokens runs on this rank's shard inside your `jax.shard_map`: pass "
                "ContextParallel(axis_name, layout=...) without `mesh`."
            )
        check_bound(cp, "previous_tokens")
    if initial is None:
        initial = jnp.zeros((x.shape[0], *x.shape[2:]), x.dtype)
    initial = jnp.asarray(initial, x.dtype)
    if initial.shape != (x.shape[0], *x.shape[2:]):
        raise ValueError(
            f"`initial` must be (batch, ...) = {(x.shape[0], *x.shape[2:])}, what the first "
            f"token reads; got {initial.shape}."
        )
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(
            f"With `cu_seqlens` the documents are packed in one batch row; `x` has {x.shape[0]}."
        )
    t = x.shape[1]
    if t == 0:
        return x
    pieces = []
    if cp is None:
        pieces.append((x, initial[:, None]))
        positions = jnp.arange(t)
    else:
        n = jax.lax.axis_size(cp.axis_name)
        rank = jax.lax.axis_index(cp.axis_name)
        incoming, holder = initial[:, None], None
        for walk in cp.layout.walks(t, n):
            order = walk.ranks(n)
            first, last = order[0], order[-1]
            segment = x[:, walk.local]
            halo = jax.lax.ppermute(segment[:, -1:], cp.axis_name, list(zip(order, order[1:])))
            if holder is not None and holder != first:
                incoming = jax.lax.ppermute(incoming, cp.axis_name, [(holder, first)])
            pieces.append((segment, jnp.where(rank == first, incoming, halo)))
            incoming, holder = segment[:, -1:], last
        positions = cp.layout.positions(t, cp.axis_name)
    y = jnp.concatenate([jnp.concatenate([p, s[:, :-1]], axis=1) for s, p in pieces], axis=1)
    if cu_seqlens is not None:
        total = t if cp is None else t * jax.lax.axis_size(cp.axis_name)
        axis_name = None if cp is None else cp.axis_name
        starts = as_cu_seqlens(cu_seqlens, 1, total, axis_name=axis_name)[1:-1]
        later = jnp.any(positions[:, None] == starts[None, :], axis=1)  # a document's first
        shape = (1, t) + (1,) * (x.ndim - 2)
        y = jnp.where(later.reshape(shape), jnp.zeros((), x.dtype), y)
    return y
