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


def varying(tree: PyTree, like: PyTree, *, but: str | None = None) -> PyTree:
    """Mark `tree`'s values as varying over every mesh axis that `like`'s values vary over
    (but the axis `but`, if given).

    Inside `shard_map`, a scan carry that starts replicated (the identity map, a state
    from the exchange) but is updated with per-rank data must be typed as per-rank from
    the start: over the context-parallel axis, and over any other axis the inputs are
    sharded on (a data-parallel batch axis, say). So must a value made up inside a custom
    VJP's caller (a default zero state) whose cotangent the VJP forms from per-rank data.
    """
    axes: set = set()
    for leaf in jax.tree.leaves(like):
        axes |= varying_axes(leaf)
    axes.discard(but)

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


def cotangent_like(cotangents: PyTree, like: PyTree) -> PyTree:
    """Type each cotangent as its primal in `like` is typed: summed over the mesh axes it
    varies over and its primal does not (`summed_like`), cast to varying over those its
    primal varies over and it does not.

    What a custom VJP's backward must return: JAX checks that each cotangent varies over
    exactly the mesh axes its primal does. A replicated initial state (the same on every
    rank of a data-parallel axis) has the sum over ranks of the per-rank cotangents as its
    cotangent.
    """

    def one(ct, x):
        if ct is None or x is None:
            return ct
        ct = summed_like(ct, x)
        missing = tuple(sorted(varying_axes(x) - varying_axes(ct), key=str))
        return jax.lax.pcast(ct, missing, to="varying") if missing else ct

    return jax.tree.map(one, cotangents, like, is_leaf=lambda t: t is None)
