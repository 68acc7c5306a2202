"""The depthwise causal convolution of the Gated DeltaNet layer, sequence-sharded by a halo."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._layout import Contiguous
from .._packing import as_cu_seqlens
from .._parallel import ContextParallel
from .._shift import halos
from .._validate import as_positive_index
from ._context import layer_cp


class CausalConv1d(eqx.Module):
    r"""A depthwise causal 1-D convolution over time, without bias.

    $y_{t,c} = \sum_{j=0}^{W-1} w_{c,j} \, x_{t-W+1+j,\,c}$: the last tap multiplies the
    current token, and the $W - 1$ inputs before the first token come from `state` (zeros if
    `None`). This is `torch.nn.Conv1d(C, C, W, groups=C, padding=W-1, bias=False)` cut to
    the first `T` outputs, the convolution of Qwen3-Next and Qwen3.5.

    Sequence-sharded (inside `jax.shard_map`, time split over `cp.axis_name`), each
    contiguous piece of the sequence needs only the last $W - 1$ inputs of the piece before
    it (its *halo*), a `(W - 1, channels)` block; nothing else crosses ranks. The layout's
    walks (`walks` of [`deltanet_cp.AbstractLayout`][]) say which piece comes before which:
    along a walk, each rank receives the tail of the previous rank in walk order, one
    `lax.ppermute` per walk; a walk's first piece continues from `state` (the first walk)
    or from the last piece of the walk before it.

    - Under [`deltanet_cp.Contiguous`][], rank `r` receives the halo of rank `r - 1`
        (rank 0 uses `state`): one `lax.ppermute`.
    - Under [`deltanet_cp.Zigzag`][], rank `r` holds pieces `r` and `2 cp - 1 - r`. Its
        first piece receives the tail of rank `r - 1`'s first piece (rank 0 uses `state`);
        its second piece the tail of rank `r + 1`'s second piece, except on the last rank,
        whose second piece (`cp`) follows its own first piece (`cp - 1`). Two
        `lax.ppermute`s, one forward and one backward, and no all-gather.

    The final state (the last $W - 1$ inputs of the sequence) is broadcast from the rank
    holding the sequence's last piece with one `lax.psum`; left unused, XLA drops it and
    its collective.
    """

    weight: Float[Array, "channels kernel"]
    channels: int = eqx.field(static=True)
    kernel_size: int = eqx.field(static=True)

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        *,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `channels`: the number of channels (each has its own filter).
        - `kernel_size`: the filter length `W` (the current token and `W - 1` before it).
        - `key`: a PRNG key for the initial weights, `U(-1/sqrt(W), 1/sqrt(W))` as in torch.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        kernel_size = as_positive_index(kernel_size, "kernel_size")
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        lim = 1 / math.sqrt(kernel_size)
        self.weight = jr.uniform(key, (channels, kernel_size), dtype, -lim, lim)
        self.channels = channels
        self.kernel_size = kernel_size

    @property
    def history(self) -> int:
        """`kernel_size - 1`: the inputs a segment needs from before its first token."""
        return self.kernel_size - 1

    def _segment(
        self,
        x: Float[Array, "seq channels"],
        prev: Float[Array, "history channels"],
        reach: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq channels"], Float[Array, "history channels"]]:
        """Convolve one contiguous segment given the `history` inputs before it.

        `reach`: per token, how many tokens back its document goes (its distance from the
        document's first token); a tap further back reads zero. `None`: no documents.

        **Returns:**

        `(y, tail)`: the outputs and the segment's last `history` inputs (reaching into
        `prev` when the segment is shorter than that).
        """
        w, t = self.history, x.shape[0]
        xp = jnp.concatenate([prev, x], axis=0)  # (w + t, channels)
        wt = self.weight.T.astype(x.dtype)  # (kernel, channels)

        def tap(j):  # the inputs `w - j` tokens back, times their weight
            back = xp[j : j + t]
            if reach is not None and j < w:
                back = jnp.where((reach >= w - j)[:, None], back, jnp.zeros((), x.dtype))
            return back * wt[j : j + 1]

        y = tap(0)
        for j in range(1, self.kernel_size):
            y = y + tap(j)
        return y, xp[xp.shape[0] - w :]

    def __call__(
        self,
        x: Float[Array, "seq channels"],
        state: Float[Array, "history channels"] | None = None,
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> tuple[Float[Array, "seq channels"], Float[Array, "history channels"]]:
        """**Arguments:**

        - `x`: the inputs, `(seq, channels)`; with `cp`, this rank's shard of time, in
            `cp.layout`'s order: each of its pieces (the shard under `Contiguous()`, each
            half under `Zigzag()`) at least `kernel_size - 1` tokens.
        - `state`: the `kernel_size - 1` inputs before the (global) first token; zeros if
            `None`. With `cp` it must be replicated.
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`); `None` on one device.
        - `cu_seqlens`: packed documents, `[0, ..., T]` over the whole sequence (a list
            or an int array, as for [`deltanet_cp.run`][]): no tap reads across a
            document's start: the inputs before a document's first token read as zeros,
            `state` included (pass `cu_seqlens` without it).

        **Returns:**

        `(y, state)`: `y` of shape `(seq, channels)`, in the same layout as `x`, and the
        state after the last token, `(kernel_size - 1, channels)`: the last
        `kernel_size - 1` inputs of the whole sequence (replicated across ranks; with
        `cu_seqlens`, zeros where they belong to an earlier document than the last
        token's).
        """
        cp = layer_cp(cp, "CausalConv1d")
        w = self.history
        t = x.shape[0]
        if state is None:
            state = jnp.zeros((w, x.shape[1]), x.dtype)
        state = state.astype(x.dtype)
        total = t if cp is None else t * jax.lax.axis_size(cp.axis_name)
        cu, reach = None, None
        if cu_seqlens is not None:
            axis_name = None if cp is None else cp.axis_name
            cu = as_cu_seqlens(cu_seqlens, 1, total, axis_name=axis_name)
            layout = Contiguous() if cp is None else cp.layout
            reach = _reach(cu, layout.positions(t, axis_name))
        if cp is None:
            y, tail = self._segment(x, state, reach)
            # Without history the state is empty: `state` itself, replicated like it.
            tail = tail if w > 0 else state
            return y, tail if cu is None else _last_document(tail, cu, total)
        n = jax.lax.axis_size(cp.axis_name)
        # A shard that does not cut into whole pieces is an error, with or without a halo.
        walks = cp.layout.walks(t, n)
        if w == 0:  # a kernel without history: nothing crosses ranks
            return self._segment(x, state, reach)[0], state
        piece = t // len(walks)
        if piece < w:
            raise ValueError(
                f"The sequence-sharded convolution needs at least kernel_size - 1 = {w} tokens "
                f"in each piece of a rank's shard; under layout={cp.layout!r} this rank's "
                f"{t} tokens are {len(walks)} piece(s) of {piece}. Use fewer ranks or a longer "
                f"sequence (at least {w * len(walks)} tokens per rank)."
            )
        pieces, tail, holder = halos(x, w, state, cp, axis=0)
        ys = [
            self._segment(piece, halo, None if reach is None else reach[walk.local])[0]
            for (piece, halo), walk in zip(pieces, walks)
        ]
        # Hand the tail of the sequence's last piece to every rank.
        rank = jax.lax.axis_index(cp.axis_name)
        final = jnp.where(rank == holder, tail, jnp.zeros_like(tail))
        final = jax.lax.psum(final, cp.axis_name)
        return jnp.concatenate(ys, axis=0), final if cu is None else _last_document(
            final, cu, total
        )


def _reach(cu: Int[Array, " docs_plus_one"], positions: Int[Array, " seq"]) -> Int[Array, " seq"]:
    """Per token at global `positions`, its distance from its document's first token."""
    starts = cu[jnp.searchsorted(cu, positions, side="right") - 1]
    return positions - starts


def _last_document(tail: Array, cu: Array, total: int) -> Array:
    """The sequence's last `history` inputs with those before the last token's document
    zeroed."""
    w = tail.shape[0]
    if w == 0 or total == 0:
        return tail
    positions = total - w + jnp.arange(w, dtype=jnp.int32)
    reach = _reach(cu, jnp.asarray([total - 1], jnp.int32))[0]
    keep = positions >= total - 1 - reach
    return jnp.where(keep[:, None], tail, jnp.zeros((), tail.dtype))
