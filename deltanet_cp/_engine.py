"""The generic chunked-recurrence engine: what a recurrence provides, and `run`.

A recurrence is a static configuration (chunk size, scale, flags); its inputs are a PyTree
handed to [`deltanet_cp.run`][] beside it, the way `lineax.linear_solve(operator, vector,
solver)` keeps the solver apart from the problem. One entry serves one device, packed
documents and context parallelism; padding, chunking and packing happen here, once.
"""

import abc
import dataclasses
import functools as ft
from typing import Any, cast, Generic, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._affine import AbstractAffineMap
from ._chunking import num_chunks, split_chunks
from ._exchange import _position, AbstractExchange, as_exchange, ExchangeName
from ._layout import (
    check_contiguous,
    check_layout,
    Contiguous,
    ContiguousLayout,
    from_zigzag,
    Layout,
    to_zigzag,
    Zigzag,
    zigzag_half,
)
from ._mesh import mesh_to_run_on
from ._packing import as_cu_seqlens, pack, segments, unpack
from ._passes import Blocks, context_parallel, local
from ._validate import check_inputs


_Inputs = TypeVar("_Inputs")
_Factors = TypeVar("_Factors")
_Map = TypeVar("_Map", bound=AbstractAffineMap)


class AbstractRecurrence(eqx.Module, Generic[_Inputs, _Factors, _Map]):
    r"""A linear recurrence whose chunks act on the state as affine maps $h \mapsto M h + U$.

    An instance is a static configuration (chunk size and the like); it holds no data.
    [`deltanet_cp.run`][] hands it the inputs, a PyTree whose array leaves all have the
    batch on axis 0 and time on axis 1. Every method below is one the engine calls:

    - `state(inputs)`: the shape and dtype of the recurrent state;
    - `prepare(chunks)`: everything that does not depend on the incoming state, batched
        over a block of chunks (chunk-parallel, outside the sequential path);
    - `step(factors, h)`: one chunk, from its incoming state to its outgoing state and
        outputs: the state recursion, the only part that walks the chunks one by one;
    - `chunk_map(factors)`: one chunk as an explicit affine map (context parallelism);
    - `compose(factors, running)`: a chunk appended to a running map; the default forms
        `chunk_map`, a recurrence overrides it where a cheaper form exists;
    - `finalize(outputs, inputs)`: the assembled outputs in the public layout;
    - `check(inputs)`: optional input validation (the default checks nothing).

    The engine differentiates the passes by hand: it keeps the state entering each chunk,
    and in the backward forms each block's factors again, walks the chunks in reverse
    carrying only the state's cotangent (`step`'s VJP in `h`), and then forms every
    factor's cotangent batched over the block (`step`'s VJP in its factors) and pulls it
    back through `prepare`. So `step` must be affine in `h`; what it does with the
    factors is free.

    The engine pads the time axis with zeros to whole chunks: a token whose inputs are all
    zero must leave the state unchanged.
    """

    chunk_size: eqx.AbstractVar[int]

    def __check_init__(self):
        c = self.chunk_size
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"`chunk_size` must be a positive int; got {c!r}.")

    def check(self, inputs: _Inputs) -> None:
        """Raise a `ValueError` that names the problem if `inputs` don't fit together."""

    @abc.abstractmethod
    def state(self, inputs: _Inputs) -> jax.ShapeDtypeStruct:
        """The shape and dtype of the recurrent state, e.g. `(B, HV, K, V)` in float32.

        The last two axes are the `(K, V)` that affine maps act on; the first is the batch.
        """

    @abc.abstractmethod
    def prepare(self, chunks: _Inputs) -> _Factors:
        """Per-chunk factors that do not depend on the incoming state, for many chunks.

        **Arguments:**

        - `chunks`: a block of the inputs: every array leaf's time axis zero-padded to
            whole chunks and split, `(B, T, *rest)` becoming `(B, N, C, *rest)` with `N`
            the chunks of the block.

        **Returns:**

        A PyTree whose every leaf has the chunk index as its leading axis (`N`).
        """

    @abc.abstractmethod
    def step(self, factors: _Factors, h: Array) -> tuple[Array, PyTree]:
        """Advance the state over one chunk and emit the chunk's outputs.

        Affine in `h`. Keep it to the state recursion: everything that does not need `h`
        belongs in `prepare`, which runs batched over chunks.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.
        - `h`: the state entering the chunk.

        **Returns:**

        `(h_next, outputs)`, the outputs a PyTree of arrays with the batch on axis 0 and
        the chunk's `C` positions on axis 1.
        """

    @abc.abstractmethod
    def chunk_map(self, factors: _Factors) -> _Map:
        r"""One chunk as an explicit affine map of the incoming state.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.

        **Returns:**

        The map $h \mapsto M h + U$ with `chunk_map(factors)(h) == step(factors, h)[0]`.
        """

    def compose(self, factors: _Factors, running: _Map) -> _Map:
        """Append one chunk to a running map: `running.then(chunk_map(factors))`.

        Override it where the chunk's structure avoids forming the dense chunk map (a
        low-rank update, a diagonal).

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.
        - `running`: the map of the chunks before it.

        **Returns:**

        The map of the chunks before it and this one, of the same type as `running`.
        """
        return running.then(self.chunk_map(factors))  # pyright: ignore[reportReturnType]

    @abc.abstractmethod
    def finalize(self, outputs: PyTree, inputs: _Inputs) -> PyTree:
        """Turn the assembled outputs of `step` into the public outputs (their dtype, say).

        **Arguments:**

        - `outputs`: the outputs of `step` for every token, time on axis 1, in token
            order (padding cut, packed documents put back).
        - `inputs`: the inputs, as handed to [`deltanet_cp.run`][].

        **Returns:**

        The public outputs.
        """


@overload
def run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    output_final_state: Literal[True],
    cu_seqlens: Any = None,
    axis_name: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    block_size: int | None = None,
) -> tuple[PyTree, Array]: ...


@overload
def run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    axis_name: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    block_size: int | None = None,
) -> tuple[PyTree, Array | None]: ...


def run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    axis_name: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    block_size: int | None = None,
) -> tuple[PyTree, Array | None]:
    """Run a chunked recurrence: on one device, over packed documents, context-parallel.

    On one device (`axis_name=None`) this is one pass over the chunks. With `axis_name`, it
    is called inside `jax.shard_map`, `inputs` holding this rank's shard of the sequence,
    and runs the three phases of context parallelism:

    1. a local pass from a zero state, composing the chunks into this rank's map;
    2. the exchange of maps: the state entering this rank;
    3. a local pass again from the true incoming state, emitting outputs.

    The phases run in [`deltanet_cp.run_contiguous`][], over contiguous, in-order slices
    only. A [`deltanet_cp.Contiguous`][] shard is one such slice. A
    [`deltanet_cp.Zigzag`][] shard is two: the first pieces of all ranks are the first half
    of the sequence, in rank order; the second pieces are the second half, in *reverse*
    rank order. So a zigzag shard is two calls, the second walking the ranks from the
    last to the first and starting from the state the first one ends in.

    Differentiated by hand: the forward keeps one state per chunk, and the backward is
    three phases again, the exchange walking the ranks the other way (see the concept
    page "The three phases").

    Compiled once per input shape and configuration (`equinox.filter_jit`); inside a
    caller's `jit` or `shard_map` it is inlined.

    **Arguments:**

    - `recurrence`: the configuration, an [`deltanet_cp.AbstractRecurrence`][].
    - `inputs`: a PyTree of arrays with batch on axis 0 and time on axis 1 (`None` leaves
        are allowed).
    - `initial_state`: the state before the first token (replicated under context
        parallelism); zeros if `None`. With `cu_seqlens`, one per document, stacked.
    - `output_final_state`: also return the state after the last token (under context
        parallelism, the global one, on every rank).
    - `cu_seqlens`: packed documents (batch size 1): the *global* document offsets
        `[0, len_0, len_0 + len_1, ..., T]`, in sequence order whatever the layout, a list
        or an int array of shape `(N + 1,)`, the same on every rank. The state resets at
        each document start, no chunk mixes two documents, documents may cross rank and
        piece boundaries, and the initial and final states are per document.
    - `axis_name`: the mesh axis the sequence is sharded over, or `None` on one device.
    - `layout`: how the sequence is laid out over `axis_name`: [`deltanet_cp.Contiguous`][]
        (the default) or [`deltanet_cp.Zigzag`][] (the local length must then be even).
        Ignored on one device.
    - `exchange`: how ranks exchange their maps: [`deltanet_cp.AllGather`][],
        [`deltanet_cp.PPermute`][], [`deltanet_cp.Ring`][], [`deltanet_cp.Auto`][], or the
        shorthands `"allgather"`, `"ppermute"`, `"ring"`, `"auto"`.
    - `block_size`: tokens whose chunk factors are formed together (rounded down to whole
        chunks). Larger blocks mean fewer, larger batched operations and fewer sequential
        steps outside the state recursion; smaller blocks bound the memory of the factors.
        A slice of at most `block_size` tokens is one block with no loop around its factor
        work. `None` takes [`deltanet_cp.default_block_size`][].

    **Returns:**

    `(outputs, final_state)`: outputs in the recurrence's public layout (this rank's tokens,
    in the layout's order, under context parallelism), and the final state or `None`.
    """
    check_inputs(recurrence, inputs)
    check_layout(layout)
    packed = cu_seqlens is not None
    if packed:
        batch, length = _batch_and_length(inputs)
        total = length if axis_name is None else length * jax.lax.axis_size(axis_name)
        cu_seqlens = as_cu_seqlens(cu_seqlens, batch, total)
    # With packed documents, `initial_state` holds the documents' initial states.
    h0, doc_h0 = (None, initial_state) if packed else (initial_state, None)
    engine = ft.partial(
        run_contiguous,
        recurrence,
        axis_name=axis_name,
        exchange=exchange,
        cu_seqlens=cu_seqlens,
        document_states=doc_h0,
        block_size=block_size,
    )
    if axis_name is None or isinstance(layout, Contiguous):
        outputs, final, finals = engine(
            inputs, initial_state=h0, output_final_state=output_final_state and not packed
        )
    else:
        # The first pieces in rank order, then the second pieces in reverse rank order from
        # the state the first ones end in (on every rank).
        _, length = _batch_and_length(inputs)
        half = zigzag_half(length)
        first, second = (
            jax.tree.map(lambda x: x[:, part], inputs)
            for part in (slice(None, half), slice(half, None))
        )
        out_first, middle, finals_first = engine(first, initial_state=h0, output_final_state=True)
        out_second, final, finals_second = engine(
            second,
            initial_state=middle,
            output_final_state=output_final_state and not packed,
            start=jax.lax.axis_size(axis_name) * half,
            reverse=True,
        )
        outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), out_first, out_second)
        finals = None
        if finals_first is not None and finals_second is not None:
            finals = finals_first + finals_second
    if not output_final_state:
        return outputs, None
    if packed:
        assert finals is not None
        final = finals if axis_name is None else jax.lax.psum(finals, axis_name)
    return outputs, final


def run_contiguous(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    layout: ContiguousLayout = Contiguous(),
    axis_name: str | None = None,
    exchange: AbstractExchange | ExchangeName = "allgather",
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    document_states: Array | None = None,
    start: int = 0,
    reverse: bool = False,
    block_size: int | None = None,
) -> tuple[PyTree, Array | None, Array | None]:
    """The engine: the three phases over one contiguous, in-order slice per rank.

    Every context-parallel function of the library ends here, once per contiguous slice:
    once for a [`deltanet_cp.Contiguous`][] shard, twice for a [`deltanet_cp.Zigzag`][]
    one (see [`deltanet_cp.run`][]). It accepts `layout=Contiguous()` and nothing else: a
    `Zigzag` is a pyright error and a `ValueError`, since reading a zigzag shard as one
    slice would compose its two pieces as if they were adjacent.

    The ranks' slices, in rank order (or in reverse rank order with `reverse=True`), are
    consecutive tokens `[start, start + cp * length)` of the sequence.

    **Arguments:**

    - `recurrence`, `inputs`, `axis_name`, `exchange`: as in [`deltanet_cp.run`][].
    - `layout`: must be [`deltanet_cp.Contiguous`][].
    - `initial_state`: the state entering the first slice (replicated); zeros if `None`.
    - `output_final_state`: also return the state after the last slice, on every rank.
    - `cu_seqlens`: packed documents, as in [`deltanet_cp.run`][]: the global offsets of
        the whole sequence (which may extend past this run of slices).
    - `document_states`: with `cu_seqlens`, the documents' initial states, stacked
        `(num_docs, *state.shape[1:])`; zeros if `None`.
    - `start`: the sequence position of the first slice's first token.
    - `reverse`: the last rank holds the first slice and rank 0 the last.
    - `block_size`: as in [`deltanet_cp.run`][].

    **Returns:**

    `(outputs, final_state, document_finals)`: this rank's outputs; the state after the
    last token of the last slice (or `None`); and, with `cu_seqlens`, the final states of
    the documents that end in this rank's slice, `(num_docs, *state.shape[1:])`, zeros for
    the others (sum them over ranks for every document's), else `None`.
    """
    check_inputs(recurrence, inputs)
    check_contiguous(layout)
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"`start` must be a non-negative int; got {start!r}.")
    if block_size is not None and (
        not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1
    ):
        raise ValueError(f"`block_size` must be a positive int or None; got {block_size!r}.")
    exchange = as_exchange(exchange)
    if cu_seqlens is not None:
        batch, length = _batch_and_length(inputs)
        walk = length if axis_name is None else length * jax.lax.axis_size(axis_name)
        cu_seqlens = as_cu_seqlens(cu_seqlens, batch, start + walk, at_least=True)
    elif document_states is not None:
        raise ValueError("`document_states` are per document: pass `cu_seqlens` too.")
    return _run(
        recurrence,
        inputs,
        initial_state,
        cu_seqlens,
        document_states,
        output_final_state=output_final_state,
        axis_name=axis_name,
        exchange=exchange,
        start=start,
        reverse=reverse,
        block_size=block_size,
    )


@eqx.filter_jit
def _run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    initial_state: Array | None,
    cu_seqlens: Array | None,
    document_states: Array | None,
    *,
    output_final_state: bool,
    axis_name: str | None,
    exchange: AbstractExchange,
    start: int,
    reverse: bool,
    block_size: int | None,
) -> tuple[PyTree, Array | None, Array | None]:
    recurrence.check(inputs)
    state = recurrence.state(inputs)
    _, length = _batch_and_length(inputs)
    # A chunk longer than the slice only pads: cap it at the slice rounded up to a power of
    # two (T = 50 with chunk_size=16384 forms chunks of 64, not of 16384 mostly padding).
    c = min(recurrence.chunk_size, 1 << max(0, length - 1).bit_length())
    h0 = _initial_state(state, initial_state)
    per_block = _chunks_per_block(block_size, c)
    # A non-finite input must not reach earlier tokens through the chunk's products (a zero
    # times NaN is NaN): the chunk is formed from zeros there, and NaN is added back to the
    # outputs from the first such token of the chunk on and to the state leaving it.
    log_decays = _log_decay_leaves(inputs)
    bad = _non_finite(inputs, log_decays)
    if cu_seqlens is None:
        seg, doc_states = None, None
        blocks = Blocks.of(num_chunks(length, c), c, per_block, log_decays)
        chunks = _split(inputs, blocks.padded, c)
        bad = _split(bad, blocks.padded, c)
        marks = None
    else:
        offset = start
        if axis_name is not None:
            offset = offset + _position(axis_name, reverse) * length
        seg = segments(cu_seqlens, length, c, offset)
        doc_states = _doc_states(state, seg.num_docs, document_states)
        blocks = Blocks.of(seg.num_chunks, c, per_block, log_decays)
        chunks = _split(jax.tree.map(lambda x: pack(x, seg), inputs), blocks.padded, c)
        bad = _split(pack(bad, seg), blocks.padded, c)
        pad = (0, blocks.padded - blocks.n)
        marks = (
            jnp.pad(seg.start_doc, pad, constant_values=-1),
            jnp.pad(seg.end_doc, pad, constant_values=-1),
            seg.empty_doc,
        )
    diff, static = eqx.partition(chunks, eqx.is_inexact_array)
    nan = jnp.asarray(jnp.nan, state.dtype)
    zero = jnp.zeros((), state.dtype)
    poison = jnp.where(jnp.any(bad, axis=2).T, nan, zero)  # (chunks, B)
    if axis_name is None:
        out = local(recurrence, blocks, diff, static, h0, marks, doc_states, poison)
    else:
        out = context_parallel(
            recurrence,
            blocks,
            exchange,
            axis_name,
            output_final_state,
            reverse,
            diff,
            static,
            h0,
            marks,
            doc_states,
            poison,
        )
    outputs, final, finals = cast(tuple[PyTree, Any, Any], out)
    after_bad = (jnp.cumsum(bad, axis=2) > 0).reshape(bad.shape[0], -1)  # (B, padded * C)

    def poisoned(y):
        mask = after_bad.reshape(after_bad.shape + (1,) * (y.ndim - 2))
        return jnp.where(mask, jnp.asarray(jnp.nan, y.dtype), y)

    outputs = jax.tree.map(poisoned, outputs)
    if seg is None:
        outputs = jax.tree.map(lambda y: y[:, :length], outputs)
    else:
        outputs = jax.tree.map(lambda y: unpack(y, seg), outputs)
        finals = finals[:, 0]
    outputs = recurrence.finalize(outputs, inputs)
    return outputs, (final if output_final_state else None), finals


def default_block_size() -> int:
    """The tokens per block [`deltanet_cp.run`][] uses when `block_size` is `None`.

    Chosen per backend from measurements of the training step at Qwen3-Next's head sizes
    (see the benchmarks page): the largest block whose factor memory stays within the
    temporaries budget.
    """
    return _DEFAULT_BLOCK_SIZE.get(jax.default_backend(), _DEFAULT_BLOCK_SIZE["cpu"])


_DEFAULT_BLOCK_SIZE = {"cpu": 1024, "gpu": 1024, "tpu": 1024}


def _chunks_per_block(block_size: int | None, chunk_size: int) -> int:
    return max(1, (default_block_size() if block_size is None else block_size) // chunk_size)


def _batch_and_length(inputs: PyTree) -> tuple[int, int]:
    leaves = jax.tree.leaves(inputs)
    if not leaves or any(getattr(x, "ndim", 0) < 2 for x in leaves):
        raise ValueError("The inputs must be arrays with the batch on axis 0 and time on axis 1.")
    sizes = {x.shape[:2] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(
            f"Every input must have the same (batch, seq) on axes 0 and 1; got {sorted(sizes)}."
        )
    (batch, length) = sizes.pop()
    return batch, length


def _non_finite(inputs: PyTree, log_decays: tuple[bool, ...]) -> Array:
    """`(B, T)`: whether any floating input of the token is NaN or infinite (`-inf` in a
    log decay excepted: a decay of zero, which the recurrences take as it is).

    A field of an inputs module declared with `eqx.field(metadata={"log_decay": True})` is
    a log decay.
    """
    batch, length = _batch_and_length(inputs)
    bad = jnp.zeros((batch, length), bool)
    for x, decay in zip(jax.tree.leaves(inputs), log_decays):
        if eqx.is_inexact_array(x):
            wrong = jnp.isnan(x) | (x == jnp.inf)
            if not decay:
                wrong = wrong | (x == -jnp.inf)
            bad = bad | jnp.any(wrong.reshape(batch, length, -1), axis=2)
    return bad


def _log_decay_leaves(inputs: PyTree) -> tuple[bool, ...]:
    """Per leaf of `inputs` (flattened), whether its field is declared a log decay."""
    leaves = jax.tree.leaves(inputs)
    if not dataclasses.is_dataclass(inputs):
        return (False,) * len(leaves)
    flags = []
    for f in dataclasses.fields(inputs):
        n = len(jax.tree.leaves(getattr(inputs, f.name)))
        flags += [bool(f.metadata.get("log_decay", False))] * n
    if len(flags) != len(leaves):  # not a plain module of array fields: no log decays
        return (False,) * len(leaves)
    return tuple(flags)


def _split(inputs: PyTree, n: int, c: int) -> PyTree:
    return jax.tree.map(lambda x: split_chunks(x, n, c), inputs)


def _initial_state(state: jax.ShapeDtypeStruct, initial_state: Array | None) -> Array:
    if initial_state is None:
        return jnp.zeros(state.shape, state.dtype)
    if initial_state.shape != state.shape:
        raise ValueError(
            f"`initial_state` must have shape {state.shape} (batch, value heads, K, V); got "
            f"{initial_state.shape}."
        )
    return initial_state.astype(state.dtype)


def _doc_states(state: jax.ShapeDtypeStruct, num_docs: int, initial_state: Array | None):
    """Each document's initial state, `(num_docs, 1, *state[1:])`."""
    shape = (num_docs, *state.shape)
    if initial_state is None:
        return jnp.zeros(shape, state.dtype)
    if initial_state.shape != (num_docs, *state.shape[1:]):
        raise ValueError(
            f"With `cu_seqlens` the initial states are per document: `initial_state` must "
            f"have shape {(num_docs, *state.shape[1:])}; got {initial_state.shape}."
        )
    return initial_state[:, None].astype(state.dtype)


def run_sharded(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    block_size: int | None = None,
) -> tuple[PyTree, Array | None]:
    """[`deltanet_cp.run`][] with context parallelism on global arrays: does the `shard_map`.

    Shards the time axis of the inputs over `axis_name` of `mesh` (and optionally the batch
    axis over `batch_axis`), runs the three phases and returns global arrays. Compiled once
    per input shapes, configuration and mesh: a second call with new values does not trace
    again. Use it at the top level; inside your own `shard_map`, call `run` directly.

    **Arguments:**

    - `recurrence`, `inputs`, `initial_state`, `output_final_state`, `cu_seqlens`,
        `exchange`, `block_size`: as in [`deltanet_cp.run`][], with global arrays in
        sequence order. The sequence length must be divisible by the size of `axis_name`
        (by twice it under `Zigzag`).
    - `layout`: [`deltanet_cp.Contiguous`][] or [`deltanet_cp.Zigzag`][]. Under `Zigzag`
        the arrays are permuted with [`deltanet_cp.to_zigzag`][] on the way in and back
        with [`deltanet_cp.from_zigzag`][] on the way out (two reorders of the sharded
        arrays); in a training loop, keep the data in zigzag order instead and call
        [`deltanet_cp.run`][] inside your own `shard_map`.
    - `mesh`: a `jax.sharding.Mesh` with an axis named `axis_name`.
    - `axis_name`: the mesh axis to shard the sequence over.
    - `batch_axis`: optionally, a mesh axis to shard the batch over (data parallelism).

    **Returns:**

    `(outputs, final_state)` as global arrays.
    """
    check_inputs(recurrence, inputs)
    check_layout(layout)
    exchange = as_exchange(exchange)
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}.")
    mesh = mesh_to_run_on(mesh)
    recurrence.check(inputs)
    batch, length = _batch_and_length(inputs)
    cp = mesh.shape[axis_name]
    pieces = cp if isinstance(layout, Contiguous) else 2 * cp
    if length % pieces:
        raise ValueError(
            f"The sequence length ({length}) must be divisible by {pieces} (mesh axis "
            f"{axis_name!r} has {cp} devices, and layout={layout!r} cuts the sequence into "
            f"{pieces} pieces): pad the sequence to a multiple of {pieces} (for example with "
            "g = 0, beta = 0 and zero q, k, v, which leaves the state unchanged) or pick a "
            "cp that divides it."
        )
    if cu_seqlens is not None:
        if batch_axis is not None:
            raise ValueError(
                "`cu_seqlens` packs documents into a batch of one: it cannot be combined with "
                "`batch_axis`."
            )
        cu_seqlens = as_cu_seqlens(cu_seqlens, batch, length)
    P = jax.sharding.PartitionSpec
    seq, state = P(batch_axis, axis_name), P(batch_axis if cu_seqlens is None else None)

    def place(tree, spec):
        return jax.tree.map(
            lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)), tree
        )

    return _sharded(
        recurrence,
        place(inputs, seq),
        place(initial_state, state),
        place(cu_seqlens, P()),
        output_final_state=output_final_state,
        mesh=mesh,
        axis_name=axis_name,
        specs=(seq, state),
        exchange=exchange,
        layout=layout,
        block_size=block_size,
    )


@eqx.filter_jit
def _sharded(
    recurrence,
    inputs,
    initial_state,
    cu_seqlens,
    *,
    output_final_state,
    mesh,
    axis_name,
    specs,
    exchange,
    layout,
    block_size,
):
    seq, state = specs
    P = jax.sharding.PartitionSpec
    zigzag = isinstance(layout, Zigzag)
    cp = mesh.shape[axis_name]

    def per_rank(inputs, initial_state, cu_seqlens):
        return run(
            recurrence,
            inputs,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            axis_name=axis_name,
            layout=layout,
            exchange=exchange,
            block_size=block_size,
        )

    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(seq, state, P()),
        out_specs=(seq, state if output_final_state else None),
    )
    if zigzag:
        inputs = jax.tree.map(lambda x: to_zigzag(x, cp, axis=1), inputs)
    outputs, final = fn(inputs, initial_state, cu_seqlens)
    if zigzag:
        outputs = jax.tree.map(lambda y: from_zigzag(y, cp, axis=1), outputs)
    return outputs, final
