"""Other libraries' formats and call shapes.

- Hugging Face `transformers` weights for [`deltanet_cp.nn.GatedDeltaNet`][], from
    safetensors only: `gated_delta_net_from_hf`, `gated_delta_net_to_hf`; and for
    [`deltanet_cp.nn.KimiDeltaAttention`][]: `kimi_delta_attention_from_hf`,
    `kimi_delta_attention_to_hf`; and for [`deltanet_cp.nn.MultiHeadLatentAttention`][]
    (Kimi Linear's attention): `multi_head_latent_attention_from_hf`,
    `multi_head_latent_attention_to_hf`. Whole models save theirs with `save_pretrained` (see
    [`deltanet_cp.models`][]).
- [`deltanet_cp.interop.fla`][]: flash-linear-attention's `fla.ops` signatures.
- [`deltanet_cp.interop.transformers`][]: transformers' torch kernels for Kimi Linear and
    Qwen3-Next.
"""

from . import fla as fla, transformers as transformers
from ._hf import (
    gated_delta_net_from_hf as gated_delta_net_from_hf,
    gated_delta_net_to_hf as gated_delta_net_to_hf,
)
from ._hf_kimi import (
    kimi_delta_attention_from_hf as kimi_delta_attention_from_hf,
    kimi_delta_attention_to_hf as kimi_delta_attention_to_hf,
)
from ._hf_mla import (
    multi_head_latent_attention_from_hf as multi_head_latent_attention_from_hf,
    multi_head_latent_attention_to_hf as multi_head_latent_attention_to_hf,
)
