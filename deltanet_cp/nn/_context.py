"""The context-parallel argument of the layers: one `ContextParallel`, without a mesh."""

from jaxtyping import Array, Int

from .._parallel import ContextParallel, Contiguous, local_cp


# The layers' and the models' rule for `cp` is the library's one rule for a call on this
# rank's shard.
layer_cp = local_cp


def local_positions(cp: ContextParallel | None, length: int) -> Int[Array, " length"]:
    """The global sequence positions of this rank's `length` local tokens (`0 ..` without
    `cp`)."""
    if cp is None:
        return Contiguous().positions(length, None)
    return cp.layout.positions(length, cp.axis_name)
