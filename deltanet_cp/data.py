r"""Fine-tuning on packed documents: pack tokenised documents into rows, give each host its
slice of them, and take the loss over their real targets.

```python
from deltanet_cp.data import causal_lm_loss, make_global_batch, pack_documents

packed = pack_documents(documents, row_length=4096, prompt_lengths=prompts)
batch = make_global_batch(packed, mesh, layout, data_axis="dp", context_axis="cp")
loss, count = causal_lm_loss(logits, batch.labels, axis_name=("dp", "cp"))  # in shard_map
```

**Rows.** [`pack_documents`][deltanet_cp.data.pack_documents] places documents greedily
(first fit, in the order given) into rows of `row_length` tokens. A row's documents follow
one another; what is left of the row is padding (`pad_id`).

**`cu_seqlens`.** Each row's documents are described in the library's convention (see
[`deltanet_cp.run`][]): the offsets `[0, end_0, end_1, ..., row_length]` of one sequence,
starting at 0, not decreasing, ending at the row's length. The padding at the end of a row
is a segment of its own, so no document's tokens see it, and it sees none of them. A batch
of rows has one row of offsets each, `(rows, max_documents + 2)`: every row is given the
same number of segments (the layers and recurrences take `cu_seqlens` of a static shape,
and a fixed shape compiles once), the unused ones empty at the row's end
(`..., row_length, row_length`). An empty segment is legal in the convention (offsets may
repeat) and costs nothing: the recurrences skip it and no token belongs to it. The layers
take one sequence and its 1-D `cu_seqlens`; a batch of rows is a `jax.vmap` over both:

```python
jax.vmap(lambda t, cu: layer(t, cu_seqlens=cu))(x, packed.cu_seqlens)
```

**Labels.** `labels[t]` is the target of position `t`, already shifted (transformers'
`shift_labels`): the next token of the same document, or `-100` (transformers' ignore
index) where there is none to learn: at the last token of each document (no target across a
document boundary), where the next token is part of a prompt (or masked out by a loss
mask), and on padding. Being shifted before the row is cut among ranks, the labels are
sliced with the tokens, and the loss needs no token from a neighbouring rank.

**Hosts and ranks.** On a mesh with a data axis (rows) and a context axis (positions),
[`rank_shard`][deltanet_cp.data.rank_shard] is what one rank holds,
[`process_local_data`][deltanet_cp.data.process_local_data] what one process must hand
`jax.make_array_from_process_local_data`, and
[`make_global_batch`][deltanet_cp.data.make_global_batch] builds the global arrays. Under
[`deltanet_cp.Zigzag`][] a rank holds two pieces of each row, and the global per-token
arrays are in the layout's order (`layout.to_layout`), as a sharded call expects them.

**Loss.** [`causal_lm_loss`][deltanet_cp.data.causal_lm_loss] is the token cross entropy
in float32 over the real targets: inside `jax.shard_map` the sum and the count of every
rank are added up (`psum`) before the division, so the loss is the mean over all the real
targets of the batch, not a mean of per-rank means (which weights a rank holding few
targets as much as one holding many).
[`chunked_causal_lm_loss`][deltanet_cp.data.chunked_causal_lm_loss] is the same loss from
the last hidden states and the LM head's weight, computed over chunks of tokens so that the
`(tokens, vocab)` logits are never held: the loss for long sequences.
[`add_router_loss`][deltanet_cp.data.add_router_loss] adds a mixture-of-experts model's
load-balancing loss as transformers does, its routing counted over the real tokens
([`real_tokens`][deltanet_cp.data.real_tokens], the model's `token_mask=`), as transformers
counts them under its `attention_mask`.
[`add_mtp_loss`][deltanet_cp.data.add_mtp_loss] adds a multi-token-prediction head's loss
(a model's `logits_and_mtp`) with its weight, on the targets
[`mtp_labels`][deltanet_cp.data.mtp_labels] shifts out of the labels.
"""

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Shaped

from ._layout import AbstractLayout
from ._parallel import ContextParallel
from ._shift import next_tokens
from .nn import load_balancing_loss, RouterStats


__all__ = [
    "add_mtp_loss",
    "add_router_loss",
    "causal_lm_loss",
    "chunked_causal_lm_loss",
    "IGNORE_INDEX",
    "make_global_batch",
    "mtp_labels",
    "pack_documents",
    "PackedRows",
    "process_local_data",
    "rank_shard",
    "real_tokens",
]

IGNORE_INDEX = -100
"""transformers' ignore index: a label that is no target (`CrossEntropyLoss(ignore_index=-100)`)."""

_INT32 = np.iinfo(np.int32)
AxisNames = str | tuple[str, ...] | None


class PackedRows(NamedTuple):
    """Documents packed into rows of equal length: what [`deltanet_cp.data.pack_documents`][]
    returns (NumPy arrays), and what [`deltanet_cp.data.make_global_batch`][] returns
    (global `jax.Array`s). A PyTree, so `jax.tree.map` goes over its four arrays.

    **Fields:**

    - `tokens`: `(rows, length)` int32 token ids, padding included.
    - `labels`: `(rows, length)` int32, the target of each position (the next token of its
        document) or `-100`.
    - `cu_seqlens`: `(rows, segments + 1)` int32, each row's offsets
        `[0, ..., length]`: its documents, then its padding, then empty segments at
        `length`.
    - `document_ids`: `(rows, segments)` int32, per segment the index of the document (in
        the list given to the packer) it holds, or `-1` for padding and empty segments. The
        pieces of a split document share its index.
    - `document_offsets`: `(rows, segments)` int32, per segment the place of its first
        token in its document (0 but for the later pieces of a split document, which first
        fit may put in any row), or `-1` with `document_ids`.
    """

    tokens: Int[Any, "rows length"]
    labels: Int[Any, "rows length"]
    cu_seqlens: Int[Any, "rows segments_plus_one"]
    document_ids: Int[Any, "rows segments"]
    document_offsets: Int[Any, "rows segments"]


def _token_ids(doc: Any, i: int) -> np.ndarray:
    if isinstance(doc, (list, tuple)):
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in doc):
            raise TypeError(f"Document {i} must hold int token ids; got {list(doc)[:8]!r}...")
        doc = np.asarray([int(t) for t in doc], dtype=object)
    elif hasattr(doc, "dtype") and hasattr(doc, "ndim"):
        if not np.issubdtype(np.dtype(doc.dtype), np.integer):
            raise TypeError(
                f"Document {i} must be an integer array of token ids; got dtype {doc.dtype}."
            )
        if doc.ndim != 1:
            raise ValueError(f"Document {i} must be 1-D, `(tokens,)`; got shape {doc.shape}.")
        doc = np.asarray(doc)
    else:
        raise TypeError(
            f"Document {i} must be a list or a 1-D integer array of token ids; got "
            f"{type(doc).__name__}."
        )
    if doc.size == 0:
        raise ValueError(f"Document {i} is empty: drop it before packing.")
    if doc.min() < 0 or doc.max() > _INT32.max:
        raise ValueError(
            f"Document {i} holds the token id {doc.min() if doc.min() < 0 else doc.max()}: "
            f"ids must lie in [0, {_INT32.max}]."
        )
    return doc.astype(np.int32)


def _as_int(value: Any, name: str, low: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int; got {type(value).__name__}.")
    if not low <= value <= _INT32.max:
        raise ValueError(f"`{name}` must lie in [{low}, {_INT32.max}]; got {value}.")
    return int(value)


def _targets(
    n: int, i: int, prompt_lengths: Sequence[int] | None, loss_masks: Sequence[Any] | None
) -> np.ndarray:
    """Per token of document `i` (of `n` tokens), whether it is to be predicted."""
    if prompt_lengths is not None:
        p = _as_int(prompt_lengths[i], f"prompt_lengths[{i}]", 0)
        if p > n:
            raise ValueError(f"`prompt_lengths[{i}]` is {p}, more than document {i}'s {n} tokens.")
        return np.arange(n) >= p
    if loss_masks is not None:
        mask = np.asarray(loss_masks[i])
        if mask.shape != (n,) or not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
            raise ValueError(
                f"`loss_masks[{i}]` must be a bool (or 0/1) array of document {i}'s shape "
                f"({n},); got {mask.dtype} {mask.shape}."
            )
        return mask.astype(bool)
    return np.ones(n, bool)


def pack_documents(
    documents: Sequence[Any],
    row_length: int,
    *,
    pad_id: int = 0,
    prompt_lengths: Sequence[int] | None = None,
    loss_masks: Sequence[Any] | None = None,
    too_long: Literal["error", "split"] = "error",
    max_documents: int | None = None,
) -> PackedRows:
    """Pack tokenised documents greedily into rows of `row_length` tokens, with their labels
    and `cu_seqlens`.

    Each document goes into the first row with room for it (first fit, documents taken in
    the order given; a new row when none has room), after the documents already there.

    **Arguments:**

    - `documents`: the documents, each a list or a 1-D integer array of token ids
        (non-negative, int32).
    - `row_length`: the tokens per row, at least 2. Under context parallelism, a multiple
        of the layout's pieces (`cp` for [`deltanet_cp.Contiguous`][], `2 * cp` for
        [`deltanet_cp.Zigzag`][]).
    - `pad_id`: the token id of padding.
    - `prompt_lengths`: for supervised fine-tuning, per document the number of its
        leading prompt tokens, which are not predicted (their positions take `-100` as a
        target; the last prompt token's target is the first answer token).
    - `loss_masks`: instead of `prompt_lengths`, per document a boolean mask of its
        tokens that are predicted (`True`: a target).
    - `too_long`: a document longer than `row_length` is an error (`"error"`, the default)
        or is cut into pieces of `row_length` tokens (`"split"`), each a segment of its
        own that starts from a fresh state; a piece's last label is then still the
        document's next token (the first of the next piece), a true next-token target.
    - `max_documents`: at most this many documents in a row (the `cu_seqlens` width is
        `max_documents + 2`, the same for every batch, so a jitted step compiles once);
        `None`: as many as the fullest row holds.

    **Returns:**

    A [`deltanet_cp.data.PackedRows`][] of NumPy arrays.

    **Raises:**

    `TypeError` for token ids that are not ints; `ValueError` for an empty document, a
    `row_length` under 2, a document longer than a row with `too_long="error"`, prompt
    lengths or loss masks that do not fit their documents, or both given.
    """
    row_length = _as_int(row_length, "row_length", 0)
    if row_length < 2:
        raise ValueError(
            f"`row_length` must be at least 2 (a token and its target); got {row_length}."
        )
    pad_id = _as_int(pad_id, "pad_id", 0)
    if too_long not in ("error", "split"):
        raise ValueError(f'`too_long` must be "error" or "split"; got {too_long!r}.')
    if max_documents is not None:
        max_documents = _as_int(max_documents, "max_documents", 1)
    if prompt_lengths is not None and loss_masks is not None:
        raise ValueError("Pass `prompt_lengths` or `loss_masks`, not both.")
    for name, per_doc in (("prompt_lengths", prompt_lengths), ("loss_masks", loss_masks)):
        if per_doc is not None and len(per_doc) != len(documents):
            raise ValueError(
                f"`{name}` must have one entry per document ({len(documents)}); got {len(per_doc)}."
            )
    if len(documents) == 0:
        raise ValueError("`documents` is empty: there is nothing to pack.")

    # The units placed in rows: (document index, offset, tokens, labels), a split
    # document's pieces one after another.
    units: list[tuple[int, int, np.ndarray, np.ndarray]] = []
    for i, doc in enumerate(documents):
        ids = _token_ids(doc, i)
        n = ids.shape[0]
        targets = _targets(n, i, prompt_lengths, loss_masks)
        labels = np.full(n, IGNORE_INDEX, np.int32)
        labels[:-1] = np.where(targets[1:], ids[1:], IGNORE_INDEX)
        if n > row_length and too_long == "error":
            raise ValueError(
                f"Document {i} has {n} tokens, more than `row_length={row_length}`: raise "
                'the row length, or pass `too_long="split"` to cut it into pieces of a row.'
            )
        for start in range(0, n, row_length):
            piece = slice(start, start + row_length)
            units.append((i, start, ids[piece], labels[piece]))

    # First fit over the rows opened so far (at most one per unit): the room left in each,
    # -1 once it holds `max_documents`, so that no unit fits there any more.
    room = np.full(len(units), -1, np.int64)
    held: list[list[tuple[int, int, np.ndarray, np.ndarray]]] = []
    for unit in units:
        n = unit[2].shape[0]
        r = int(np.argmax(room >= n)) if (room >= n).any() else len(held)
        if r == len(held):
            held.append([])
            room[r] = row_length
        held[r].append(unit)
        room[r] -= n
        if max_documents is not None and len(held[r]) == max_documents:
            room[r] = -1

    width = max_documents if max_documents is not None else max(len(r) for r in held)
    rows = len(held)
    tokens = np.full((rows, row_length), pad_id, np.int32)
    labels = np.full((rows, row_length), IGNORE_INDEX, np.int32)
    cu = np.full((rows, width + 2), row_length, np.int32)
    ids = np.full((rows, width + 1), -1, np.int32)
    offsets = np.full((rows, width + 1), -1, np.int32)
    for r, row in enumerate(held):
        at = 0
        cu[r, 0] = 0
        for k, (i, start, t, lab) in enumerate(row):
            tokens[r, at : at + t.shape[0]] = t
            labels[r, at : at + t.shape[0]] = lab
            at += t.shape[0]
            cu[r, k + 1] = at
            ids[r, k] = i
            offsets[r, k] = start
        # The padding, if any, is segment `len(row)`: it ends at `row_length`, like every
        # segment after it.
    return PackedRows(tokens, labels, cu, ids, offsets)


def _axes(axis: AxisNames) -> tuple[str, ...]:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _axis_size(mesh: jax.sharding.Mesh, axis: AxisNames) -> int:
    size = 1
    for a in _axes(axis):
        if a not in mesh.shape:
            raise ValueError(f"The mesh has no axis {a!r}; its axes are {tuple(mesh.shape)}.")
        size *= mesh.shape[a]
    return size


def _layout_order(layout: AbstractLayout, length: int, cp: int) -> np.ndarray:
    """The sequence position at each place of a row in `layout`'s order (ranks' shards one
    after another): `layout.position_table` read rank after rank."""
    pieces = layout.pieces(cp)
    if length % pieces:
        each = "" if pieces == cp else f", {pieces // cp} pieces per rank"
        raise ValueError(
            f"The row length {length} must be a multiple of the context-parallel size {cp} "
            f"and of the {pieces} pieces {layout!r} cuts a row into for {cp} ranks"
            f"{each}: pack with a `row_length` that is a multiple of {pieces}."
        )
    return layout.position_table(length // cp, cp).reshape(-1)


def _check_packed(packed: PackedRows) -> None:
    """A `ValueError` naming the field unless `packed`'s arrays fit together: `tokens` and
    `labels` `(rows, length)`, `cu_seqlens` `(rows, segments + 1)`, `document_ids` and
    `document_offsets` `(rows, segments)`."""
    if not isinstance(packed, PackedRows):
        raise TypeError(
            f"`packed` must be a `deltanet_cp.data.PackedRows` (from `pack_documents`); got "
            f"{type(packed).__name__}."
        )
    shape = np.shape(packed.tokens)
    if len(shape) != 2:
        raise ValueError(f"`packed.tokens` must be (rows, length); got shape {shape}.")
    if np.shape(packed.labels) != shape:
        raise ValueError(
            f"`packed.labels` must have the shape of `packed.tokens`, {shape}: one target "
            f"(or -100) per token, shifted already; got {np.shape(packed.labels)}."
        )
    cu = np.shape(packed.cu_seqlens)
    if len(cu) != 2 or cu[0] != shape[0] or cu[1] < 2:
        raise ValueError(
            f"`packed.cu_seqlens` must be (rows, segments + 1) with rows = {shape[0]}, each "
            f"row's offsets [0, ..., {shape[1]}]; got shape {cu}."
        )
    for name in ("document_ids", "document_offsets"):
        got = np.shape(getattr(packed, name))
        if got != (shape[0], cu[1] - 1):
            raise ValueError(
                f"`packed.{name}` must be (rows, segments) = {(shape[0], cu[1] - 1)}, one "
                f"entry per segment of `cu_seqlens`; got {got}."
            )


def rank_shard(
    packed: PackedRows,
    layout: AbstractLayout,
    *,
    cp: int,
    context_rank: int,
    dp: int = 1,
    data_rank: int = 0,
) -> PackedRows:
    """What one rank holds of a packed batch: its rows and, in each, its tokens in `layout`.

    **Arguments:**

    - `packed`: the whole batch (NumPy arrays), in sequence order.
    - `layout`: the context-parallel layout, e.g. [`deltanet_cp.Zigzag`][].
    - `cp`, `context_rank`: the size of the context axis and this rank's place on it.
    - `dp`, `data_rank`: the size of the data axis and this rank's place on it.

    **Returns:**

    A [`deltanet_cp.data.PackedRows`][]: rows `data_rank * rows / dp, ...`; `tokens` and
    `labels` hold the positions `layout.position_table(length // cp, cp)[context_rank]`
    (under zigzag, pieces `r` and `2 cp - 1 - r`); the per-row fields (`cu_seqlens`, ...)
    stay global (every context rank gets the same, as the recurrences expect).

    **Raises:**

    `ValueError` if `packed`'s fields do not fit together (`labels` not of `tokens`'
    shape, offsets not one row per row), the rows do not divide over `dp`, or the row
    length over the layout's pieces (`cp`, or `2 * cp` under [`deltanet_cp.Zigzag`][]).
    """
    _check_packed(packed)
    rows, length = np.shape(packed.tokens)
    if rows % dp:
        raise ValueError(f"The batch's {rows} rows must be a multiple of the data axis size {dp}.")
    if not (0 <= data_rank < dp and 0 <= context_rank < cp):
        raise ValueError(
            f"Ranks out of range: data_rank={data_rank} of {dp}, context_rank={context_rank} "
            f"of {cp}."
        )
    per = rows // dp
    r = slice(data_rank * per, (data_rank + 1) * per)
    _layout_order(layout, length, cp)  # checks the length
    cols = layout.position_table(length // cp, cp)[context_rank]
    return PackedRows(
        tokens=np.asarray(packed.tokens)[r][:, cols],
        labels=np.asarray(packed.labels)[r][:, cols],
        cu_seqlens=np.asarray(packed.cu_seqlens)[r],
        document_ids=np.asarray(packed.document_ids)[r],
        document_offsets=np.asarray(packed.document_offsets)[r],
    )


def _shardings(
    mesh: jax.sharding.Mesh, data_axis: AxisNames, context_axis: str | None
) -> PackedRows:
    """The sharding of each field: per-token arrays over (data, context), offsets per row."""
    P = jax.sharding.PartitionSpec
    rows = None if data_axis is None else data_axis
    token = jax.sharding.NamedSharding(mesh, P(rows, context_axis))
    offsets = jax.sharding.NamedSharding(mesh, P(rows, None))
    return PackedRows(token, token, offsets, offsets, offsets)


def _process_block(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], devices: set[Any]
) -> tuple[slice, ...]:
    """The block of a global array of `shape` that `devices` hold together under `sharding`,
    checked to be all of a rectangle (what `make_array_from_process_local_data` needs)."""
    indices = {
        tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        for d, index in sharding.devices_indices_map(shape).items()
        if d in devices
    }
    if not indices:
        raise ValueError("None of the given devices is in the mesh.")
    lo = [min(ix[k][0] for ix in indices) for k in range(len(shape))]
    hi = [max(ix[k][1] for ix in indices) for k in range(len(shape))]
    volume = sum(int(np.prod([b - a for a, b in ix])) for ix in indices)
    if volume != int(np.prod([b - a for a, b in zip(lo, hi)])):
        raise ValueError(
            "This process's devices do not hold one rectangular block of the batch (rows x "
            "positions): order the mesh's devices so that each process's devices are "
            "neighbours on both axes (`jax.make_mesh` does), e.g. the context axis inside a "
            "host and the data axis across hosts."
        )
    return tuple(slice(a, b) for a, b in zip(lo, hi))


def process_local_data(
    packed: PackedRows,
    mesh: jax.sharding.Mesh,
    layout: AbstractLayout,
    *,
    data_axis: AxisNames,
    context_axis: str | None,
    devices: Any = None,
) -> PackedRows:
    """What one process holds of a packed batch: the block of each global array (in the
    layout's order) that its devices hold, for `jax.make_array_from_process_local_data`.

    **Arguments:**

    - `packed`: the whole batch, NumPy arrays in sequence order (every process packs the
        same documents the same way, or loads the same rows).
    - `mesh`: the mesh; rows go over `data_axis`, positions over `context_axis`. Other
        axes replicate the batch.
    - `layout`: the layout of the context axis.
    - `data_axis`: the mesh axis (or axes, or `None`) that splits the rows.
    - `context_axis`: the mesh axis that splits each row's positions, or `None`.
    - `devices`: whose block to give; `None`: this process's devices
        (`jax.process_index()`).

    **Returns:**

    A [`deltanet_cp.data.PackedRows`][] of NumPy arrays: `tokens` and `labels` of the
    process's rows at the process's places in the layout's order; the offsets of its rows.

    **Raises:**

    `ValueError` if `packed`'s fields do not fit together (`labels` not of `tokens`'
    shape, offsets not one row per row), the rows do not divide over the data axis, the
    row length over the context axis's pieces (`2 * cp` under [`deltanet_cp.Zigzag`][]),
    or if the process's devices do not hold one rectangular block.
    """
    _check_packed(packed)
    tokens = np.asarray(packed.tokens)
    rows, length = tokens.shape
    cp = _axis_size(mesh, context_axis)
    dp = _axis_size(mesh, data_axis)
    if rows % dp:
        raise ValueError(f"The batch's {rows} rows must be a multiple of the data axes' size {dp}.")
    order = _layout_order(layout, length, cp)
    if devices is None:
        devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    chosen = set(devices)
    shardings = _shardings(mesh, data_axis, context_axis)
    r, c = _process_block(shardings.tokens, (rows, length), chosen)
    positions = order[c]
    offsets_rows = _process_block(shardings.cu_seqlens, np.shape(packed.cu_seqlens), chosen)[0]
    return PackedRows(
        tokens=tokens[r][:, positions],
        labels=np.asarray(packed.labels)[r][:, positions],
        cu_seqlens=np.asarray(packed.cu_seqlens)[offsets_rows],
        document_ids=np.asarray(packed.document_ids)[offsets_rows],
        document_offsets=np.asarray(packed.document_offsets)[offsets_rows],
    )


def make_global_batch(
    packed: PackedRows,
    mesh: jax.sharding.Mesh,
    layout: AbstractLayout,
    *,
    data_axis: AxisNames,
    context_axis: str | None,
) -> PackedRows:
    """The global arrays of a packed batch, each process giving only its own block.

    Calls `jax.make_array_from_process_local_data(sharding, local, global_shape)` per field
    on [`deltanet_cp.data.process_local_data`][]'s blocks: `tokens` and `labels` sharded
    `P(data_axis, context_axis)` in the layout's order (each rank's shard is its pieces,
    what a model called with `cp=ContextParallel(context_axis, layout=layout)` inside
    `jax.shard_map` expects), the per-row fields (`cu_seqlens`, ...) `P(data_axis, None)` (global
    offsets, the same on every context rank). Runs in one process as in many.

    **Arguments:** as for [`deltanet_cp.data.process_local_data`][] (without `devices`).

    **Returns:**

    A [`deltanet_cp.data.PackedRows`][] of global `jax.Array`s.

    **Raises:**

    As [`deltanet_cp.data.process_local_data`][].
    """
    local = process_local_data(packed, mesh, layout, data_axis=data_axis, context_axis=context_axis)
    shardings = _shardings(mesh, data_axis, context_axis)
    return PackedRows(
        *(
            jax.make_array_from_process_local_data(s, x, np.shape(full))
            for s, x, full in zip(shardings, local, packed)
        )
    )


def real_tokens(packed: PackedRows, *, cp: ContextParallel | None = None) -> Bool[Array, "..."]:
    """Which tokens of packed rows are real (a document's), not padding: the `token_mask`
    of a mixture-of-experts model's `logits_and_router_stats`, so that the routing
    statistics and the load-balancing loss count real tokens only (transformers'
    `attention_mask`).

    A token is padding if its segment (of `cu_seqlens`) holds no document
    (`document_ids == -1`); prompt tokens are real (they are routed and balanced, though
    they are no targets).

    **Arguments:**

    - `packed`: packed rows: whole rows in sequence order (what
        [`deltanet_cp.data.pack_documents`][] returns), or, inside `jax.shard_map` with
        `cp`, this rank's block of a [`deltanet_cp.data.make_global_batch`][] batch (its
        tokens in `cp.layout`'s order, the global `cu_seqlens` and `document_ids` of its
        rows).
    - `cp`: `None` for whole rows; inside `jax.shard_map`, the
        [`deltanet_cp.ContextParallel`][] the model is called with, for this rank's
        tokens' places in the row.

    **Returns:**

    A boolean array of `packed.tokens`' shape, `True` on the real tokens.

    **Raises:**

    `ValueError` if `cu_seqlens` and `document_ids` do not have the rows of `tokens` and
    one more offset than segments, or if, without `cp`, the rows are not whole (the
    offsets end at another length than the tokens' rows: pass `cp`).
    """
    tokens, cu, ids = packed.tokens, packed.cu_seqlens, packed.document_ids
    rows, length = np.shape(tokens)[:-1], np.shape(tokens)[-1]
    if (
        np.ndim(cu) < 1
        or np.shape(cu)[:-1] != rows
        or np.shape(ids) != (*rows, np.shape(cu)[-1] - 1)
    ):
        raise ValueError(
            f"`packed.cu_seqlens` must be (*rows, segments + 1) and `packed.document_ids` "
            f"(*rows, segments), with the rows of `packed.tokens` {tuple(rows)}; got "
            f"{np.shape(cu)} and {np.shape(ids)}."
        )
    if cp is None:
        try:
            ends = np.unique(np.asarray(cu)[..., -1])
        except jax.errors.TracerArrayConversionError:  # traced: not checked
            ends = np.asarray([length])
        if ends.size and (ends != length).any():
            raise ValueError(
                f"`packed`'s rows hold {length} tokens, but its `cu_seqlens` end at "
                f"{ends.tolist()}: these are not whole rows. For a rank's shard, call "
                "`real_tokens(packed, cp=...)` inside `jax.shard_map`."
            )
        positions = jnp.arange(length)
    else:
        positions = cp.layout.positions(length, cp.axis_name)

    def row(cu, ids):
        segment = jnp.searchsorted(cu, positions, side="right") - 1
        return ids[jnp.clip(segment, 0, ids.shape[0] - 1)] >= 0

    cu, ids = jnp.asarray(cu), jnp.asarray(ids)
    flat = jax.vmap(row)(cu.reshape(-1, cu.shape[-1]), ids.reshape(-1, ids.shape[-1]))
    return flat.reshape(np.shape(tokens))


def _psum(tree: Any, axis_name: AxisNames) -> Any:
    """`jax.lax.psum` of every leaf over `axis_name` (inside `shard_map`), a leaf that does
    not vary over one of the axes (a rank's sum computed from per-row fields only, or an
    axis of size 1 the tokens never met) taken as that rank's own part of the sum."""
    axes = _axes(axis_name)

    def one(x):
        varying = jax.typeof(x).manual_axis_type.varying
        missing = tuple(a for a in axes if a not in varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.lax.psum(jax.tree.map(one, tree), axes)


def _replicated_flag(bad: Array, axis_name: AxisNames) -> Array:
    """`bad` reduced over `axis_name` (inside `shard_map`), the same on every rank."""
    axes = _axes(axis_name)
    if not axes:
        return bad
    flag = bad.astype(jnp.int32)
    varying = jax.typeof(flag).manual_axis_type.varying
    missing = tuple(a for a in axes if a not in varying)
    if missing:
        flag = jax.lax.pcast(flag, missing, to="varying")
    return jax.lax.pmax(flag, axes) > 0


def causal_lm_loss(
    logits: Float[Array, "*batch seq vocab"],
    labels: Shaped[Array, "..."],
    *,
    ignore_index: int = IGNORE_INDEX,
    axis_name: AxisNames = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    r"""The mean token cross entropy over the real targets, and their count.

    $$\mathcal L = \frac{1}{N} \sum_{t:\ \ell_t \ne -100} -\log \mathrm{softmax}(z_t)_{\ell_t},$$

    in float32 whatever the logits' dtype (as transformers' `ForCausalLMLoss` upcasts), with
    $N$ the number of real targets. Inside `jax.shard_map`, pass the axes the batch is split
    over (`axis_name=("dp", "cp")`): each rank's sum and count are added up over them
    (`psum`) before the one division, so every rank returns the loss of the whole batch.
    A batch with no real target has loss 0.

    **Arguments:**

    - `logits`: `(*batch, seq, vocab)` (this rank's, under `shard_map`).
    - `labels`: `(*batch, seq)` integer targets, already shifted (as
        [`deltanet_cp.data.pack_documents`][] makes them): `labels[..., t]` is the target
        of position `t`, or `ignore_index`.
    - `ignore_index`: the label that is no target.
    - `axis_name`: the mesh axis name (or names) to sum over inside `jax.shard_map`;
        `None` on one device (or to keep each rank's own loss).

    **Returns:**

    `(loss, count)`: float32 scalars, the mean and the number of real targets (over all
    the ranks of `axis_name`).

    **Raises:**

    `ValueError` naming `labels` for a shape that is not `logits`' without its last axis,
    or a dtype that is not an integer; a label outside `[0, vocab)` (other than
    `ignore_index`) fails through `equinox.error_if` (on every rank together).
    """
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"`labels` must be an integer array of target ids; got "
            f"{getattr(labels, 'dtype', type(labels).__name__)}."
        )
    if jnp.ndim(logits) < 1 or labels.shape != jnp.shape(logits)[:-1]:
        raise ValueError(
            f"`labels` must have the shape of `logits` without its vocabulary axis, "
            f"{jnp.shape(logits)[:-1]}; got {labels.shape}."
        )
    vocab = logits.shape[-1]
    real = labels != ignore_index
    bad = jnp.any(real & ((labels < 0) | (labels >= vocab)))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(real, labels, 0)[..., None], axis=-1)[..., 0]
    total = -jnp.sum(jnp.where(real, picked, 0.0))
    count = jnp.sum(real, dtype=jnp.float32)
    if _axes(axis_name):
        total, count = _psum((total, count), axis_name)
    msg = (
        f"`labels` must lie in [0, {vocab}) (the vocabulary) or equal ignore_index={ignore_index}."
    )
    total = total + eqx.error_if(jnp.zeros((), jnp.float32), _replicated_flag(bad, axis_name), msg)
    return total / jnp.maximum(count, 1.0), count


def chunked_causal_lm_loss(
    hidden: Float[Array, "*batch seq dim"],
    weight: Float[Array, "vocab dim"],
    labels: Shaped[Array, "..."],
    *,
    chunk_size: int,
    ignore_index: int = IGNORE_INDEX,
    axis_name: AxisNames = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    r"""[`causal_lm_loss`][deltanet_cp.data.causal_lm_loss] of the logits
    `hidden @ weight.T`, computed `chunk_size` tokens at a time so that the
    `(tokens, vocab)` logits are never held.

    The LM head, the log-softmax and the picked targets run in a `jax.lax.scan` over chunks
    of `chunk_size` positions; each chunk's logits are recomputed in the backward
    (`jax.checkpoint`), so the loss and its gradient hold one chunk's `(chunk_size, vocab)`
    logits at a time instead of every token's: at a 151,936-word vocabulary the float32
    logits and their gradient are about 1.2 MiB per token. The price is one more product
    with the head (the recomputed logits). The value is `causal_lm_loss`'s on the full
    logits computed in float32 (at least): the products of `hidden` and `weight` in their
    dtype are accumulated and kept in float32, not rounded to a bfloat16 operands' dtype
    first (as a bfloat16 model's own logits are). The head's gradient is summed over the
    chunks in float32 (at least) and cast back to `weight`'s dtype once.

    Get `hidden` (the last hidden states after the final norm) and `weight` (the LM head's,
    the embedding's if tied) from a model's `hidden_states` and `head_weight`.

    **Arguments:**

    - `hidden`: `(*batch, seq, dim)` hidden states (this rank's, under `shard_map`).
    - `weight`: `(vocab, dim)`, the LM head's weight: the logits are `hidden @ weight.T`.
    - `labels`: `(*batch, seq)` integer targets, already shifted, or `ignore_index` (as
        for `causal_lm_loss`).
    - `chunk_size`: the positions per chunk; it must divide `seq`. Memory falls with it,
        down to where one chunk's product no longer fills the device.
    - `ignore_index`: the label that is no target.
    - `axis_name`: the mesh axis name (or names) to sum over inside `jax.shard_map`;
        `None` on one device.

    **Returns:**

    `(loss, count)`: float32 scalars, as `causal_lm_loss`'s.

    **Raises:**

    `ValueError` naming the argument: `labels` not integer or not of `hidden`'s shape
    without its last axis; `weight` not `(vocab, dim)` with `hidden`'s `dim`; a
    `chunk_size` that is not a positive integer dividing `seq`. A label outside
    `[0, vocab)` (other than `ignore_index`) fails through `equinox.error_if`.
    """
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"`labels` must be an integer array of target ids; got "
            f"{getattr(labels, 'dtype', type(labels).__name__)}."
        )
    if jnp.ndim(hidden) < 2 or labels.shape != jnp.shape(hidden)[:-1]:
        raise ValueError(
            f"`labels` must have the shape of `hidden` without its last axis (`hidden` is "
            f"`(*batch, seq, dim)`), {jnp.shape(hidden)[:-1]}; got {labels.shape}."
        )
    dim = hidden.shape[-1]
    if jnp.ndim(weight) != 2 or weight.shape[1] != dim:
        raise ValueError(
            f"`weight` must be the LM head's `(vocab, dim)` with dim={dim} (`hidden`'s last "
            f"axis); got {jnp.shape(weight)}."
        )
    seq = hidden.shape[-2]
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int | np.integer)
        or chunk_size < 1
        or seq % chunk_size
    ):
        raise ValueError(
            f"`chunk_size` must be a positive integer dividing the sequence length {seq} "
            f"(`hidden`'s second-to-last axis); got {chunk_size!r}."
        )
    chunk_size = int(chunk_size)
    vocab = weight.shape[0]
    real = labels != ignore_index
    bad = jnp.any(real & ((labels < 0) | (labels >= vocab)))
    count = jnp.sum(real, dtype=jnp.float32)
    # Chunks of the flattened positions: a chunk never crosses a row (it divides `seq`).
    h = hidden.reshape(-1, chunk_size, dim)
    y = jnp.where(real, labels, 0).reshape(-1, chunk_size)
    r = real.reshape(-1, chunk_size)
    # The head's gradient is summed over the chunks in this dtype, then cast back once.
    wide = jnp.finfo(weight.dtype).bits >= 32
    master = weight.astype(weight.dtype if wide else jnp.float32)

    @jax.checkpoint
    def chunk(w, h, y, r):
        z = jnp.matmul(h, w.astype(weight.dtype).T, preferred_element_type=master.dtype)
        z = z.astype(jnp.float32)
        picked = jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]
        nll = jax.nn.logsumexp(z, axis=-1) - picked
        return jnp.sum(jnp.where(r, nll, 0.0))

    total = jnp.sum(jax.lax.map(lambda xs: chunk(master, *xs), (h, y, r)))
    if _axes(axis_name):
        total, count = _psum((total, count), axis_name)
    msg = (
        f"`labels` must lie in [0, {vocab}) (the vocabulary) or equal ignore_index={ignore_index}."
    )
    total = total + eqx.error_if(jnp.zeros((), jnp.float32), _replicated_flag(bad, axis_name), msg)
    return total / jnp.maximum(count, 1.0), count


def add_router_loss(
    loss: Float[Array, ""],
    stats: RouterStats,
    coefficient: float,
    *,
    axis_name: AxisNames = None,
) -> Float[Array, ""]:
    """`loss` plus a mixture-of-experts model's load-balancing loss, as transformers adds it.

    transformers' MoE models (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE) compute
    `aux_loss = load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`
    over every layer's routing of every token of the batch together and return
    `loss + router_aux_loss_coef * aux_loss`, the padding left out through the
    `attention_mask`. Here the routing's sums (a [`deltanet_cp.nn.RouterStats`][], from a
    model's `logits_and_router_stats`, with `token_mask=real_tokens(...)` to leave the
    padding out) are
    summed over any leading batch axes (a `jax.vmap` over rows) and, inside
    `jax.shard_map`, over `axis_name` (every rank's tokens), before
    [`deltanet_cp.nn.load_balancing_loss`][] normalises them once.

    **Arguments:**

    - `loss`: the language-model loss, e.g. [`deltanet_cp.data.causal_lm_loss`][]'s.
    - `stats`: the routing statistics, `(*batch, experts)` counts and probabilities.
    - `coefficient`: the weight, a config's `router_aux_loss_coef`.
    - `axis_name`: the mesh axes to sum the statistics over inside `jax.shard_map`.

    **Returns:**

    `loss + coefficient * load_balancing_loss(stats)`, a float32 scalar.
    """
    stats = RouterStats(
        counts=stats.counts.reshape(-1, stats.counts.shape[-1]).sum(0),
        probabilities=stats.probabilities.reshape(-1, stats.probabilities.shape[-1]).sum(0),
        tokens=jnp.sum(stats.tokens),
    )
    if _axes(axis_name):
        stats = _psum(stats, axis_name)
    return loss + coefficient * load_balancing_loss(stats)


def mtp_labels(
    labels: Shaped[Array, "..."],
    depth: int = 1,
    *,
    cp: ContextParallel | None = None,
    cu_seqlens: Any = None,
    ignore_index: int = IGNORE_INDEX,
) -> Int[Array, "depth seq"]:
    """The targets of a multi-token-prediction head's logits (a model's `logits_and_mtp`),
    from one row's labels: at depth `k` and position `t`, the target of token `t + 2 + k`,
    `labels[t + 1 + k]` if positions `t .. t + 1 + k` lie in one document, else
    `ignore_index` (no target across a document's end; a prompt or padding label stays
    ignored).

    The labels are moved one token per depth with the next-token shift the model's head
    applies to the tokens: under `cp` the first label of the next piece crosses from the
    rank that holds it (inside `jax.shard_map`, either layout). One row, as the model
    takes one sequence: `jax.vmap` it over the rows and their `cu_seqlens`.

    **Arguments:**

    - `labels`: `(seq,)` integer targets, already shifted (as
        [`deltanet_cp.data.pack_documents`][] makes them); with `cp`, this rank's shard.
    - `depth`: the head's depths, its config's `mtp_num_hidden_layers`.
    - `cp`: a [`deltanet_cp.ContextParallel`][] without `mesh`, or `None` on one device.
    - `cu_seqlens`: the row's packed documents (global offsets), as the model takes them.
    - `ignore_index`: the label that is no target.

    **Returns:**

    `(depth, seq)`, the labels of `mtp_logits` (`(depth, seq, vocab)`).

    **Raises:**

    `ValueError` naming `labels` unless it is a 1-D integer array, or `depth` unless it is
    an int at least 1.
    """
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"`labels` must be an integer array of target ids; got "
            f"{getattr(labels, 'dtype', type(labels).__name__)}."
        )
    if jnp.ndim(labels) != 1:
        raise ValueError(
            f"`labels` must be one row, `(seq,)`; got shape {jnp.shape(labels)}. `jax.vmap` "
            "over the rows (and their `cu_seqlens`)."
        )
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"`depth` must be an int at least 1; got {depth!r}.")
    out, current = [], jnp.asarray(labels)
    for _ in range(depth):
        current = next_tokens(current[None], cp=cp, cu_seqlens=cu_seqlens, fill=ignore_index)[0]
        out.append(current)
    return jnp.stack(out)


def add_mtp_loss(
    loss: Float[Array, ""],
    mtp_logits: Float[Array, "*batch depth seq vocab"],
    labels: Shaped[Array, "..."],
    weight: float,
    *,
    ignore_index: int = IGNORE_INDEX,
    axis_name: AxisNames = None,
) -> Float[Array, ""]:
    r"""`loss` plus a multi-token-prediction head's loss with its weight.

    $$\mathcal L + \frac{\lambda}{D} \sum_{k=0}^{D-1} \mathcal L_k,$$

    with $\mathcal L_k$ depth $k$'s mean token cross entropy over its real targets
    ([`deltanet_cp.data.causal_lm_loss`][]: float32, summed over `axis_name` inside
    `jax.shard_map` before the division) and $\lambda$ the `weight` (DeepSeek-V3's
    multi-token-prediction loss; its $\lambda$ was 0.3, then 0.1).

    **Arguments:**

    - `loss`: the language-model loss, e.g. [`deltanet_cp.data.causal_lm_loss`][]'s.
    - `mtp_logits`: a model's `logits_and_mtp` head logits, `(*batch, depth, seq, vocab)`.
    - `labels`: their targets, `(*batch, depth, seq)`, from
        [`deltanet_cp.data.mtp_labels`][].
    - `weight`: $\lambda$, at least 0.
    - `ignore_index`, `axis_name`: as for [`deltanet_cp.data.causal_lm_loss`][].

    **Returns:**

    A float32 scalar.

    **Raises:**

    `ValueError` naming `weight` if negative, or `labels` if its shape is not
    `mtp_logits`' without the vocabulary axis (or they have no depth axis).
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ValueError(f"`weight` must be a number at least 0; got {weight!r}.")
    if jnp.ndim(mtp_logits) < 3 or jnp.shape(labels) != jnp.shape(mtp_logits)[:-1]:
        raise ValueError(
            "`labels` must have the shape of `mtp_logits` `(*batch, depth, seq, vocab)` "
            f"without its vocabulary axis, {jnp.shape(mtp_logits)[:-1]}; got "
            f"{jnp.shape(labels)}."
        )
    depth = mtp_logits.shape[-3]
    total = jnp.zeros((), jnp.float32)
    for k in range(depth):
        part, _ = causal_lm_loss(
            mtp_logits[..., k, :, :],
            labels[..., k, :],
            ignore_index=ignore_index,
            axis_name=axis_name,
        )
        total = total + part
    return loss + weight * total / depth
