"""The Qwen3.5 dense text model (`Qwen3_5ForCausalLM`), built from deltanet_cp's layers."""

import os

import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..nn._norm import ZeroCenteredRMSNorm
from ._causal_lm import AbstractCausalLM, init_model
from ._config import Qwen3_5Config
from ._decoder_layer import Qwen3_5DecoderLayer
from ._layer_stack import Qwen3_5LayerStack
from ._mtp import Qwen3_5MTP
from ._weights import load


class Qwen3_5ForCausalLM(AbstractCausalLM[Qwen3_5Config]):
    """The Qwen3.5 dense text model: what transformers' `Qwen3_5ForCausalLM` computes.

    Embedding; `num_hidden_layers` pre-norm residual blocks whose token mixer is a
    [`deltanet_cp.nn.GatedDeltaNet`][] (`"linear_attention"`) or a gated, grouped-query
    [`deltanet_cp.nn.CausalSelfAttention`][] with q/k norms and a partial rotary embedding
    (`"full_attention"`), each followed by a SwiGLU MLP; zero-centred RMSNorms
    ($x / \\mathrm{rms}(x) \\cdot (1 + w)$); a final norm and the LM head (the embedding's
    transpose if `tie_word_embeddings`).

    Unbatched like the layers: `model(tokens)` maps `(T,)` token ids to `(T, vocab)`
    logits; `jax.vmap` it over a batch. Context parallel: inside `jax.shard_map`, pass a
    [`deltanet_cp.ContextParallel`][] as `cp` (and the attention layers' `kv_schedule`);
    every layer runs on the same shards.

    For generation: `prefill` (optionally context parallel, from a cache, with state
    checkpoints), `decode_step` and greedy `generate`.

    With a multi-token-prediction head (`mtp`, a [`deltanet_cp.models.Qwen3_5MTP`][]: a
    config's `mtp_num_hidden_layers`, the released checkpoints' `mtp.*`; `None` without):
    `logits_and_mtp` to train it and `speculative_generate` to draft with it.
    """

    embed: eqx.nn.Embedding
    layers: tuple[Qwen3_5DecoderLayer, ...] | Qwen3_5LayerStack
    norm: ZeroCenteredRMSNorm
    lm_head: eqx.nn.Linear | None
    mtp: Qwen3_5MTP | None
    config: Qwen3_5Config = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        config: Qwen3_5Config,
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

        - `config`: the sizes, a [`deltanet_cp.models.Qwen3_5Config`][].
        - `chunk_size`: the Gated DeltaNet layers' chunk size.
        - `block_size`: the Gated DeltaNet layers' engine block, tokens whose chunk factors
            are formed together (the `block_size` of [`deltanet_cp.run`][]); `None` takes
            [`deltanet_cp.default_block_size`][].
        - `memory`: what the engine keeps for the backward, `"low"` (`None`, the
            default) or `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `tile_size`: the side of the attention layers' score tiles (see
            [`deltanet_cp.nn.CausalSelfAttention`][]).
        - `precision`: every token mixer's precision policy: `"highest"` (float32
            operands at `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32
            accumulation), `"default"` (`jax.default_matmul_precision`), or `None`: from
            the parameters' dtype, `"bfloat16"` for bfloat16 parameters and `"highest"`
            otherwise. The recurrent states, the softmax statistics and the norms stay
            float32 under every policy; the dense projections, MLPs, embedding and LM
            head multiply in the parameters' dtype at JAX's default precision. See
            [`deltanet_cp.nn.GatedDeltaNet`][] and [`deltanet_cp.nn.CausalSelfAttention`][].
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `scan_layers`: hold the decoder layers stacked by their repeating pattern, a
            [`deltanet_cp.nn.LayerStack`][], and run them with
            `jax.lax.scan`: the compile time of the forward and its gradient stays flat
            in depth (48 layers compile in about the time of 4). The parameters (for a
            given `key`) are those of the loop over layers (`False`, the default). The
            float32 logits equal the loop's bit for bit with the Gated DeltaNet, Kimi
            Delta Attention and softmax attention layers in the scan's body (the tests
            check it), and to rounding (1 ulp seen) with a multi-head latent attention
            layer there; the gradients equal the loop's to rounding. The scan's body is
            compiled as a program of its own, and XLA chooses the fusion and order of a
            program's floating-point operations per program: where it chooses as for
            the unrolled layers the results are the same bits, otherwise they differ in
            the last ones (a backward always, a latent attention's forward too).
            `model.layers` then reads as the tuple of layers. FSDP (`fsdp=`)
            works on the stacked layers too, each gathered where it runs in the scan.
        - `key`: a PRNG key for the (random) initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
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
    ) -> "Qwen3_5ForCausalLM":
        """Load a Hugging Face checkpoint: a directory with `config.json` and
        `model.safetensors`, or `model.safetensors.index.json` and its shards.

        Only safetensors are read (never pickle). Every tensor is mapped by name to its
        parameter; the names of transformers' `Qwen3_5ForCausalLM` (`model.layers.N...`)
        and of the multimodal `Qwen3_5ForConditionalGeneration` (`model.language_model.
        layers.N...`, whose vision tower `model.visual.*` is skipped) are both read. The
        multi-token-prediction weights (`mtp.*`) are read into `mtp` (a
        [`deltanet_cp.models.Qwen3_5MTP`][]) if the config has `mtp_num_hidden_layers`
        and the checkpoint holds them; else skipped, as transformers skips them.

        **Arguments:**

        - `path`: the checkpoint directory.
        - `dtype`: cast every parameter to this dtype (e.g. `jnp.bfloat16`; the recurrent
            states stay float32); keep each tensor's stored dtype if `None`.
        - `chunk_size`, `block_size`, `memory`, `tile_size`, `precision`, `options`,
            `scan_layers`: as for `__init__`.

        **Raises:**

        `ValueError` listing, by name, every missing, unexpected or misshapen tensor.
        """
        options = engine_options(options, chunk_size, block_size, memory, precision)
        return load(
            cls,
            Qwen3_5Config,
            path,
            dtype=dtype,
            chunk_size=options.chunk_size,
            block_size=options.block_size,
            memory=options.memory,
            tile_size=tile_size,
            precision=options.precision,
            scan_layers=scan_layers,
        )
