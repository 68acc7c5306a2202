"""The mesh a top-level sharded call runs on."""

import jax
from jax.sharding import AxisType, Mesh


def mesh_to_run_on(mesh: Mesh) -> Mesh:
    """`mesh`, with its `Explicit` axes made `Auto` when no mesh context is set.

    `jax.make_mesh` gives `Explicit` axes by default, and the arrays a `shard_map` over
    such a mesh returns carry their sharding in their type. Outside a mesh context, JAX
    cannot differentiate eagerly through them: `jax.grad` of a loss of the outputs fails
    with "enter your `jit` into a mesh context via `jax.set_mesh`", and `jax.set_mesh`
    itself is refused under a trace. With `Auto` axes the arrays are sharded the same way,
    their types plain, and eager `jax.grad`, `jax.jit` and `jax.vmap` all work. Inside a
    mesh context (`with jax.set_mesh(mesh):`) the caller is using sharding in types, and
    the mesh is returned as it is.

    **Arguments:**

    - `mesh`: the mesh a `*_sharded` function was given.

    **Returns:**

    The mesh to build its `shard_map` and input shardings on: the same devices and axis
    names.
    """
    if not jax.sharding.get_abstract_mesh().empty:
        return mesh
    types = tuple(AxisType.Auto if t == AxisType.Explicit else t for t in mesh.axis_types)
    if types == tuple(mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)
