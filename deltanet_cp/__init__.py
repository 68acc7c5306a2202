"""Context parallelism for matrix-valued linear RNNs (Gated DeltaNet and friends) in JAX."""

import importlib.metadata

from ._affine import (
    AbstractAffineMap as AbstractAffineMap,
    AffineMap as AffineMap,
    DiagonalAffineMap as DiagonalAffineMap,
    prefix_scan as prefix_scan,
)
from ._engine import (
    AbstractChunkedRecurrence as AbstractChunkedRecurrence,
    local_map as local_map,
    run_context_parallel as run_context_parallel,
    run_local as run_local,
    run_packed as run_packed,
)
from ._exchange import (
    choose_strategy as choose_strategy,
    estimated_seconds as estimated_seconds,
    payload_elements as payload_elements,
)
from ._hlo import (
    Collective as Collective,
    collectives as collectives,
    received_bytes_per_rank as received_bytes_per_rank,
)
from ._layout import (
    AbstractLayout as AbstractLayout,
    Contiguous as Contiguous,
    Zigzag as Zigzag,
)
from ._packing import (
    pack as pack,
    Segments as Segments,
    segments as segments,
    unpack as unpack,
)
from .recurrences._common import DeltaFactors as DeltaFactors
from .recurrences._delta import (
    chunk_delta_rule as chunk_delta_rule,
    chunk_delta_rule_cp as chunk_delta_rule_cp,
    DeltaRule as DeltaRule,
    recurrent_delta_rule as recurrent_delta_rule,
)
from .recurrences._delta_product import (
    chunk_gated_delta_product as chunk_gated_delta_product,
    chunk_gated_delta_product_cp as chunk_gated_delta_product_cp,
    GatedDeltaProduct as GatedDeltaProduct,
    recurrent_gated_delta_product as recurrent_gated_delta_product,
)
from .recurrences._gated_delta import (
    chunk_gated_delta_rule as chunk_gated_delta_rule,
    chunk_gated_delta_rule_cp as chunk_gated_delta_rule_cp,
    chunk_gated_delta_rule_sharded as chunk_gated_delta_rule_sharded,
    GatedDeltaFactors as GatedDeltaFactors,
    GatedDeltaRule as GatedDeltaRule,
    recurrent_gated_delta_rule as recurrent_gated_delta_rule,
)
from .recurrences._gla import (
    chunk_gla as chunk_gla,
    chunk_gla_cp as chunk_gla_cp,
    GatedLinearAttention as GatedLinearAttention,
    GatedLinearAttentionFactors as GatedLinearAttentionFactors,
    recurrent_gla as recurrent_gla,
)
from .recurrences._kda import (
    chunk_kimi_delta_attention as chunk_kimi_delta_attention,
    chunk_kimi_delta_attention_cp as chunk_kimi_delta_attention_cp,
    KimiDeltaAttention as KimiDeltaAttention,
    recurrent_kimi_delta_attention as recurrent_kimi_delta_attention,
)


__version__ = importlib.metadata.version("deltanet_cp")

__all__ = [
    "AbstractAffineMap",
    "AbstractChunkedRecurrence",
    "AbstractLayout",
    "AffineMap",
    "Collective",
    "Contiguous",
    "DeltaFactors",
    "DeltaRule",
    "DiagonalAffineMap",
    "GatedDeltaFactors",
    "GatedDeltaProduct",
    "GatedDeltaRule",
    "GatedLinearAttention",
    "GatedLinearAttentionFactors",
    "KimiDeltaAttention",
    "Segments",
    "Zigzag",
    "choose_strategy",
    "chunk_delta_rule",
    "chunk_delta_rule_cp",
    "chunk_gated_delta_product",
    "chunk_gated_delta_product_cp",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_cp",
    "chunk_gated_delta_rule_sharded",
    "chunk_gla",
    "chunk_gla_cp",
    "chunk_kimi_delta_attention",
    "chunk_kimi_delta_attention_cp",
    "collectives",
    "estimated_seconds",
    "local_map",
    "pack",
    "payload_elements",
    "prefix_scan",
    "received_bytes_per_rank",
    "recurrent_delta_rule",
    "recurrent_gated_delta_product",
    "recurrent_gated_delta_rule",
    "recurrent_gla",
    "recurrent_kimi_delta_attention",
    "run_context_parallel",
    "run_local",
    "run_packed",
    "segments",
    "unpack",
]
