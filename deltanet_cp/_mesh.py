"""The mesh a top-level sharded call runs on."""

from typing import Any

import jax
from jax.sharding import AxisType, Mesh


def mesh_to_run_on(mesh: Mesh, *trees: Any) -> Mesh:
    """`mesh` as the caller uses it: its own `Explicit` axes, or made `Auto`.

    `jax.make_mesh` gives `Explicit` axes by default, and the arrays a `shard_map` over
    such a mesh returns carry their sharding in their type. Three cases:

    - The caller's arrays are typed on `mesh` (placed on it with its `Explicit` axes, as
      values or under `jax.jit`), or a mesh context is set (`with jax.set_mesh(mesh):`):
      the caller uses sharding in types, and the call runs on `mesh` as it is, so that its
      outputs are typed on the caller's mesh and meet the caller's arrays in one program.
      (Running on any other mesh there is JAX's "mesh should be the same across the entire
      program".)
    - Otherwise the `Explicit` axes are made `Auto`: the same devices and axis names, the
      arrays sharded the same way and their types plain. Outside a mesh context JAX cannot
      differentiate eagerly through arrays typed on an `Explicit` mesh (`jax.grad` fails
      with "enter your `jit` into a mesh context via `jax.set_mesh`"), and a caller who
      never placed an array should not meet that.

    **Arguments:**

    - `mesh`: the mesh of the `ContextParallel` the call was given.
    - `trees`: the call's array arguments (pytrees; `None` and non-arrays are skipped).

    **Returns:**

    The mesh to build the call's `shard_map` and input shardings on.
    """
    if not jax.sharding.get_abstract_mesh().empty:
        return mesh
    types = tuple(AxisType.Auto if t == AxisType.Explicit else t for t in mesh.axis_types)
    if types == tuple(mesh.axis_types) or _typed_on(mesh, trees):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def _typed_on(mesh: Mesh, trees: tuple[Any, ...]) -> bool:
    """Whether an array in `trees` carries a sharding on `mesh`'s `Explicit` axes in its type."""
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array):
            continue
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        typed = getattr(sharding, "mesh", None)
        if (
            typed is not None
            and not typed.empty
            and typed.axis_names == mesh.axis_names
            and AxisType.Explicit in typed.axis_types
        ):
            return True
    return False
