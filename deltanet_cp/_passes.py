"""The passes over a slice's chunks, and their hand-written VJPs.

Everything that does not depend on the state (a recurrence's `prepare`) runs batched over a
block of chunks; only the state recursion (`step`, affine in the state) walks the chunks one
by one. Blocks bound the working set: the factors of one block exist at a time, and a slice
that fits in one block has no loop around its factor work at all.

- forward: per block, the factors; then a scan of `step` over the block's chunks, keeping
  the state entering each block (not each chunk) for the backward.
- backward: per block (in reverse), the factors again and the VJP of `prepare`; the state
  entering each chunk again, from the block's (the state recursion alone); a reverse scan
  that carries only the state's cotangent (the VJP of `step` in `h`, which does not depend
  on `h` since `step` is affine in it); then every factor's cotangent batched over the
  block (`factor_cotangents`, from the states and the cotangents the scan emitted), pulled
  back through `prepare`. What the backward holds grows with the sequence by one state per
  block; the rest is one block's working set.
- the chunk maps (context parallelism's phase 1): per block, the factors; then `compose`
  over the block's chunks.
- with `memory="high"` (`Engine.keep`) every block's factors and `prepare`'s VJP are formed
  once (`kept_factors`) and read by every pass, and the forward keeps the state entering
  each chunk: the backward forms nothing again, for every chunk's factors in memory.

Packed documents: `marks = (start, end, empty)` per chunk the document starting / ending
there (or -1), per document whether it is empty; a document's first chunk starts from that
document's initial state, and the state after its last chunk is its final state.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from ._affine import AbstractAffineMap
from ._exchange import AbstractExchange
from ._recurrence import AbstractRecurrence
from ._sharding import cotangent_like, summed_like, varying


class Blocks(eqx.Module):
    """How a slice's `n` chunks of `c` tokens are cut into `count` blocks of `size` chunks.

    The inputs are padded with zero chunks (identity steps) up to `count * size`; `count`
    is as small as the block size allows and the blocks are balanced, so the padding is
    less than `count` chunks.
    """

    n: int = eqx.field(static=True)
    c: int = eqx.field(static=True)
    count: int = eqx.field(static=True)
    size: int = eqx.field(static=True)
    # Per input leaf (flattened), whether it is a log decay, which may hold -inf.
    log_decays: tuple[bool, ...] = eqx.field(static=True)

    @classmethod
    def of(cls, n: int, c: int, max_size: int, log_decays: tuple[bool, ...]) -> "Blocks":
        count = -(-n // max(1, max_size))
        return cls(n, c, count, -(-n // count), log_decays)

    @property
    def padded(self) -> int:
        """Chunks after padding: `count * size`."""
        return self.count * self.size

    def block(self, tree: PyTree, i, axis: int = 1) -> PyTree:
        """Block `i` of per-chunk values whose chunk axis is `axis`."""
        return jax.tree.map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, i * self.size, self.size, axis), tree
        )

    def read(self, tree: PyTree, i) -> PyTree:
        """Block `i` of per-token values `(B, padded * C, ...)` as `(size, B, C, ...)`."""
        n = self.size * self.c

        def one(x):
            x = jax.lax.dynamic_slice_in_dim(x, i * n, n, 1)
            return jnp.moveaxis(x.reshape(x.shape[0], self.size, self.c, *x.shape[2:]), 1, 0)

        return jax.tree.map(one, tree)

    def tokens(self, block: PyTree) -> PyTree:
        """One block's per-chunk values `(size, B, C, ...)` as `(B, size * C, ...)`."""

        def one(y):
            y = jnp.moveaxis(y, 0, 1)
            return y.reshape(y.shape[0], self.size * self.c, *y.shape[3:])

        return jax.tree.map(one, block)

    def join(self, blocks: PyTree) -> PyTree:
        """Every block's `(B, size * C, ...)`, stacked `(count, B, size * C, ...)`, as
        `(B, padded * C, ...)` (no copy for one block or a batch of one)."""

        def one(x):
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])

        return jax.tree.map(one, blocks)


def _over_blocks(body, carry, count: int, *, reverse: bool = False):
    """`body(carry, i)` for every block `i`, stacking what it emits; no loop for one block."""
    if count == 1:
        carry, ys = body(carry, 0)
        return carry, jax.tree.map(lambda y: y[None], ys)
    return jax.lax.scan(body, carry, jnp.arange(count), reverse=reverse)


def factors(recurrence, blocks: Blocks, diff: PyTree, static: PyTree) -> PyTree:
    """One block's factors, from its inputs `(B, size, C, ...)` split by `eqx.partition`.

    Non-finite inputs are read as zeros (NaN, infinities; `-inf` in a log decay is kept):
    the engine adds NaN back to the outputs and states they reach (`poison`), and zeros
    keep them from reaching earlier tokens through the chunk's products. Done here, inside
    the block, so that no cleaned copy of the inputs is ever stored.
    """
    leaves, treedef = jax.tree.flatten(eqx.combine(diff, static))

    def clean(x, decay):
        if not eqx.is_inexact_array(x):
            return x
        return jnp.where(non_finite(x, decay), jnp.zeros((), x.dtype), x)

    leaves = [clean(x, d) for x, d in zip(leaves, blocks.log_decays)]
    return recurrence.prepare(jax.tree.unflatten(treedef, leaves))


def non_finite(x, log_decay: bool):
    """Where a floating input is NaN or infinite; `-inf` in a log decay (a decay of zero,
    which the recurrences take as it is) excepted."""
    wrong = jnp.isnan(x) | (x == jnp.inf)
    return wrong if log_decay else wrong | (x == -jnp.inf)


def steps(recurrence, f, carry, marks, doc_states, poison, *, keep_states: bool):
    """The state recursion over one block's chunks.

    `carry = (h, finals)`: the state and the documents' final states (`None` without packed
    documents, or when they are not wanted). `poison`
    holds per chunk and batch row 0, or NaN where the chunk holds a non-finite input (its
    factors were formed from zeros there), added to the state leaving it. Returns the
    carry after the block and, per chunk, the outputs and (with `keep_states`) the state
    entering the chunk.
    """

    def body(carry, inp):
        h, finals = carry
        f_c, m, p = inp
        if m is not None:
            h = jnp.where(m[0] >= 0, doc_states[jnp.maximum(m[0], 0)], h)
        h_next, out = recurrence.step(f_c, h)
        h_next = h_next + p.reshape(p.shape + (1,) * (h_next.ndim - 1))
        if m is not None and finals is not None:
            e = m[1]
            slot = jnp.maximum(e, 0)
            finals = finals.at[slot].set(jnp.where(e >= 0, h_next, finals[slot]))
        return (h_next, finals), (out, h if keep_states else None)

    return jax.lax.scan(body, carry, (f, marks, poison))


def state_cotangents(recurrence, f, states, d_outputs, carry, marks, d_finals):
    """The reverse scan of one block: only the state's cotangent is carried.

    `carry = (dh, d_docs)`: the cotangent of the state leaving the block and the
    documents' initial states' cotangents (or `None`). Returns the carry for the block
    before and, per chunk, the cotangent of the state leaving it (what the factors'
    cotangents need).
    """

    def pull_state(f_c, h, d_out, d_next):
        _, pull = jax.vjp(lambda h: recurrence.step(f_c, h), h)
        return pull((d_next, d_out))[0]

    def body(carry, inp):
        d_next, d_docs = carry
        f_c, h, d_out, m = inp
        if m is not None:
            e = m[1]
            d_next = d_next + jnp.where(e >= 0, d_finals[jnp.maximum(e, 0)], 0 * d_next)
        dh = pull_state(f_c, h, d_out, d_next)
        if m is not None:
            s = m[0]
            slot = jnp.maximum(s, 0)
            d_docs = d_docs.at[slot].add(jnp.where(s >= 0, dh, jnp.zeros_like(dh)))
            dh = jnp.where(s >= 0, jnp.zeros_like(dh), dh)
        return (dh, d_docs), d_next

    return jax.lax.scan(body, carry, (f, states, d_outputs, marks), reverse=True)


def chunk_states(recurrence, f, h, marks, doc_states, poison):
    """The state entering each of a block's chunks, from the state entering the block.

    The backward's recomputation: the forward keeps one state per block, and the state
    recursion is a small share of the work (its outputs are not formed again).
    """
    _, (_, states) = steps(recurrence, f, (h, None), marks, doc_states, poison, keep_states=True)
    return states


def composes(recurrence, f, running: AbstractAffineMap, marks, doc_states, poison):
    """One block's chunks appended to a running map (phase 1), one `compose` per chunk.

    With packed documents, a document's first chunk is preceded by the constant map to
    that document's initial state ($M = 0$, and `resets`: what enters it is forgotten
    exactly, even a non-finite state, wherever the map is composed or applied). The
    recurrence composes the chunk into the map without the flag, which a chunk never
    changes. `poison` as in `steps`, added to the map's offset.
    """

    def body(running, inp):
        f_c, m, p = inp
        resets = running.resets
        if m is not None:
            s = m[0]
            reset = jax.tree.map(jnp.zeros_like, running.with_resets(None))
            reset = eqx.tree_at(lambda m: m.U, reset, doc_states[jnp.maximum(s, 0)])
            reset = reset.with_resets(True)
            running = jax.tree.map(lambda a, b: jnp.where(s >= 0, a, b), reset, running)
            resets = running.resets
        running = recurrence.compose(f_c, running.with_resets(None)).with_resets(resets)
        u = running.U + p.reshape(p.shape + (1,) * (running.U.ndim - 1))
        return eqx.tree_at(lambda m: m.U, running, u), None

    running, _ = jax.lax.scan(body, running, (f, marks, poison))
    return running


# ---------------------------------------------------------------------------------------
# The whole slice: a pass over all blocks, and the three phases of context parallelism.
# Inputs arrive as `(B, padded, C, ...)` (split by `eqx.partition`), outputs leave as
# `(B, padded * C, ...)`, kept states as `(count, *state)`; `marks` holds the per-chunk
# `(start, end)`, `(padded,)` each, and the per-document `empty`; `poison` is the pair
# `(per chunk (padded, B): 0 or NaN added to the state leaving it, per token
# (B, padded * C): whether the output is NaN)`.


def _marks(marks):
    return None if marks is None else marks[:2]


def _masked(tree: PyTree, mask, value) -> PyTree:
    """`value` where `mask` `(size, B, C)` is set, else `tree`'s `(size, B, C, ...)` leaves."""

    def one(x):
        m = mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))
        return jnp.where(m, jnp.asarray(value, x.dtype), x)

    return jax.tree.map(one, tree)


def _output_cotangents(blocks, d_outputs, poison, i) -> PyTree:
    """Block `i`'s output cotangents `(size, B, C, ...)`, zero where the output was NaN."""
    return _masked(blocks.read(d_outputs, i), blocks.read(poison[1], i), 0)


def kept_factors(recurrence, blocks: Blocks, diff, static) -> PyTree:
    """Every block's factors and the VJP of `prepare` that formed them, stacked over the
    blocks: what the engine keeps under `memory="high"`, so that no pass forms a factor
    again (phase 1, phase 3 and the backward all read them)."""

    def body(_, i):
        d, s = blocks.block((diff, static), i)
        f, pull = jax.vjp(lambda d: factors(recurrence, blocks, d, s), d)
        return None, (f, pull)

    return _over_blocks(body, None, blocks.count)[1]


def _factors_of(recurrence, blocks: Blocks, diff, static, kept, i) -> PyTree:
    """Block `i`'s factors: read from `kept`, or formed."""
    if kept is not None:
        return _chunk(kept[0], i)
    return factors(recurrence, blocks, *blocks.block((diff, static), i))


def forward(
    recurrence, blocks, diff, static, h0, marks, doc_states, poison, *, keep_states: bool, kept=None
):
    """All blocks from `h0`: `((h, finals, outputs), states)`, `states` the state entering
    each block (`(count, *state)`; `None` without `keep_states`), or with `kept` factors
    (see `kept_factors`) the state entering each chunk (`(count, size, *state)`).

    Each block's outputs leave the loop in the token layout `(B, size * C, ...)`, NaN where
    `poison[1]` says a non-finite input came before them in their chunk.
    """
    finals = None
    if marks is not None:
        empty = marks[2].reshape((-1,) + (1,) * (doc_states.ndim - 1))
        finals = jnp.where(empty, doc_states, jnp.zeros((), doc_states.dtype))
        # A scan carry updated from per-rank states (`doc_states` may be replicated).
        finals = varying(finals, diff)

    per_chunk = keep_states and kept is not None

    def body(carry, i):
        h, finals = carry
        f = _factors_of(recurrence, blocks, diff, static, kept, i)
        m, p = blocks.block((_marks(marks), poison[0]), i, axis=0)
        carry, (out, hs) = steps(recurrence, f, carry, m, doc_states, p, keep_states=per_chunk)
        out = blocks.tokens(_masked(out, blocks.read(poison[1], i), jnp.nan))
        return carry, (out, hs if per_chunk else h if keep_states else None)

    (h, finals), (outputs, states) = _over_blocks(body, (h0, finals), blocks.count)
    return (h, finals, blocks.join(outputs)), states


def backward(recurrence, blocks, diff, static, states, marks, doc_states, poison, cts, kept=None):
    """The cotangents of `(diff, h0, doc_states)` given those of `(outputs, h, finals)`;
    `states` the state entering each block, or with `kept` factors each chunk."""
    d_outputs, d_h, d_finals = cts
    d_docs = None
    if marks is not None:
        empty = marks[2].reshape((-1,) + (1,) * (d_h.ndim))
        d_docs = jnp.where(empty, d_finals, jnp.zeros((), d_finals.dtype))
    d_diff = jax.tree.map(jnp.zeros_like, diff)

    def body(carry, i):
        dh, d_docs, d_diff = carry
        m, p = blocks.block((_marks(marks), poison[0]), i, axis=0)
        if kept is None:
            d, s = blocks.block((diff, static), i)
            f, pull = jax.vjp(lambda d: factors(recurrence, blocks, d, s), d)
            h = chunk_states(recurrence, f, states[i], m, doc_states, p)
        else:
            f, pull = _chunk(kept, i)
            h = states[i]
        d_out = _output_cotangents(blocks, d_outputs, poison, i)
        (dh, d_docs), d_next = state_cotangents(recurrence, f, h, d_out, (dh, d_docs), m, d_finals)
        d_f = recurrence.factor_cotangents(f, h, d_next, d_out)
        d_diff = jax.tree.map(
            lambda b, x: jax.lax.dynamic_update_slice_in_dim(b, x, i * blocks.size, 1),
            d_diff,
            pull(summed_like(d_f, f))[0],
        )
        return (dh, d_docs, d_diff), None

    count = blocks.count
    (dh0, d_docs, d_diff), _ = _over_blocks(body, (d_h, d_docs, d_diff), count, reverse=True)
    return d_diff, dh0, d_docs


def state_cotangent_in(
    recurrence, blocks, diff, static, states, marks, poison, d_outputs, d_finals, kept=None
):
    """What the outputs (and documents' finals) ask of the state entering the slice.

    The backward's first reverse scan under context parallelism: the cotangent of the
    incoming state with nothing asked of the slice's final state. No factor cotangents.
    """
    zero = jnp.zeros_like(states[0] if kept is None else states[0, 0])
    d_docs = None if marks is None else jnp.zeros_like(d_finals)

    def body(dh, i):
        f = _factors_of(recurrence, blocks, diff, static, kept, i)
        m = blocks.block(_marks(marks), i, axis=0)
        # `step` is affine in the state: its VJP in the state does not depend on where it is
        # taken, so no chunk state is formed again here.
        h = (
            states[i]
            if kept is not None
            else jnp.broadcast_to(states[i], (blocks.size, *states.shape[1:]))
        )
        d_out = _output_cotangents(blocks, d_outputs, poison, i)
        (dh, _), _ = state_cotangents(recurrence, f, h, d_out, (dh, d_docs), m, d_finals)
        return dh, None

    dh, _ = _over_blocks(body, zero, blocks.count, reverse=True)
    return dh


def local_map(
    recurrence,
    blocks,
    diff,
    static,
    marks,
    doc_states,
    poison,
    identity: AbstractAffineMap,
    kept=None,
):
    """The affine map of the whole slice (phase 1): the blocks' chunks composed in order.

    With packed documents the map tracks where it resets (a document starts in the slice).
    """
    if marks is not None:
        identity = varying(identity.with_resets(False), diff)

    def body(running, i):
        f = _factors_of(recurrence, blocks, diff, static, kept, i)
        m, p = blocks.block((_marks(marks), poison[0]), i, axis=0)
        return composes(recurrence, f, running, m, doc_states, p), None

    running, _ = _over_blocks(body, identity, blocks.count)
    return running


def _chunk(tree: PyTree, i) -> PyTree:
    return jax.tree.map(lambda x: x[i], tree)


# ---------------------------------------------------------------------------------------
# The custom VJPs: one device (a pass), and context parallelism (three phases).


class Engine(eqx.Module):
    """What the passes over one rank's slice of a walk are configured by: the custom VJPs'
    one non-differentiable argument (static, hashed with the trace).

    - `recurrence`: the recurrence.
    - `blocks`: how the slice's chunks are cut into blocks.
    - `exchange`: the exchange of maps over `axis_name`; `None` on one device.
    - `axis_name`: the context-parallel mesh axis; `None` on one device.
    - `keep`: the backward keeps every chunk's factors, the VJP of `prepare` and the
        state entering each chunk (`memory="high"`), instead of one state per block, the
        factors and chunk states formed again (`"low"`).
    - `reverse`: per walk, in chain order, whether it visits the ranks from the last to
        the first. Several walks (a zigzag shard's two pieces) are stacked on the batch
        axis, walk `w` in rows `w * B, ..., (w + 1) * B - 1`: phases 1 and 3 run once over
        all of them, batched, and only the exchanges go walk after walk, each starting
        from the state the one before ends in.
    """

    recurrence: AbstractRecurrence = eqx.field(static=True)
    blocks: Blocks = eqx.field(static=True)
    exchange: AbstractExchange | None = eqx.field(static=True, default=None)
    axis_name: str | None = eqx.field(static=True, default=None)
    reverse: tuple[bool, ...] = eqx.field(static=True, default=(False,))
    keep: bool = eqx.field(static=True, default=False)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def local(engine: Engine, diff, static, h0, marks, doc_states, poison):
    """One pass over all chunks from `h0`: `(outputs, final_state, document_finals)`."""
    args = (diff, static, h0, marks, doc_states, poison)
    return _local_fwd(engine, *args, keep=False)[0]


def _local_fwd(engine: Engine, diff, static, h0, marks, doc_states, poison, *, keep=True):
    recurrence, blocks = engine.recurrence, engine.blocks
    kept = kept_factors(recurrence, blocks, diff, static) if keep and engine.keep else None
    (h, finals, outputs), states = forward(
        recurrence,
        blocks,
        diff,
        static,
        varying(h0, diff),
        marks,
        doc_states,
        poison,
        keep_states=keep,
        kept=kept,
    )
    # `h0` is kept for its type only: its cotangent must vary over the mesh axes it does.
    return (outputs, h, finals), (diff, static, states, marks, doc_states, poison, h0, kept)


def _local_bwd(engine: Engine, res, cts):
    diff, static, states, marks, doc_states, poison, h0, kept = res
    d_outputs, d_h, d_finals = cts
    cts = (d_outputs, varying(d_h, diff), d_finals)
    d_diff, dh0, d_docs = backward(
        engine.recurrence, engine.blocks, diff, static, states, marks, doc_states, poison, cts, kept
    )
    dh0, d_docs = cotangent_like((dh0, d_docs), (h0, doc_states))
    return d_diff, None, dh0, None, d_docs, None


local.defvjp(_local_fwd, _local_bwd)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def context_parallel(engine: Engine, diff, static, h0, marks, doc_states, poison):
    """The three phases: `(outputs, final_state, document_finals or None)`."""
    return _three_phases(engine, diff, static, h0, marks, doc_states, poison, keep=False)[0]


def _three_phases(engine: Engine, diff, static, h0, marks, doc_states, poison, *, keep=True):
    recurrence, blocks, exchange = engine.recurrence, engine.blocks, engine.exchange
    assert exchange is not None and engine.axis_name is not None
    identity = _identity(recurrence, blocks, diff, static)
    kept = kept_factors(recurrence, blocks, diff, static) if keep and engine.keep else None
    mine = local_map(recurrence, blocks, diff, static, marks, doc_states, poison, identity, kept)
    walks = len(engine.reverse)
    h_in, h_final = [], h0
    for w, reverse in enumerate(engine.reverse):  # in chain order
        h, h_final = exchange(
            _walk(mine, w, walks), h_final, axis_name=engine.axis_name, reverse=reverse
        )
        h_in.append(h)
    h_in = varying(jnp.concatenate(h_in, axis=0), diff)
    (_, finals, outputs), states = forward(
        recurrence,
        blocks,
        diff,
        static,
        h_in,
        marks,
        doc_states,
        poison,
        keep_states=keep,
        kept=kept,
    )
    return (outputs, h_final, finals), (mine, states, kept)


def _walk(maps: AbstractAffineMap, w: int, walks: int) -> AbstractAffineMap:
    """Walk `w`'s rows of maps of `walks` walks stacked on the batch axis."""
    if walks == 1:
        return maps
    return jax.tree.map(lambda x: x.reshape(walks, -1, *x.shape[1:])[w], maps)


def _identity(recurrence, blocks, diff, static) -> AbstractAffineMap:
    """The identity map of the shape a chunk map of this slice has, varying like `diff`."""

    def chunk_map(d, s):
        f = factors(recurrence, blocks, *blocks.block((d, s), 0))
        return recurrence.chunk_map(_chunk(f, 0))

    shapes = eqx.filter_eval_shape(chunk_map, diff, static)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return varying(zeros.identity_like(), diff)


def _context_parallel_fwd(engine: Engine, diff, static, h0, marks, doc_states, poison):
    out, (mine, states, kept) = _three_phases(engine, diff, static, h0, marks, doc_states, poison)
    # `h0` is kept for its type only: its cotangent must vary over the mesh axes it does.
    return out, (diff, static, states, marks, doc_states, poison, mine, h0, kept)


def _context_parallel_bwd(engine: Engine, res, cts):
    # The backward has three phases too. The cotangent of the state entering rank r is
    # lambda_r = g_r + M_r^T lambda_{r+1}, with g_r what rank r's own outputs ask of it: an
    # affine map of lambda_{r+1}, so the exchange composes these maps walking the ranks the
    # other way, starting from the final state's cotangent. Nothing per chunk is kept but
    # the states of phase 3.
    recurrence, blocks, exchange = engine.recurrence, engine.blocks, engine.exchange
    assert exchange is not None and engine.axis_name is not None
    diff, static, states, marks, doc_states, poison, mine, h0, kept = res
    d_outputs, d_final, d_finals = cts
    g = state_cotangent_in(
        recurrence, blocks, diff, static, states, marks, poison, d_outputs, d_finals, kept
    )
    adjoints = mine.adjoint(g)
    walks = len(engine.reverse)
    lam_next, lam0 = [], d_final
    for w in reversed(range(walks)):  # the chain backwards: each walk's from the next's
        lam, lam0 = exchange(
            _walk(adjoints, w, walks),
            lam0,
            axis_name=engine.axis_name,
            reverse=not engine.reverse[w],
        )
        lam_next.insert(0, lam)
    cts = (d_outputs, varying(jnp.concatenate(lam_next, axis=0), diff), d_finals)
    d_diff, _, d_docs = backward(
        recurrence, blocks, diff, static, states, marks, doc_states, poison, cts, kept
    )
    d_docs = None if d_docs is None else jax.lax.psum(d_docs, engine.axis_name)
    lam0, d_docs = cotangent_like((lam0, d_docs), (h0, doc_states))
    return d_diff, None, lam0, None, d_docs, None


context_parallel.defvjp(_context_parallel_fwd, _context_parallel_bwd)
