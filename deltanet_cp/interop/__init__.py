"""Loading (and saving) Hugging Face `transformers` weights, from safetensors only."""

from ._hf import (
    gated_delta_net_from_hf as gated_delta_net_from_hf,
    gated_delta_net_to_hf as gated_delta_net_to_hf,
)
