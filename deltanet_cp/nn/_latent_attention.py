"""Multi-head latent attention (MLA) as Kimi Linear computes it: keys and values expanded per
token from a compressed latent, which is what the cache holds and what context parallelism
exchanges.

The blockwise kernel is `_flash.py`'s; the latent exchange (all-gather or ring of the
latents, each rank expanding what it receives) is `latent_attention` there.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._parallel import axis_size, ContextParallel
from .._precision import as_precision, PrecisionName, resolve_precision
from .._validate import as_positive_index
from ._context import documents, layer_cp, local_positions
from ._flash import cached_attention, decode_attention, latent_attention, merge_attention
from ._mixer import AbstractTokenMixer
from ._norm import RMSNorm
from ._schedule import check_kv_schedule, KVSchedule


class LatentKVCache(eqx.Module):
    """The compressed keys and values a [`deltanet_cp.nn.MultiHeadLatentAttention`][] has
    seen, for decoding (what transformers' cache holds for Kimi Linear's attention).

    **Fields:**

    - `latent`: `(capacity, kv_lora_rank)`, the normed key/value latent of each token
        (after `kv_a_layernorm`, before `kv_b_proj`).
    - `k_rot`: `(capacity, qk_rope_head_dim)`, the key part every head shares.

    Entry `p` is the token at position `p`; entries at or past the number of tokens seen
    are ignored (the caller keeps that number, the next position). Both may carry the same
    leading batch axes (to be `jax.vmap`ped over with the input).
    """

    latent: Float[Array, "*batch capacity kv_lora_rank"]
    k_rot: Float[Array, "*batch capacity qk_rope_head_dim"]


class _Expand(eqx.Module):
    """The per-token expansion of the compressed latents `[latent, k_rot]` into keys
    `(seq, heads, qk_nope + qk_rope)` and values `(seq, heads, v)`: `kv_b_proj` on the
    latent, split into the keys' first part and the values, and `k_rot` broadcast to every
    head after the keys' first part (transformers' `expand_kv`)."""

    kv_b_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)

    def __call__(self, c: Float[Array, "seq latent"]) -> tuple[Array, Array]:
        t, h, r, dn = c.shape[0], self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim
        latent, k_rot = c[:, :r], c[:, r:]
        kv = jax.vmap(self.kv_b_proj)(latent.astype(self.kv_b_proj.weight.dtype))
        kv = kv.reshape(t, h, -1)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        k_rot = jnp.broadcast_to(k_rot[:, None, :], (t, h, k_rot.shape[-1]))
        return jnp.concatenate([k_nope, k_rot.astype(k_nope.dtype)], axis=-1), v


class MultiHeadLatentAttention(AbstractTokenMixer):
    r"""Multi-head latent attention (MLA) without position embeddings: Kimi Linear's full
    attention layer (transformers' `KimiLinearAttention`, DeepSeek-V2's MLA with NoPE).

    Per token $x$, with $H$ heads:

    1. queries $q = x W_q$ (or $q = \mathrm{rms}(x W_{qa}) W_{qb}$ with `q_lora_rank`),
        $H$ heads of $d_n + d_r$ (`qk_nope_head_dim + qk_rope_head_dim`);
    2. the compressed latent $[c, k_r] = x W_{kva}$ (`kv_a_proj_with_mqa`): $c$ of
        `kv_lora_rank` features, normed by an RMSNorm (`kv_a_layernorm`), and the shared key
        part $k_r$ of $d_r$;
    3. per head, $[k_n, v] = c W_{kvb}$ (`kv_b_proj`), the keys $k = [k_n, k_r]$ ($k_r$ the
        same for every head) and the values $v$ of `v_head_dim`;
    4. causal softmax attention, scaled by $(d_n + d_r)^{-1/2}$, no rotary embedding;
    5. the output projection `o_proj` of the heads' `H * v_head_dim` outputs.

    The scores are computed in `(tile_size, tile_size)` tiles with an online softmax by the
    kernel of [`deltanet_cp.nn.CausalSelfAttention`][] (memory linear in the sequence
    length; tiles wholly in the future of their queries, or outside a packed document,
    never computed).

    **Context parallelism.** Inside `jax.shard_map` with time sharded over `cp.axis_name`
    (pass a [`deltanet_cp.ContextParallel`][] as `cp`), the other ranks' keys and values
    travel as their compressed latents $[c, k_r]$, `kv_lora_rank + qk_rope_head_dim`
    numbers per token, and each rank expands what it receives through `kv_b_proj` (exact:
    the expansion is per token). Full keys and values would be
    `num_heads * (qk_nope + qk_rope + v_head_dim)` numbers per token: at Kimi-Linear-48B's
    sizes (512 + 64 against 32 * (192 + 128)) the latent is 17.8 times smaller. With
    `kv_schedule="allgather"` the latents are all-gathered (the backward reduce-scatters
    their gradients): a rank receives `(cp - 1) / cp * S * (kv_lora_rank +
    qk_rope_head_dim)` numbers per layer forward, and expands the whole sequence's,
    `2 S kv_lora_rank H (d_n + d_v)` flops per rank and layer. With `"ring"` the expanded
    keys and values go around the ring, as [`deltanet_cp.nn.CausalSelfAttention`][]'s do.

    **Decoding.** A [`deltanet_cp.nn.LatentKVCache`][] holds the compressed latents:
    `prefill` attends to the cached tokens as well and writes the new latents (context
    parallel or not), `step` does one token (expanding the cache as transformers does).
    """

    q_proj: eqx.nn.Linear | None
    q_a_proj: eqx.nn.Linear | None
    q_a_layernorm: RMSNorm | None
    q_b_proj: eqx.nn.Linear | None
    kv_a_proj_with_mqa: eqx.nn.Linear
    kv_a_layernorm: RMSNorm
    kv_b_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    q_lora_rank: int | None = eqx.field(static=True)
    tile_size: int = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        attention_bias: bool = False,
        norm_eps: float = 1e-6,
        tile_size: int = 128,
        precision: PrecisionName | None = None,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `num_heads`: the number of heads (of queries, keys and values alike).
        - `kv_lora_rank`: the width of the key/value latent.
        - `qk_nope_head_dim`: the per-head part of each query and key head.
        - `qk_rope_head_dim`: the part of each key head that every head shares (and of each
            query head that reads it). Kimi Linear turns no rotary embedding on it.
        - `v_head_dim`: the size of each value head.
        - `q_lora_rank`: the width of the queries' low-rank bottleneck (`q_a_proj`, an
            RMSNorm, `q_b_proj`); `None` for one `q_proj` (Kimi Linear).
        - `attention_bias`: biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (as
            transformers puts them).
        - `norm_eps`: the epsilon of the latents' RMSNorms (transformers' default, `1e-6`,
            not the config's `rms_norm_eps`).
        - `tile_size`: the side of the score tiles, as for
            [`deltanet_cp.nn.CausalSelfAttention`][].
        - `precision`: how the score tiles' products multiply, as for
            [`deltanet_cp.nn.CausalSelfAttention`][] (`None`: from the parameters' dtype).
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `ValueError` for a size below 1 (`TypeError` for one that is not an integer).
        """
        hidden_size = as_positive_index(hidden_size, "hidden_size")
        num_heads = as_positive_index(num_heads, "num_heads")
        kv_lora_rank = as_positive_index(kv_lora_rank, "kv_lora_rank")
        qk_nope_head_dim = as_positive_index(qk_nope_head_dim, "qk_nope_head_dim")
        qk_rope_head_dim = as_positive_index(qk_rope_head_dim, "qk_rope_head_dim")
        v_head_dim = as_positive_index(v_head_dim, "v_head_dim")
        if q_lora_rank is not None:
            q_lora_rank = as_positive_index(q_lora_rank, "q_lora_rank")
        tile_size = as_positive_index(tile_size, "tile_size")
        precision = as_precision(precision)
        kq, kqb, kkv, kkvb, ko = jr.split(key, 5)
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim

        def linear(i, o, k, bias=False):
            return eqx.nn.Linear(i, o, use_bias=bias, key=k, dtype=dtype)

        if q_lora_rank is None:
            self.q_proj = linear(hidden_size, num_heads * qk_head_dim, kq)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(hidden_size, q_lora_rank, kq, attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps, dtype=dtype)
            self.q_b_proj = linear(q_lora_rank, num_heads * qk_head_dim, kqb)
        self.kv_a_proj_with_mqa = linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, kkv, attention_bias
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps, dtype=dtype)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), kkvb)
        self.o_proj = linear(num_heads * v_head_dim, hidden_size, ko, attention_bias)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_lora_rank = q_lora_rank
        self.tile_size = tile_size
        self.precision = precision

    # -----------------------------------------------------------------------------------
    # Caches
    # -----------------------------------------------------------------------------------

    def init_cache(self, capacity: int, dtype=None) -> LatentKVCache:
        """An empty cache for `capacity` tokens.

        **Arguments:**

        - `capacity`: the most tokens (prompt and generated) the cache holds.
        - `dtype`: the dtype of the latents; the parameters' if `None`.
        """
        capacity = as_positive_index(capacity, "capacity")
        dtype = self.kv_a_proj_with_mqa.weight.dtype if dtype is None else dtype
        return LatentKVCache(
            latent=jnp.zeros((capacity, self.kv_lora_rank), dtype),
            k_rot=jnp.zeros((capacity, self.qk_rope_head_dim), dtype),
        )

    def init_state(self, dtype=None, *, capacity: int | None = None) -> LatentKVCache:
        """`init_cache(capacity, dtype)`: the token mixers' common name (see
        [`deltanet_cp.nn.AbstractTokenMixer`][]); `capacity` is required.

        **Raises:**

        `ValueError` without `capacity`.
        """
        if capacity is None:
            raise ValueError(
                "MultiHeadLatentAttention.init_state needs `capacity=`, the most tokens its "
                "latent cache holds."
            )
        return self.init_cache(capacity, dtype)

    # -----------------------------------------------------------------------------------
    # The computation
    # -----------------------------------------------------------------------------------

    def _check_input(self, x: Array, ndim: int, where: str) -> None:
        if x.ndim != ndim or x.shape[-1] != self.hidden_size:
            want = "(seq, hidden_size)" if ndim == 2 else "(hidden_size,)"
            raise ValueError(
                f"MultiHeadLatentAttention.{where} takes one sequence's input of shape "
                f"{want} with hidden_size = {self.hidden_size}; got shape {x.shape} "
                "(vmap over a batch axis)."
            )

    def _check_cache(self, cache: LatentKVCache, where: str) -> None:
        r, dr = self.kv_lora_rank, self.qk_rope_head_dim
        ok = (
            cache.latent.ndim == 2
            and cache.k_rot.ndim == 2
            and cache.latent.shape[0] == cache.k_rot.shape[0]
            and cache.latent.shape[1] == r
            and cache.k_rot.shape[1] == dr
        )
        if not ok:
            raise ValueError(
                f"MultiHeadLatentAttention.{where}: the cache must hold `latent` "
                f"(capacity, {r}) and `k_rot` (capacity, {dr}) (from `init_cache`); got "
                f"{cache.latent.shape} and {cache.k_rot.shape}."
            )

    def _expansion(self) -> _Expand:
        return _Expand(self.kv_b_proj, self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim)

    def _project(self, x: Float[Array, "seq hidden"]) -> tuple[Array, Array]:
        """The queries `(seq, heads, qk_nope + qk_rope)` and the compressed latents
        `[latent, k_rot]`, `(seq, kv_lora_rank + qk_rope)`, the latent normed."""
        t = x.shape[0]
        if self.q_proj is not None:
            q = jax.vmap(self.q_proj)(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = jax.vmap(self.q_b_proj)(self.q_a_layernorm(jax.vmap(self.q_a_proj)(x)))
        q = q.reshape(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        c = jax.vmap(self.kv_a_proj_with_mqa)(x)
        r = self.kv_lora_rank
        latent = self.kv_a_layernorm(c[:, :r])
        return q, jnp.concatenate([latent, c[:, r:].astype(latent.dtype)], axis=-1)

    def _finish(self, o: Array) -> Float[Array, "seq hidden"]:
        o = o.reshape(o.shape[0], self.num_heads * self.v_head_dim)
        return jax.vmap(self.o_proj)(o.astype(self.o_proj.weight.dtype))

    def _precision(self, q: Array, c: Array) -> PrecisionName:
        return resolve_precision(self.precision, q, c, self.kv_b_proj.weight)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        state: LatentKVCache | None = None,
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
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`); `None` on one device. With [`deltanet_cp.Zigzag`][] the causal work
            is the same on every rank; `cp.exchange` plays no part here.
        - `cu_seqlens`: packed documents: the global offsets `[0, ..., S]` of the
            documents of the (whole, with `cp`) sequence, as for
            [`deltanet_cp.nn.CausalSelfAttention`][]: each token attends only to the
            tokens before it in its own document.
        - `kv_schedule`: how the keys and values reach every rank: `"allgather"` (one
            all-gather of the latents, then one expansion of the whole sequence's) or
            `"ring"` (`cp - 1` steps of `jax.lax.ppermute` of the expanded keys and values,
            `O(S / cp)` memory per rank). Ignored without `cp`.
        - `v_first`: ignored (RWKV-7's; every token mixer takes it).

        **Returns:**

        The output, `(seq, hidden)`.

        **Raises:**

        `ValueError` for a `state`, an input of the wrong shape, or `cu_seqlens` that do
        not start at 0, end at the sequence length or increase.
        """
        del v_first
        if state is not None:
            raise ValueError(
                "MultiHeadLatentAttention.__call__ takes no `state`: to attend to cached "
                "tokens as well, call `prefill(x, cache, length)`."
            )
        self._check_input(x, 2, "__call__")
        check_kv_schedule(kv_schedule)
        cp = layer_cp(cp, "MultiHeadLatentAttention")
        rel = local_positions(cp, x.shape[0])
        docs = None if cu_seqlens is None else documents(cp, x.shape[0], cu_seqlens)
        q, c = self._project(x)
        out, _ = latent_attention(
            q,
            c,
            self._expansion(),
            rel,
            cp=cp,
            kv_schedule=kv_schedule,
            tile_size=self.tile_size,
            precision=self._precision(q, c),
            cu_seqlens=None if docs is None else docs.cu_seqlens,
        )
        return self._finish(out)

    def extend(
        self,
        x: Float[Array, "seq hidden"],
        state: LatentKVCache,
        position: Int[Array, ""] | int,
        /,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Float[Array, "seq heads v"] | None = None,
        checkpoint_every: int | None = None,
    ) -> tuple[Float[Array, "seq hidden"], LatentKVCache, None]:
        """`prefill(x, state, position, cp=cp, kv_schedule=kv_schedule)` and no checkpoints
        (see [`deltanet_cp.nn.AbstractTokenMixer.extend`][])."""
        del v_first, checkpoint_every
        y, cache = self.prefill(x, state, position, cp=cp, kv_schedule=kv_schedule)
        return y, cache, None

    def prefill(
        self,
        x: Float[Array, "seq hidden"],
        cache: LatentKVCache,
        length: Int[Array, ""] | int,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
    ) -> tuple[Float[Array, "seq hidden"], LatentKVCache]:
        """`__call__` after `length` earlier tokens held in a cache, writing the new latents
        into it.

        **Arguments:**

        - `x`: the next tokens, `(seq, hidden)`; with `cp`, this rank's shard of them.
        - `cache`: the latents of the `length` earlier tokens, replicated on every rank
            with `cp`. The queries attend to those too (the cache expanded once); it must
            hold `length + ` the whole sequence's tokens.
        - `length`: how many tokens `cache` holds (the position of the first token of `x`).
        - `cp`, `kv_schedule`: as for `__call__`.

        **Returns:**

        `(output, new_cache)`, the new cache the same on every rank: under context
        parallelism the new latents are all-gathered into it, in sequence order.
        """
        self._check_input(x, 2, "prefill")
        self._check_cache(cache, "prefill")
        check_kv_schedule(kv_schedule)
        cp = layer_cp(cp, "MultiHeadLatentAttention")
        rel = local_positions(cp, x.shape[0])
        q, c = self._project(x)
        precision = self._precision(q, c)
        expand = self._expansion()
        out, lse = latent_attention(
            q,
            c,
            expand,
            rel,
            cp=cp,
            kv_schedule=kv_schedule,
            tile_size=self.tile_size,
            return_lse=True,
            precision=precision,
        )
        assert lse is not None
        k_old, v_old = expand(jnp.concatenate([cache.latent, cache.k_rot], axis=-1))
        old = cached_attention(q, k_old, v_old, length, self.tile_size, precision=precision)
        o = merge_attention(old, (out, lse)).astype(v_old.dtype)
        if cp is not None:
            # Every rank's latents, the same on every rank, in sequence order.
            gathered = jax.lax.all_gather(c, cp.axis_name, axis=0, tiled=True, to="invarying")
            c = cp.layout.from_layout(gathered, axis_size(cp), axis=0)
        r = self.kv_lora_rank
        new_cache = LatentKVCache(
            latent=jax.lax.dynamic_update_slice_in_dim(
                cache.latent, c[:, :r].astype(cache.latent.dtype), length, 0
            ),
            k_rot=jax.lax.dynamic_update_slice_in_dim(
                cache.k_rot, c[:, r:].astype(cache.k_rot.dtype), length, 0
            ),
        )
        return self._finish(o), new_cache

    def step(
        self,
        x: Float[Array, " hidden"],
        cache: LatentKVCache,
        position: Int[Array, ""] | int | None = None,
        *,
        v_first: Array | None = None,
    ) -> tuple[Float[Array, " hidden"], LatentKVCache]:
        """One token of generation.

        **Arguments:**

        - `x`: the new token's input, `(hidden,)`.
        - `cache`: the latents of the `position` tokens before it.
        - `position`: the token's position (how many tokens the cache holds), below the
            cache's capacity (required: `None` is a `ValueError`).
        - `v_first`: ignored (RWKV-7's; every token mixer takes it).

        **Returns:**

        `(y, new_cache)`: the output `(hidden,)` and the cache with the token's latents
        written at `position`.
        """
        del v_first
        if position is None:
            raise ValueError(
                "MultiHeadLatentAttention.step needs `position`, the new token's position "
                "(how many tokens its cache holds)."
            )
        self._check_input(x, 1, "step")
        self._check_cache(cache, "step")
        position = jnp.asarray(position, jnp.int32)
        q, c = self._project(x[None])
        r = self.kv_lora_rank
        cache = LatentKVCache(
            latent=jax.lax.dynamic_update_slice_in_dim(
                cache.latent, c[:, :r].astype(cache.latent.dtype), position, 0
            ),
            k_rot=jax.lax.dynamic_update_slice_in_dim(
                cache.k_rot, c[:, r:].astype(cache.k_rot.dtype), position, 0
            ),
        )
        k, v = self._expansion()(jnp.concatenate([cache.latent, cache.k_rot], axis=-1))
        o = decode_attention(q[0], k, v, position, precision=self._precision(q, c))
        return self._finish(o[None].astype(v.dtype))[0], cache
