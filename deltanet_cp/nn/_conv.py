"""The depthwise causal convolution of the Gated DeltaNet layer, sequence-sharded by a halo."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._layout import check_layout, Contiguous, Layout, Zigzag, zigzag_half


class CausalConv1d(eqx.Module):
    r"""A depthwise causal 1-D convolution over time, without bias.

    $y_{t,c} = \sum_{j=0}^{W-1} w_{c,j} \, x_{t-W+1+j,\,c}$: the last tap multiplies the
    current token, and the $W - 1$ inputs before the first token come from `state` (zeros if
    `None`). This is `torch.nn.Conv1d(C, C, W, groups=C, padding=W-1, bias=False)` cut to
    the first `T` outputs, the convolution of Qwen3-Next and Qwen3.5.

    Sequence-sharded (inside `jax.shard_map`, time split over `axis_name`), each contiguous
    piece of the sequence needs only the last $W - 1$ inputs of the piece before it (its
    *halo*), a `(W - 1, channels)` block; nothing else crosses ranks.

    - Under [`deltanet_cp.Contiguous`][], rank `r` receives the halo of rank `r - 1`
        (rank 0 uses `state`): one `lax.ppermute`.
    - Under [`deltanet_cp.Zigzag`][], rank `r` holds pieces `r` and `2 cp - 1 - r`. Its
        first piece receives the tail of rank `r - 1`'s first piece (rank 0 uses `state`);
        its second piece the tail of rank `r + 1`'s second piece, except on the last rank,
        whose second piece (`cp`) follows its own first piece (`cp - 1`). Two
        `lax.ppermute`s, one forward and one backward, and no all-gather.

    With `return_state`, the final state (the last $W - 1$ inputs of the sequence) is
    broadcast from the rank holding the sequence's last piece with one `lax.psum`.
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
        if kernel_size < 1:
            raise ValueError(f"`kernel_size` must be at least 1; got {kernel_size}.")
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
        self, x: Float[Array, "seq channels"], prev: Float[Array, "history channels"]
    ) -> tuple[Float[Array, "seq channels"], Float[Array, "history channels"]]:
        """Convolve one contiguous segment given the `history` inputs before it.

        **Returns:**

        `(y, tail)`: the outputs and the segment's last `history` inputs (reaching into
        `prev` when the segment is shorter than that).
        """
        w, t = self.history, x.shape[0]
        xp = jnp.concatenate([prev, x], axis=0)  # (w + t, channels)
        wt = self.weight.T.astype(x.dtype)  # (kernel, channels)
        y = xp[0:t] * wt[0:1]
        for j in range(1, self.kernel_size):
            y = y + xp[j : j + t] * wt[j : j + 1]
        return y, xp[xp.shape[0] - w :]

    def __call__(
        self,
        x: Float[Array, "seq channels"],
        state: Float[Array, "history channels"] | None = None,
        *,
        axis_name: str | None = None,
        return_state: bool = False,
        layout: Layout = Contiguous(),
    ) -> tuple[Float[Array, "seq channels"], Float[Array, "history channels"] | None]:
        """**Arguments:**

        - `x`: the inputs, `(seq, channels)`; with `axis_name`, this rank's shard of time:
            under `Contiguous()` at least `kernel_size - 1` tokens, under `Zigzag()` an even
            number, each of its two pieces at least `kernel_size - 1` tokens.
        - `state`: the `kernel_size - 1` inputs before the (global) first token; zeros if
            `None`. With `axis_name` it is used by rank 0 only and must be replicated.
        - `axis_name`: the `shard_map` axis that time is split over, or `None` on a single
            device.
        - `return_state`: also return the state after the last token: the last
            `kernel_size - 1` inputs of the whole sequence (replicated across ranks).
        - `layout`: how time is laid out over `axis_name`: [`deltanet_cp.Contiguous`][]
            (rank order is sequence order; the default) or [`deltanet_cp.Zigzag`][] (rank
            `r` holds pieces `r` and `2 cp - 1 - r` of `2 cp`, as
            [`deltanet_cp.to_zigzag`][] lays them out). Ignored without `axis_name`.

        **Returns:**

        `(y, state)`: `y` of shape `(seq, channels)`, in the same layout as `x`, and, if
        `return_state`, the new state `(kernel_size - 1, channels)`, else `None`.
        """
        check_layout(layout, "CausalConv1d")
        w = self.history
        t = x.shape[0]
        if state is None:
            state = jnp.zeros((w, x.shape[1]), x.dtype)
        state = state.astype(x.dtype)
        if axis_name is not None and isinstance(layout, Zigzag):
            zigzag_half(t)  # an odd shard is an error, with or without a halo
        if axis_name is None or w == 0:
            # One device, or a kernel without history: nothing crosses ranks.
            y, tail = self._segment(x, state)
            if not return_state:
                return y, None
            # Without history the state is empty: `state` itself, replicated like it.
            return y, tail if w > 0 else state
        n = jax.lax.axis_size(axis_name)
        rank = jax.lax.axis_index(axis_name)
        forward = [(i, i + 1) for i in range(n - 1)]
        if isinstance(layout, Contiguous):
            if t < w:
                raise ValueError(
                    f"Each rank needs at least kernel_size - 1 = {w} tokens for the "
                    f"sequence-sharded convolution; this rank has {t}. Use fewer ranks or a "
                    "longer sequence."
                )
            # Rank i's last W - 1 inputs go to rank i + 1; rank 0 receives nothing (zeros).
            halo = jax.lax.ppermute(x[t - w :], axis_name, forward)
            y, tail = self._segment(x, jnp.where(rank == 0, state, halo))
            source = n - 1  # the sequence ends on the last rank
        else:
            half = zigzag_half(t)
            if half < w:
                raise ValueError(
                    f"Under layout=Zigzag() each of a rank's two pieces needs at least "
                    f"kernel_size - 1 = {w} tokens for the sequence-sharded convolution; "
                    f"this rank's pieces have {half} (local length {t}). Use fewer ranks or a "
                    f"longer sequence (at least {2 * w} tokens per rank)."
                )
            first, second = x[:half], x[half:]
            # First pieces run in rank order: rank i's first tail goes to rank i + 1.
            first_halo = jax.lax.ppermute(first[half - w :], axis_name, forward)
            # Second pieces run in reverse rank order: rank i + 1's second tail goes to i.
            backward = [(i + 1, i) for i in range(n - 1)]
            second_halo = jax.lax.ppermute(second[half - w :], axis_name, backward)
            y_first, first_tail = self._segment(first, jnp.where(rank == 0, state, first_halo))
            # The last rank's second piece (cp) follows its own first piece (cp - 1).
            y_second, tail = self._segment(
                second, jnp.where(rank == n - 1, first_tail, second_halo)
            )
            y = jnp.concatenate([y_first, y_second], axis=0)
            source = 0  # the sequence ends with rank 0's second piece
        if not return_state:
            return y, None
        # Hand the tail of the sequence's last piece to every rank.
        new_state = jax.lax.psum(jnp.where(rank == source, tail, jnp.zeros_like(tail)), axis_name)
        return y, new_state
