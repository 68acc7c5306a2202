"""Causal softmax self-attention, context-parallel by all-gathering keys and values.

This is the O(S) baseline the design note compares the gated delta rule against: each rank
receives the keys and values of every other rank, `(cp - 1) / cp` of the sequence.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray


_HI = jax.lax.Precision.HIGHEST


def _rope(x: Float[Array, "seq heads dim"], positions: Array, theta: float) -> Array:
    """Rotary position embedding (the half-split convention of Llama / Qwen)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class CausalSelfAttention(eqx.Module):
    """Multi-head causal softmax self-attention with rotary position embeddings.

    Inside `jax.shard_map` with time sharded contiguously over `axis_name`, every rank
    all-gathers the keys and values of the whole sequence and attends from its own queries
    (at their global positions): a payload of `(cp - 1) / cp * S * 2 * heads * head_dim`
    elements per rank and layer, growing with the sequence length `S`.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10_000.0,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `num_heads`: the number of attention heads (queries, keys and values alike).
        - `head_dim`: the size of each head (even, for the rotary embedding).
        - `rope_theta`: the base of the rotary embedding's frequencies.
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        if head_dim % 2:
            raise ValueError(f"`head_dim` must be even for rotary embeddings; got {head_dim}.")
        kq, kk, kv, ko = jr.split(key, 4)
        inner = num_heads * head_dim
        self.q_proj = eqx.nn.Linear(hidden_size, inner, use_bias=False, key=kq, dtype=dtype)
        self.k_proj = eqx.nn.Linear(hidden_size, inner, use_bias=False, key=kk, dtype=dtype)
        self.v_proj = eqx.nn.Linear(hidden_size, inner, use_bias=False, key=kv, dtype=dtype)
        self.o_proj = eqx.nn.Linear(inner, hidden_size, use_bias=False, key=ko, dtype=dtype)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta

    def __call__(
        self, x: Float[Array, "seq hidden"], *, axis_name: str | None = None
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: one sequence, `(seq, hidden)`; with `axis_name`, this rank's contiguous slice.
        - `axis_name`: the `shard_map` axis that time is sharded over, or `None`.

        **Returns:**

        The output, `(seq, hidden)`.
        """
        t = x.shape[0]

        def heads(lin):
            return jax.vmap(lin)(x).reshape(t, self.num_heads, self.head_dim)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * t
        pos_q = offset + jnp.arange(t)
        q, k = _rope(q, pos_q, self.rope_theta), _rope(k, pos_q, self.rope_theta)
        if axis_name is not None:
            k = jax.lax.all_gather(k, axis_name, axis=0, tiled=True)
            v = jax.lax.all_gather(v, axis_name, axis=0, tiled=True)
        pos_k = jnp.arange(k.shape[0])
        scores = jnp.einsum("qhd,khd->hqk", q, k, precision=_HI).astype(jnp.float32)
        scores = scores * jnp.float32(self.head_dim**-0.5)
        mask = (pos_q[:, None] >= pos_k[None, :])[None]
        scores = jnp.where(mask, scores, jnp.float32(-jnp.inf))
        p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("hqk,khd->qhd", p, v, precision=_HI)
        return jax.vmap(self.o_proj)(o.reshape(t, self.num_heads * self.head_dim))
