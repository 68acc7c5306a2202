"""A tiny hybrid language model: Gated DeltaNet layers with one softmax-attention layer in four."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._parallel import ContextParallel
from .._precision import as_precision, PrecisionName
from .._validate import as_positive_index
from ._attention import CausalSelfAttention
from ._context import layer_cp
from ._gated_delta_net import GatedDeltaNet
from ._schedule import KVSchedule
from ._tokens import check_tokens


class SwiGLU(eqx.Module):
    """The gated MLP of Llama / Qwen: `down(silu(gate(x)) * up(x))`, on one token."""

    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, hidden_size: int, intermediate_size: int, *, key: PRNGKeyArray, dtype=None):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `intermediate_size`: the width of the hidden layer.
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        kg, ku, kd = jr.split(key, 3)
        self.gate_proj = eqx.nn.Linear(
            hidden_size, intermediate_size, use_bias=False, key=kg, dtype=dtype
        )
        self.up_proj = eqx.nn.Linear(
            hidden_size, intermediate_size, use_bias=False, key=ku, dtype=dtype
        )
        self.down_proj = eqx.nn.Linear(
            intermediate_size, hidden_size, use_bias=False, key=kd, dtype=dtype
        )

    def __call__(self, x: Float[Array, " hidden"]) -> Float[Array, " hidden"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class HybridBlock(eqx.Module):
    """A pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))`.

    The token mixer is a [`deltanet_cp.nn.GatedDeltaNet`][] or a
    [`deltanet_cp.nn.CausalSelfAttention`][].
    """

    mixer_norm: eqx.nn.RMSNorm
    mixer: GatedDeltaNet | CausalSelfAttention
    mlp_norm: eqx.nn.RMSNorm
    mlp: SwiGLU

    def __init__(
        self,
        mixer: GatedDeltaNet | CausalSelfAttention,
        mlp: SwiGLU,
        hidden_size: int,
        *,
        eps: float = 1e-6,
        dtype=None,
    ):
        """**Arguments:**

        - `mixer`: the token mixer.
        - `mlp`: the per-token MLP.
        - `hidden_size`: the model width (for the two RMSNorms).
        - `eps`: the RMSNorms' epsilon.
        - `dtype`: the norms' parameter dtype.
        """
        self.mixer_norm = eqx.nn.RMSNorm(hidden_size, eps, use_bias=False, dtype=dtype)
        self.mixer = mixer
        self.mlp_norm = eqx.nn.RMSNorm(hidden_size, eps, use_bias=False, dtype=dtype)
        self.mlp = mlp

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:** as for [`deltanet_cp.nn.HybridLM`][], on hidden states."""
        h = jax.vmap(self.mixer_norm)(x)
        if isinstance(self.mixer, GatedDeltaNet):
            h = self.mixer(h, cp=cp)
        else:
            h = self.mixer(h, cp=cp, kv_schedule=kv_schedule)
        x = x + h
        return x + jax.vmap(lambda y: self.mlp(self.mlp_norm(y)))(x)


class HybridLM(eqx.Module):
    """A small hybrid language model in the Qwen3-Next pattern.

    Embedding; `num_layers` residual blocks whose token mixer is a Gated DeltaNet, except
    every `attention_every`-th one, which is causal softmax attention; SwiGLU MLPs; a final
    RMSNorm; an untied LM head. Every layer is context parallel: call it inside
    `jax.shard_map` with a [`deltanet_cp.ContextParallel`][] `cp` and this rank's shard of
    the tokens, under either layout. With [`deltanet_cp.Zigzag`][] every layer (Gated
    DeltaNet, its convolution, attention) runs on the same zigzag shards, with no
    reordering between layers.
    """

    embed: eqx.nn.Embedding
    blocks: tuple[HybridBlock, ...]
    norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        *,
        attention_every: int = 4,
        num_key_heads: int = 2,
        num_value_heads: int = 4,
        key_head_dim: int = 16,
        value_head_dim: int = 16,
        conv_kernel_size: int = 4,
        num_attention_heads: int = 4,
        attention_head_dim: int = 16,
        intermediate_size: int | None = None,
        chunk_size: int = 64,
        block_size: int | None = None,
        tile_size: int = 128,
        precision: PrecisionName | None = None,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `vocab_size`: the number of tokens.
        - `hidden_size`: the model width.
        - `num_layers`: the number of residual blocks.
        - `attention_every`: block `i` uses softmax attention iff
            `(i + 1) % attention_every == 0` (Qwen3-Next: 4, so 3 GDN : 1 attention).
        - `num_key_heads`, `num_value_heads`, `key_head_dim`, `value_head_dim`,
            `conv_kernel_size`, `chunk_size`: the Gated DeltaNet sizes.
        - `block_size`: the Gated DeltaNet layers' engine block, tokens whose chunk factors
            are formed together (the `block_size` of [`deltanet_cp.run`][]); `None` takes
            [`deltanet_cp.default_block_size`][].
        - `num_attention_heads`, `attention_head_dim`: the attention sizes.
        - `tile_size`: the side of the attention layers' score tiles (see
            [`deltanet_cp.nn.CausalSelfAttention`][]).
        - `precision`: every token mixer's precision policy (`"highest"`, `"bfloat16"`,
            `"default"`, or `None`: from the parameters' dtype); see
            [`deltanet_cp.nn.GatedDeltaNet`][] and [`deltanet_cp.nn.CausalSelfAttention`][].
            The MLPs, the embedding and the LM head multiply in the parameters' dtype at
            JAX's default precision.
        - `intermediate_size`: the MLP width; `4 * hidden_size` if `None`.
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if `vocab_size`, `hidden_size`, `num_layers` or `attention_every` is not
        an int (NumPy integers are accepted), `ValueError` if one is not positive.
        """
        vocab_size = as_positive_index(vocab_size, "vocab_size")
        hidden_size = as_positive_index(hidden_size, "hidden_size")
        num_layers = as_positive_index(num_layers, "num_layers")
        attention_every = as_positive_index(attention_every, "attention_every")
        precision = as_precision(precision)
        intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
        kemb, khead, *kblocks = jr.split(key, num_layers + 2)
        blocks = []
        for i, kb in enumerate(kblocks):
            kmix, kmlp = jr.split(kb)
            if (i + 1) % attention_every == 0:
                mixer = CausalSelfAttention(
                    hidden_size,
                    num_attention_heads,
                    attention_head_dim,
                    tile_size=tile_size,
                    precision=precision,
                    key=kmix,
                    dtype=dtype,
                )
            else:
                mixer = GatedDeltaNet(
                    hidden_size,
                    num_key_heads,
                    num_value_heads,
                    key_head_dim,
                    value_head_dim,
                    conv_kernel_size=conv_kernel_size,
                    chunk_size=chunk_size,
                    block_size=block_size,
                    precision=precision,
                    key=kmix,
                    dtype=dtype,
                )
            mlp = SwiGLU(hidden_size, intermediate_size, key=kmlp, dtype=dtype)
            blocks.append(HybridBlock(mixer, mlp, hidden_size, dtype=dtype))
        self.embed = eqx.nn.Embedding(vocab_size, hidden_size, key=kemb, dtype=dtype)
        self.blocks = tuple(blocks)
        self.norm = eqx.nn.RMSNorm(hidden_size, 1e-6, use_bias=False, dtype=dtype)
        self.lm_head = eqx.nn.Linear(
            hidden_size, vocab_size, use_bias=False, key=khead, dtype=dtype
        )
        self.precision = precision

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
    ) -> Float[Array, "seq vocab"]:
        """**Arguments:**

        - `tokens`: one sequence of token ids; with `cp`, this rank's shard of it under
            `cp.layout`.
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`; the logits come out in `cp.layout`'s order); `None` on one device.
            [`deltanet_cp.Zigzag`][] balances the attention layers' causal work.
        - `kv_schedule`: how the attention layers get the other ranks' keys and values:
        - `kv_schedule`: how the attention layers get the other ranks' keys and values:
            `"allgather"` or `"ring"` (see [`deltanet_cp.nn.CausalSelfAttention`][]).

        **Returns:**

        The next-token logits, `(seq, vocab)`; `(0, vocab)` for an empty `tokens`.

        **Raises:**

        `ValueError` if `tokens` is not a 1-D integer array, or holds a token id outside
        `[0, vocab_size)` (which an embedding lookup would silently clamp). Traced ids
        (under `jax.jit`) are checked through `equinox.error_if`: the computation fails
        when it runs.
        """
        cp = layer_cp(cp, "HybridLM")
        tokens = check_tokens(tokens, self.embed.num_embeddings)
        if tokens.shape[0] == 0:
            return jnp.zeros((0, self.embed.num_embeddings), self.lm_head.weight.dtype)
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x, cp=cp, kv_schedule=kv_schedule)
        return jax.vmap(lambda y: self.lm_head(self.norm(y)))(x)
