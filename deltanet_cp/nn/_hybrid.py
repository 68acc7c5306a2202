"""A small hybrid language model: recurrent token mixers (Gated DeltaNet by default) with one
softmax-attention layer in four, or any pattern of mixers."""

from collections.abc import Callable, Sequence
from typing import get_args, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._options import engine_options, EngineOptions
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._run import Memory
from .._validate import as_positive_index
from ._attention import CausalSelfAttention
from ._context import documents, layer_cp
from ._delta_net import DeltaNet
from ._fsdp import FSDP
from ._gated_delta_net import GatedDeltaNet
from ._gated_delta_net_2 import GatedDeltaNet2
from ._gated_delta_product import GatedDeltaProduct
from ._gated_linear_attention import GatedLinearAttention, SimpleGatedLinearAttention
from ._kimi_delta_attention import KimiDeltaAttention
from ._layer_stack import (
    call_layer,
    check_fsdp_layers,
    check_remat,
    LayerStack,
    Remat,
    run_stack,
    stack_layers,
)
from ._mixer import AbstractTokenMixer
from ._mlp import SwiGLU as SwiGLU
from ._momentum_delta_net import MomentumDeltaNet
from ._precond import PrecondGatedDeltaNet, PrecondKimiDeltaAttention
from ._rwkv7_attention import RWKV7Attention
from ._schedule import KVSchedule
from ._tokens import check_tokens


# A token mixer of a `HybridBlock`: any of `deltanet_cp.nn`'s, all called alike.
Mixer = AbstractTokenMixer

# The token mixers `HybridLM` builds by name.
MixerKind = Literal[
    "gated_delta_net",
    "delta_net",
    "attention",
    "kimi_delta_attention",
    "gated_linear_attention",
    "simple_gated_linear_attention",
    "gated_delta_product",
    "gated_delta_net_2",
    "momentum_delta_net",
    "precond_gated_delta_net",
    "precond_kimi_delta_attention",
    "rwkv7",
]


class HybridBlock(eqx.Module):
    """A pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))`.

    The token mixer is one of the recurrent layers of `deltanet_cp.nn`
    ([`deltanet_cp.nn.GatedDeltaNet`][], [`deltanet_cp.nn.KimiDeltaAttention`][],
    [`deltanet_cp.nn.GatedLinearAttention`][], [`deltanet_cp.nn.RWKV7Attention`][], ...) or
    a [`deltanet_cp.nn.CausalSelfAttention`][].
    """

    mixer_norm: eqx.nn.RMSNorm
    mixer: Mixer
    mlp_norm: eqx.nn.RMSNorm
    mlp: SwiGLU

    def __init__(
        self,
        mixer: Mixer,
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
        v_first: Float[Array, "seq heads v"] | None = None,
        cu_seqlens: CuSeqlens | None = None,
        remat: Remat = "none",
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:** as for [`deltanet_cp.nn.HybridLM`][], on hidden states, and
        `v_first`: for an RWKV-7 mixer after the model's first, the first one's `values`
        on its normed input (`first_values`); `None` up to and including the first one;
        ignored by the other mixers. Every mixer is called the same way
        ([`deltanet_cp.nn.AbstractTokenMixer`][])."""
        check_remat(remat)
        return self._forward(x, cp, kv_schedule, v_first, cu_seqlens, remat=remat)[0]

    def _forward(
        self, x, cp, kv_schedule, v_first, cu_seqlens=None, *, remat: Remat = "none"
    ) -> tuple[Array, Array | None]:
        """`(output, v_first)`: the block's output and the `v_first` of the blocks after
        it (the given one, or the values this block's mixer makes if it is the first
        RWKV-7 one; `first_values`); `remat` as for `HybridLM`."""
        args = (x, cp, kv_schedule, v_first, cu_seqlens)
        if remat == "layer":
            return eqx.filter_checkpoint(_block_forward)(self, *args, "none")
        return _block_forward(self, *args, remat)


def _block_forward(
    block: HybridBlock, x, cp, kv_schedule, v_first, cu_seqlens, remat: Remat
) -> tuple[Array, Array | None]:
    h = jax.vmap(block.mixer_norm)(x)
    if v_first is None:
        v_first_after = block.mixer.first_values(h, cp=cp, cu_seqlens=cu_seqlens)
    else:
        v_first_after = v_first
    x = x + block.mixer(h, cp=cp, kv_schedule=kv_schedule, v_first=v_first, cu_seqlens=cu_seqlens)
    if remat == "feed_forward":
        return eqx.filter_checkpoint(_feed_forward)(block, x), v_first_after
    return _feed_forward(block, x), v_first_after


def _feed_forward(block: HybridBlock, x) -> Array:
    """`x + mlp(norm(x))`, the block's second residual."""
    return x + jax.vmap(lambda y: block.mlp(block.mlp_norm(y)))(x)


class HybridLM(eqx.Module):
    """A small hybrid language model in the Qwen3-Next pattern, or any pattern of mixers.

    Embedding; `num_layers` residual blocks whose token mixer is a Gated DeltaNet, except
    every `attention_every`-th one, which is causal softmax attention (or, with `mixers`,
    the mixer named for each block: Kimi Linear's three Kimi Delta Attention layers to one
    attention layer, gated linear attention, ...); SwiGLU MLPs; a final RMSNorm; an untied
    LM head. Every layer is context parallel: call it inside
    `jax.shard_map` with a [`deltanet_cp.ContextParallel`][] `cp` and this rank's shard of
    the tokens, under either layout. With [`deltanet_cp.Zigzag`][] every layer (Gated
    DeltaNet, its convolution, attention) runs on the same zigzag shards, with no
    reordering between layers.
    """

    embed: eqx.nn.Embedding
    blocks: tuple[HybridBlock, ...] | LayerStack
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
        mixers: Sequence[MixerKind | Callable[[PRNGKeyArray], Mixer]] | None = None,
        num_key_heads: int = 2,
        num_value_heads: int = 4,
        key_head_dim: int = 16,
        value_head_dim: int = 16,
        conv_kernel_size: int = 4,
        num_attention_heads: int = 4,
        attention_head_dim: int = 16,
        intermediate_size: int | None = None,
        chunk_size: int | None = None,
        block_size: int | None = None,
        memory: Memory | None = None,
        tile_size: int = 128,
        precision: PrecisionName | None = None,
        options: EngineOptions | None = None,
        scan_layers: bool = False,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `vocab_size`: the number of tokens.
        - `hidden_size`: the model width.
        - `num_layers`: the number of residual blocks.
        - `attention_every`: block `i` uses softmax attention iff
            `(i + 1) % attention_every == 0` (Qwen3-Next: 4, so 3 GDN : 1 attention).
            Unused with `mixers`.
        - `mixers`: the token mixer of each block, `num_layers` of them, or `None` for the
            pattern of `attention_every`. Each is a name, built with the sizes below:
            `"gated_delta_net"`, `"delta_net"` (the Gated DeltaNet sizes), `"attention"`,
            `"kimi_delta_attention"`
            (`num_value_heads` heads of size `key_head_dim`), `"gated_linear_attention"`
            and `"simple_gated_linear_attention"` (`num_value_heads` heads,
            `key_head_dim`, `value_head_dim`), `"gated_delta_product"`,
            `"gated_delta_net_2"`, `"momentum_delta_net"` and `"precond_gated_delta_net"`
            (the Gated DeltaNet sizes), `"precond_kimi_delta_attention"` (as
            `"kimi_delta_attention"`),
            `"rwkv7"` (`num_value_heads` heads, `key_head_dim`, `value_head_dim`, its
            default LoRA ranks; the first one hands its values to the later ones as
            `v_first`); or a function of a PRNG key returning the mixer (any layer of
            `deltanet_cp.nn` with other sizes; an RWKV-7 one built with `layer_idx=0` if
            and only if it is the first RWKV-7 block).
        - `num_key_heads`, `num_value_heads`, `key_head_dim`, `value_head_dim`,
            `conv_kernel_size`, `chunk_size`: the Gated DeltaNet sizes (and those of the
            other recurrent mixers named in `mixers`).
        - `block_size`: the recurrent layers' engine block, tokens whose chunk factors
            are formed together (the `block_size` of [`deltanet_cp.run`][]); `None` takes
            [`deltanet_cp.default_block_size`][].
        - `memory`: what the recurrent layers' engine keeps for the backward, `"low"`
            (`None`, the default) or `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `num_attention_heads`, `attention_head_dim`: the attention sizes.
        - `tile_size`: the side of the attention layers' score tiles (see
            [`deltanet_cp.nn.CausalSelfAttention`][]).
        - `precision`: every token mixer's precision policy (`"highest"`, `"bfloat16"`,
            `"default"`, or `None`: from the parameters' dtype); see
            [`deltanet_cp.nn.GatedDeltaNet`][] and [`deltanet_cp.nn.CausalSelfAttention`][].
            The MLPs, the embedding and the LM head multiply in the parameters' dtype at
            JAX's default precision.
        - `intermediate_size`: the MLP width; `4 * hidden_size` if `None`.
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose); its
            `precision` is the attention layers' too.
        - `scan_layers`: stack the blocks by the shortest period of their pattern (of
            mixer kinds, sizes and dtypes: 4 for the default one) into a
            [`deltanet_cp.nn.LayerStack`][] and run each period's blocks as the body of a
            `jax.lax.scan` over the periods, so the compile time does not grow with
            `num_layers`. The parameters are the same as without (the stack holds them
            along a leading axis); `blocks` then reads as the tuple it replaces.
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if `vocab_size`, `hidden_size`, `num_layers` or `attention_every` is not
        an int (NumPy integers are accepted) or `scan_layers` is not a bool; `ValueError`
        if one is not positive, if `mixers` is not `num_layers` names or functions, or if
        the first RWKV-7 mixer is not `is_first` or a later one is.
        """
        vocab_size = as_positive_index(vocab_size, "vocab_size")
        hidden_size = as_positive_index(hidden_size, "hidden_size")
        num_layers = as_positive_index(num_layers, "num_layers")
        attention_every = as_positive_index(attention_every, "attention_every")
        options = engine_options(options, chunk_size, block_size, memory, precision)
        precision = options.precision
        intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
        if mixers is None:
            mixers = [
                "attention" if (i + 1) % attention_every == 0 else "gated_delta_net"
                for i in range(num_layers)
            ]
        mixers = list(mixers)
        if len(mixers) != num_layers:
            raise ValueError(
                f"`mixers` must name one token mixer per block: {num_layers} of them; got "
                f"{len(mixers)}."
            )
        sizes = (num_key_heads, num_value_heads, key_head_dim, value_head_dim)
        recurrent = dict(conv_kernel_size=conv_kernel_size, options=options, dtype=dtype)
        attention = dict(tile_size=tile_size, precision=precision, dtype=dtype)
        kemb, khead, *kblocks = jr.split(key, num_layers + 2)
        blocks = []
        for i, (mixer_kind, kb) in enumerate(zip(mixers, kblocks)):
            kmix, kmlp = jr.split(kb)
            if callable(mixer_kind):
                mixer = mixer_kind(kmix)
            elif mixer_kind == "rwkv7":
                # Its place among the model's RWKV-7 blocks: the first makes `v_first`.
                before = sum(isinstance(b.mixer, RWKV7Attention) for b in blocks)
                mixer = RWKV7Attention(
                    hidden_size,
                    num_value_heads,
                    key_head_dim,
                    value_head_dim,
                    layer_idx=before,
                    num_layers=before + sum(m == "rwkv7" for m in mixers[i:] if isinstance(m, str)),
                    options=options,
                    key=kmix,
                    dtype=dtype,
                )
            else:
                mixer = _mixer(
                    mixer_kind,
                    hidden_size,
                    sizes,
                    (num_attention_heads, attention_head_dim),
                    recurrent,
                    attention,
                    kmix,
                )
            mlp = SwiGLU(hidden_size, intermediate_size, key=kmlp, dtype=dtype)
            blocks.append(HybridBlock(mixer, mlp, hidden_size, dtype=dtype))
        _check_rwkv7_first(blocks)
        self.embed = eqx.nn.Embedding(vocab_size, hidden_size, key=kemb, dtype=dtype)
        self.blocks = stack_layers(tuple(blocks), scan_layers)
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
        cu_seqlens: CuSeqlens | None = None,
        fsdp: FSDP | None = None,
        remat: Remat = "none",
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
        - `cu_seqlens`: packed documents in `tokens`: the offsets `[0, ..., S]` of the
            documents of the whole sequence (global, also under `cp`), a list or an integer
            array, as [`deltanet_cp.data.pack_documents`][] makes them. Every mixer treats
            each document as a sequence of its own (recurrences and convolutions restart
            from zeros, attention is causal within each document with its rotary positions
            restarting at 0), so the logits equal each document's run alone. A repeated
            offset is an empty document: a batch of rows is a `jax.vmap` over the rows and
            their `cu_seqlens`, padded to one width by repeating `S`. `None`: one document.
        - `fsdp`: inside `jax.shard_map`, for parameters split over a data axis (fully
            sharded data parallelism): a [`deltanet_cp.nn.FSDP`][] naming the axis and the
            parameters' specs (from [`deltanet_cp.nn.partition_specs`][] of this model's
            parameters, the `shard_map`'s `in_specs` of them). Each block's parameters are
            gathered over the axis just before it runs and again in its backward
            (`FSDP.apply`), the embedding and the LM head where they are used; with
            `scan_layers=True`, in the scan's body from the group's slices. The gradients
            come out split as the parameters. `None`: the parameters are whole on every
            rank.
        - `remat`: what each block keeps for the backward pass (rematerialisation):
            `"none"` (everything its backward needs), `"layer"` (only the block's input:
            the whole block is recomputed in the backward, `jax.checkpoint`) or
            `"feed_forward"` (the token mixer's intermediates and output: the MLP is
            recomputed). The values and gradients are the same under every policy.

        **Returns:**

        The next-token logits, `(seq, vocab)`; `(0, vocab)` for an empty `tokens`.

        **Raises:**

        `ValueError` if `tokens` is not a 1-D integer array, or holds a token id outside
        `[0, vocab_size)` (which an embedding lookup would silently clamp). Traced ids
        (under `jax.jit`) are checked through `equinox.error_if`: the computation fails
        when it runs. `ValueError` for `cu_seqlens` that do not start at 0, end at the
        sequence length (`S`, over all ranks) or increase; for a `remat` that is not one of
        the policies; for `fsdp` specs whose blocks are not stacked as this model's are.
        """
        cp = layer_cp(cp, "HybridLM")
        check_remat(remat)
        tokens = check_tokens(tokens, self.embed.num_embeddings)
        if tokens.shape[0] == 0:
            return jnp.zeros((0, self.embed.num_embeddings), self.lm_head.weight.dtype)
        if cu_seqlens is not None:
            # Checked once, here, for every block.
            cu_seqlens = documents(cp, tokens.shape[0], cu_seqlens).cu_seqlens
        if fsdp is not None:
            check_fsdp_layers(self.blocks, getattr(fsdp.specs, "blocks", None))
        embed = self.embed if fsdp is None else fsdp.gather(self.embed, lambda s: s.embed)
        x = jax.vmap(embed)(tokens)

        def run_block(block, carry, fsdp):
            # `v_first`: the first RWKV-7 block's values, for the later ones.
            x, v_first = carry
            args = (x, cp, kv_schedule, v_first, cu_seqlens)
            return call_layer(HybridBlock._forward, block, *args, remat=remat, fsdp=fsdp)

        block_fsdp = None if fsdp is None else FSDP(fsdp.axis, fsdp.specs.blocks)
        x, _ = run_stack(self.blocks, (x, None), run_block, block_fsdp)
        parts = (self.norm, self.lm_head)
        if fsdp is None:
            return _head(parts, x)
        return fsdp.apply(parts, lambda s: (s.norm, s.lm_head), x, fn=_head)


def _head(parts: tuple[eqx.nn.RMSNorm, eqx.nn.Linear], x) -> Array:
    """The logits of the last hidden states `x`: the final norm, then the LM head."""
    norm, lm_head = parts
    return jax.vmap(lambda y: lm_head(norm(y)))(x)


def _check_rwkv7_first(blocks: list[HybridBlock]) -> None:
    """A `ValueError` unless the first RWKV-7 mixer, and only it, is `is_first`."""
    firsts = [b.mixer.is_first for b in blocks if isinstance(b.mixer, RWKV7Attention)]
    if firsts and (not firsts[0] or any(firsts[1:])):
        raise ValueError(
            "The first RWKV-7 mixer in `mixers` must be built with `layer_idx=0` (it makes "
            "`v_first` for the later ones), and only it; got `is_first` = "
            f"{firsts} in block order."
        )


def _mixer(kind, hidden, sizes, attention_sizes, recurrent, attention, key) -> Mixer:
    """The token mixer named `kind`, of `HybridLM`'s sizes."""
    h, hv, dk, dv = sizes
    if kind == "attention":
        return CausalSelfAttention(hidden, *attention_sizes, key=key, **attention)
    if kind == "gated_delta_net":
        return GatedDeltaNet(hidden, h, hv, dk, dv, key=key, **recurrent)
    if kind == "delta_net":
        return DeltaNet(hidden, h, hv, dk, dv, key=key, **recurrent)
    if kind == "kimi_delta_attention":
        return KimiDeltaAttention(hidden, hv, dk, key=key, **recurrent)
    if kind == "gated_linear_attention":
        return GatedLinearAttention(hidden, hv, dk, dv, key=key, **recurrent)
    if kind == "simple_gated_linear_attention":
        return SimpleGatedLinearAttention(hidden, hv, dk, dv, key=key, **recurrent)
    if kind == "gated_delta_product":
        return GatedDeltaProduct(hidden, h, hv, dk, dv, key=key, **recurrent)
    if kind == "gated_delta_net_2":
        return GatedDeltaNet2(hidden, h, hv, dk, dv, key=key, **recurrent)
    if kind == "momentum_delta_net":
        return MomentumDeltaNet(hidden, h, hv, dk, dv, key=key, **recurrent)
    if kind == "precond_gated_delta_net":
        return PrecondGatedDeltaNet(hidden, h, hv, dk, dv, key=key, **recurrent)
    if kind == "precond_kimi_delta_attention":
        return PrecondKimiDeltaAttention(hidden, hv, dk, key=key, **recurrent)
    raise ValueError(
        f"Unknown token mixer {kind!r} in `mixers`: pass one of {get_args(MixerKind)} or a "
        "function of a PRNG key that returns the mixer."
    )
