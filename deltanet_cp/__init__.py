"""Context parallelism for matrix-valued linear RNNs (Gated DeltaNet and friends) in JAX."""

import warnings as _warnings
from importlib import metadata as _metadata
from typing import Any as _Any, TYPE_CHECKING as _TYPE_CHECKING

from . import (
    chunkops as chunkops,
    data as data,
    internal as internal,
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
from ._layout import (
    AbstractLayout as AbstractLayout,
    Contiguous as Contiguous,
    from_zigzag as from_zigzag,
    Layout as Layout,
    to_zigzag as to_zigzag,
    Zigzag as Zigzag,
)
from ._options import EngineOptions as EngineOptions
from ._parallel import ContextParallel as ContextParallel
from ._recurrence import AbstractRecurrence as AbstractRecurrence
from ._run import (
    default_block_size as default_block_size,
    Memory as Memory,
    run as run,
)
from ._shift import next_tokens as next_tokens, previous_tokens as previous_tokens
from .recurrences._delta import (
    chunk_delta_rule as chunk_delta_rule,
    DeltaRule as DeltaRule,
    recurrent_delta_rule as recurrent_delta_rule,
)
from .recurrences._delta_family import (
    AbstractDeltaRule as AbstractDeltaRule,
    DeltaInputs as DeltaInputs,
)
from .recurrences._delta_product import (
    chunk_gated_delta_product as chunk_gated_delta_product,
    GatedDeltaProductRule as GatedDeltaProductRule,
    recurrent_gated_delta_product as recurrent_gated_delta_product,
)
from .recurrences._dplr import (
    DPLRDeltaRule as DPLRDeltaRule,
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
    GatedDeltaNet2Rule as GatedDeltaNet2Rule,
    recurrent_gdn2 as recurrent_gdn2,
)
from .recurrences._gla import (
    chunk_gla as chunk_gla,
    GLAInputs as GLAInputs,
    GLARule as GLARule,
    recurrent_gla as recurrent_gla,
)
from .recurrences._kda import (
    chunk_kda as chunk_kda,
    KimiDeltaRule as KimiDeltaRule,
    recurrent_kda as recurrent_kda,
)
from .recurrences._momentum import (
    MomentumDeltaRule as MomentumDeltaRule,
    MomentumInputs as MomentumInputs,
)
from .recurrences._momentum_functions import (
    chunk_momentum_delta_rule as chunk_momentum_delta_rule,
    recurrent_momentum_delta_rule as recurrent_momentum_delta_rule,
)
from .recurrences._precond import (
    PrecondGatedDeltaRule as PrecondGatedDeltaRule,
    PrecondKimiDeltaRule as PrecondKimiDeltaRule,
)
from .recurrences._precond_functions import (
    chunk_precond_gated_delta_rule as chunk_precond_gated_delta_rule,
    chunk_precond_kda as chunk_precond_kda,
    recurrent_precond_gated_delta_rule as recurrent_precond_gated_delta_rule,
    recurrent_precond_kda as recurrent_precond_kda,
)


__version__ = _metadata.version("deltanet_cp")


# Names that moved to `deltanet_cp.internal` (what only people extending the engine need),
# and the recurrence configurations renamed so as not to share a name with a layer of
# `deltanet_cp.nn`: the old paths work for one release, with a `DeprecationWarning`.
_MOVED = (
    "Collective",
    "collectives",
    "DeltaFactors",
    "DPLRFactors",
    "GatedLinearAttentionFactors",
    "MomentumFactors",
    "pack",
    "received_bytes_per_rank",
    "run_contiguous",
    "Segments",
    "segments",
    "unpack",
    "Walk",
)
_RENAMED = {
    "GatedDeltaNet2": "GatedDeltaNet2Rule",
    "GatedDeltaProduct": "GatedDeltaProductRule",
    "GatedLinearAttention": "GLARule",
    "KimiDeltaAttention": "KimiDeltaRule",
    "PrecondKimiDeltaAttention": "PrecondKimiDeltaRule",
}

if _TYPE_CHECKING:  # the old paths, for static type checkers
    from .internal import (
        Collective as Collective,
        collectives as collectives,
        DeltaFactors as DeltaFactors,
        DPLRFactors as DPLRFactors,
        GatedLinearAttentionFactors as GatedLinearAttentionFactors,
        MomentumFactors as MomentumFactors,
        pack as pack,
        received_bytes_per_rank as received_bytes_per_rank,
        run_contiguous as run_contiguous,
        Segments as Segments,
        segments as segments,
        unpack as unpack,
        Walk as Walk,
    )
    from .recurrences._delta_product import GatedDeltaProductRule as GatedDeltaProduct  # noqa: F401
    from .recurrences._gdn2 import GatedDeltaNet2Rule as GatedDeltaNet2  # noqa: F401
    from .recurrences._gla import GLARule as GatedLinearAttention  # noqa: F401
    from .recurrences._kda import KimiDeltaRule as KimiDeltaAttention  # noqa: F401
    from .recurrences._precond import PrecondKimiDeltaRule as PrecondKimiDeltaAttention  # noqa: F401


def __getattr__(name: str) -> _Any:
    if name in _MOVED:
        _warnings.warn(
            f"`deltanet_cp.{name}` moved to `deltanet_cp.internal.{name}` (the names only "
            "people extending the engine need); the old path goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(internal, name)
    if name in _RENAMED:
        new = _RENAMED[name]
        _warnings.warn(
            f"The recurrence `deltanet_cp.{name}` is now `deltanet_cp.{new}` (the name "
            f"`{name}` is the layer `deltanet_cp.nn.{name}`); the old name goes in the next "
            "release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module 'deltanet_cp' has no attribute {name!r}")
