"""The names only people extending the engine need.

A user runs recurrences with [`deltanet_cp.run`][] and the `chunk_*` / `recurrent_*`
functions, shards them with [`deltanet_cp.ContextParallel`][], and builds models from
`deltanet_cp.nn`. Whoever writes a recurrence, a layout or an exchange of their own, or
inspects what the engine does, also needs what is here:

- the engine's walk over one contiguous slice per rank, [`deltanet_cp.internal.run_contiguous`][],
    and its unit, [`deltanet_cp.internal.Walk`][];
- the packing of documents into whole chunks: [`deltanet_cp.internal.segments`][],
    [`deltanet_cp.internal.Segments`][], [`deltanet_cp.internal.pack`][],
    [`deltanet_cp.internal.unpack`][];
- the chunk factors the built-in recurrences form (`prepare`'s results):
    [`deltanet_cp.internal.DeltaFactors`][], [`deltanet_cp.internal.GatedLinearAttentionFactors`][],
    [`deltanet_cp.internal.MomentumFactors`][], [`deltanet_cp.internal.DPLRFactors`][];
- the reading of compiled programs: [`deltanet_cp.internal.collectives`][],
    [`deltanet_cp.internal.Collective`][], [`deltanet_cp.internal.received_bytes_per_rank`][],
    [`deltanet_cp.internal.loop_trips`][].

These names were importable from `deltanet_cp` itself until now; that path still works for
one release, with a `DeprecationWarning`.
"""

from ._hlo import (
    Collective as Collective,
    collectives as collectives,
    loop_trips as loop_trips,
    received_bytes_per_rank as received_bytes_per_rank,
)
from ._layout import Walk as Walk
from ._packing import (
    pack as pack,
    Segments as Segments,
    segments as segments,
    unpack as unpack,
)
from ._run import run_contiguous as run_contiguous
from .recurrences._delta_family import DeltaFactors as DeltaFactors
from .recurrences._dplr import DPLRFactors as DPLRFactors
from .recurrences._gla import GatedLinearAttentionFactors as GatedLinearAttentionFactors
from .recurrences._momentum import MomentumFactors as MomentumFactors
