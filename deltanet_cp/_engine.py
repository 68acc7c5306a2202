"""The generic chunked-recurrence engine: what a recurrence provides, and `run`.

A recurrence is a static configuration (chunk size, scale, flags); its inputs are a PyTree
handed to [`deltanet_cp.run`][] beside it, the way `lineax.linear_solve(operator, vector,
solver)` keeps the solver apart from the problem. One entry serves one device, packed
documents and context parallelism; padding, chunking and packing happen here, once.
"""

import abc
from typing import Any, Generic, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._affine import AbstractAffineMap
from ._chunking import num_chunks, split_chunks
from ._exchange import AbstractExchange, as_exchange, ExchangeName
from ._layout import check_contiguous, Contiguous, ContiguousLayout
from ._packing import as_cu_seqlens, pack, Segments, segments, unpack


_Inputs = TypeVar("_Inputs")
_Factors = TypeVar("_Factors")
_Map = TypeVar("_Map", bound=AbstractAffineMap)


class AbstractRecurrence(eqx.Module, Generic[_Inputs, _Factors, _Map]):
    r"""A linear recurrence whose chunks act on the state as affine maps $h \mapsto M h + U$.

    An instance is a static configuration (chunk size and the like); it holds no data.
    [`deltanet_cp.run`][] hands it the inputs, a PyTree whose array leaves all have the
    batch on axis 0 and time on axis 1. Every method below is one the engine calls:

    - `state(inputs)`: the shape and dtype of the recurrent state;
    - `prepare(chunks)`: everything that does not depend on the incoming state, for all
        chunks at once;
    - `step(factors, h)`: one chunk, from its incoming state to its outgoing state and
        outputs;
    - `chunk_map(factors)`: one chunk as an explicit affine map (context parallelism);
    - `compose(factors, running)`: a chunk appended to a running map; the default forms
        `chunk_map`, a recurrence overrides it where a cheaper form exists;
    - `finalize(outputs, chunks)`: the stacked per-chunk outputs in the public layout;
    - `check(inputs)`: optional input validation (the default checks nothing).

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
        """Per-chunk factors that do not depend on the incoming state.

        **Arguments:**

        - `chunks`: the inputs with every array leaf's time axis zero-padded to whole
            chunks and split: `(B, T, *rest)` becomes `(B, N, C, *rest)`.

        **Returns:**

        A PyTree whose every leaf has the chunk index as its leading axis.
        """

    @abc.abstractmethod
    def step(self, factors: _Factors, h: Array) -> tuple[Array, PyTree]:
        """Advance the state over one chunk and emit the chunk's outputs.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.
        - `h`: the state entering the chunk.

        **Returns:**

        `(h_next, outputs)`.
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
    def finalize(self, outputs: PyTree, chunks: _Inputs) -> PyTree:
        """Turn the stacked per-chunk outputs of `step` into the public layout.

        **Arguments:**

        - `outputs`: the outputs of `step`, stacked on a leading chunk axis.
        - `chunks`: the chunked inputs, as given to `prepare`.

        **Returns:**

        The outputs with time on axis 1, all `N * C` positions of it (the engine cuts the
        padding and puts packed documents back in token order).
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
    layout: ContiguousLayout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
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
    layout: ContiguousLayout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
) -> tuple[PyTree, Array | None]: ...


def run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    axis_name: str | None = None,
    layout: ContiguousLayout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
) -> tuple[PyTree, Array | None]:
    """Run a chunked recurrence: on one device, over packed documents, context-parallel.

    On one device (`axis_name=None`) this is one pass over the chunks. With `axis_name`, it
    is called inside `jax.shard_map`, `inputs` holding this rank's contiguous slice of the
    sequence, and runs the three phases of context parallelism:

    1. a local pass from a zero state, composing the chunks into this rank's map;
    2. the exchange of maps: the state entering this rank;
    3. a local pass again from the true incoming state, reusing phase 1's factors, emitting
       outputs.

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
        `[0, len_0, len_0 + len_1, ..., T]`, a list or an int array of shape `(N + 1,)`,
        the same on every rank. The state resets at each document start, no chunk mixes
        two documents, documents may cross rank boundaries, and the initial and final
        states are per document.
    - `axis_name`: the mesh axis the sequence is sharded over, or `None` on one device.
    - `layout`: must be [`deltanet_cp.Contiguous`][] (a [`deltanet_cp.Zigzag`][] is a type
        error for pyright and a `ValueError` at run time).
    - `exchange`: how ranks exchange their maps: [`deltanet_cp.AllGather`][],
        [`deltanet_cp.PPermute`][], [`deltanet_cp.Ring`][], [`deltanet_cp.Auto`][], or the
        shorthands `"allgather"`, `"ppermute"`, `"ring"`, `"auto"`.

    **Returns:**

    `(outputs, final_state)`: outputs in the recurrence's public layout (this rank's tokens
    under context parallelism), and the final state or `None`.
    """
    if axis_name is not None:
        check_contiguous(layout)
    exchange = as_exchange(exchange)
    if cu_seqlens is not None:
        batch, length = _batch_and_length(inputs)
        total = length if axis_name is None else length * jax.lax.axis_size(axis_name)
        cu_seqlens = as_cu_seqlens(cu_seqlens, batch, total)
    return _run(
        recurrence,
        inputs,
        initial_state,
        cu_seqlens,
        output_final_state=output_final_state,
        axis_name=axis_name,
        exchange=exchange,
    )


@eqx.filter_jit
def _run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    initial_state: Array | None,
    cu_seqlens: Array | None,
    *,
    output_final_state: bool,
    axis_name: str | None,
    exchange: AbstractExchange,
) -> tuple[PyTree, Array | None]:
    recurrence.check(inputs)
    state = recurrence.state(inputs)
    c = recurrence.chunk_size
    _, length = _batch_and_length(inputs)
    if cu_seqlens is None:
        seg, doc_states = None, None
        h0 = _initial_state(state, initial_state)
        chunks = _split(inputs, num_chunks(length, c), c)
    else:
        offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * length
        seg = segments(cu_seqlens, length, c, offset)
        doc_states = _doc_states(state, seg.num_docs, initial_state)
        h0 = jnp.zeros(state.shape, state.dtype)
        chunks = _split(jax.tree.map(lambda x: pack(x, seg), inputs), seg.num_chunks, c)
    factors = recurrence.prepare(chunks)

    if axis_name is None:
        outputs, final = _local_pass(recurrence, factors, h0, seg, doc_states)
    else:
        mine = _local_map(recurrence, factors, axis_name, seg, doc_states)
        need_final = output_final_state and seg is None
        h_in, final = exchange(mine, h0, axis_name=axis_name, need_final_state=need_final)
        outputs, finals = _local_pass(recurrence, factors, _varying(h_in, factors), seg, doc_states)
        if seg is not None and output_final_state:
            # Each document ends on exactly one rank (or, if empty, starts on one): one
            # all-reduce of the per-document final states, which grows with their number.
            final = jax.lax.psum(finals, axis_name)

    outputs = recurrence.finalize(outputs, chunks)
    if seg is None:
        outputs = jax.tree.map(lambda y: y[:, :length], outputs)
    else:
        outputs = jax.tree.map(lambda y: unpack(y, seg), outputs)
        final = None if final is None else final[:, 0]
    return outputs, (final if output_final_state else None)


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


def _local_pass(
    recurrence: AbstractRecurrence,
    factors: PyTree,
    h0: Array,
    seg: Segments | None,
    doc_states: Array | None,
) -> tuple[PyTree, Array]:
    """One pass over all chunks from `h0`, emitting outputs.

    **Returns:**

    `(outputs, final_state)`, outputs stacked on a leading chunk axis. With `seg`, the
    state is reset at each document's first chunk and `final_state` is instead the stack of
    the final states of the documents that end in this pass (zeros for the others, except
    documents that are empty and start here, whose final state is their initial state).
    """
    if seg is None:
        h, outputs = jax.lax.scan(lambda h, f: recurrence.step(f, h), h0, factors)
        return outputs, h

    assert doc_states is not None
    empty = seg.empty_doc.reshape((-1,) + (1,) * h0.ndim)
    finals = jnp.where(empty, doc_states, jnp.zeros_like(doc_states))

    def body(carry, xs):
        h, finals = carry
        f, start, end = xs
        h = jnp.where(start >= 0, doc_states[jnp.maximum(start, 0)], h)
        h, out = recurrence.step(f, h)
        slot = jnp.maximum(end, 0)
        finals = finals.at[slot].set(jnp.where(end >= 0, h, finals[slot]))
        return (h, finals), out

    xs = (factors, seg.start_doc, seg.end_doc)
    (_, finals), outputs = jax.lax.scan(body, (h0, finals), xs)
    return outputs, finals


def _local_map(
    recurrence: AbstractRecurrence,
    factors: PyTree,
    axis_name: str,
    seg: Segments | None,
    doc_states: Array | None,
) -> AbstractAffineMap:
    """The affine map of all chunks together (phase 1): no outputs, state from zero.

    With `seg`, a document's first chunk is preceded by the constant map to that document's
    initial state ($M = 0$): what enters it does not matter.
    """
    first = jax.tree.map(lambda x: x[0], factors)
    shapes = eqx.filter_eval_shape(recurrence.chunk_map, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    init = _varying(zeros.identity_like(), factors)
    if seg is None:
        running, _ = jax.lax.scan(lambda m, f: (recurrence.compose(f, m), None), init, factors)
        return running

    assert doc_states is not None
    constant = jax.tree.map(jnp.zeros_like, init)

    def body(running, xs):
        f, start = xs
        reset = eqx.tree_at(lambda m: m.U, constant, doc_states[jnp.maximum(start, 0)])
        running = jax.tree.map(lambda a, b: jnp.where(start >= 0, a, b), reset, running)
        return recurrence.compose(f, running), None

    running, _ = jax.lax.scan(body, init, (factors, seg.start_doc))
    return running


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
    layout: ContiguousLayout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
) -> tuple[PyTree, Array | None]:
    """[`deltanet_cp.run`][] with context parallelism on global arrays: does the `shard_map`.

    Shards the time axis of the inputs over `axis_name` of `mesh` (and optionally the batch
    axis over `batch_axis`), runs the three phases and returns global arrays. Compiled once
    per input shapes, configuration and mesh: a second call with new values does not trace
    again. Use it at the top level; inside your own `shard_map`, call `run` directly.

    **Arguments:**

    - `recurrence`, `inputs`, `initial_state`, `output_final_state`, `cu_seqlens`,
        `layout`, `exchange`: as in [`deltanet_cp.run`][], with global arrays. The sequence
        length must be divisible by the size of `axis_name`.
    - `mesh`: a `jax.sharding.Mesh` with an axis named `axis_name`.
    - `axis_name`: the mesh axis to shard the sequence over.
    - `batch_axis`: optionally, a mesh axis to shard the batch over (data parallelism).

    **Returns:**

    `(outputs, final_state)` as global arrays.
    """
    check_contiguous(layout)
    exchange = as_exchange(exchange)
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}.")
    recurrence.check(inputs)
    batch, length = _batch_and_length(inputs)
    cp = mesh.shape[axis_name]
    if length % cp:
        raise ValueError(
            f"The sequence length ({length}) must be divisible by the context-parallel size "
            f"(mesh axis {axis_name!r} has {cp} devices): pad the sequence to a multiple of "
            f"{cp} (for example with g = 0, beta = 0 and zero q, k, v, which leaves the state "
            "unchanged) or pick a cp that divides it."
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
):
    seq, state = specs
    P = jax.sharding.PartitionSpec

    def per_rank(inputs, initial_state, cu_seqlens):
        return run(
            recurrence,
            inputs,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            axis_name=axis_name,
            exchange=exchange,
        )

    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(seq, state, P()),
        out_specs=(seq, state if output_final_state else None),
    )
    return fn(inputs, initial_state, cu_seqlens)
