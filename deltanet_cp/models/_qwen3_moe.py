"""The mixture-of-experts text models of the Qwen3.5 family, Qwen3-Next
(`Qwen3NextForCausalLM`) and Qwen3.5 MoE (`Qwen3_5MoeForCausalLM`)."""

import os

import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..nn._norm import ZeroCenteredRMSNorm
from ._causal_lm import AbstractCausalLM, init_model
from ._config import Qwen3_5MoeConfig, Qwen3NextConfig
from ._decoder_layer import Qwen3_5DecoderLayer
from ._layer_stack import Qwen3_5LayerStack
from ._mtp import Qwen3_5MTP
from ._weights import load


class Qwen3NextForCausalLM(AbstractCausalLM[Qwen3NextConfig]):
    """The Qwen3-Next text model: what transformers' `Qwen3NextForCausalLM` computes.

    [`deltanet_cp.models.Qwen3_5ForCausalLM`][]'s layers (Gated DeltaNet and gated
    attention token mixers, zero-centred RMSNorms), with a sparse mixture-of-experts
    feed-forward ([`deltanet_cp.nn.SparseMoE`][]: softmax top-k router, renormalised if
    `norm_topk_prob`, and a gated shared expert) in the layers the config makes sparse
    (`decoder_sparse_step`, `mlp_only_layers`) and a dense SwiGLU MLP in the others.

    Called, context parallel, prefilled, decoded and generated as
    [`deltanet_cp.models.Qwen3_5ForCausalLM`][] (the same cache); for training,
    `logits_and_router_stats` also returns what the load-balancing loss needs; with a
    multi-token-prediction head (`mtp`), `logits_and_mtp` and `speculative_generate` as there.
    """

    embed: eqx.nn.Embedding
    layers: tuple[Qwen3_5DecoderLayer, ...] | Qwen3_5LayerStack
    norm: ZeroCenteredRMSNorm
    lm_head: eqx.nn.Linear | None
    mtp: Qwen3_5MTP | None
    config: Qwen3NextConfig = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        config: Qwen3NextConfig,
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

        - `config`: the sizes, a [`deltanet_cp.models.Qwen3NextConfig`][].
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`, `key`, `dtype`: as for
            [`deltanet_cp.models.Qwen3_5ForCausalLM`][]'s `__init__` (the routers, the
            experts and the MLPs multiply in the parameters' dtype at JAX's default
            precision; the router's softmax runs in float32).
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
    ) -> "Qwen3NextForCausalLM":
        """Load a Hugging Face checkpoint: a directory with `config.json` and
        `model.safetensors`, or `model.safetensors.index.json` and its shards.

        Only safetensors are read (never pickle). Every tensor is mapped by name to its
        parameter. The routed experts are read in either layout: one tensor per expert
        (`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`, as transformers'
        `save_pretrained` writes by default and the released Qwen3-Next checkpoints hold)
        or fused (`mlp.experts.gate_up_proj` `(E, 2I, H)`, gate rows first, and
        `mlp.experts.down_proj` `(E, H, I)`, as the released Qwen3.5 MoE checkpoints and
        `save_pretrained(..., save_original_format=False)` hold). The Gated DeltaNet
        projections are read fused (Qwen3-Next's head-interleaved `in_proj_qkvz`,
        `in_proj_ba`) or separate (Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
        `in_proj_a`). The names are transformers' `Qwen3NextForCausalLM`'s
        (`model.layers.N...`). The multi-token-prediction weights (`mtp.*`) are read into
        `mtp` (a [`deltanet_cp.models.Qwen3_5MTP`][]) if the config has
        `mtp_num_hidden_layers` (or `num_nextn_predict_layers`) and the checkpoint holds
        them; else skipped, as transformers skips them.

        **Arguments:**

        - `path`: the checkpoint directory.
        - `dtype`: cast every parameter to this dtype (e.g. `jnp.bfloat16`; the recurrent
            states stay float32); keep each tensor's stored dtype if `None`.
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`: as for `__init__`.

        **Raises:**

        `ValueError` listing, by name, every missing (one expert's tensor too), unexpected
        or misshapen tensor; naming the config field that is missing or wrong, or the
        class that reads the config if it is another model's.
        """
        options = engine_options(options, chunk_size, block_size, memory, precision)
        return load(
            cls,
            Qwen3NextConfig,
            path,
            dtype=dtype,
            chunk_size=options.chunk_size,
            block_size=options.block_size,
            memory=options.memory,
            tile_size=tile_size,
            precision=options.precision,
            scan_layers=scan_layers,
        )


class Qwen3_5MoeForCausalLM(AbstractCausalLM[Qwen3_5MoeConfig]):
    """The Qwen3.5 MoE text model: what transformers' `Qwen3_5MoeForCausalLM` computes.

    [`deltanet_cp.models.Qwen3_5ForCausalLM`][]'s layers with, in every layer, a sparse
    mixture-of-experts feed-forward ([`deltanet_cp.nn.SparseMoE`][]: softmax top-k router,
    the top-k probabilities renormalised, and a gated shared expert).

    Called, context parallel, prefilled, decoded and generated as
    [`deltanet_cp.models.Qwen3_5ForCausalLM`][] (the same cache); for training,
    `logits_and_router_stats` also returns what the load-balancing loss needs; with a
    multi-token-prediction head (`mtp`), `logits_and_mtp` and `speculative_generate` as there.
    """

    embed: eqx.nn.Embedding
    layers: tuple[Qwen3_5DecoderLayer, ...] | Qwen3_5LayerStack
    norm: ZeroCenteredRMSNorm
    lm_head: eqx.nn.Linear | None
    mtp: Qwen3_5MTP | None
    config: Qwen3_5MoeConfig = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        config: Qwen3_5MoeConfig,
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

        - `config`: the sizes, a [`deltanet_cp.models.Qwen3_5MoeConfig`][].
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`, `key`, `dtype`: as for
            [`deltanet_cp.models.Qwen3_5ForCausalLM`][]'s `__init__` (the routers, the
            experts and the MLPs multiply in the parameters' dtype at JAX's default
            precision; the router's softmax runs in float32).
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
    ) -> "Qwen3_5MoeForCausalLM":
        """Load a Hugging Face checkpoint: a directory with `config.json` and
        `model.safetensors`, or `model.safetensors.index.json` and its shards.

        Only safetensors are read (never pickle). Every tensor is mapped by name to its
        parameter. The routed experts are read in either layout: one tensor per expert
        (`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`, as transformers'
        `save_pretrained` writes by default and the released Qwen3-Next checkpoints hold)
        or fused (`mlp.experts.gate_up_proj` `(E, 2I, H)`, gate rows first, and
        `mlp.experts.down_proj` `(E, H, I)`, as the released Qwen3.5 MoE checkpoints and
        `save_pretrained(..., save_original_format=False)` hold). The Gated DeltaNet
        projections are read fused (Qwen3-Next's head-interleaved `in_proj_qkvz`,
        `in_proj_ba`) or separate (Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
        `in_proj_a`). The names of transformers' `Qwen3_5MoeForCausalLM`
        (`model.layers.N...`) and of the multimodal `Qwen3_5MoeForConditionalGeneration`
        (`model.language_model.layers.N...`, whose vision tower `model.visual.*` is
        skipped; its `config.json` with the text model's fields under `text_config`) are
        both read. The multi-token-prediction weights (`mtp.*`) are read into `mtp` (a
        [`deltanet_cp.models.Qwen3_5MTP`][]) if the config has `mtp_num_hidden_layers` and
        the checkpoint holds them; else skipped, as transformers skips them.

        **Arguments:**

        - `path`: the checkpoint directory.
        - `dtype`: cast every parameter to this dtype (e.g. `jnp.bfloat16`; the recurrent
            states stay float32); keep each tensor's stored dtype if `None`.
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`: as for `__init__`.

        **Raises:**

        `ValueError` listing, by name, every missing (one expert's tensor too), unexpected
        or misshapen tensor; naming the config field that is missing or wrong, or the
        class that reads the config if it is another model's.
        """
        options = engine_options(options, chunk_size, block_size, memory, precision)
        return load(
            cls,
            Qwen3_5MoeConfig,
            path,
            dtype=dtype,
            chunk_size=options.chunk_size,
            block_size=options.block_size,
            memory=options.memory,
            tile_size=tile_size,
            precision=options.precision,
            scan_layers=scan_layers,
        )
