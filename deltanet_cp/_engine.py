"""The generic chunked-recurrence engine: what a recurrence provides, and the passes over it."""

import abc
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._affine import AbstractAffineMap
from ._exchange import choose_strategy, exchange, STRATEGIES
from ._layout import check_contiguous
from ._packing import check_cu_seqlens, pack, Segments, segments, unpack


_Factors = TypeVar("_Factors")
_Map = TypeVar("_Map", bound=AbstractAffineMap)


class AbstractChunkedRecurrence(eqx.Module, Generic[_Factors, _Map]):
    r"""A linear recurrence whose chunks act on the state as affine maps $h \mapsto M h + U$.

    An instance holds one call's inputs. The engine drives it through three pieces:
    **prepare** (everything that does not depend on the incoming state, for all chunks at
    once), a **chunk step** (with or without outputs) and **finalize**. Context parallelism
    additionally needs each chunk's map composed into a running map, which an instance
    provides in whatever cheap form its structure allows (low rank, diagonal, ...).

    Subclasses must be final and must keep every input that depends on the sequence in
    its own fields; the engine never looks inside them.
    """

    chunk_size: eqx.AbstractVar[int]

    @abc.abstractmethod
    def state_shape(self) -> tuple[int, ...]:
        """The shape of the recurrent state, e.g. `(batch, value_heads, K, V)`."""

    @abc.abstractmethod
    def state_dtype(self) -> Any:
        """The dtype the state is carried in (float32 for 16- and 32-bit inputs)."""

    @abc.abstractmethod
    def prepare(self) -> _Factors:
        """Per-chunk factors that do not depend on the incoming state.

        **Returns:**

        A PyTree whose every leaf has the chunk index as its leading axis.
        """

    @abc.abstractmethod
    def step(self, factors: _Factors, h: Float[Array, "..."]) -> tuple[Array, PyTree]:
        """Advance the state over one chunk and emit the chunk's outputs.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare()`.
        - `h`: the state entering the chunk.

        **Returns:**

        `(h_next, outputs)`.
        """

    @abc.abstractmethod
    def advance(self, factors: _Factors, h: Float[Array, "..."]) -> Array:
        """Advance the state over one chunk without computing outputs.

        **Arguments:** as for `step`.

        **Returns:**

        `h_next`, the state leaving the chunk (what `step` returns first).
        """

    @abc.abstractmethod
    def identity_map(self) -> _Map:
        """The identity map for this recurrence's state (the empty sequence).

        **Returns:**

        An [`deltanet_cp.AbstractAffineMap`][] with batch shape `state_shape()[:-2]`.
        """

    @abc.abstractmethod
    def chunk_map(self, factors: _Factors) -> _Map:
        r"""One chunk as an explicit affine map of the incoming state.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare()`.

        **Returns:**

        The map $h \mapsto M h + U$ with `chunk_map(factors)(h) == advance(factors, h)`.
        """

    @abc.abstractmethod
    def compose(self, factors: _Factors, running: _Map) -> _Map:
        """Append one chunk to a running map: returns `running.then(chunk_map(factors))`.

        Implementations use the chunk's structure to avoid forming the dense chunk map.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare()`.
        - `running`: the map of the chunks before it.

        **Returns:**

        The map of the chunks before it and this one, of the same type as `running`.
        """

    @abc.abstractmethod
    def finalize(self, outputs: PyTree) -> PyTree:
        """Turn the stacked per-chunk outputs of `step` into the user-facing outputs.

        **Arguments:**

        - `outputs`: the outputs of `step`, stacked on a leading chunk axis.

        **Returns:**

        The outputs in the recurrence's public layout, e.g. `(B, T, HV, V)` with the padding
        of the last chunk removed.
        """


@eqx.filter_jit
def run_local(
    recurrence: AbstractChunkedRecurrence,
    initial_state: Array | None,
    factors: Any = None,
    segments: Segments | None = None,
    doc_states: Array | None = None,
) -> tuple[PyTree, Array]:
    """One pass over all chunks from `initial_state` (zeros if `None`), emitting outputs.

    Wrapped in `equinox.filter_jit`: called outside `jax.jit` (eagerly, as in a notebook),
    the whole pass compiles once per input shape instead of operation by operation; inside
    a caller's `jit` or `shard_map` it is inlined like any nested `jit`.

    **Arguments:**

    - `recurrence`: the inputs, as an [`deltanet_cp.AbstractChunkedRecurrence`][].
    - `initial_state`: the state entering the first chunk; zeros if `None`.
    - `factors`: `recurrence.prepare()`, if already computed (phase 3 reuses phase 1's).
    - `segments`: packed documents laid out in whole chunks (see
        [`deltanet_cp.segments`][]); the state is reset at each document's first chunk.
    - `doc_states`: with `segments`, each document's initial state, stacked on a leading
        axis; zeros if `None`.

    **Returns:**

    `(outputs, final_state)`; with `segments`, `final_state` is instead the stack of the
    final states of the documents that end in this pass (zeros for the others, except
    documents that are empty and start here, whose final state is their initial state).
    """
    if factors is None:
        factors = recurrence.prepare()
    h0 = _initial_state(recurrence, initial_state)
    if segments is None:
        h, outputs = jax.lax.scan(lambda h, f: recurrence.step(f, h), h0, factors)
        return recurrence.finalize(outputs), h

    starts = _doc_states(recurrence, segments, doc_states)
    empty = segments.empty_doc.reshape((-1,) + (1,) * h0.ndim)
    finals = jnp.where(empty, starts, jnp.zeros_like(starts))

    def body(carry, xs):
        h, finals = carry
        f, start, end = xs
        h = jnp.where(start >= 0, starts[jnp.maximum(start, 0)], h)
        h, out = recurrence.step(f, h)
        slot = jnp.maximum(end, 0)
        finals = finals.at[slot].set(jnp.where(end >= 0, h, finals[slot]))
        return (h, finals), out

    xs = (factors, segments.start_doc, segments.end_doc)
    (_, finals), outputs = jax.lax.scan(body, (h0, finals), xs)
    return recurrence.finalize(outputs), finals


def local_map(
    recurrence: AbstractChunkedRecurrence,
    factors: Any,
    axis_name: str | None = None,
    segments: Segments | None = None,
    doc_states: Array | None = None,
) -> AbstractAffineMap:
    """The affine map of all chunks together (phase 1): no outputs, state from zero.

    With `segments`, a document's first chunk is preceded by the constant map to that
    document's initial state ($M = 0$): what enters it does not matter.

    **Arguments:**

    - `recurrence`: the inputs, as an [`deltanet_cp.AbstractChunkedRecurrence`][].
    - `factors`: `recurrence.prepare()`.
    - `axis_name`: inside `jax.shard_map`, the context-parallel axis (the running map is
        then marked as varying over it); `None` otherwise.
    - `segments`, `doc_states`: packed documents, as in [`deltanet_cp.run_local`][].

    **Returns:**

    The map from the state entering the first chunk to the state leaving the last, of the
    type `recurrence.identity_map()` returns.
    """
    init = recurrence.identity_map()
    if axis_name is not None:
        init = _varying(init, factors)
    if segments is None:

        def body(running, f):
            return recurrence.compose(f, running), None

        running, _ = jax.lax.scan(body, init, factors)
        return running

    starts = _doc_states(recurrence, segments, doc_states)
    constant = jax.tree.map(jnp.zeros_like, init)

    def body_segments(running, xs):
        f, start = xs
        reset = eqx.tree_at(lambda m: m.U, constant, starts[jnp.maximum(start, 0)])
        running = jax.tree.map(lambda a, b: jnp.where(start >= 0, a, b), reset, running)
        return recurrence.compose(f, running), None

    running, _ = jax.lax.scan(body_segments, init, (factors, segments.start_doc))
    return running


def _doc_states(recurrence, segments: Segments, doc_states: Array | None) -> Array:
    shape = (segments.num_docs, *recurrence.state_shape())
    if doc_states is None:
        return jnp.zeros(shape, recurrence.state_dtype())
    if doc_states.shape != shape:
        raise ValueError(
            f"With packed documents the initial states must have shape {shape} (one per "
            f"document); got {doc_states.shape}."
        )
    return doc_states.astype(recurrence.state_dtype())


def _varying(tree: PyTree, like: PyTree) -> PyTree:
    """Mark `tree`'s values as varying over every mesh axis that `like`'s values vary over.

    Inside `shard_map`, a scan carry that starts replicated (the identity map, a state
    from the exchange) but is updated with per-rank data must be typed as per-rank from
    the start: over the context-parallel axis, and over any other axis the inputs are
    sharded on (a data-parallel batch axis, say).
    """
    axes: set = set()
    for leaf in jax.tree.leaves(like):
        axes |= set(jax.typeof(leaf).manual_axis_type.varying)

    def cast(x):
        missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def run_context_parallel(
    recurrence: AbstractChunkedRecurrence,
    initial_state: Array | None,
    *,
    axis_name: str,
    layout: object,
    strategy: str = "allgather",
    output_final_state: bool = False,
    segments: Segments | None = None,
    doc_states: Array | None = None,
) -> tuple[PyTree, Array | None]:
    """The three phases of context parallelism, for any chunked recurrence.

    Called inside `jax.shard_map`, with `recurrence` holding this rank's contiguous slice
    of the sequence.

    1. A local pass from a zero state, composing the chunks into this rank's map; no outputs.
    2. An exchange of maps and an exclusive prefix over ranks: the state entering this rank.
    3. A local pass again from the true incoming state, reusing phase 1's factors, emitting
       outputs.

    **Arguments:**

    - `recurrence`: this rank's inputs, as an [`deltanet_cp.AbstractChunkedRecurrence`][].
    - `initial_state`: the state before the first token of the whole sequence (replicated);
        zeros if `None`.
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `layout`: must be [`deltanet_cp.Contiguous`][]; anything else is a `ValueError`.
    - `strategy`: `"allgather"`, `"ppermute"`, `"ring"` or `"auto"` (see
        [`deltanet_cp.choose_strategy`][]).
    - `output_final_state`: also return the state after the last token of the sequence.
    - `segments`: packed documents, this rank's slice laid out in whole chunks (see
        [`deltanet_cp.segments`][], with `offset` at this rank's first token). Documents
        may cross rank boundaries.
    - `doc_states`: with `segments`, each document's initial state (replicated); zeros if
        `None`.

    **Returns:**

    `(outputs, final_state)`: this rank's outputs, and the global final state (the same on
    every rank) or `None`. With `segments`, the final state is one per document, stacked.
    """
    check_contiguous(layout)
    if strategy == "auto":
        *batch, dk, dv = recurrence.state_shape()
        strategy = choose_strategy(jax.lax.axis_size(axis_name), math.prod(batch), dk, dv)
    elif strategy not in STRATEGIES:
        raise ValueError(
            f"Unknown exchange strategy {strategy!r}; use one of {STRATEGIES + ('auto',)}."
        )
    factors = recurrence.prepare()
    mine = local_map(recurrence, factors, axis_name, segments, doc_states)
    h0 = _initial_state(recurrence, initial_state)
    need_final = output_final_state and segments is None
    h_in, h_final = exchange(
        mine, h0, axis_name=axis_name, strategy=strategy, need_final_state=need_final
    )
    h_in = _varying(h_in, factors)
    if segments is None:
        outputs, _ = run_local(recurrence, h_in, factors)
        return outputs, h_final
    # Each document ends on exactly one rank (or, if empty, starts on one): one all-reduce
    # of the per-document final states, whose size grows with the number of documents.
    outputs, finals = run_local(recurrence, h_in, factors, segments, doc_states)
    return outputs, (jax.lax.psum(finals, axis_name) if output_final_state else None)


def _initial_state(recurrence: AbstractChunkedRecurrence, initial_state: Array | None):
    shape, dtype = recurrence.state_shape(), recurrence.state_dtype()
    if initial_state is None:
        return jax.numpy.zeros(shape, dtype)
    if initial_state.shape != shape:
        raise ValueError(
            f"initial_state must have shape {shape} (batch, value heads, K, V); "
            f"got {initial_state.shape}."
        )
    return initial_state.astype(dtype)


def run_packed(
    build: Callable[..., AbstractChunkedRecurrence],
    inputs: tuple[Array, ...],
    cu_seqlens: Array,
    initial_state: Array | None,
    *,
    chunk_size: int,
    output_final_state: bool,
    axis_name: str | None = None,
    layout: object = None,
    strategy: str = "allgather",
) -> tuple[Array, Array | None]:
    """Run a recurrence over packed documents, on one device or context-parallel.

    Re-lays the tokens so that every document fills whole chunks (no chunk mixes two
    documents), runs the passes with the state reset at each document start, and puts the
    outputs back in token order.

    **Arguments:**

    - `build`: `build(*packed_inputs) -> recurrence`, with the same keyword settings as the
        caller (scale, chunk size, ...).
    - `inputs`: the per-token inputs, time on axis 1 and batch size 1.
    - `cu_seqlens`: the global document offsets `[0, ..., T]`, `(num_docs + 1,)`.
    - `initial_state`: per-document initial states `(num_docs, *state_shape[1:])`, or
        `None` for zeros.
    - `chunk_size`: tokens per chunk.
    - `output_final_state`: also return the per-document final states.
    - `axis_name`, `layout`, `strategy`: for context parallelism (inside `jax.shard_map`),
        as in [`deltanet_cp.run_context_parallel`][]; `axis_name=None` runs on one device.

    **Returns:**

    `(outputs, final_states)`, outputs in token order and final states
    `(num_docs, *state_shape[1:])` or `None`.
    """
    length = inputs[0].shape[1]
    if axis_name is None:
        check_cu_seqlens(cu_seqlens, inputs[0].shape[0], length)
        offset = 0
    else:
        check_contiguous(layout)
        check_cu_seqlens(cu_seqlens, inputs[0].shape[0])
        offset = jax.lax.axis_index(axis_name) * length
    seg = segments(cu_seqlens, length, chunk_size, offset)
    recurrence = build(*(pack(x, seg) for x in inputs))
    doc_states = None if initial_state is None else initial_state[:, None]
    if axis_name is None:
        outputs, finals = run_local(recurrence, None, None, seg, doc_states)
    else:
        outputs, finals = run_context_parallel(
            recurrence,
            None,
            axis_name=axis_name,
            layout=layout,
            strategy=strategy,
            output_final_state=output_final_state,
            segments=seg,
            doc_states=doc_states,
        )
    outputs = jax.tree.map(lambda y: unpack(y, seg), outputs)
    if not output_final_state or finals is None:
        return outputs, None
    return outputs, finals[:, 0]
