"""Kimi Linear (`KimiLinearForCausalLM`): Kimi Delta Attention and multi-head latent attention
layers, a sigmoid-routed mixture of experts, built from deltanet_cp's layers."""

import os

import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..nn._norm import RMSNorm
from ._causal_lm import AbstractCausalLM, init_model
from ._config import KimiLinearConfig
from ._decoder_layer import KimiLinearDecoderLayer
from ._layer_stack import Qwen3_5LayerStack
from ._mtp import Qwen3_5MTP
from ._weights import load


class KimiLinearForCausalLM(AbstractCausalLM[KimiLinearConfig]):
    """Kimi Linear: what transformers' `KimiLinearForCausalLM` computes.

    Embedding; `num_hidden_layers` pre-norm residual blocks
    ([`deltanet_cp.models.KimiLinearDecoderLayer`][]) whose token mixer is a
    [`deltanet_cp.nn.KimiDeltaAttention`][] (`"linear_attention"`) or multi-head latent
    attention (`"full_attention"`), each followed by a SwiGLU MLP (`"dense"`, Kimi
    Linear's first layer) or the sparse mixture-of-experts block
    ([`deltanet_cp.nn.SparseMoE`][] with `router="sigmoid"`: sigmoid scores, the
    `e_score_correction_bias` for the choice only, grouped top-k, the weights renormalised
    and scaled by `routed_scaling_factor`, the router in float32; an ungated shared expert
    `moe_intermediate_size * n_shared_experts` wide); RMSNorms
    ([`deltanet_cp.nn.RMSNorm`][], $w \\, x / \\mathrm{rms}(x)$); a final norm and the LM
    head (never tied).

    The API of [`deltanet_cp.models.Qwen3_5ForCausalLM`][]: unbatched calls (`jax.vmap`
    over a batch), context parallelism (`cp`, `kv_schedule`), experts split over a mesh
    axis (`expert_axis`), packed documents (`cu_seqlens`), FSDP (`fsdp`), `remat`,
    `scan_layers`; `logits_and_router_stats` for the routing statistics (see
    [`deltanet_cp.nn.RouterStats`][] for what they mean for the sigmoid router:
    transformers' Kimi Linear adds no load-balancing loss, its config's
    `router_aux_loss_coef` reads 0); `prefill`, `decode_step`, `generate`;
    `save_pretrained` / `from_pretrained`. Kimi Linear has no multi-token-prediction head
    (`mtp` is `None`).
    """

    embed: eqx.nn.Embedding
    layers: tuple[KimiLinearDecoderLayer, ...] | Qwen3_5LayerStack
    norm: RMSNorm
    lm_head: eqx.nn.Linear | None
    mtp: Qwen3_5MTP | None
    config: KimiLinearConfig = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        config: KimiLinearConfig,
        *,
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

        - `config`: the sizes, a [`deltanet_cp.models.KimiLinearConfig`][].
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`, `key`, `dtype`: as for
            [`deltanet_cp.models.Qwen3_5ForCausalLM`][]'s `__init__` (the Kimi Delta
            Attention layers take the engine's settings; the routers are float32 whatever
            `dtype`; the experts and MLPs multiply in the parameters' dtype).
        """
        init_model(
            self,
            config,
            chunk_size=chunk_size,
            block_size=block_size,
            memory=memory,
            tile_size=tile_size,
            precision=precision,
            options=options,
            scan_layers=scan_layers,
            key=key,
            dtype=dtype,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype=None,
        chunk_size: int | None = None,
        block_size: int | None = None,
        memory: Memory | None = None,
        tile_size: int = 128,
        precision: PrecisionName | None = None,
        options: EngineOptions | None = None,
        scan_layers: bool = False,
    ) -> "KimiLinearForCausalLM":
        """Load a Hugging Face checkpoint: a directory with `config.json` (transformers' or
        Moonshot's, see [`deltanet_cp.models.KimiLinearConfig`][]) and `model.safetensors`,
        or `model.safetensors.index.json` and its shards.

        Only safetensors are read (never pickle). Every tensor is mapped by name to its
        parameter, in either naming: the released checkpoints' (what transformers'
        `save_pretrained` writes): the Kimi Delta Attention layers' `self_attn.q_proj`,
        `k_proj`, `v_proj`, `q_conv1d`, `k_conv1d`, `v_conv1d`, `f_a_proj`, `f_b_proj`,
        `dt_bias`, `A_log`, `b_proj`, `g_a_proj`, `g_b_proj`, `o_norm`, `o_proj`; the sparse
        blocks' `block_sparse_moe.gate.weight`, `gate.e_score_correction_bias`,
        `experts.{j}.w1` / `w3` / `w2` (gate, up, down) and `shared_experts.*`; the dense
        MLP's `mlp.*` (or `block_sparse_moe.*`). Or transformers' module names: one
        `self_attn.conv1d`, the gate under `self_attn.forget_gate.`, the sparse blocks under
        `mlp.` with the experts fused (`mlp.experts.gate_up_proj` `(E, 2I, H)`, gate rows
        first, `mlp.experts.down_proj` `(E, H, I)`).

        **Arguments:**

        - `path`: the checkpoint directory.
        - `dtype`: cast every parameter to this dtype (e.g. `jnp.bfloat16`; the routers'
            weights and biases stay float32, as transformers keeps them); keep each
            tensor's stored dtype if `None`.
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`: as for `__init__`.

        **Raises:**

        `ValueError` listing, by name, every missing, unexpected or misshapen tensor;
        naming the config field that is missing or wrong, or the class that reads the
        config if it is another model's.
        """
        options = engine_options(options, chunk_size, block_size, memory, precision)
        return load(
            cls,
            KimiLinearConfig,
            path,
            dtype=dtype,
            chunk_size=options.chunk_size,
            block_size=options.block_size,
            memory=options.memory,
            tile_size=tile_size,
            precision=options.precision,
            scan_layers=scan_layers,
        )
