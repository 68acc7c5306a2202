"""The engine's entry points: `run` (validation once, then dispatch) and the walk over one
contiguous slice, `run_contiguous` (public in `deltanet_cp.internal`). Both check their
arguments once and hand the walks to one private engine, `_run`.

A recurrence is a static configuration; its inputs are a PyTree handed to `run` beside it,
the way `lineax.linear_solve(operator, vector, solver)` keeps the solver apart from the
problem. One entry serves one device, packed documents and context parallelism; padding,
chunking and packing happen here, once. The passes themselves are in `_passes.py`.
"""

import dataclasses
from typing import Any, cast, Literal, NamedTuple, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._chunking import num_chunks, split_chunks
from ._layout import Walk
from ._mesh import mesh_to_run_on
from ._packing import (
    as_cu_seqlens,
    check_cu_seqlens,
    check_offsets,
    concrete_offsets,
    cu_seqlens_array,
    pack,
    segments,
    unpack,
)
from ._parallel import (
    along_walks,
    axis_size,
    call_cp,
    check_bound,
    ContextParallel,
    Contiguous,
    contiguous,
    ContiguousParallel,
)
from ._passes import Blocks, context_parallel, Engine, local, non_finite
from ._recurrence import AbstractRecurrence, check_inputs, check_shapes
from ._sharding import varying
from ._validate import as_index, as_positive_index


Memory: TypeAlias = Literal["low", "high"]
"""What the backward keeps: `"low"` one state per block, `"high"` every chunk's factors and
state (see [`deltanet_cp.run`][])."""


def run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    cu_seqlens: Any = None,
    cp: ContextParallel | None = None,
    block_size: int | None = None,
    memory: Memory | None = None,
) -> tuple[PyTree, Array]:
    """Run a chunked recurrence: on one device, over packed documents, context-parallel.

    On one device (`cp=None`) this is one pass over the chunks. With a
    [`deltanet_cp.ContextParallel`][] `cp`, it runs the three phases of context
    parallelism:

    1. a local pass from a zero state, composing the chunks into this rank's map;
    2. the exchange of maps: the state entering this rank;
    3. a local pass again from the true incoming state, emitting outputs.

    Without `cp.mesh` the call is made inside `jax.shard_map` and `inputs` hold this
    rank's shard; with `cp.mesh` the arrays are global, in sequence order, and `run` does
    the `shard_map` itself (compiled once per shapes, configuration and mesh).

    The phases run in the engine of [`deltanet_cp.internal.run_contiguous`][], over contiguous,
    in-order slices only: the layout's [`walks`][deltanet_cp.AbstractLayout.walks], each
    from the state the walk before it ends in ([`deltanet_cp.Contiguous`][]: the shard;
    [`deltanet_cp.Zigzag`][]: the first pieces in rank order, then the second pieces in
    reverse rank order). Several walks go through the engine together: their slices are
    stacked on the batch axis, so phases 1 and 3 run once over all of them (one pass, one
    program), and only the exchanges go walk after walk; `block_size` counts the tokens of
    all the walks together. With `cu_seqlens` (whose chunks differ from walk to walk) the
    engine runs once per walk instead. The arguments are checked once, here, before the
    engine.

    Differentiated by hand: the forward keeps one state per chunk, and the backward is
    three phases again, the exchange walking the ranks the other way (see the concept
    page "The three phases").

    Gate ranges are checked where the values are concrete (an eager call, or arrays a
    traced function closes over): a finite log decay above 0 (an inputs field declared
    `eqx.field(metadata={"log_decay": True})`: `g`, `gk`, `log_alpha`, ...), and a delta
    rule's step size `beta` outside $[0, 2]$, are a `ValueError`. That costs one small
    reduction per gate, compiled once per shape, and a wait for the gate's values. Traced
    values (under `jax.jit`, `grad`, `vmap` or `shard_map`) are not checked, which would
    add a callback to every call: there a positive log decay or a step size outside
    $[0, 2]$ makes the state grow without bound. Non-finite values are not range errors:
    they make the outputs non-finite from their token on (`-inf` in a log decay is a
    decay of zero).

    **Arguments:**

    - `recurrence`: the configuration, an [`deltanet_cp.AbstractRecurrence`][].
    - `inputs`: a PyTree of arrays with batch on axis 0 and time on axis 1 (`None` leaves
        are allowed).
    - `initial_state`: the state before the first token (replicated under context
        parallelism); zeros if `None`. With `cu_seqlens`, one per document, stacked.
    - `cu_seqlens`: packed documents (batch size 1): the *global* document offsets
        `[0, len_0, len_0 + len_1, ..., T]`, in sequence order whatever the layout, a list
        or an int array of shape `(N + 1,)`, the same on every rank. The state resets at
        each document start, no chunk mixes two documents, documents may cross rank and
        piece boundaries, and the initial and final states are per document.
    - `cp`: how the call is sharded, a [`deltanet_cp.ContextParallel`][], or `None` on
        one device.
    - `block_size`: tokens whose chunk factors are formed together (rounded down to whole
        chunks). Larger blocks mean fewer, larger batched operations and fewer sequential
        steps outside the state recursion; smaller blocks bound the memory of the factors.
        A slice of at most `block_size` tokens is one block with no loop around its factor
        work. `None` takes [`deltanet_cp.default_block_size`][].
    - `memory`: what the backward keeps (see the benchmarks page for the figures).
        `"low"` (`None`, the default): one state per block, the factors and the chunk
        states formed again in the backward; the temporaries per token stay small and grow
        with the sequence by one state per block. `"high"`: every chunk's factors, the VJP
        of the recurrence's `prepare` and the state entering each chunk, so no pass forms
        a factor twice (under context parallelism phase 1's factors serve phase 3 and the
        backward): about a fifth fewer FLOPs in the training step, for several times the
        temporaries.

    **Returns:**

    `(outputs, final_state)`: outputs in the recurrence's public layout (this rank's tokens,
    in the layout's order, under context parallelism without a mesh), and the state after
    the last token (with `cu_seqlens`, one per document; under context parallelism the
    global one, on every rank). An unused final state costs nothing: XLA drops its
    computation and its collectives.
    """
    check_inputs(recurrence, inputs)
    return run_checked(
        recurrence,
        inputs,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        block_size=block_size,
        memory=memory,
    )


def run_checked(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    cu_seqlens: Any = None,
    cp: ContextParallel | None = None,
    block_size: int | None = None,
    memory: Memory | None = None,
) -> tuple[PyTree, Array]:
    """[`deltanet_cp.run`][] for `inputs` that `check_inputs` has passed already (a public
    function that reads them before the engine does): the rest of the arguments checked,
    once, then the engine."""
    cp = call_cp(cp, "deltanet_cp.run")
    blocking = _blocking(block_size, memory)
    if cp is not None and cp.mesh is not None:
        return _run_global(recurrence, inputs, initial_state, cu_seqlens, cp, blocking)
    if cu_seqlens is not None:
        batch, length = _batch_and_length(inputs)
        cu_seqlens = as_cu_seqlens(
            cu_seqlens,
            batch,
            length * axis_size(cp),
            axis_name=None if cp is None else cp.axis_name,
        )
    return _per_rank(recurrence, inputs, initial_state, cu_seqlens, cp, blocking)


def _per_rank(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    initial_state: Array | None,
    cu_seqlens: Array | None,
    cp: ContextParallel | None,
    blocking: "Blocking",
) -> tuple[PyTree, Array]:
    """`run` on this rank's shard, its arguments checked: the layout's walks in chain order,
    each through the engine (`_run`) once."""
    packed = cu_seqlens is not None
    # With packed documents, `initial_state` holds the documents' initial states.
    state, doc_h0 = (None, initial_state) if packed else (initial_state, None)
    batch, length = _batch_and_length(inputs)
    if batch == 0 or length == 0:  # (the same on every rank: the shapes are)
        return _empty(recurrence, inputs, initial_state, cu_seqlens)
    walks = (Contiguous() if cp is None else cp.layout).walks(length, axis_size(cp))
    # Every walk runs in the typed engine, with the contiguous `ContextParallel` of a walk.
    along = None if cp is None else along_walks(cp)
    if not packed:
        # One pass over every walk, the walks stacked on the batch axis (their slices are of
        # one length): one program of the engine's passes, batched, instead of one per walk.
        stacked = inputs
        if len(walks) > 1:
            stacked = jax.tree.map(
                lambda x: jnp.concatenate([x[:, w.local] for w in walks]), inputs
            )
        out, state, _ = _run(
            recurrence, stacked, state, None, None, cp=along, walks=walks, blocking=blocking
        )
        if len(walks) > 1:
            parts = len(walks)
            out = jax.tree.map(lambda y: jnp.concatenate(jnp.split(y, parts), axis=1), out)
        return out, cast(Array, state)
    # Packed documents: the chunks differ from walk to walk, so one engine pass per walk.
    outputs, finals = [], None
    for walk in walks:
        n = walk.local.stop - walk.local.start
        part = inputs if len(walks) == 1 else jax.tree.map(lambda x: x[:, walk.local], inputs)
        out, state, f = _run(
            recurrence,
            part,
            state,
            cu_seqlens,
            doc_h0,
            cp=along,
            walks=(Walk(slice(0, n), walk.start, walk.reverse),),
            blocking=blocking,
        )
        outputs.append(out)
        finals = f if finals is None or f is None else finals + f
    if len(outputs) > 1:
        outputs = [jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1), *outputs)]
    if cp is not None:
        finals = jax.lax.psum(finals, cp.axis_name)
    return outputs[0], cast(Array, finals)


def _empty(recurrence, inputs, initial_state, cu_seqlens) -> tuple[PyTree, Array]:
    """`run` without a token or a batch row: empty outputs, and the initial state (zeros
    if `None`; with `cu_seqlens`, each document's) as the final state, as FLA does."""
    batch, length = _batch_and_length(inputs)
    state = recurrence.state(inputs)
    probe = jax.tree.map(lambda x: jnp.zeros((1, 1, *x.shape[2:]), x.dtype), inputs)
    shapes = eqx.filter_eval_shape(
        lambda p: _per_rank(recurrence, p, None, None, None, Blocking(None, "low"))[0], probe
    )
    outputs = jax.tree.map(lambda s: jnp.zeros((batch, length, *s.shape[2:]), s.dtype), shapes)
    if cu_seqlens is None:
        return outputs, _initial_state(state, initial_state)
    return outputs, _doc_states(state, cu_seqlens.shape[0] - 1, initial_state)[:, 0]


def run_contiguous(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    cp: ContiguousParallel | None = None,
    initial_state: Array | None = None,
    cu_seqlens: Any = None,
    document_states: Array | None = None,
    start: int = 0,
    reverse: bool = False,
    block_size: int | None = None,
    memory: "Memory | None" = None,
) -> tuple[PyTree, Array, Array | None]:
    """The engine's walk: the three phases over one contiguous, in-order slice per rank.

    Every call of the library ends in the engine this walks: a
    [`deltanet_cp.Contiguous`][] shard is one walk, and [`deltanet_cp.run`][] hands the
    engine the walks of any other layout together (or one at a time, with packed
    documents). It takes a `ContextParallel[Contiguous]` only: a
    zigzag one (or one of any other layout) is a pyright error and a `ValueError`, since
    reading a zigzag shard as one slice would compose its two pieces as if they were
    adjacent.

    The ranks' slices, in rank order (or in reverse rank order with `reverse=True`), are
    consecutive tokens `[start, start + cp * length)` of the sequence.

    **Arguments:**

    - `recurrence`, `inputs`, `block_size`, `memory`: as in [`deltanet_cp.run`][].
    - `cp`: a [`deltanet_cp.ContextParallel`][] with the [`deltanet_cp.Contiguous`][]
        layout and no mesh (inside `jax.shard_map`), or `None` on one device.
    - `initial_state`: the state entering the first slice (replicated); zeros if `None`.
    - `cu_seqlens`: packed documents, as in [`deltanet_cp.run`][]: the global offsets of
        the whole sequence (which may extend past this run of slices).
    - `document_states`: with `cu_seqlens`, the documents' initial states, stacked
        `(num_docs, *state.shape[1:])`; zeros if `None`.
    - `start`: the sequence position of the first slice's first token.
    - `reverse`: the last rank holds the first slice and rank 0 the last.

    **Returns:**

    `(outputs, final_state, document_finals)`: this rank's outputs; the state after the
    last token of the last slice; and, with `cu_seqlens`, the final states of the
    documents that end in this rank's slice, `(num_docs, *state.shape[1:])`, zeros for the
    others (sum them over ranks for every document's), else `None`.
    """
    check_inputs(recurrence, inputs)
    if cp is not None:
        cp = contiguous(cp)  # the type, then the layout
        if cp.mesh is not None:
            raise ValueError(
                "run_contiguous runs inside jax.shard_map on this rank's slice: pass a "
                "ContextParallel without `mesh` (deltanet_cp.run takes global arrays)."
            )
        check_bound(cp, "run_contiguous")
    if (start := as_index(start, "start")) < 0:
        raise ValueError(f"`start` must be a non-negative int; got {start!r}.")
    blocking = _blocking(block_size, memory)
    if 0 in _batch_and_length(inputs):
        raise ValueError(
            "run_contiguous walks at least one token of at least one batch row; got inputs "
            f"of (batch, seq) = {_batch_and_length(inputs)} (deltanet_cp.run takes empty "
            "inputs and returns empty outputs)."
        )
    axis_name = None if cp is None else cp.axis_name
    if cu_seqlens is not None:
        batch, length = _batch_and_length(inputs)
        walk = length if axis_name is None else length * jax.lax.axis_size(axis_name)
        cu_seqlens = as_cu_seqlens(
            cu_seqlens, batch, start + walk, at_least=True, axis_name=axis_name
        )
    elif document_states is not None:
        raise ValueError("`document_states` are per document: pass `cu_seqlens` too.")
    _, length = _batch_and_length(inputs)
    outputs, final, finals = _run(
        recurrence,
        inputs,
        initial_state,
        cu_seqlens,
        document_states,
        cp=cp,
        walks=(Walk(slice(0, length), start, reverse),),
        blocking=blocking,
    )
    return outputs, final, finals


@eqx.filter_jit
def _run(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    initial_state: Array | None,
    cu_seqlens: Array | None,
    document_states: Array | None,
    *,
    cp: "ContextParallel[Contiguous] | None",
    walks: tuple[Walk, ...],
    blocking: "Blocking",
) -> tuple[PyTree, Array, Array | None]:
    """The walks of `run_contiguous` and `run`, their arguments checked: this rank's slices
    `inputs` of `walks`, in chain order, stacked on the batch axis (walk `w` in rows
    `w * B, ..., (w + 1) * B - 1`; one walk with `cu_seqlens`), each from the state the one
    before ends in: the engine's passes run once over all of them, batched."""
    axis_name = None if cp is None else cp.axis_name
    batch, length = _batch_and_length(inputs)
    assert (cp is not None or len(walks) == 1) and (cu_seqlens is None or len(walks) == 1)
    walk = walks[0]
    # A chunk longer than the slice only pads: cap it at the slice rounded up to a power of
    # two (T = 50 with chunk_size=16384 forms chunks of 64, not of 16384 mostly padding).
    c = min(recurrence.chunk_size, 1 << max(0, length - 1).bit_length())
    state = check_shapes(recurrence, inputs, c)  # `state`, `step`: named errors, at trace time
    state = jax.ShapeDtypeStruct((batch // len(walks), *state.shape[1:]), state.dtype)
    h0 = _initial_state(state, initial_state)
    if initial_state is None:  # per rank wherever the inputs are but along the walk
        h0 = varying(h0, inputs, but=axis_name)
    # A block holds `block_size` tokens of all the walks together (each walk's share of
    # it), so that stacking the walks leaves the working set where one walk's would be.
    per_block = max(1, _chunks_per_block(blocking, c) // len(walks))
    # A non-finite input must not reach earlier tokens through the chunk's products (a zero
    # times NaN is NaN): the chunk is formed from zeros there, and NaN is added back to the
    # outputs from the first such token of the chunk on and to the state leaving it. An
    # input that reaches only its own token's outputs (a query) poisons only those.
    log_decays = _leaf_flags(inputs, "log_decay")
    bad, bad_out = _non_finite(inputs, log_decays, _leaf_flags(inputs, "output_only"))
    if cu_seqlens is None:
        seg, doc_states = None, None
        blocks = Blocks.of(num_chunks(length, c), c, per_block, log_decays)
        chunks = _split(inputs, blocks.padded, c)
        bad, bad_out = _split((bad, bad_out), blocks.padded, c)
        marks = None
    else:
        seg = segments(cu_seqlens, length, c, walk.first_token(axis_name))
        doc_states = _doc_states(state, seg.num_docs, document_states)
        if document_states is None:
            doc_states = varying(doc_states, inputs, but=axis_name)
        blocks = Blocks.of(seg.num_chunks, c, per_block, log_decays)
        chunks = _split(jax.tree.map(lambda x: pack(x, seg), inputs), blocks.padded, c)
        bad, bad_out = _split((pack(bad, seg), pack(bad_out, seg)), blocks.padded, c)
        pad = (0, blocks.padded - blocks.n)
        marks = (
            jnp.pad(seg.start_doc, pad, constant_values=-1),
            jnp.pad(seg.end_doc, pad, constant_values=-1),
            seg.empty_doc,
        )
    diff, static = eqx.partition(chunks, eqx.is_inexact_array)
    nan = jnp.asarray(jnp.nan, state.dtype)
    zero = jnp.zeros((), state.dtype)
    after_bad = (jnp.cumsum(bad, axis=2) > 0) | bad_out
    after_bad = after_bad.reshape(bad.shape[0], -1)  # (B, padded * C)
    poison = (jnp.where(jnp.any(bad, axis=2).T, nan, zero), after_bad)  # (chunks, B), tokens
    keep = blocking.memory == "high"
    if cp is None:
        engine = Engine(recurrence, blocks, keep=keep)
        out = local(engine, diff, static, h0, marks, doc_states, poison)
    else:
        directions = tuple(w.reverse for w in walks)
        engine = Engine(recurrence, blocks, cp.exchange, cp.axis_name, directions, keep)
        out = context_parallel(engine, diff, static, h0, marks, doc_states, poison)
    outputs, final, finals = cast(tuple[PyTree, Array, Any], out)
    if seg is None:
        outputs = jax.tree.map(lambda y: y[:, :length], outputs)
    else:
        outputs = jax.tree.map(lambda y: unpack(y, seg), outputs)
        finals = finals[:, 0]
    outputs = recurrence.finalize(outputs, inputs)
    return outputs, final, finals


def default_block_size() -> int:
    """The tokens per block [`deltanet_cp.run`][] uses when `block_size` is `None`.

    Chosen per backend from measurements of the training step at Qwen3-Next's head sizes
    (see the benchmarks page): 512 tokens on a CPU (the training step's temporaries stay
    under 64 KiB per token at 4,096 tokens, and grow with the sequence by one state per
    block), 4,096 on a GPU or TPU (fewer ops on the sequential path: under 0.6 per token
    forward and backward, and fewer formed twice; one block's working set is a few GiB at
    those heads).
    """
    return _DEFAULT_BLOCK_SIZE.get(jax.default_backend(), _DEFAULT_BLOCK_SIZE["cpu"])


_DEFAULT_BLOCK_SIZE = {"cpu": 512, "gpu": 4096, "tpu": 4096}


class Blocking(NamedTuple):
    """`block_size` and `memory`, checked (static)."""

    size: int | None
    memory: Memory


def as_memory(memory: Any) -> "Memory | None":
    """`memory` as a plain `str` if it is `"low"` or `"high"` (a NumPy string too), `None` if
    it is `None`, else a `ValueError`."""
    if isinstance(memory, str) and memory in ("low", "high"):
        return cast(Memory, str(memory))  # a plain `str` (not `np.str_`): hashed as static
    if memory is not None:
        raise ValueError(
            f'`memory` must be "low" (the default: one state per block kept for the '
            f'backward) or "high" (every chunk\'s factors and state kept); got {memory!r}.'
        )
    return memory


def _blocking(block_size: int | None, memory: "Memory | None") -> Blocking:
    size = None if block_size is None else as_positive_index(block_size, "block_size")
    return Blocking(size, as_memory(memory) or "low")


def _chunks_per_block(blocking: Blocking, chunk_size: int) -> int:
    size = default_block_size() if blocking.size is None else blocking.size
    return max(1, size // chunk_size)


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


def _non_finite(
    inputs: PyTree, log_decays: tuple[bool, ...], output_only: tuple[bool, ...]
) -> tuple[Array, Array]:
    """`(B, T)` twice: whether any floating input of the token that reaches the state is
    NaN or infinite (`-inf` in a log decay excepted: a decay of zero, which the recurrences
    take as it is), and whether one that reaches only the token's own outputs is.

    A field of an inputs module declared with `eqx.field(metadata={"log_decay": True})` is
    a log decay; one declared with `eqx.field(metadata={"output_only": True})` (a query)
    reaches only the outputs of its own token, neither the state nor other tokens.
    """
    batch, length = _batch_and_length(inputs)
    bad = jnp.zeros((batch, length), bool)
    bad_out = jnp.zeros((batch, length), bool)
    for x, decay, out in zip(jax.tree.leaves(inputs), log_decays, output_only):
        if eqx.is_inexact_array(x):
            wrong = jnp.any(non_finite(x, decay).reshape(batch, length, -1), axis=2)
            if out:
                bad_out = bad_out | wrong
            else:
                bad = bad | wrong
    return bad, bad_out


def _leaf_flags(inputs: PyTree, key: str) -> tuple[bool, ...]:
    """Per leaf of `inputs` (flattened), whether its field's metadata sets `key` (as
    `eqx.field(metadata={key: True})`)."""
    leaves = jax.tree.leaves(inputs)
    if not dataclasses.is_dataclass(inputs):
        return (False,) * len(leaves)
    flags = []
    for f in dataclasses.fields(inputs):
        n = len(jax.tree.leaves(getattr(inputs, f.name)))
        flags += [bool(f.metadata.get(key, False))] * n
    if len(flags) != len(leaves):  # not a plain module of array fields: no flags
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


def _run_global(recurrence, inputs, initial_state, cu_seqlens, cp: ContextParallel, blocking):
    """`run` on global arrays: place them, then the `shard_map` (compiled once)."""
    assert cp.mesh is not None
    mesh = mesh_to_run_on(cp.mesh, inputs, initial_state, cu_seqlens)
    batch, length = _batch_and_length(inputs)
    n = mesh.shape[cp.axis_name]
    pieces = cp.layout.pieces(n)
    if length % pieces:
        raise ValueError(
            f"The sequence length ({length}) must be divisible by {pieces} (mesh axis "
            f"{cp.axis_name!r} has {n} devices, and layout={cp.layout!r} cuts the sequence "
            f"into {pieces} pieces): pad the sequence to a multiple of {pieces} (for example "
            "with g = 0, beta = 0 and zero q, k, v, which leaves the state unchanged) or pick "
            "a cp that divides it."
        )
    if cp.batch_axis is not None and batch % mesh.shape[cp.batch_axis]:
        size = mesh.shape[cp.batch_axis]
        raise ValueError(
            f"The batch size ({batch}) must be divisible by {size} (mesh axis "
            f"{cp.batch_axis!r}, the `batch_axis`, has {size} devices): pad the batch to a "
            f"multiple of {size} or pick a `batch_axis` whose size divides it."
        )
    if cu_seqlens is not None:
        if cp.batch_axis is not None:
            raise ValueError(
                "`cu_seqlens` packs documents into a batch of one: it cannot be combined with "
                "`batch_axis`."
            )
        # Known values are checked now; traced ones inside the shard_map, where every rank
        # can agree on them.
        cu_seqlens, values = cu_seqlens_array(cu_seqlens, batch), concrete_offsets(cu_seqlens)
        if values is not None:
            check_offsets(values, length)
    P = jax.sharding.PartitionSpec
    seq = P(cp.batch_axis, cp.axis_name)
    state = P(cp.batch_axis if cu_seqlens is None else None)

    def place(tree, spec):
        return jax.tree.map(
            lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)), tree
        )

    return _sharded(
        recurrence,
        place(inputs, seq),
        place(initial_state, state),
        place(cu_seqlens, P()),
        mesh=mesh,
        specs=(seq, state),
        cp=cp,
        blocking=blocking,
    )


@eqx.filter_jit
def _sharded(recurrence, inputs, initial_state, cu_seqlens, *, mesh, specs, cp, blocking):
    seq, state = specs
    n = mesh.shape[cp.axis_name]

    def per_rank(inputs, initial_state, cu_seqlens):
        if cu_seqlens is not None:
            total = _batch_and_length(inputs)[1] * n
            cu_seqlens = check_cu_seqlens(cu_seqlens, total, axis_name=cp.axis_name)
        return _per_rank(recurrence, inputs, initial_state, cu_seqlens, cp, blocking)

    P = jax.sharding.PartitionSpec
    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq, state, P()), out_specs=(seq, state))
    inputs = jax.tree.map(lambda x: cp.layout.to_layout(x, n, axis=1), inputs)
    outputs, final = fn(inputs, initial_state, cu_seqlens)
    return jax.tree.map(lambda y: cp.layout.from_layout(y, n, axis=1), outputs), final
