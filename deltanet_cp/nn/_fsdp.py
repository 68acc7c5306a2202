"""A model's parameters sharded over named mesh axes: fully sharded data parallelism (FSDP:
every parameter split over the data axis, gathered layer by layer inside the step) and the
routed experts split over their own axis."""

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._moe import SwiGLUExperts


MeshAxis = str | tuple[str, ...]


def _names(axis: Any, name: str, optional: bool = True) -> tuple[str, ...]:
    """`axis` as a tuple of mesh axis names; a `TypeError` naming `name` otherwise (saying
    that `None` is allowed if `optional`)."""
    names = (axis,) if isinstance(axis, str) else axis
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(a, str) for a in names)
        or len(set(names)) != len(names)
    ):
        raise TypeError(
            f"`{name}` must be {'None, ' if optional else ''}the name of a mesh axis or a "
            f"tuple of distinct names; got {axis!r}."
        )
    return names


def _entry(names: tuple[str, ...]) -> MeshAxis:
    """One dimension's entry of a `PartitionSpec` for the mesh axes `names`."""
    return names[0] if len(names) == 1 else names


def _mesh_sizes(mesh: Any) -> Mapping[str, int]:
    sizes = getattr(mesh, "shape", None)
    if not isinstance(sizes, Mapping):
        raise TypeError(
            "`mesh` must be a `jax.sharding.Mesh` or `jax.sharding.AbstractMesh` (whose "
            f"`shape` maps each axis name to its size); got {type(mesh).__name__}."
        )
    return sizes


def _size(sizes: Mapping[str, int], names: tuple[str, ...], name: str) -> int:
    missing = [a for a in names if a not in sizes]
    if missing:
        raise ValueError(
            f"`{name}` names mesh axes {missing} that the mesh does not have (its axes: "
            f"{list(sizes)}). Pass axes of the mesh the parameters are placed on."
        )
    return math.prod(sizes[a] for a in names)


def _fsdp_dim(shape: tuple[int, ...], n: int, taken: int | None = None) -> int | None:
    """The dimension FSDP splits `n` ways: the largest dimension divisible by `n` (the
    first of equal ones), but `taken`; `None` if no dimension divides."""
    order = sorted((d for d in range(len(shape)) if d != taken), key=lambda d: -shape[d])
    return next((d for d in order if shape[d] % n == 0), None)


def _spec(split: Mapping[int, MeshAxis]) -> P:
    if not split:
        return P()
    return P(*(split.get(d) for d in range(max(split) + 1)))


def partition_specs(
    tree: PyTree,
    mesh: Any,
    *,
    data_axis: MeshAxis | None = None,
    expert_axis: MeshAxis | None = None,
) -> PyTree:
    """The `jax.sharding.PartitionSpec` of every parameter of a model for named mesh axes:
    fully sharded data parallelism (FSDP, ZeRO-3) over `data_axis` and the routed experts
    over `expert_axis`.

    **The rule.** Each array of a [`deltanet_cp.nn.SwiGLUExperts`][] is split over
    `expert_axis` on its first dimension (the experts), as
    [`deltanet_cp.nn.expert_partition_specs`][] does. Every array is then split over
    `data_axis` on its largest dimension that the axis's size divides (the first of equal
    ones; never the experts' dimension); the experts' arrays only if `expert_axis` shares
    no mesh axis with `data_axis` (else they are split over those axes already). An array
    no dimension of which divides (a vector of 4 value heads' decays over 8 ranks) stays
    whole on every rank: a `UserWarning` names each such array and their total size.
    Scalars and leaves that are not arrays are replicated (`P()`).

    A model built with `scan_layers=True` holds its layers stacked (a
    [`deltanet_cp.nn.LayerStack`][]): the arrays of its `period` lead with the
    group axis, which is never split (`P(None, ...)`, the rule applied to the other
    dimensions: `P(None, expert_axis, ...)` for the experts), and the layers of its `rest`
    are split as any other. The scan gathers each layer from its group's slices where it
    runs.

    Use the specs for `jax.shard_map`'s `in_specs` of the parameters (and its `out_specs`
    of their gradients), to place them on the mesh (`jax.device_put(params,
    jax.tree.map(lambda s: NamedSharding(mesh, s), specs))`), and for the optimizer's state
    through `optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, state, specs,
    transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))` (Adam's
    moments get their parameters' specs, its step count `P()`). Inside the step, a model
    called with `fsdp=deltanet_cp.nn.FSDP(data_axis, specs)` gathers each layer's
    parameters just before the layer runs and again in its backward
    ([`deltanet_cp.nn.FSDP`][]); their gradients come out split as the parameters.

    **Arguments:**

    - `tree`: the model's parameters (`equinox.partition(model, equinox.is_array)[0]`),
        arrays or `jax.ShapeDtypeStruct`s of their whole (unsharded) shapes.
    - `mesh`: the `jax.sharding.Mesh` (or `AbstractMesh`) the parameters go on; its
        axis sizes decide what divides.
    - `data_axis`: the mesh axis (or tuple of axes) the parameters are split over,
        `None` for no FSDP. Usually the axis the batch is split over; a tuple such as
        `("dp", "cp")` splits them over every device of both.
    - `expert_axis`: the mesh axis (or tuple of axes) the routed experts are split over,
        as passed to the models; `None` for every expert on every rank (then FSDP splits
        the experts too).

    **Returns:**

    A pytree of `PartitionSpec`s with `tree`'s structure.

    **Raises:**

    `TypeError` for an axis that is not a name or a tuple of names, or a `mesh` without
    named axis sizes; `ValueError` for an axis the mesh does not have, an `expert_axis`
    whose size does not divide the experts (naming both), or an `expert_axis` for a tree
    without experts.
    """
    sizes = _mesh_sizes(mesh)
    data = None if data_axis is None else _names(data_axis, "data_axis")
    experts = None if expert_axis is None else _names(expert_axis, "expert_axis")
    n = 1 if data is None else _size(sizes, data, "data_axis")
    e = 1 if experts is None else _size(sizes, experts, "expert_axis")
    # The layer stack runs layers through `FSDP`: imported when called.
    from ._layer_stack import LayerStack

    is_experts = lambda x: isinstance(x, SwiGLUExperts)  # noqa: E731
    is_stack = lambda x: isinstance(x, LayerStack)  # noqa: E731
    if experts is not None and not any(is_experts(x) for x in jax.tree.leaves(tree, is_experts)):
        raise ValueError(
            f"`expert_axis={expert_axis!r}`, but there are no routed experts "
            "(`deltanet_cp.nn.SwiGLUExperts`) in `tree` to split over it. Pass "
            "`expert_axis=None`."
        )
    fsdp_experts = data is not None and (experts is None or not set(data) & set(experts))
    whole: list[tuple[str, int]] = []

    def one(path, x, in_experts: bool, lead: int) -> Any:
        # `lead`: the leading (group) axes of stacked layers, never split.
        full = getattr(x, "shape", None)
        if full is None or len(full) <= lead:
            return P()
        shape = tuple(full[lead:])
        split: dict[int, MeshAxis] = {}
        if in_experts and experts is not None:
            if shape[0] % e:
                raise ValueError(
                    f"{shape[0]} experts (`{jax.tree_util.keystr(path)}`) cannot be split "
                    f"evenly over the {e} ranks of `expert_axis={expert_axis!r}`: use an "
                    f"expert axis whose size divides {shape[0]}."
                )
            split[0] = _entry(experts)
        if data is not None and (fsdp_experts or not in_experts):
            d = _fsdp_dim(shape, n, 0 if in_experts else None)
            if d is None:
                whole.append((jax.tree_util.keystr(path), math.prod(full)))
            else:
                split[d] = _entry(data)
        return P(*(None,) * lead, *_spec(split)) if split else P()

    def node(path, x, lead: int = 0):
        if is_experts(x):
            return jax.tree_util.tree_map_with_path(lambda p, y: one(path + p, y, True, lead), x)
        return one(path, x, False, lead)

    def stack(path, x):
        # A model's stacked layers: `period`'s arrays lead with the group axis, `rest`'s not.
        def member(p, y):
            return node(path + p, y, int(getattr(p[0], "name", None) == "period"))

        return jax.tree_util.tree_map_with_path(member, x, is_leaf=is_experts)

    def top(path, x):
        return stack(path, x) if is_stack(x) else node(path, x)

    specs = jax.tree_util.tree_map_with_path(
        top, tree, is_leaf=lambda x: is_experts(x) or is_stack(x)
    )
    if whole:
        names = ", ".join(f"`{p}`" for p, _ in whole)
        warnings.warn(
            f"{len(whole)} parameters ({sum(s for _, s in whole)} elements) have no "
            f"dimension that the {n} ranks of `data_axis={data_axis!r}` divide and stay "
            f"whole on every rank: {names}.",
            UserWarning,
            stacklevel=2,
        )
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, P)


def gather_params(tree: PyTree, specs: PyTree, axis: MeshAxis) -> PyTree:
    """Inside `jax.shard_map`: `tree`'s parameters whole along the dimensions their specs
    split over `axis` (`jax.lax.all_gather(..., tiled=True)`), the others as they are.

    Call it on one layer just before the layer runs, so that only that layer's gathered
    parameters live at once. The gradient of an all-gather is a reduce-scatter: the
    gradients of the parameters come out split as the parameters are, summed over `axis`.
    The experts' dimension of a [`deltanet_cp.nn.SwiGLUExperts`][] (the third from last
    of its arrays) is never gathered: the experts stay split over their axis.

    **Arguments:**

    - `tree`: a layer, model or their parameters, as this rank holds them; a stack of
        layers (each array with an extra leading dimension) too.
    - `specs`: the `PartitionSpec`s of `tree`'s arrays, with its structure (from
        [`deltanet_cp.nn.partition_specs`][], e.g. `specs.layers[i]` for
        `model.layers[i]`; with `P(None, ...)` for a stack's leading dimension).
    - `axis`: the mesh axis (or tuple of axes) the FSDP split is over, the `data_axis`
        of `partition_specs`.

    **Returns:**

    `tree` with those arrays gathered.

    **Raises:**

    `TypeError` for an `axis` that is not a name or a tuple of names; `ValueError` if
    `axis` names no axis of the enclosing `jax.shard_map`, or if `specs` is not of
    `tree`'s structure.
    """
    names = _names(axis, "axis", optional=False)
    try:
        for a in names:
            jax.lax.axis_size(a)
    except NameError:
        raise ValueError(
            f"`axis={axis!r}` names a mesh axis that the enclosing `jax.shard_map` does not "
            "have (or there is none): gather the parameters inside the `shard_map` whose "
            "`in_specs` split them, naming its data axis."
        ) from None
    key = _entry(names)

    def gather(spec, x, experts: bool):
        if x is None or not isinstance(spec, P):
            return x
        skip = x.ndim - 3 if experts else None
        for d, entry in enumerate(spec):
            if entry is None or d == skip:
                continue
            if ((entry,) if isinstance(entry, str) else tuple(entry)) == names:
                x = jax.lax.all_gather(x, key, axis=d, tiled=True)
        return x

    def node(spec, x):
        if isinstance(spec, SwiGLUExperts):
            return jax.tree.map(lambda s, y: gather(s, y, True), spec, x, is_leaf=_is_spec)
        return gather(spec, x, False)

    arrays, rest = eqx.partition(tree, eqx.is_array)
    try:
        gathered = jax.tree.map(
            node, specs, arrays, is_leaf=lambda s: _is_spec(s) or isinstance(s, SwiGLUExperts)
        )
    except ValueError as err:
        raise ValueError(
            "`specs` is not of `tree`'s structure: pass the specs of the same part of the "
            "model (e.g. `specs.layers[i]` for `model.layers[i]`, from "
            f"`deltanet_cp.nn.partition_specs`). ({err})"
        ) from None
    return eqx.combine(gathered, rest)


# Primitives that only move, retype or broadcast a value: recomputed in the backward rather
# than saved, so that a gathered weight is not kept in another layout (transposed, cast to
# varying over another axis).
_LAYOUT = frozenset(
    {
        "transpose",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "pvary",
        "reduce_precision",
        "copy",
    }
)


def _not_the_gathers(names: tuple[str, ...]) -> Callable[..., bool]:
    """A `jax.checkpoint` policy: save every intermediate but the all-gathers over `names`
    and the layout changes of values (which the backward redoes from their inputs)."""

    def policy(prim, *_, **params) -> bool:
        if prim.name == "all_gather":
            return tuple(params.get("axis_name", ())) != names
        return prim.name not in _LAYOUT

    return policy


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallelism inside `jax.shard_map`: the mesh axis a model's
    parameters are split over and their specs. A model called with `fsdp=FSDP(axis,
    specs)` runs each layer through `apply`: the layer's parameters are gathered just
    before it runs and gathered again in the backward, so that only one layer's whole
    parameters live at once (the embedding and the LM head likewise, where they are used).
    Layers scanned (`scan_layers=True`) are gathered in the scan's body, each from its
    group's slices of the stacked parameters.

    **Fields:**

    - `axis`: the mesh axis (or tuple of axes) of the FSDP split, the `data_axis` of
        [`deltanet_cp.nn.partition_specs`][].
    - `specs`: the `PartitionSpec`s of the whole model's parameters, from
        `partition_specs` (the same as the `shard_map`'s `in_specs` of them).
    """

    axis: MeshAxis
    specs: PyTree

    def __post_init__(self):
        _names(self.axis, "axis", optional=False)

    def gather(self, tree: PyTree, where: Callable[[PyTree], PyTree]) -> PyTree:
        """`tree` gathered (see [`deltanet_cp.nn.gather_params`][]), whose specs are
        `where(self.specs)` (e.g. `lambda s: s.layers[i]`)."""
        return gather_params(tree, where(self.specs), self.axis)

    def apply(
        self,
        tree: PyTree,
        where: Callable[[PyTree], PyTree],
        *args: Any,
        fn: Callable[..., Any] | None = None,
    ) -> Any:
        """`fn(gathered, *args)` (`gathered(*args)` if `fn` is `None`: a layer's call),
        `gathered` being `tree` gathered as `gather` does.

        Autodiff would keep each gathered layer for the backward (the products' gradients
        need the weights): the whole model gathered at once. Here the call runs under
        `jax.checkpoint` with a policy that saves every intermediate but the all-gathers
        over `axis`, which the backward repeats (as FSDP does). An all-gather over the
        same axes inside the layer (a mixture of experts' token gather when `expert_axis`
        equals `axis`) is repeated too.

        **Arguments:**

        - `tree`: the layer (or part of the model) as this rank holds it.
        - `where`: its specs in `self.specs` (e.g. `lambda s: s.layers[i]`).
        - `args`: the call's arguments.
        - `fn`: what to compute from the gathered `tree` and `args`.
        """
        specs, axis = where(self.specs), self.axis

        def run(tree, *args):
            gathered = gather_params(tree, specs, axis)
            return gathered(*args) if fn is None else fn(gathered, *args)

        policy = _not_the_gathers(_names(axis, "axis", optional=False))
        return eqx.filter_checkpoint(run, policy=policy)(tree, *args)
