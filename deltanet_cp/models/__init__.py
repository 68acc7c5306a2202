"""Whole models built from deltanet_cp's layers, with Hugging Face checkpoints.

- [`deltanet_cp.models.Qwen3_5ForCausalLM`][]: the Qwen3.5 dense text model (Gated
    DeltaNet and gated attention layers), context parallel, with prefill (state
    checkpoints included) and decoding.
- [`deltanet_cp.models.Qwen3NextForCausalLM`][] and
    [`deltanet_cp.models.Qwen3_5MoeForCausalLM`][]: the mixture-of-experts models of the
    family, the same layers with sparse mixture-of-experts feed-forwards, the same cache
    and generation.
- [`deltanet_cp.models.Qwen3_5MTP`][]: the multi-token-prediction head the released
    checkpoints of all three ship (`mtp.*`), trained through a model's `logits_and_mtp`.
- [`deltanet_cp.models.KimiLinearForCausalLM`][]: Kimi Linear (Kimi Delta Attention and
    multi-head latent attention layers, a sigmoid-routed mixture of experts), with the
    same API.
"""

from ._cache import Qwen3_5Cache as Qwen3_5Cache, Qwen3_5Checkpoints as Qwen3_5Checkpoints
from ._config import (
    KimiLinearConfig as KimiLinearConfig,
    Qwen3_5Config as Qwen3_5Config,
    Qwen3_5MoeConfig as Qwen3_5MoeConfig,
    Qwen3NextConfig as Qwen3NextConfig,
)
from ._decoder_layer import (
    KimiLinearDecoderLayer as KimiLinearDecoderLayer,
    Qwen3_5DecoderLayer as Qwen3_5DecoderLayer,
)
from ._kimi_linear import KimiLinearForCausalLM as KimiLinearForCausalLM
from ._layer_stack import Qwen3_5LayerStack as Qwen3_5LayerStack
from ._mtp import Qwen3_5MTP as Qwen3_5MTP
from ._qwen3_5 import Qwen3_5ForCausalLM as Qwen3_5ForCausalLM
from ._qwen3_moe import (
    Qwen3_5MoeForCausalLM as Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM as Qwen3NextForCausalLM,
)
