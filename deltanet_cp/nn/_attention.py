"""Causal softmax self-attention: grouped-query, optionally gated, with rotary embeddings and
a key/value cache; context parallel in both layouts.

The blockwise (flash-style) kernel is in `_flash.py`, its tile schedules in `_schedule.py`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._parallel import axis_size, ContextParallel
from .._precision import (
    as_precision,
    PrecisionName,
    resolve_precision,
)
from .._validate import as_index, as_positive_index
from ._context import documents, layer_cp, local_positions
from ._flash import (
    blockwise_attention,
    cached_attention,
    decode_attention,
    merge_attention,
)
from ._mixer import AbstractTokenMixer
from ._norm import ZeroCenteredRMSNorm
from ._schedule import check_kv_schedule, KVSchedule


class KVCache(eqx.Module):
    """The keys and values a [`deltanet_cp.nn.CausalSelfAttention`][] has seen, for decoding.

    **Fields:**

    - `k`, `v`: `(capacity, kv_heads, head_dim)`, entry `p` for the token at position `p`
        (keys after the rotary embedding). Entries at or past the number of tokens seen
        are ignored; the caller keeps that number (the next position).

    Both may carry the same leading batch axes (to be `jax.vmap`ped over with the input).
    """

    k: Float[Array, "*batch capacity kv_heads dim"]
    v: Float[Array, "*batch capacity kv_heads dim"]


def _rope(
    x: Float[Array, "seq heads dim"], positions: Array, theta: float, rotary_dim: int | None = None
) -> Array:
    """Rotary position embedding (the half-split convention of Llama / Qwen) on the first
    `rotary_dim` features of each head (all if `None`); the others pass through."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:rotary_dim].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


class CausalSelfAttention(AbstractTokenMixer):
    """Causal softmax self-attention with rotary position embeddings: multi-head or
    grouped-query, optionally with an output gate and q/k norms (Qwen3.5's attention).

    The scores are computed in `(tile_size, tile_size)` tiles with an online softmax
    (flash attention): memory grows linearly with the sequence length, forward and
    backward (which recomputes the tiles), and tiles wholly in the future of their queries
    are never computed. With `num_kv_heads < num_heads`, query head `h` reads key/value
    head `h // (num_heads // num_kv_heads)` (grouped-query attention), and only
    `num_kv_heads` heads of keys and values are stored, exchanged and cached.

    Inside `jax.shard_map` with time sharded over `cp.axis_name` (pass a
    [`deltanet_cp.ContextParallel`][] as `cp`), every rank attends from its own queries
    (at their global positions) to the keys and values of the whole sequence, received by
    one all-gather or around a ring (`kv_schedule`): a payload of
    `(cp - 1) / cp * S * 2 * num_kv_heads * head_dim` elements per rank and layer either
    way, growing with the sequence length `S`.

    Memory per rank is linear in the sequence length: no score matrix is ever held, only
    one tile of it. The all-gather holds the keys and values of the whole sequence,
    `O(S)` per rank. The ring holds one rank's piece of them at a time, `O(S / cp)` per
    rank, forward and backward: its steps are a loop, and its backward saves only the
    local queries, keys, values, output and log-sum-exp, then passes the keys and values
    around the ring again with accumulators of their gradients (which one more step
    brings home: the backward sends `cp - 1` pieces of keys and values and `cp` of their
    gradients, in the accumulation dtype).

    With `cp.layout = Contiguous()` the causal work is unbalanced: rank `r` computes about
    `(2 r + 1) / cp` times the average rank's tiles, so the last rank does
    `(2 cp - 1) / cp` times the average (1.75 at `cp = 4`) and every step waits for it,
    with either exchange (the ring's steps skip the future ranks' keys, so the early ranks
    idle). With `cp.layout = Zigzag()` every rank computes the same tiles' worth of work: the
    causal ideal plus half a tile per query block on the two diagonals, a fraction
    `tile_size / S` more.

    For generation, a [`deltanet_cp.nn.KVCache`][] holds the keys and values seen so far:
    `prefill` attends to it as well and writes the new keys and values into it (context
    parallel or not), `step` does one token.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    q_norm: ZeroCenteredRMSNorm | None
    k_norm: ZeroCenteredRMSNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rotary_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    output_gate: bool = eqx.field(static=True)
    tile_size: int = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int | None = None,
        rope_theta: float = 10_000.0,
        rotary_dim: int | None = None,
        output_gate: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        tile_size: int = 128,
        precision: PrecisionName | None = None,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `num_heads`: the number of query heads.
        - `head_dim`: the size of each head.
        - `num_kv_heads`: the number of key/value heads, dividing `num_heads`; `num_heads`
            if `None` (multi-head attention).
        - `rope_theta`: the base of the rotary embedding's frequencies.
        - `rotary_dim`: how many features of each head (the first ones, an even number)
            the rotary embedding turns; all of them if `None`. Qwen3.5: a quarter.
        - `output_gate`: gate the attention output per head and feature by
            `sigmoid(gate)`, the gate projected by `q_proj` beside the queries (its rows
            per head: `head_dim` of query, then `head_dim` of gate, as in Qwen3.5).
        - `qk_norm`: a [`deltanet_cp.nn.ZeroCenteredRMSNorm`][] over each query and key
            head before the rotary embedding (Qwen3.5).
        - `norm_eps`: the epsilon of the q/k norms.
        - `tile_size`: the side of the score tiles, in queries and in keys (the Gated
            DeltaNet layers' `block_size` is another quantity, the engine's). A sequence
            (on one device), local sequence (`Contiguous`) or zigzag piece (`Zigzag`, half
            the local sequence) shorter than it is one tile; a longer one must be a
            multiple of it (a `ValueError` at call time says which value to pass otherwise).
        - `precision`: how the score tiles' products (`q k^T`, `p v`, and their backward)
            and the decoding step's multiply: `"highest"` (float32 operands at
            `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32 accumulation),
            `"default"` (`jax.default_matmul_precision`), or `None`: from the queries,
            keys and values, which are in the parameters' dtype (`"bfloat16"` for
            bfloat16 parameters, `"highest"` otherwise). The softmax statistics and the
            accumulators stay float32 under every policy. The projections are
            `equinox.nn.Linear`s: they multiply in the parameters' dtype at JAX's default
            precision whatever the policy.
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        hidden_size = as_positive_index(hidden_size, "hidden_size")
        num_heads = as_positive_index(num_heads, "num_heads")
        head_dim = as_positive_index(head_dim, "head_dim")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        num_kv_heads = as_positive_index(num_kv_heads, "num_kv_heads")
        rotary_dim = as_index(head_dim if rotary_dim is None else rotary_dim, "rotary_dim")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"`num_kv_heads` ({num_kv_heads}) must divide `num_heads` ({num_heads})."
            )
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"`rotary_dim` must be even and in (0, head_dim = {head_dim}]; got {rotary_dim}."
            )
        tile_size = as_positive_index(tile_size, "tile_size")
        precision = as_precision(precision)
        kq, kk, kv, ko = jr.split(key, 4)
        inner, kv_inner = num_heads * head_dim, num_kv_heads * head_dim

        def linear(i, o, k):
            return eqx.nn.Linear(i, o, use_bias=False, key=k, dtype=dtype)

        self.q_proj = linear(hidden_size, inner * (2 if output_gate else 1), kq)
        self.k_proj = linear(hidden_size, kv_inner, kk)
        self.v_proj = linear(hidden_size, kv_inner, kv)
        self.o_proj = linear(inner, hidden_size, ko)
        if qk_norm:
            self.q_norm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps, dtype=dtype)
            self.k_norm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.rope_theta = rope_theta
        self.output_gate = output_gate
        self.tile_size = tile_size
        self.precision = precision

    def init_cache(self, capacity: int, dtype=None) -> KVCache:
        """An empty cache for `capacity` tokens.

        **Arguments:**

        - `capacity`: the most tokens (prompt and generated) the cache holds.
        - `dtype`: the dtype of the keys and values; the parameters' if `None`.
        """
        dtype = self.k_proj.weight.dtype if dtype is None else dtype
        shape = (capacity, self.num_kv_heads, self.head_dim)
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def init_state(self, dtype=None, *, capacity: int | None = None) -> KVCache:
        """`init_cache(capacity, dtype)`: the token mixers' common name (see
        [`deltanet_cp.nn.AbstractTokenMixer`][]); `capacity` is required.

        **Raises:**

        `ValueError` without `capacity`.
        """
        if capacity is None:
            raise ValueError(
                "CausalSelfAttention.init_state needs `capacity=`, the most tokens its "
                "key/value cache holds."
            )
        return self.init_cache(capacity, dtype)

    def _project(self, x, pos):
        """Queries, keys (both normed and turned), values and the output gate (or `None`)."""
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q = jax.vmap(self.q_proj)(x)
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q.reshape(t, h, 2 * d), 2, axis=-1)
            gate = gate.reshape(t, h * d)
        q = q.reshape(t, h, d)
        k = jax.vmap(self.k_proj)(x).reshape(t, self.num_kv_heads, d)
        v = jax.vmap(self.v_proj)(x).reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rope(q, pos, self.rope_theta, self.rotary_dim)
        k = _rope(k, pos, self.rope_theta, self.rotary_dim)
        return q, k, v, gate

    def _finish(self, o, gate):
        """The output gate and projection: `(seq, hidden)`."""
        o = o.reshape(o.shape[0], self.num_heads * self.head_dim)
        if gate is not None:
            o = o * jax.nn.sigmoid(gate.astype(o.dtype))
        return jax.vmap(self.o_proj)(o.astype(self.o_proj.weight.dtype))

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        state: KVCache | None = None,
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Array | None = None,
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: one sequence, `(seq, hidden)`; with `cp`, this rank's shard of it.
        - `state`: must be `None` (the call of every token mixer takes it; to attend to
            cached tokens as well, call `prefill` with the cache and its length).
        - `cu_seqlens`: packed documents: the global offsets `[0, ..., S]` of the
            documents of the (whole, with `cp`) sequence, a list or an integer array, as the
            recurrent layers take them. Each token attends only to the tokens before it in
            its own document (tiles wholly outside a document are skipped), and the rotary
            positions restart at 0 at each document's first token: the output equals each
            document's run alone. A repeated offset is an empty document (rows padded to
            one width with repeated `S` are `jax.vmap`ped over).
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`); `None` on one device. With [`deltanet_cp.Zigzag`][] the causal work
            is the same on every rank; `cp.exchange` plays no part here.
        - `kv_schedule`: how the keys and values reach every rank: `"allgather"` (one
            all-gather; each rank then computes only the tiles its queries need) or
            `"ring"` (`cp - 1` steps of `jax.lax.ppermute` in a loop, attending to one
            rank's keys per step in one online softmax, with `O(S / cp)` memory per rank;
            with `Zigzag` every rank computes the same number of tiles at every step).
            Ignored without `cp`.
        - `v_first`: ignored (RWKV-7's; every token mixer takes it).

        **Returns:**

        The output, `(seq, hidden)`.

        **Raises:**

        `ValueError` for a `state`, or for `cu_seqlens` that do not start at 0, end at
        the sequence length or increase.
        """
        del v_first
        if state is not None:
            raise ValueError(
                "CausalSelfAttention.__call__ takes no `state`: to attend to cached tokens "
                "as well, call `prefill(x, cache, length)`."
            )
        check_kv_schedule(kv_schedule)
        cp = layer_cp(cp, "CausalSelfAttention")
        rel = local_positions(cp, x.shape[0])
        docs = None if cu_seqlens is None else documents(cp, x.shape[0], cu_seqlens)
        # Global positions mask the scores; in-document positions turn the queries and keys.
        q, k, v, gate = self._project(x, rel if docs is None else docs.positions)
        out, _ = blockwise_attention(
            q,
            k,
            v,
            rel,
            cp=cp,
            kv_schedule=kv_schedule,
            tile_size=self.tile_size,
            precision=resolve_precision(self.precision, q, k, v),
            cu_seqlens=None if docs is None else docs.cu_seqlens,
        )
        return self._finish(out, gate)

    def extend(
        self,
        x: Float[Array, "seq hidden"],
        state: KVCache,
        position: Int[Array, ""] | int,
        /,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Float[Array, "seq heads v"] | None = None,
        checkpoint_every: int | None = None,
    ) -> tuple[Float[Array, "seq hidden"], KVCache, None]:
        """`prefill(x, state, position, cp=cp, kv_schedule=kv_schedule)` and no checkpoints
        (see [`deltanet_cp.nn.AbstractTokenMixer.extend`][])."""
        del v_first, checkpoint_every
        y, cache = self.prefill(x, state, position, cp=cp, kv_schedule=kv_schedule)
        return y, cache, None

    def prefill(
        self,
        x: Float[Array, "seq hidden"],
        cache: KVCache,
        length: Int[Array, ""] | int,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
    ) -> tuple[Float[Array, "seq hidden"], KVCache]:
        """`__call__` after `length` earlier tokens held in a cache, writing the new keys
        and values into it.

        **Arguments:**

        - `x`: the next tokens, `(seq, hidden)`; with `cp`, this rank's shard of them.
        - `cache`: the keys and values of the `length` earlier tokens, replicated on every
            rank with `cp`. The queries attend to those too; it must hold `length + ` the
            whole sequence's tokens.
        - `length`: how many tokens `cache` holds (the position of the first token of `x`).
        - `cp`, `kv_schedule`: as for `__call__`.

        **Returns:**

        `(output, new_cache)`, the new cache the same on every rank: under context
        parallelism the new keys and values are all-gathered into it, in sequence order.
        """
        check_kv_schedule(kv_schedule)
        cp = layer_cp(cp, "CausalSelfAttention")
        rel = local_positions(cp, x.shape[0])
        q, k, v, gate = self._project(x, rel + length)
        precision = resolve_precision(self.precision, q, k, v)
        out, lse = blockwise_attention(
            q,
            k,
            v,
            rel,
            cp=cp,
            kv_schedule=kv_schedule,
            tile_size=self.tile_size,
            return_lse=True,
            precision=precision,
        )
        assert lse is not None
        old = cached_attention(q, cache.k, cache.v, length, self.tile_size, precision=precision)
        o = merge_attention(old, (out, lse)).astype(v.dtype)
        if cp is not None:
            # Every rank's keys and values, the same on every rank (an invariant value),
            # in sequence order.
            k, v = (
                cp.layout.from_layout(
                    jax.lax.all_gather(a, cp.axis_name, axis=0, tiled=True, to="invarying"),
                    axis_size(cp),
                    axis=0,
                )
                for a in (k, v)
            )
        new_cache = KVCache(
            k=jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), length, 0),
            v=jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), length, 0),
        )
        return self._finish(o, gate), new_cache

    def step(
        self,
        x: Float[Array, " hidden"],
        cache: KVCache,
        position: Int[Array, ""] | int | None = None,
        *,
        v_first: Array | None = None,
    ) -> tuple[Float[Array, " hidden"], KVCache]:
        """One token of generation.

        **Arguments:**

        - `x`: the new token's input, `(hidden,)`.
        - `cache`: the keys and values of the `position` tokens before it.
        - `position`: the token's position (how many tokens the cache holds), below the
            cache's capacity (required: `None` is a `ValueError`).
        - `v_first`: ignored (RWKV-7's; every token mixer takes it).

        **Returns:**

        `(y, new_cache)`: the output `(hidden,)` and the cache with the token's key and
        value written at `position`.
        """
        del v_first
        if position is None:
            raise ValueError(
                "CausalSelfAttention.step needs `position`, the new token's position (how "
                "many tokens its cache holds)."
            )
        position = jnp.asarray(position, jnp.int32)
        q, k, v, gate = self._project(x[None], position[None])
        cache = KVCache(
            k=jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), position, 0),
            v=jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), position, 0),
        )
        precision = resolve_precision(self.precision, q, k, v)
        o = decode_attention(q[0], cache.k, cache.v, position, precision=precision)
        return self._finish(o[None].astype(v.dtype), gate)[0], cache
