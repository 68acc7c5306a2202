"""Context parallelism for matrix-valued linear RNNs (Gated DeltaNet and friends) in JAX."""

from importlib import metadata as _metadata

from . import (
    chunkops as chunkops,
    interop as interop,
    models as models,
    nn as nn,
    testing as testing,
)
from ._affine import (
    AbstractAffineMap as AbstractAffineMap,
    AffineMap as AffineMap,
    DiagonalAffineMap as DiagonalAffineMap,
    prefix_scan as prefix_scan,
)
from ._exchange import (
    AbstractCostedExchange as AbstractCostedExchange,
    AbstractExchange as AbstractExchange,
    AllGather as AllGather,
    Auto as Auto,
    PPermute as PPermute,
    Ring as Ring,
)
from ._hlo import (
    Collective as Collective,
    collectives as collectives,
    received_bytes_per_rank as received_bytes_per_rank,
)
from ._layout import (
    AbstractLayout as AbstractLayout,
    Contiguous as Contiguous,
    from_zigzag as from_zigzag,
    Layout as Layout,
    to_zigzag as to_zigzag,
    Walk as Walk,
    Zigzag as Zigzag,
)
from ._options import EngineOptions as EngineOptions
from ._packing import (
    pack as pack,
    Segments as Segments,
    segments as segments,
    unpack as unpack,
)
from ._parallel import ContextParallel as ContextParallel
from ._recurrence import AbstractRecurrence as AbstractRecurrence
from ._run import (
    default_block_size as default_block_size,
    Memory as Memory,
    run as run,
    run_contiguous as run_contiguous,
)
from ._shift import previous_tokens as previous_tokens
from .recurrences._delta import (
    chunk_delta_rule as chunk_delta_rule,
    DeltaRule as DeltaRule,
    recurrent_delta_rule as recurrent_delta_rule,
)
from .recurrences._delta_family import (
    AbstractDeltaRule as AbstractDeltaRule,
    DeltaFactors as DeltaFactors,
    DeltaInputs as DeltaInputs,
)
from .recurrences._delta_product import (
    chunk_gated_delta_product as chunk_gated_delta_product,
    GatedDeltaProduct as GatedDeltaProduct,
    recurrent_gated_delta_product as recurrent_gated_delta_product,
)
from .recurrences._dplr import (
    DPLRDeltaRule as DPLRDeltaRule,
    DPLRFactors as DPLRFactors,
    DPLRInputs as DPLRInputs,
)
from .recurrences._dplr_functions import (
    chunk_dplr_delta_rule as chunk_dplr_delta_rule,
    recurrent_dplr_delta_rule as recurrent_dplr_delta_rule,
)
from .recurrences._gated_delta import (
    chunk_gated_delta_rule as chunk_gated_delta_rule,
    GatedDeltaRule as GatedDeltaRule,
    recurrent_gated_delta_rule as recurrent_gated_delta_rule,
)
from .recurrences._gdn2 import (
    chunk_gdn2 as chunk_gdn2,
    GatedDeltaNet2 as GatedDeltaNet2,
    recurrent_gdn2 as recurrent_gdn2,
)
from .recurrences._gla import (
    chunk_gla as chunk_gla,
    GatedLinearAttention as GatedLinearAttention,
    GatedLinearAttentionFactors as GatedLinearAttentionFactors,
    GLAInputs as GLAInputs,
    recurrent_gla as recurrent_gla,
)
from .recurrences._kda import (
    chunk_kda as chunk_kda,
    KimiDeltaAttention as KimiDeltaAttention,
    recurrent_kda as recurrent_kda,
)
from .recurrences._momentum import (
    MomentumDeltaRule as MomentumDeltaRule,
    MomentumFactors as MomentumFactors,
    MomentumInputs as MomentumInputs,
)
from .recurrences._momentum_functions import (
    chunk_momentum_delta_rule as chunk_momentum_delta_rule,
    recurrent_momentum_delta_rule as recurrent_momentum_delta_rule,
)
from .recurrences._precond import (
    PrecondGatedDeltaRule as PrecondGatedDeltaRule,
    PrecondKimiDeltaAttention as PrecondKimiDeltaAttention,
)
from .recurrences._precond_functions import (
    chunk_precond_gated_delta_rule as chunk_precond_gated_delta_rule,
    chunk_precond_kda as chunk_precond_kda,
    recurrent_precond_gated_delta_rule as recurrent_precond_gated_delta_rule,
    recurrent_precond_kda as recurrent_precond_kda,
)


__version__ = _metadata.version("deltanet_cp")
