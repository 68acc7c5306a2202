"""The context-parallel argument of the layers: one `ContextParallel`, without a mesh."""

from jaxtyping import Array, Int

from .._parallel import check_bound, check_cp, ContextParallel, Contiguous


def layer_cp(cp: object, where: str) -> ContextParallel | None:
    """`cp` if it is `None` or a [`deltanet_cp.ContextParallel`][] without `mesh`; else a
    `TypeError` / `ValueError` saying what to pass."""
    check_cp(cp, where)
    if cp is None:
        return None
    assert isinstance(cp, ContextParallel)
    if cp.mesh is not None:
        raise ValueError(
            f"{where} runs inside your `jax.shard_map` on this rank's shard, so its `cp` "
            "takes no `mesh`: pass ContextParallel(axis_name, layout=...) without `mesh` and "
            "call the layer inside `jax.shard_map` over that mesh (the time axis sharded over "
            "`axis_name`)."
        )
    check_bound(cp, where)
    return cp


def local_positions(cp: ContextParallel | None, length: int) -> Int[Array, " length"]:
    """The global sequence positions of this rank's `length` local tokens (`0 ..` without
    `cp`)."""
    if cp is None:
        return Contiguous().positions(length, None)
    return cp.layout.positions(length, cp.axis_name)
