"""Typing helpers for values inside `jax.shard_map`: which mesh axes a value varies over."""

import jax
from jaxtyping import PyTree


def varying_axes(x) -> frozenset:
    """The mesh axes `x` varies over inside `jax.shard_map` (empty outside it).

    Newer jax keeps them on the abstract value's `manual_axis_type.varying`; older jax on its
    `vma`.
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def varying(tree: PyTree, like: PyTree) -> PyTree:
    """Mark `tree`'s values as varying over every mesh axis that `like`'s values vary over.

    Inside `shard_map`, a scan carry that starts replicated (the identity map, a state
    from the exchange) but is updated with per-rank data must be typed as per-rank from
    the start: over the context-parallel axis, and over any other axis the inputs are
    sharded on (a data-parallel batch axis, say).
    """
    axes: set = set()
    for leaf in jax.tree.leaves(like):
        axes |= varying_axes(leaf)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def summed_like(cotangents: PyTree, like: PyTree) -> PyTree:
    """Sum each cotangent over the mesh axes it varies over and its primal in `like` does
    not: the transpose of JAX's implicit cast of a replicated value to a per-rank one.

    A factor that reads no per-rank input (DeltaNet's decay of one) is the same on every
    rank; a hand-written cotangent of it is per rank.
    """

    def one(ct, x):
        extra = tuple(sorted(varying_axes(ct) - varying_axes(x), key=str))
        return jax.lax.psum(ct, extra) if extra else ct

    return jax.tree.map(one, cotangents, like)
