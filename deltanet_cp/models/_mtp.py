"""The multi-token-prediction (MTP) head of the Qwen3-Next and Qwen3.5 (dense and MoE) models.

The architecture, as the serving engines define it for the released checkpoints (transformers
skips these weights; vLLM `vllm/model_executor/models/qwen3_next_mtp.py` and
`qwen3_5_mtp.py`, SGLang `python/sglang/srt/models/qwen3_next_mtp.py`, lmdeploy
`lmdeploy/pytorch/models/qwen3_5_mtp.py`):

- Tensors (top level in every checkpoint, also the multimodal Qwen3.5 ones whose text model
  is under `model.language_model.`): `mtp.pre_fc_norm_embedding.weight`,
  `mtp.pre_fc_norm_hidden.weight`, `mtp.fc.weight` `(H, 2H)` (no bias), `mtp.layers.{k}.*`
  (a decoder layer with the main layers' names: `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
  `self_attn.{q,k}_norm`, `post_attention_layernorm`, `mlp.*`) and `mtp.norm.weight`. The
  embedding and the LM head are the main model's (vLLM's `load_weights` maps only
  `embed_tokens` and `lm_head` from outside `mtp.`).
- Every norm is the zero-centred RMSNorm, $x / \\mathrm{rms}(x) \\cdot (1 + w)$ (vLLM's
  `Qwen3NextRMSNorm` / SGLang's `GemmaRMSNorm`; lmdeploy adds 1 to `mtp.norm`,
  `pre_fc_norm_*` on loading).
- Layer `k` is a `"full_attention"` decoder layer (gated attention, q/k norms, partial
  rotary embedding), its feed-forward the one the main model's layer `k` would have: dense
  for Qwen3.5, sparse for Qwen3.5 MoE, and for Qwen3-Next sparse unless `mlp_only_layers` or
  `decoder_sparse_step` say otherwise for index `k` (vLLM's `Qwen3NextDecoderLayer` reads the
  index from the prefix `mtp.layers.k`; SGLang builds a one-layer `Qwen3NextModel`).
- At position $t$, with $h_t$ the main model's last hidden state *after* its final norm (what
  vLLM's `Qwen3NextModel.forward` returns and its proposer hands the draft model as
  `target_hidden_states`) and $e_{t+1}$ the embedding of the next token:
  $u_t = W_{fc} [\\mathrm{norm}_e(e_{t+1}); \\mathrm{norm}_h(h_t)]$ (embedding first), then the
  layer on the sequence $u$ (causal attention, rotary position $t$), then `mtp.norm`; the
  LM head on that gives the logits of token $t + 2$. The normed output is also the hidden
  state of the next draft step, whose layer is `mtp.layers[step % mtp_num_hidden_layers]`
  (vLLM's `spec_step_idx`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from .._options import EngineOptions
from .._parallel import ContextParallel
from ..nn._layer_stack import Remat
from ..nn._moe import ExpertAxis, RouterStats
from ..nn._norm import ZeroCenteredRMSNorm
from ..nn._schedule import KVSchedule
from ._config import AbstractQwenTextConfig
from ._decoder_layer import Qwen3_5DecoderLayer


class Qwen3_5MTP(eqx.Module):
    """The multi-token-prediction head of a Qwen3-Next or Qwen3.5 (MoE) model: from the main
    model's last (normed) hidden state at position $t$ and the embedding of token $t + 1$, the
    hidden state whose logits (the main model's LM head) predict token $t + 2$.

    $u = \\mathrm{fc}([\\mathrm{norm}_e(e_{t+1}); \\mathrm{norm}_h(h_t)])$, a full-attention
    [`deltanet_cp.models.Qwen3_5DecoderLayer`][] on $u$, then `norm`; all norms zero-centred
    RMSNorms. A model built with a config's `mtp_num_hidden_layers > 0` holds one as `mtp`
    (the checkpoints' `mtp.*` tensors); see the model's `logits_and_mtp`.

    **Fields:**

    - `pre_fc_norm_embedding`, `pre_fc_norm_hidden`: the norms of the two inputs.
    - `fc`: the projection `(2 H) -> H`, no bias, embedding half first.
    - `layers`: the decoder layers, one per draft depth.
    - `norm`: the output norm.
    """

    pre_fc_norm_embedding: ZeroCenteredRMSNorm
    pre_fc_norm_hidden: ZeroCenteredRMSNorm
    fc: eqx.nn.Linear
    layers: tuple[Qwen3_5DecoderLayer, ...]
    norm: ZeroCenteredRMSNorm

    def __init__(
        self,
        config: AbstractQwenTextConfig,
        *,
        tile_size: int,
        options: EngineOptions,
        key,
        dtype=None,
    ):
        """**Arguments:**

        - `config`: the model's config; `mtp_num_hidden_layers` layers (at least 1).
        - `tile_size`, `options`: as for the model's attention layers.
        - `key`: a PRNG key for the random initial parameters.
        - `dtype`: the parameter dtype.
        """
        n = config.mtp_num_hidden_layers
        if n < 1:
            raise ValueError(
                f"`config.mtp_num_hidden_layers` is {n}: a multi-token-prediction head needs at "
                "least one layer."
            )
        kfc, *keys = jr.split(key, n + 1)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps=eps, dtype=dtype)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps=eps, dtype=dtype)
        self.fc = eqx.nn.Linear(2 * h, h, use_bias=False, key=kfc, dtype=dtype)
        self.layers = tuple(
            Qwen3_5DecoderLayer(
                config,
                "full_attention",
                sparse=config.is_sparse(k),
                tile_size=tile_size,
                options=options,
                key=keys[k],
                dtype=dtype,
            )
            for k in range(n)
        )
        self.norm = ZeroCenteredRMSNorm(h, eps=eps, dtype=dtype)

    def fuse(self, hidden: jax.Array, embedded: jax.Array) -> jax.Array:
        """`fc([norm_e(embedded); norm_h(hidden)])`, `(seq, H)` each: the layer's input."""
        x = jnp.concatenate(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        return jax.vmap(self.fc)(x)

    def __call__(
        self,
        hidden: jax.Array,
        embedded: jax.Array,
        depth: int = 0,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
        cu_seqlens=None,
        token_mask=None,
        remat: Remat = "none",
    ) -> tuple[jax.Array, RouterStats | None]:
        """The head's hidden states, `(seq, H)`, after `norm` (the LM head's input, and the
        next depth's `hidden`), and the layer's router statistics (`None` for a dense one).

        **Arguments:**

        - `hidden`: the main model's last hidden states after its final norm (or the
            previous depth's output), `(seq, H)`.
        - `embedded`: the embeddings of the next tokens, `(seq, H)`: row `t` is token
            `t + 1 + depth`'s.
        - `depth`: which layer, `0 .. len(layers) - 1`.
        - `cp`, `kv_schedule`, `expert_axis`, `cu_seqlens`, `token_mask`, `remat`: as for
            the model's call (the sequence's sharding, packed documents, ...).
        """
        x = self.fuse(hidden, embedded)
        x, stats = self.layers[depth](
            x, cp, kv_schedule, expert_axis, cu_seqlens, token_mask, remat=remat
        )
        return self.norm(x), stats
