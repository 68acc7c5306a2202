"""The generic chunked-recurrence engine: what a recurrence provides, and `run`.

A recurrence is a static configuration (chunk size, scale, flags); its inputs are a PyTree
handed to [`deltanet_cp.run`][] beside it, the way `lineax.linear_solve(operator, vector,
solver)` keeps the solver apart from the problem. One entry serves one device, packed
documents and context parallelism; padding, chunking and packing happen here, once.
"""

import abc
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
from ._packing import as_cu_seqlens, pack, segments, unpack


_Inputs = TypeVar("_Inputs")
_Factors = TypeVar("_Factors")
_Map = TypeVar("_Map", bound=AbstractAffineMap)


class AbstractRecurrence(eqx.Module, Generic[_Inputs, _Factors, _Map]):
    r"""A linear recurrence whose chunks act on the state as affine maps $h \mapsto M h + U$.

    An instance is a static configuration (chunk size and the like); it holds no data.
    [`deltanet_cp.run`][] hands it the inputs, a PyTree whose array leaves all have the
    batch on axis 0 and time on axis 1. Every method below is one the engine calls:

    - `state(inputs)`: the shape and dtype of the recurrent state;
    - `prepare(chunks)`: everything that does not depend on the incoming state (the
        engine calls it on one chunk at a time inside its scans, and again in the
        backward, so the factors of the whole sequence never exist at once);
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
    layout: Layout = Contiguous(),
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
    layout: Layout = Contiguous(),
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
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
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

    **Returns:**

    `(outputs, final_state)`: outputs in the recurrence's public layout (this rank's tokens,
    in the layout's order, under context parallelism), and the final state or `None`.
    """
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

    **Returns:**

    `(outputs, final_state, document_finals)`: this rank's outputs; the state after the
    last token of the last slice (or `None`); and, with `cu_seqlens`, the final states of
    the documents that end in this rank's slice, `(num_docs, *state.shape[1:])`, zeros for
    the others (sum them over ranks for every document's), else `None`.
    """
    check_contiguous(layout)
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"`start` must be a non-negative int; got {start!r}.")
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
) -> tuple[PyTree, Array | None, Array | None]:
    recurrence.check(inputs)
    state = recurrence.state(inputs)
    c = recurrence.chunk_size
    _, length = _batch_and_length(inputs)
    h0 = _initial_state(state, initial_state)
    if cu_seqlens is None:
        seg, doc_states = None, None
        chunks = _split(inputs, num_chunks(length, c), c)
    else:
        offset = start
        if axis_name is not None:
            offset = offset + _position(axis_name, reverse) * length
        seg = segments(cu_seqlens, length, c, offset)
        doc_states = _doc_states(state, seg.num_docs, document_states)
        chunks = _split(jax.tree.map(lambda x: pack(x, seg), inputs), seg.num_chunks, c)
    diff, static = eqx.partition(_by_chunk(chunks), eqx.is_inexact_array)
    marks = None if seg is None else (seg.start_doc, seg.end_doc, seg.empty_doc)
    if axis_name is None:
        out = _local(recurrence, diff, static, h0, marks, doc_states)
    else:
        out = _context_parallel(
            recurrence,
            exchange,
            axis_name,
            output_final_state,
            reverse,
            diff,
            static,
            h0,
            marks,
            doc_states,
        )
    outputs, final, finals = cast(tuple[PyTree, Any, Any], out)
    outputs = recurrence.finalize(outputs, chunks)
    if seg is None:
        outputs = jax.tree.map(lambda y: y[:, :length], outputs)
    else:
        outputs = jax.tree.map(lambda y: unpack(y, seg), outputs)
        finals = finals[:, 0]
    return outputs, (final if output_final_state else None), finals


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


def _by_chunk(chunks: PyTree) -> PyTree:
    """`(B, N, C, ...)` -> `(N, B, C, ...)`: the scans below walk the leading chunk axis."""
    return jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), chunks)


def _factors(recurrence: AbstractRecurrence, x: tuple[PyTree, PyTree]) -> PyTree:
    """One chunk's factors, from that chunk's inputs `(B, C, ...)`, split as
    `(floating, other)` by `eqx.partition`.

    Factors are formed chunk by chunk inside the scans, never for all chunks at once: the
    working set is one chunk's, whatever the sequence length, and the backward recomputes
    them from the inputs instead of keeping them.
    """
    f = recurrence.prepare(jax.tree.map(lambda a: a[:, None], eqx.combine(*x)))
    return jax.tree.map(lambda a: a[0], f)


# The local pass, differentiated by hand. Its forward keeps only the state entering each
# chunk; its backward is one reverse scan over the chunks carrying the state's cotangent,
# each chunk's factors recomputed from its inputs and differentiated with `jax.vjp`. The
# packed-document version resets the state at each document's first chunk (`marks`: per
# chunk, the document starting / ending there or -1; per document, whether it is empty and
# starts here) and collects the final state of each document that ends here.


def _pass(recurrence, diff, static, h0, marks, doc_states, *, keep_states: bool):
    xs = (diff, static)  # floating inputs (differentiated), and the rest (masks, ...)

    def run_chunk(h, x):
        return recurrence.step(_factors(recurrence, x), h)

    if marks is None:

        def body(h, x):
            h_next, out = run_chunk(h, x)
            return h_next, (out, h if keep_states else None)

        h, (outputs, states) = jax.lax.scan(body, h0, xs)
        return (outputs, h, None), states

    start, end, empty = marks
    finals = jnp.where(empty.reshape((-1,) + (1,) * h0.ndim), doc_states, 0 * doc_states)

    def body_docs(carry, inp):
        h, finals = carry
        x, s, e = inp
        h = jnp.where(s >= 0, doc_states[jnp.maximum(s, 0)], h)
        h_next, out = run_chunk(h, x)
        slot = jnp.maximum(e, 0)
        finals = finals.at[slot].set(jnp.where(e >= 0, h_next, finals[slot]))
        return (h_next, finals), (out, h if keep_states else None)

    (h, finals), (outputs, states) = jax.lax.scan(body_docs, (h0, finals), (xs, start, end))
    return (outputs, h, finals), states


def _pass_backward(recurrence, diff, static, states, marks, doc_states, cts):
    """The cotangents of `(diff, h0, doc_states)` given those of `(outputs, h, finals)`."""
    d_outputs, d_h, d_finals = cts

    def chunk_vjp(x, h, d_out, d_next):
        def f(x_diff, h):
            return recurrence.step(_factors(recurrence, (x_diff, x[1])), h)

        _, pull = jax.vjp(f, x[0], h)
        return pull((d_next, d_out))

    xs = (diff, static)
    if marks is None:

        def body(d_next, inp):
            x, h, d_out = inp
            dx, dh = chunk_vjp(x, h, d_out, d_next)
            return dh, dx

        dh0, dxs = jax.lax.scan(body, d_h, (xs, states, d_outputs), reverse=True)
        return dxs, dh0, None

    start, end, empty = marks
    d_docs = jnp.where(empty.reshape((-1,) + (1,) * d_h.ndim), d_finals, 0 * d_finals)

    def body_docs(carry, inp):
        d_next, d_docs = carry
        x, h, d_out, s, e = inp
        d_next = d_next + jnp.where(e >= 0, d_finals[jnp.maximum(e, 0)], 0 * d_next)
        dx, dh = chunk_vjp(x, h, d_out, d_next)
        slot = jnp.maximum(s, 0)
        d_docs = d_docs.at[slot].add(jnp.where(s >= 0, dh, 0 * dh))
        return (jnp.where(s >= 0, 0 * dh, dh), d_docs), dx

    init = (d_h, d_docs)
    (dh0, d_docs), dxs = jax.lax.scan(
        body_docs, init, (xs, states, d_outputs, start, end), reverse=True
    )
    return dxs, dh0, d_docs


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local(recurrence, diff, static, h0, marks, doc_states):
    """One pass over all chunks from `h0`: `(outputs, final_state, document_finals)`."""
    out, _ = _pass(recurrence, diff, static, h0, marks, doc_states, keep_states=False)
    return out


def _local_fwd(recurrence, diff, static, h0, marks, doc_states):
    out, states = _pass(recurrence, diff, static, h0, marks, doc_states, keep_states=True)
    return out, (diff, static, states, marks, doc_states)


def _local_bwd(recurrence, res, cts):
    diff, static, states, marks, doc_states = res
    dxs, dh0, d_docs = _pass_backward(recurrence, diff, static, states, marks, doc_states, cts)
    return dxs, None, dh0, None, d_docs


_local.defvjp(_local_fwd, _local_bwd)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _context_parallel(
    recurrence, exchange, axis_name, need_final, reverse, diff, static, h0, marks, doc_states
):
    """The three phases: `(outputs, final_state or None, document_finals or None)`."""
    walk = (recurrence, exchange, axis_name, need_final, reverse)
    out, _ = _three_phases(walk, diff, static, h0, marks, doc_states, keep=False)
    return out


def _three_phases(walk, diff, static, h0, marks, doc_states, *, keep):
    recurrence, exchange, axis_name, need_final, reverse = walk
    mine = _local_map(recurrence, diff, static, axis_name, marks, doc_states)
    h_in, h_final = exchange(
        mine, h0, axis_name=axis_name, need_final_state=need_final, reverse=reverse
    )
    h_in = _varying(h_in, diff)
    (outputs, _, finals), states = _pass(
        recurrence, diff, static, h_in, marks, doc_states, keep_states=keep
    )
    return (outputs, h_final, finals), (mine, states)


def _context_parallel_fwd(
    recurrence, exchange, axis_name, need_final, reverse, diff, static, h0, marks, doc_states
):
    walk = (recurrence, exchange, axis_name, need_final, reverse)
    out, (mine, states) = _three_phases(walk, diff, static, h0, marks, doc_states, keep=True)
    return out, (diff, static, states, marks, doc_states, mine, h0)


def _context_parallel_bwd(recurrence, exchange, axis_name, need_final, reverse, res, cts):
    # The backward has three phases too. The cotangent of the state entering rank r is
    # lambda_r = g_r + M_r^T lambda_{r+1}, with g_r what rank r's own outputs ask of it: an
    # affine map of lambda_{r+1}, so the exchange composes these maps walking the ranks the
    # other way, starting from the final state's cotangent. Nothing per chunk is kept but
    # the states of phase 3.
    diff, static, states, marks, doc_states, mine, h0 = res
    d_outputs, d_final, d_finals = cts
    zero = jnp.zeros_like(states[0])
    _, g, _ = _pass_backward(
        recurrence, diff, static, states, marks, doc_states, (d_outputs, zero, d_finals)
    )
    start = d_final if need_final else jnp.zeros_like(h0)
    lam_next, lam0 = exchange(
        mine.adjoint(g),
        start,
        axis_name=axis_name,
        need_final_state=True,
        reverse=not reverse,
    )
    cts = (d_outputs, _varying(lam_next, diff), d_finals)
    dxs, _, d_docs = _pass_backward(recurrence, diff, static, states, marks, doc_states, cts)
    d_docs = None if d_docs is None else jax.lax.psum(d_docs, axis_name)
    return dxs, None, lam0, None, d_docs


_context_parallel.defvjp(_context_parallel_fwd, _context_parallel_bwd)


def _local_map(recurrence, diff, static, axis_name, marks, doc_states) -> AbstractAffineMap:
    """The affine map of all chunks together (phase 1): no outputs, state from zero.

    With packed documents, a document's first chunk is preceded by the constant map to that
    document's initial state ($M = 0$): what enters it does not matter.
    """
    xs = (diff, static)

    def compose(running, x):
        return recurrence.compose(_factors(recurrence, x), running)

    def chunk_map(x):
        return recurrence.chunk_map(_factors(recurrence, x))

    shapes = eqx.filter_eval_shape(chunk_map, jax.tree.map(lambda a: a[0], xs))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    init = _varying(zeros.identity_like(), diff)
    if marks is None:
        running, _ = jax.lax.scan(lambda m, x: (compose(m, x), None), init, xs)
        return running

    constant = jax.tree.map(jnp.zeros_like, init)

    def body(running, inp):
        x, s = inp
        reset = eqx.tree_at(lambda m: m.U, constant, doc_states[jnp.maximum(s, 0)])
        running = jax.tree.map(lambda a, b: jnp.where(s >= 0, a, b), reset, running)
        return compose(running, x), None

    running, _ = jax.lax.scan(body, init, (xs, marks[0]))
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
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
) -> tuple[PyTree, Array | None]:
    """[`deltanet_cp.run`][] with context parallelism on global arrays: does the `shard_map`.

    Shards the time axis of the inputs over `axis_name` of `mesh` (and optionally the batch
    axis over `batch_axis`), runs the three phases and returns global arrays. Compiled once
    per input shapes, configuration and mesh: a second call with new values does not trace
    again. Use it at the top level; inside your own `shard_map`, call `run` directly.

    **Arguments:**

    - `recurrence`, `inputs`, `initial_state`, `output_final_state`, `cu_seqlens`,
        `exchange`: as in [`deltanet_cp.run`][], with global arrays in sequence order. The
        sequence length must be divisible by the size of `axis_name` (by twice it under
        `Zigzag`).
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
    check_layout(layout)
    exchange = as_exchange(exchange)
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}.")
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
