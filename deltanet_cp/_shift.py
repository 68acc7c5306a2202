"""The token before each token and the token after it, across ranks and documents:
`previous_tokens`, `next_tokens`."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from ._custom_types import CuSeqlens
from ._packing import as_cu_seqlens
from ._parallel import ContextParallel, local_cp


def halos(
    x: Array, history: int, initial: Array, cp: ContextParallel, *, axis: int
) -> tuple[list[tuple[Array, Array]], Array, int | None]:
    """This rank's shard of `x` (inside `jax.shard_map` over `cp.axis_name`) as the pieces
    of its walks, each with the `history` tokens before it in the sequence: its *halo*.

    Along a walk, each rank receives the tail of the previous rank in walk order (one
    `jax.lax.ppermute` per walk); a walk's first piece continues from `initial` (the first
    walk; replicated) or from the last piece of the walk before it (one more
    `jax.lax.ppermute` when another rank holds that). Values are moved, never multiplied.
    The one halo rule of the short convolution and `previous_tokens`.

    **Arguments:**

    - `x`: this rank's shard, time on `axis`, in `cp.layout`'s order; each piece at least
        `history` tokens.
    - `history`: the tokens a piece needs from before its first token, at least 1.
    - `initial`: the `history` tokens before the sequence's first token (time on `axis`).
    - `cp`: a checked `ContextParallel` without `mesh`.
    - `axis`: the time axis of `x` and `initial`.

    **Returns:**

    `(pieces, tail, holder)`: per walk in chain order, `(piece, halo)`; the last `history`
    tokens of the sequence's last piece, right on rank `holder` only.
    """
    n = jax.lax.axis_size(cp.axis_name)
    rank = jax.lax.axis_index(cp.axis_name)
    pieces = []
    incoming, holder = initial, None
    for walk in cp.layout.walks(x.shape[axis], n):
        order = walk.ranks(n)
        first, last = order[0], order[-1]
        piece = jax.lax.slice_in_dim(x, walk.local.start, walk.local.stop, axis=axis)
        size = piece.shape[axis]
        end = jax.lax.slice_in_dim(piece, size - history, size, axis=axis)
        halo = jax.lax.ppermute(end, cp.axis_name, list(zip(order, order[1:])))
        if holder is not None and holder != first:
            incoming = jax.lax.ppermute(incoming, cp.axis_name, [(holder, first)])
        pieces.append((piece, jnp.where(rank == first, incoming, halo)))
        incoming, holder = end, last
    return pieces, incoming, holder


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
    cp = local_cp(cp, "previous_tokens")
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
    if cp is None:
        pieces = [(x, initial[:, None])]
        positions = jnp.arange(t)
    else:
        pieces, _, _ = halos(x, 1, initial[:, None], cp, axis=1)
        positions = cp.layout.positions(t, cp.axis_name)
    y = jnp.concatenate([jnp.concatenate([h, s[:, :-1]], axis=1) for s, h in pieces], axis=1)
    if cu_seqlens is not None:
        total = t if cp is None else t * jax.lax.axis_size(cp.axis_name)
        axis_name = None if cp is None else cp.axis_name
        starts = as_cu_seqlens(cu_seqlens, 1, total, axis_name=axis_name)[1:-1]
        later = jnp.any(positions[:, None] == starts[None, :], axis=1)  # a document's first
        shape = (1, t) + (1,) * (x.ndim - 2)
        y = jnp.where(later.reshape(shape), jnp.zeros((), x.dtype), y)
    return y


def next_tokens(
    x: Shaped[Array, "batch seq *rest"],
    *,
    cp: ContextParallel | None = None,
    cu_seqlens: CuSeqlens | None = None,
    fill: int | float = 0,
) -> Shaped[Array, "batch seq *rest"]:
    """Every token's successor: `y[:, t] = x[:, t + 1]`, the mirror of `previous_tokens`
    (the next token's id for a multi-token-prediction head, a label one step further:
    [`deltanet_cp.models.Qwen3_5MTP`][]).

    The last token of the sequence, and with `cu_seqlens` the last token of every packed
    document, gets `fill`: a document never reads its neighbour's first token. Under context
    parallelism the last token of each piece of a rank's shard gets the first token of the
    piece after it in the sequence, from the rank that holds it (one token per piece crosses
    ranks, a `jax.lax.ppermute`), in either layout. Values are moved, never multiplied.

    **Arguments:**

    - `x`: `(batch, seq, ...)`; with `cp`, this rank's shard of time in `cp.layout`'s order
        (inside `jax.shard_map`).
    - `cp`: a [`deltanet_cp.ContextParallel`][] without `mesh`, or `None` on one device.
    - `cu_seqlens`: packed documents (`batch` 1): the documents' boundaries in the whole
        sequence, `[0, ..., total]`, as [`deltanet_cp.previous_tokens`][] takes them.
    - `fill`: what a last token gets (e.g. `-100`, the ignore index, for labels).

    **Returns:**

    `x`'s shape and dtype, in the same layout.

    **Raises:**

    `ValueError` for `x` without a time axis, a `cp` with a `mesh`, or a `cu_seqlens` with
    more than one batch row.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"`x` must be (batch, seq, ...) with time on axis 1; got shape {x.shape}.")
    cp = local_cp(cp, "next_tokens")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(
            f"With `cu_seqlens` the documents are packed in one batch row; `x` has {x.shape[0]}."
        )
    t = x.shape[1]
    if t == 0:
        return x
    last = jnp.full((x.shape[0], 1, *x.shape[2:]), fill, x.dtype)
    if cp is None:
        y = jnp.concatenate([x[:, 1:], last], axis=1)
        positions = jnp.arange(t)
    else:
        n = jax.lax.axis_size(cp.axis_name)
        rank = jax.lax.axis_index(cp.axis_name)
        walks = cp.layout.walks(t, n)
        pieces = [jax.lax.slice_in_dim(x, w.local.start, w.local.stop, axis=1) for w in walks]
        out = []
        for i, (walk, piece) in enumerate(zip(walks, pieces)):
            order = walk.ranks(n)
            # Within a walk each rank gets the first token of the next rank's piece.
            within = jax.lax.ppermute(piece[:, :1], cp.axis_name, list(zip(order[1:], order)))
            if i + 1 < len(walks):
                # The walk's last rank continues into the next walk's first piece.
                src, dst = walks[i + 1].ranks(n)[0], order[-1]
                after = pieces[i + 1][:, :1]
                if src != dst:
                    after = jax.lax.ppermute(after, cp.axis_name, [(src, dst)])
            else:
                after = last
            halo = jnp.where(rank == order[-1], after, within)
            out.append(jnp.concatenate([piece[:, 1:], halo], axis=1))
        y = jnp.concatenate(out, axis=1)
        positions = cp.layout.positions(t, cp.axis_name)
    if cu_seqlens is not None:
        total = t if cp is None else t * jax.lax.axis_size(cp.axis_name)
        axis_name = None if cp is None else cp.axis_name
        ends = as_cu_seqlens(cu_seqlens, 1, total, axis_name=axis_name)[1:-1]
        final = jnp.any(positions[:, None] + 1 == ends[None, :], axis=1)  # a document's last
        shape = (1, t) + (1,) * (x.ndim - 2)
        y = jnp.where(final.reshape(shape), jnp.full((), fill, x.dtype), y)
    return y
