"""The depthwise causal convolution of the Gated DeltaNet layer, sequence-sharded by a halo."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray


class CausalConv1d(eqx.Module):
    r"""A depthwise causal 1-D convolution over time, without bias.

    $y_{t,c} = \sum_{j=0}^{W-1} w_{c,j} \, x_{t-W+1+j,\,c}$: the last tap multiplies the
    current token, and the $W - 1$ inputs before the first token come from `state` (zeros if
    `None`). This is `torch.nn.Conv1d(C, C, W, groups=C, padding=W-1, bias=False)` cut to
    the first `T` outputs, the convolution of Qwen3-Next and Qwen3.5.

    Sequence-sharded (inside `jax.shard_map`, time split contiguously over `axis_name`),
    each rank needs only the last $W - 1$ inputs of the rank before it: one
    `lax.ppermute` of `(W - 1, channels)` elements.
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

    def __call__(
        self,
        x: Float[Array, "seq channels"],
        state: Float[Array, "history channels"] | None = None,
        *,
        axis_name: str | None = None,
        return_state: bool = False,
    ) -> tuple[Float[Array, "seq channels"], Float[Array, "history channels"] | None]:
        """**Arguments:**

        - `x`: the inputs, `(seq, channels)`; with `axis_name`, this rank's slice of time.
        - `state`: the `kernel_size - 1` inputs before the (global) first token; zeros if
            `None`. With `axis_name` it is used by rank 0 only and must be replicated.
        - `axis_name`: the `shard_map` axis that time is split over (contiguously, in rank
            order), or `None` on a single device.
        - `return_state`: also return the state after the last token: the last
            `kernel_size - 1` inputs of the whole sequence (replicated across ranks).

        **Returns:**

        `(y, state)`: `y` of shape `(seq, channels)` and, if `return_state`, the new state
        `(kernel_size - 1, channels)`, else `None`.
        """
        w = self.history
        t = x.shape[0]
        if state is None:
            state = jnp.zeros((w, x.shape[1]), x.dtype)
        state = state.astype(x.dtype)
        if axis_name is not None and w > 0:
            if t < w:
                raise ValueError(
                    f"Each rank needs at least kernel_size - 1 = {w} tokens for the "
                    f"sequence-sharded convolution; this rank has {t}. Use fewer ranks or a "
                    "longer sequence."
                )
            n = jax.lax.axis_size(axis_name)
            # Rank i's last W - 1 inputs go to rank i + 1; rank 0 receives nothing (zeros).
            halo = jax.lax.ppermute(x[t - w :], axis_name, [(i, i + 1) for i in range(n - 1)])
            first = jax.lax.axis_index(axis_name) == 0
            prev = jnp.where(first, state, halo)
        else:
            prev = state
        xp = jnp.concatenate([prev, x], axis=0)  # (w + t, channels)
        wt = self.weight.T.astype(x.dtype)  # (kernel, channels)
        y = xp[0:t] * wt[0:1]
        for j in range(1, self.kernel_size):
            y = y + xp[j : j + t] * wt[j : j + 1]
        if not return_state:
            return y, None
        new_state = xp[xp.shape[0] - w :]
        if axis_name is not None:
            # The sequence ends on the last rank; hand its tail to every rank.
            last = jax.lax.axis_index(axis_name) == jax.lax.axis_size(axis_name) - 1
            new_state = jax.lax.psum(
                jnp.where(last, new_state, jnp.zeros_like(new_state)), axis_name
            )
        return y, new_state
