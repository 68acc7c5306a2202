"""One decoder layer of the Qwen3.5 model: a Gated DeltaNet or attention token mixer and a
SwiGLU MLP, each in a pre-norm residual."""

import equinox as eqx
import jax
import jax.random as jr

from .._parallel import ContextParallel
from ..nn._attention import CausalSelfAttention, KVCache
from ..nn._gated_delta_net import GatedDeltaNet, GatedDeltaNetState
from ..nn._hybrid import SwiGLU
from ..nn._norm import ZeroCenteredRMSNorm
from ..nn._schedule import KVSchedule
from ._config import Qwen3_5Config


class Qwen3_5DecoderLayer(eqx.Module):
    """A pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))`, with
    zero-centred RMSNorms; the token mixer is a [`deltanet_cp.nn.GatedDeltaNet`][] or a
    [`deltanet_cp.nn.CausalSelfAttention`][]."""

    input_layernorm: ZeroCenteredRMSNorm
    mixer: GatedDeltaNet | CausalSelfAttention
    post_attention_layernorm: ZeroCenteredRMSNorm
    mlp: SwiGLU

    def __init__(
        self,
        config: Qwen3_5Config,
        kind: str,
        *,
        chunk_size,
        block_size,
        tile_size,
        precision,
        key,
        dtype,
    ):
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
                chunk_size=chunk_size,
                block_size=block_size,
                precision=precision,
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
                precision=precision,
                key=kmix,
                dtype=dtype,
            )
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=eps, dtype=dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=eps, dtype=dtype)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, key=kmlp, dtype=dtype)

    def _mlp(self, x):
        return x + jax.vmap(self.mlp)(self.post_attention_layernorm(x))

    def __call__(self, x, cp: ContextParallel | None, kv_schedule: KVSchedule):
        h = self.input_layernorm(x)
        if isinstance(self.mixer, GatedDeltaNet):
            h = self.mixer(h, cp=cp)
        else:
            h = self.mixer(h, cp=cp, kv_schedule=kv_schedule)
        return self._mlp(x + h)

    def prefill(self, x, cache, length, checkpoint_every, cp, kv_schedule: KVSchedule):
        h = self.input_layernorm(x)
        saved = None
        if isinstance(self.mixer, GatedDeltaNet):
            assert isinstance(cache, GatedDeltaNetState)
            h, cache, saved = self.mixer.prefill(h, cache, checkpoint_every=checkpoint_every, cp=cp)
        else:
            assert isinstance(cache, KVCache)
            h, cache = self.mixer.prefill(h, cache, length, cp=cp, kv_schedule=kv_schedule)
        return self._mlp(x + h), cache, saved

    def step(self, x, cache, position):
        h = self.input_layernorm(x)
        if isinstance(self.mixer, GatedDeltaNet):
            assert isinstance(cache, GatedDeltaNetState)
            h, cache = self.mixer.step(h, cache)
        else:
            assert isinstance(cache, KVCache)
            h, cache = self.mixer.step(h, cache, position)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache
