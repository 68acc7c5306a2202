"""How a call is sharded: `ContextParallel`, one static value (its layout, its exchange,
the mesh axis and, for global arrays, the mesh), above the layouts and the exchanges."""

from typing import Any, cast, Generic, overload, TYPE_CHECKING, TypeAlias, TypeVar

import equinox as eqx
import jax

from ._exchange import AbstractExchange, as_exchange, ExchangeName
from ._layout import AbstractLayout, Contiguous, Zigzag


__all__ = ["AbstractLayout", "ContextParallel", "Contiguous", "Zigzag"]

_L = TypeVar("_L", bound=AbstractLayout)


class ContextParallel(eqx.Module, Generic[_L]):
    """How a call is sharded over a context-parallel mesh axis: one static value.

    Pass it as `cp=` to [`deltanet_cp.run`][], the `chunk_*` and `recurrent_*` functions,
    the layers of `deltanet_cp.nn` and the models; `cp=None` (the default) runs on one
    device. What every `cp=` means:

    - The sequence axis is sharded over the mesh axis `axis_name`: axis 1 of every
        per-token argument of the functions (`(B, T, ...)`), axis 0 of a layer's or
        model's one sequence (`(seq, ...)`).
    - Without `mesh`, the call is made inside your own `jax.shard_map` and every
        per-token array, in and out, is this rank's shard, its pieces in `layout`'s order
        (`layout.to_layout` puts a global array in that order, `layout.from_layout` takes
        it back). An initial state is replicated, and the final state is the whole
        sequence's, the same on every rank.
    - With `mesh`, the arrays are global, in sequence order, and the function does the
        `shard_map` itself (and returns global arrays). The layers and models take a
        `ContextParallel` without `mesh` only.
    - The ranks exchange recurrent state by `exchange`; attention's keys and values go by
        the `kv_schedule=` of the layer's call instead.
    """

    axis_name: str = eqx.field(static=True)
    layout: _L = eqx.field(static=True)
    exchange: AbstractExchange = eqx.field(static=True)
    mesh: jax.sharding.Mesh | None = eqx.field(static=True)
    batch_axis: str | None = eqx.field(static=True)

    @overload
    def __init__(
        self: "ContextParallel[Contiguous]",
        axis_name: str,
        *,
        exchange: AbstractExchange | ExchangeName = ...,
        mesh: jax.sharding.Mesh | None = ...,
        batch_axis: str | None = ...,
    ): ...

    @overload
    def __init__(
        self,
        axis_name: str,
        *,
        layout: _L,
        exchange: AbstractExchange | ExchangeName = ...,
        mesh: jax.sharding.Mesh | None = ...,
        batch_axis: str | None = ...,
    ): ...

    def __init__(
        self,
        axis_name: str,
        *,
        layout: Any = Contiguous(),
        exchange: Any = "allgather",
        mesh: jax.sharding.Mesh | None = None,
        batch_axis: str | None = None,
    ):
        """**Arguments:**

        - `axis_name`: the mesh axis the sequence is sharded over.
        - `layout`: [`deltanet_cp.Contiguous`][] (the default), [`deltanet_cp.Zigzag`][],
            or a layout of your own (an [`deltanet_cp.AbstractLayout`][]).
        - `exchange`: how ranks exchange their maps: [`deltanet_cp.AllGather`][] (the
            default), [`deltanet_cp.PPermute`][], [`deltanet_cp.Ring`][],
            [`deltanet_cp.Auto`][], or the shorthands `"allgather"`, `"ppermute"`,
            `"ring"`, `"auto"`.
        - `mesh`: a `jax.sharding.Mesh` with an axis `axis_name`, for global arrays (the
            function does the `jax.shard_map`); `None` (the default) for a call made
            inside your own `jax.shard_map` on each rank's shard. Arrays you placed on
            the mesh (`jax.device_put` with a `NamedSharding` of it), or a mesh context
            (`jax.set_mesh`), make the call run on this mesh as it is, and the outputs
            come back typed on it; unplaced arrays run on a copy with `Auto` axes (same
            devices and names), so that eager `jax.grad` works without a mesh context.
        - `batch_axis`: with `mesh`, optionally a mesh axis to shard the batch over (data
            parallelism).
        """
        if not isinstance(axis_name, str):
            raise TypeError(f"`axis_name` must be a mesh axis name (a str); got {axis_name!r}.")
        if not isinstance(layout, AbstractLayout):
            raise ValueError(
                "`layout` must be a deltanet_cp.AbstractLayout instance, such as Contiguous() "
                f"or Zigzag(); got {layout!r}."
            )
        if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(
                "`mesh` must be a jax.sharding.Mesh with an axis named "
                f"{axis_name!r}, such as jax.make_mesh((4,), ({axis_name!r},)) or "
                f"jax.sharding.Mesh(devices, ({axis_name!r},)) over a list or array of devices "
                "(an AbstractMesh has no devices to run on); or None inside your own "
                f"`jax.shard_map`. Got {type(mesh).__name__}."
            )
        if mesh is not None and axis_name not in mesh.shape:
            raise ValueError(
                f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}."
            )
        if mesh is not None:
            layout.directions(mesh.shape[axis_name])  # its walks, checked now
        if batch_axis is not None and (mesh is None or batch_axis not in mesh.shape):
            raise ValueError(
                f"`batch_axis` ({batch_axis!r}) shards global arrays: pass a `mesh` that has it."
            )
        if batch_axis is not None and batch_axis == axis_name:
            raise ValueError(
                f"`batch_axis` ({batch_axis!r}) is the context-parallel axis: the batch and "
                "the sequence must be sharded over different mesh axes. Pass another axis of "
                f"the mesh {dict(mesh.shape)} as `batch_axis` (data parallelism), or "  # pyright: ignore[reportOptionalMemberAccess]
                "`batch_axis=None`."
            )
        self.axis_name = axis_name
        self.layout = cast(Any, layout)
        self.exchange = as_exchange(exchange)
        self.mesh = mesh
        self.batch_axis = batch_axis


def check_cp(cp: object, where: str) -> "ContextParallel | None":
    """`cp` itself if it is a `ContextParallel` or `None`; else a `TypeError` naming
    `where`."""
    if cp is not None and not isinstance(cp, ContextParallel):
        raise TypeError(f"{where}: `cp` must be a deltanet_cp.ContextParallel or None; got {cp!r}.")
    return cp


def local_cp(cp: object, where: str) -> "ContextParallel | None":
    """The library's one rule for the `cp` of a call on this rank's shard (the layers, the
    models, [`deltanet_cp.previous_tokens`][], the engine's walk): `cp` itself if it is
    `None`, or a `ContextParallel` without `mesh` whose axis is bound here (inside
    `jax.shard_map`); else a `TypeError` / `ValueError` naming `where` and what to pass."""
    cp = check_cp(cp, where)
    if cp is None:
        return None
    if cp.mesh is not None:
        raise ValueError(
            f"{where} runs inside jax.shard_map on this rank's shard, so its `cp` takes no "
            "`mesh`: pass ContextParallel(axis_name, layout=...) without `mesh` and make the "
            "call inside `jax.shard_map` over that mesh (the time axis sharded over "
            "`axis_name`); deltanet_cp.run and the chunk_* functions take the mesh and "
            "global arrays."
        )
    check_bound(cp, where)
    return cp


def call_cp(cp: object, where: str) -> "ContextParallel | None":
    """The rule for the `cp` of a function that takes either form ([`deltanet_cp.run`][],
    the `chunk_*` and `recurrent_*` functions): with `mesh`, global arrays outside any
    `jax.shard_map` over its axis (`check_global`); without, `local_cp`'s rule."""
    if isinstance(cp, ContextParallel) and cp.mesh is not None:
        check_global(cp, where)
        return cp
    return local_cp(cp, where)


def check_bound(cp: "ContextParallel", where: str) -> None:
    """A `ValueError` naming `where` if `cp`'s axis is unbound here.

    Without `mesh`, a call runs on this rank's shard inside `jax.shard_map`; outside one (or
    inside one without the axis) JAX would only say `NameError: unbound axis name`.
    """
    try:
        jax.lax.axis_size(cp.axis_name)
    except NameError:
        raise ValueError(
            f"{where}: cp=ContextParallel({cp.axis_name!r}) has no `mesh`, so the call must "
            f"be made inside `jax.shard_map` over a mesh with an axis {cp.axis_name!r} (on "
            f"each rank's shard), but no axis {cp.axis_name!r} is bound here. Either pass "
            f"the mesh, ContextParallel({cp.axis_name!r}, mesh=mesh), and global arrays, or "
            "make the call inside `jax.shard_map`."
        ) from None


def check_global(cp: "ContextParallel", where: str) -> None:
    """A `ValueError` naming `where` if `cp` (with a `mesh`: global arrays, the library's
    own `jax.shard_map`) is used inside a `jax.shard_map` over its axis already (where JAX
    would only say the mesh "should be of type Manual")."""
    try:
        jax.lax.axis_size(cp.axis_name)
    except NameError:
        return  # outside any shard_map over the axis: as it should be
    raise ValueError(
        f"{where}: cp=ContextParallel({cp.axis_name!r}, mesh=...) takes global arrays and "
        f"runs its own `jax.shard_map`, but this call is already inside one over "
        f"{cp.axis_name!r} (on a rank's shard). Inside your `jax.shard_map`, pass "
        f"ContextParallel({cp.axis_name!r}, layout=...) without `mesh`."
    )


def axis_size(cp: "ContextParallel | None") -> int:
    """The number of ranks of a checked `cp` (`local_cp`; inside `jax.shard_map`); 1
    without it."""
    return 1 if cp is None else jax.lax.axis_size(cp.axis_name)


def along_walks(cp: ContextParallel) -> "ContextParallel[Contiguous]":
    """What each walk of a shard under `cp` runs with: `cp`'s axis and exchange, the
    contiguous layout, no mesh (`cp` itself when it is that already)."""
    if isinstance(cp.layout, Contiguous) and cp.mesh is None:
        return cp  # pyright: ignore[reportReturnType]
    return ContextParallel(cp.axis_name, exchange=cp.exchange)


def contiguous(cp: "ContextParallel") -> "ContextParallel[Contiguous]":
    """`cp` itself if it is a `ContextParallel` with the [`deltanet_cp.Contiguous`][]
    layout, else a `TypeError` / `ValueError`."""
    check_cp(cp, "run_contiguous")
    if isinstance(cp.layout, Contiguous):
        return cp  # pyright: ignore[reportReturnType]
    raise ValueError(
        f"The engine's walk requires layout=Contiguous(), got {cp.layout!r}. It runs the "
        "three phases over one contiguous, in-order slice per rank (rank r holds tokens "
        "[r*S/cp, (r+1)*S/cp)); a zigzag shard interleaves pieces across ranks and, read as "
        "one slice, would silently compute the wrong result. Pass the ContextParallel to "
        "deltanet_cp.run or a chunk_* function instead: they hand the engine each walk of "
        "the shard (a zigzag shard's two contiguous pieces), in chain order."
    )


if TYPE_CHECKING:
    # For static type checkers the walk accepts `ContextParallel[Contiguous]` only...
    ContiguousParallel: TypeAlias = ContextParallel[Contiguous]
else:
    # ...while at run time any `ContextParallel` gets through the signature, so that
    # `contiguous` always answers with its explanatory `ValueError`.
    ContiguousParallel: TypeAlias = ContextParallel
