"""One decoder layer of the Qwen3.5, Qwen3-Next, Qwen3.5 MoE and Kimi Linear models: a recurrent
or attention token mixer and a SwiGLU MLP or sparse mixture-of-experts block, each in a pre-norm
residual."""

from typing import Any

import equinox as eqx
import jax
import jax.random as jr

from .._options import engine_options, EngineOptions
from .._parallel import ContextParallel
from ..nn._attention import CausalSelfAttention
from ..nn._gated_delta_net import GatedDeltaNet
from ..nn._kimi_delta_attention import KimiDeltaAttention
from ..nn._latent_attention import MultiHeadLatentAttention
from ..nn._layer_stack import Remat
from ..nn._mlp import SwiGLU
from ..nn._moe import ExpertAxis, RouterStats, SparseMoE
from ..nn._norm import RMSNorm, ZeroCenteredRMSNorm
from ..nn._schedule import KVSchedule
from ._config import (
    AbstractQwenTextConfig,
    KimiLinearConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3NextConfig,
)


class AbstractDecoderLayer(eqx.Module):
    """A pre-norm residual block: `x + mixer(input_layernorm(x))`, then
    `x + mlp(post_attention_layernorm(x))`; the token mixer takes the mixers' call shape
    (`__call__`, `extend`, `step`, `init_state`), the feed-forward `mlp` is a
    [`deltanet_cp.nn.SwiGLU`][] or a [`deltanet_cp.nn.SparseMoE`][]. Each model's layer
    holds these fields and builds them from its config."""

    input_layernorm: eqx.AbstractVar[Any]
    mixer: eqx.AbstractVar[Any]
    post_attention_layernorm: eqx.AbstractVar[Any]
    mlp: eqx.AbstractVar[SwiGLU | SparseMoE]

    def _mlp(
        self, x, expert_axis: ExpertAxis = None, token_mask=None
    ) -> tuple[jax.Array, RouterStats | None]:
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoE):
            h, stats = self.mlp(h, expert_axis=expert_axis, token_mask=token_mask)
            return x + h, stats
        return x + jax.vmap(self.mlp)(h), None

    def __call__(
        self,
        x,
        cp: ContextParallel | None,
        kv_schedule: KVSchedule,
        expert_axis: ExpertAxis = None,
        cu_seqlens=None,
        token_mask=None,
        *,
        remat: Remat = "none",
    ) -> tuple[jax.Array, RouterStats | None]:
        """The layer on `x`, `(seq, hidden)`; with `remat`, what its backward recomputes:
        `"none"` keeps every intermediate the backward needs, `"layer"` keeps only the
        layer's input and recomputes the whole layer (`jax.checkpoint`), `"feed_forward"`
        keeps the token mixer's intermediates and its output and recomputes the MLP or
        mixture-of-experts block. The values are the same under every policy."""
        args = (x, cp, kv_schedule, expert_axis, cu_seqlens, token_mask)
        if remat == "layer":
            return eqx.filter_checkpoint(_layer_forward)(self, *args, "none")
        return _layer_forward(self, *args, remat)

    def prefill(
        self,
        x,
        cache,
        length,
        checkpoint_every,
        cp,
        kv_schedule: KVSchedule,
        expert_axis: ExpertAxis = None,
    ):
        h, cache, saved = self.mixer.extend(
            self.input_layernorm(x),
            cache,
            length,
            cp=cp,
            kv_schedule=kv_schedule,
            checkpoint_every=checkpoint_every,
        )
        return self._mlp(x + h, expert_axis)[0], cache, saved

    def step(self, x, cache, position):
        h, cache = self.mixer.step(self.input_layernorm(x), cache, position)
        return self._mlp((x + h)[None])[0][0], cache


class Qwen3_5DecoderLayer(AbstractDecoderLayer):
    """A pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))`, with
    zero-centred RMSNorms; the token mixer is a [`deltanet_cp.nn.GatedDeltaNet`][] or a
    [`deltanet_cp.nn.CausalSelfAttention`][], the feed-forward `mlp` a
    [`deltanet_cp.nn.SwiGLU`][] or a [`deltanet_cp.nn.SparseMoE`][] (the decoder layer of
    all three models: Qwen3.5, Qwen3-Next, Qwen3.5 MoE)."""

    input_layernorm: ZeroCenteredRMSNorm
    mixer: GatedDeltaNet | CausalSelfAttention
    post_attention_layernorm: ZeroCenteredRMSNorm
    mlp: SwiGLU | SparseMoE

    def __init__(
        self,
        config: AbstractQwenTextConfig,
        kind: str,
        *,
        sparse: bool = False,
        chunk_size=None,
        block_size=None,
        memory=None,
        tile_size,
        precision=None,
        options: EngineOptions | None = None,
        key,
        dtype,
    ):
        options = engine_options(options, chunk_size, block_size, memory, precision)
        kmix, kmlp = jr.split(key)
        c, eps = config, config.rms_norm_eps
        if kind == "linear_attention":
            self.mixer = GatedDeltaNet(
                c.hidden_size,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                conv_kernel_size=c.linear_conv_kernel_dim,
                norm_eps=eps,
                options=options,
                key=kmix,
                dtype=dtype,
            )
        else:
            self.mixer = CausalSelfAttention(
                c.hidden_size,
                c.num_attention_heads,
                c.head_dim,
                num_kv_heads=c.num_key_value_heads,
                rope_theta=c.rope_theta,
                rotary_dim=c.rotary_dim,
                output_gate=True,
                qk_norm=True,
                norm_eps=eps,
                tile_size=tile_size,
                precision=options.precision,
                key=kmix,
                dtype=dtype,
            )
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=eps, dtype=dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=eps, dtype=dtype)
        if sparse:
            assert isinstance(c, (Qwen3NextConfig, Qwen3_5MoeConfig))
            self.mlp = SparseMoE(
                c.hidden_size,
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
                norm_topk_prob=c.norm_topk_prob,
                key=kmlp,
                dtype=dtype,
            )
        else:
            assert isinstance(c, (Qwen3_5Config, Qwen3NextConfig))
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, key=kmlp, dtype=dtype)


class KimiLinearDecoderLayer(AbstractDecoderLayer):
    """Kimi Linear's decoder layer: RMSNorms ([`deltanet_cp.nn.RMSNorm`][]), a
    [`deltanet_cp.nn.KimiDeltaAttention`][] (`"linear_attention"`) or multi-head latent
    attention (`"full_attention"`) token mixer, and a SwiGLU MLP (`"dense"`) or a sparse
    mixture-of-experts block with the sigmoid router and an ungated shared expert
    (`"sparse"`): transformers' `KimiLinearDecoderLayer`."""

    input_layernorm: RMSNorm
    mixer: KimiDeltaAttention | MultiHeadLatentAttention
    post_attention_layernorm: RMSNorm
    mlp: SwiGLU | SparseMoE

    def __init__(
        self,
        config: KimiLinearConfig,
        kind: str,
        *,
        sparse: bool = False,
        tile_size: int,
        options: EngineOptions,
        key,
        dtype,
    ):
        kmix, kmlp = jr.split(key)
        c, eps = config, config.rms_norm_eps
        if kind == "linear_attention":
            self.mixer = KimiDeltaAttention(
                c.hidden_size,
                c.linear_num_heads,
                c.linear_head_dim,
                conv_kernel_size=c.linear_conv_kernel_dim,
                norm_eps=eps,
                options=options,
                key=kmix,
                dtype=dtype,
            )
        else:
            # The latents' norms keep transformers' default epsilon, not `rms_norm_eps`.
            self.mixer = MultiHeadLatentAttention(
                c.hidden_size,
                c.num_attention_heads,
                kv_lora_rank=c.kv_lora_rank,
                qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim,
                v_head_dim=c.v_head_dim,
                q_lora_rank=c.q_lora_rank,
                attention_bias=c.attention_bias,
                tile_size=tile_size,
                precision=options.precision,
                key=kmix,
                dtype=dtype,
            )
        self.input_layernorm = RMSNorm(c.hidden_size, eps=eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=eps, dtype=dtype)
        if sparse:
            self.mlp = SparseMoE(
                c.hidden_size,
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
                norm_topk_prob=c.norm_topk_prob,
                router="sigmoid",
                n_group=c.n_group,
                topk_group=c.topk_group,
                routed_scaling_factor=c.routed_scaling_factor,
                shared_expert_gate=False,
                key=kmlp,
                dtype=dtype,
            )
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, key=kmlp, dtype=dtype)


def _layer_forward(
    layer: AbstractDecoderLayer,
    x,
    cp,
    kv_schedule,
    expert_axis,
    cu_seqlens,
    token_mask,
    remat: Remat,
) -> tuple[jax.Array, RouterStats | None]:
    h = layer.mixer(layer.input_layernorm(x), cp=cp, kv_schedule=kv_schedule, cu_seqlens=cu_seqlens)
    if remat == "feed_forward":
        return eqx.filter_checkpoint(type(layer)._mlp)(layer, x + h, expert_axis, token_mask)
    return layer._mlp(x + h, expert_axis, token_mask)
