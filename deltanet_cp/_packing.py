"""Packed documents (`cu_seqlens`): re-laying tokens so that no chunk mixes two documents.

Several documents are concatenated along the time axis of a batch of one, with offsets
`cu_seqlens = [0, len_0, len_0 + len_1, ..., T]` (the FlashAttention / flash-linear-attention
convention). The recurrent state resets at each document start. We pad every document to
a multiple of the chunk size, so each chunk belongs to one document, and mark in each
chunk whether a document starts there (its state is replaced by the document's initial
state: the affine map with $M = 0$) and whether one ends there (its state is a final state).

Under context parallelism the same global `cu_seqlens` is given to every rank; each rank
re-lays its own slice `[offset, offset + length)`. A document may start on one rank and end
on another: it then simply has no start chunk on the later rank and its state arrives
through the prefix scan over ranks.

All shapes are static (they depend on the sequence length, the chunk size and the number of
documents only), so `cu_seqlens` may be a traced array.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Int, Shaped


class Segments(eqx.Module):
    """Where the documents of one packed sequence (or one rank's slice of it) lie in chunks.

    **Fields:**

    - `start_doc`: per chunk, the document starting at this chunk, or `-1`.
    - `end_doc`: per chunk, the document ending in this chunk, or `-1`.
    - `source`: per padded position, the token it holds, or `-1` for padding.
    - `target`: per token, its padded position.
    - `empty_doc`: per document, whether it has no token in this slice *and* starts in
        it (such a document's final state is its initial state).
    """

    start_doc: Int[Array, " chunks"]
    end_doc: Int[Array, " chunks"]
    source: Int[Array, " padded"]
    target: Int[Array, " seq"]
    empty_doc: Shaped[Array, " docs"]

    @property
    def num_docs(self) -> int:
        return self.empty_doc.shape[0]

    @property
    def num_chunks(self) -> int:
        return self.start_doc.shape[0]


def as_cu_seqlens(
    cu_seqlens: Any,
    batch: int,
    total: int,
    *,
    at_least: bool = False,
    axis_name: str | None = None,
) -> Int[Array, " docs_plus_one"]:
    """`cu_seqlens` as an int32 array, checked: a `ValueError` names what to change.

    Shapes, dtypes and concrete values' range are checked at once (`cu_seqlens_array`);
    the values (starting at 0, not decreasing, ending at the global length `total`, or at
    or after it if `at_least`) at once too where they are known (a list, a NumPy array, a
    concrete JAX array: `check_offsets`), else with `equinox.error_if`
    (`check_cu_seqlens`), so that a bad traced value under `jax.jit` raises when the
    computation runs. Inside `jax.shard_map`, pass the context-parallel `axis_name`: every
    rank then raises together.
    """
    cu = cu_seqlens_array(cu_seqlens, batch)
    values = concrete_offsets(cu_seqlens)
    if values is not None:
        check_offsets(values, total, at_least=at_least)
        return cu
    return check_cu_seqlens(cu, total, at_least=at_least, axis_name=axis_name)


def concrete_offsets(cu_seqlens: Any) -> np.ndarray | None:
    """The values of a `cu_seqlens` that `cu_seqlens_array` accepted, if they are known
    now (a list, a NumPy array, a JAX array that is not traced); else `None`."""
    if isinstance(cu_seqlens, Tracer):
        return None
    return np.asarray(cu_seqlens).astype(np.int64)


def check_offsets(values: np.ndarray, total: int, *, at_least: bool = False) -> None:
    """A `ValueError` saying which rule the document offsets `values` break (see
    `as_cu_seqlens`), with the values."""
    shown = values.tolist() if values.size <= 12 else f"{values[:12].tolist()} ..."
    end = f"at or after position {total}" if at_least else f"at the sequence length {total}"
    rules = (
        "`cu_seqlens` holds the document offsets [0, len_0, len_0 + len_1, ..., T]: it must "
        f"start at 0, not decrease, and end {end}"
    )
    if values[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0; got {shown} ({rules}).")
    drops = np.flatnonzero(values[1:] < values[:-1])
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(
            f"`cu_seqlens` must not decrease; got {values[i]} after {values[i - 1]} at index "
            f"{i} of {shown} ({rules})."
        )
    if (values[-1] < total) if at_least else (values[-1] != total):
        raise ValueError(
            f"`cu_seqlens` must end {end} (the tokens of the whole sequence, over every rank "
            f"under context parallelism); got {shown}, which ends at {values[-1]} ({rules})."
        )


_INT32 = np.iinfo(np.int32)


def cu_seqlens_array(cu_seqlens: Any, batch: int) -> Int[Array, " docs_plus_one"]:
    """`cu_seqlens` as an int32 array, its batch, type, shape and range checked.

    A concrete value that does not fit in int32 is refused (converting it would wrap it
    round); so is a traced one of a wider integer dtype, whose values cannot be seen.
    """
    if batch != 1:
        raise ValueError(
            f"With `cu_seqlens`, pack the documents along the time axis of a batch of one: "
            f"expected batch size 1, got {batch}."
        )
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(x, (int, np.integer)) for x in cu_seqlens):
            raise ValueError(f"`cu_seqlens` must hold ints; got {cu_seqlens!r}.")
        cu_seqlens = np.asarray([int(x) for x in cu_seqlens], object)
        too_big = [x for x in cu_seqlens if not _INT32.min <= x <= _INT32.max]
        if too_big:
            raise ValueError(_out_of_range(too_big[0]))
        cu_seqlens = cu_seqlens.astype(np.int32)
    if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(
            "`cu_seqlens` must be a list or an integer array of document offsets [0, ..., T]; "
            f"got {getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}."
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"`cu_seqlens` must have shape (num_docs + 1,) with num_docs >= 1; got "
            f"{cu_seqlens.shape}."
        )
    dtype = np.dtype(cu_seqlens.dtype)
    if not np.can_cast(dtype, np.int32):
        try:
            values = np.asarray(cu_seqlens)
        except jax.errors.TracerArrayConversionError:
            raise ValueError(
                f"A traced `cu_seqlens` must have an integer dtype that fits in int32; got "
                f"{dtype}, whose values could be wrapped round. Pass it as int32 (for "
                "example `cu_seqlens.astype(jnp.int32)` once you know its values fit)."
            ) from None
        outside = values[(values < _INT32.min) | (values > _INT32.max)]
        if outside.size:
            raise ValueError(_out_of_range(outside[0]))
    return jnp.asarray(cu_seqlens).astype(jnp.int32)


def _out_of_range(value) -> str:
    return (
        f"`cu_seqlens` holds {int(value)}, which does not fit in int32 (at most "
        f"{_INT32.max}): document offsets are int32 token positions."
    )


def check_cu_seqlens(
    cu: Int[Array, " docs_plus_one"],
    total: int,
    *,
    at_least: bool = False,
    axis_name: str | None = None,
) -> Int[Array, " docs_plus_one"]:
    """`cu` itself, with `equinox.error_if` on its values (see `as_cu_seqlens`): for traced
    values, whose error comes when the computation runs (`equinox`'s report of it begins
    with the stack; the rule broken follows). Known values are checked by
    `check_offsets` instead, a `ValueError` at once.

    With `axis_name` (inside `jax.shard_map`), the predicate is reduced over that axis
    first, so that every rank raises or none does: a rank that raised alone would leave
    the others waiting in the exchange's collectives forever.
    """
    short = cu[-1] < total if at_least else cu[-1] != total
    bad = (cu[0] != 0) | jnp.any(cu[1:] < cu[:-1]) | short
    end = (
        f"at or after position {total}" if at_least else f"at the (global) sequence length {total}"
    )
    msg = f"`cu_seqlens` must start at 0, not decrease, and end {end}."
    if axis_name is None:
        # On a zero, not on `cu`: inside `jax.shard_map`, `cu` may vary over a data axis,
        # and `error_if`'s operand must not.
        return cu + eqx.error_if(jnp.zeros((), cu.dtype), bad, msg)
    bad = bad.astype(jnp.int32)
    if axis_name not in jax.typeof(bad).manual_axis_type.varying:
        bad = jax.lax.pcast(bad, (axis_name,), to="varying")
    bad = jax.lax.pmax(bad, axis_name) > 0  # the same on every rank
    # `error_if` takes an operand typed as its predicate (the same on every rank), which
    # `cu` need not be: the check is on a zero that `cu` then depends on.
    return cu + eqx.error_if(jnp.zeros((), cu.dtype), bad, msg)


def num_padded_chunks(length: int, num_docs: int, chunk_size: int) -> int:
    """A static bound on the chunks needed when every document is padded to whole chunks."""
    return max(1, (length + num_docs * (chunk_size - 1)) // chunk_size)


def segments(
    cu_seqlens: Int[Array, " docs_plus_one"],
    length: int,
    chunk_size: int,
    offset: Int[Array, ""] | int = 0,
) -> Segments:
    """Lay out the documents of the slice `[offset, offset + length)` in whole chunks.

    **Arguments:**

    - `cu_seqlens`: the global document offsets, `(num_docs + 1,)`.
    - `length`: the number of tokens in this slice (the local sequence length).
    - `chunk_size`: tokens per chunk.
    - `offset`: the global index of the slice's first token (`rank * length` under
        context parallelism).

    **Returns:**

    A [`deltanet_cp.internal.Segments`][] with `num_padded_chunks(length, num_docs, chunk_size)`
    chunks.
    """
    c = chunk_size
    n_docs = cu_seqlens.shape[0] - 1
    n_chunks = num_padded_chunks(length, n_docs, c)
    cu = cu_seqlens.astype(jnp.int32)
    # Each document's part of this slice, in local token indices.
    lo = jnp.clip(cu[:-1] - offset, 0, length)
    hi = jnp.clip(cu[1:] - offset, 0, length)
    local_len = hi - lo
    chunks = (local_len + c - 1) // c
    first_chunk = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks)[:-1]])
    end = offset + length
    # A document starts in the slice holding its first token; an empty document at the
    # very end of the sequence counts as starting in the last slice.
    starts_here = (cu[:-1] >= offset) & ((cu[:-1] < end) | ((cu[:-1] == end) & (end == cu[-1])))
    ends_here = (cu[1:] > offset) & (cu[1:] <= end)
    doc_ids = jnp.arange(n_docs, dtype=jnp.int32)
    has_tokens = local_len > 0

    # Scatter: a document's first / last chunk, where it starts / ends in this slice.
    start_doc = jnp.full((n_chunks,), -1, jnp.int32)
    start_doc = start_doc.at[jnp.where(starts_here & has_tokens, first_chunk, n_chunks)].set(
        doc_ids, mode="drop"
    )
    end_doc = jnp.full((n_chunks,), -1, jnp.int32)
    last_chunk = first_chunk + chunks - 1
    end_doc = end_doc.at[jnp.where(ends_here & has_tokens, last_chunk, n_chunks)].set(
        doc_ids, mode="drop"
    )

    # Padded position p belongs to the last document starting at or before it (documents
    # with no chunk here share their start with the next one, which then wins the tie).
    positions = jnp.arange(n_chunks * c, dtype=jnp.int32)
    doc_of_pos = jnp.searchsorted(first_chunk * c, positions, side="right") - 1
    doc_of_pos = jnp.clip(doc_of_pos, 0, n_docs - 1)
    inside = positions - first_chunk[doc_of_pos] * c
    valid = inside < local_len[doc_of_pos]
    source = jnp.where(valid, lo[doc_of_pos] + inside, -1)

    tokens = jnp.arange(length, dtype=jnp.int32)
    doc_of_token = jnp.clip(jnp.searchsorted(hi, tokens, side="right"), 0, n_docs - 1)
    target = first_chunk[doc_of_token] * c + tokens - lo[doc_of_token]
    return Segments(
        start_doc=start_doc,
        end_doc=end_doc,
        source=source,
        target=target,
        empty_doc=starts_here & ~has_tokens,
    )


def pack(x: Shaped[Array, "batch seq *rest"], seg: Segments) -> Array:
    """Re-lay the tokens of `x` (time on axis 1) into whole-chunk documents; zeros pad."""
    taken = jnp.take(x, jnp.maximum(seg.source, 0), axis=1)
    mask = (seg.source >= 0).reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(mask, taken, jnp.zeros((), x.dtype))


def unpack(y: Shaped[Array, "batch padded *rest"], seg: Segments) -> Array:
    """Inverse of `pack` for per-token outputs: back to token order, padding dropped."""
    return jnp.take(y, seg.target, axis=1)
