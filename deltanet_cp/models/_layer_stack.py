"""The decoder layers of a Qwen3.5-family model stacked by their repeating pattern and run with
`jax.lax.scan` (Equinox's stacked-module pattern), so a deep model compiles its repeated group
of layers once; and the loop over layers both forms share."""

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._parallel import ContextParallel
from .._sharding import varying
from ..nn import FSDP
from ..nn._moe import ExpertAxis, RouterStats, SparseMoE
from ..nn._schedule import KVSchedule
from ._decoder_layer import AbstractDecoderLayer, Remat


def _signature(layer: AbstractDecoderLayer) -> tuple[Any, ...]:
    """What two layers must share to be stacked: the tree (static fields included) and
    every array's shape and dtype."""
    leaves, treedef = jax.tree.flatten(layer)
    return (treedef, tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves))


def layer_period(layers: Sequence[AbstractDecoderLayer]) -> int:
    """The shortest period `p` of the layers' pattern: layer `i` and layer `i + p` are alike
    (the same token mixer, feed-forward, shapes and dtypes) for every `i`; `len(layers)` if
    the pattern does not repeat."""
    sig = [_signature(layer) for layer in layers]
    n = len(sig)
    for p in range(1, n):
        if all(sig[i] == sig[i + p] for i in range(n - p)):
            return p
    return max(n, 1)


def _is_array(x) -> bool:
    """An array or an abstract one (`jax.eval_shape`'s `ShapeDtypeStruct`)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _stack(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return jnp.stack(xs) if eqx.is_array(xs[0]) else xs[0]


def _index(x, g: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[g] if eqx.is_array(x) else x


class Qwen3_5LayerStack(eqx.Module):
    """A model's decoder layers stacked by their repeating pattern: the `p` layers of one
    period (e.g. three Gated DeltaNet layers and one attention layer, Qwen3.5's and
    Qwen3-Next's `full_attention_interval = 4`) each hold the parameters of all `G` groups
    along a leading axis, and the forward runs the group with `jax.lax.scan` over that axis:
    one compiled group, whatever the depth. Layers past the last whole period (`n - G p`)
    are kept as they are and run after the scan.

    A model built or loaded with `scan_layers=True` holds one as its `layers`. It reads as
    the tuple of layers it replaces: `len(stack)` is the number of layers, `stack[i]` is
    layer `i` (its parameters sliced out of the stack: a new module, so edit a stacked
    model's layers with `stack.unstack()` and `Qwen3_5LayerStack.stack(...)`), iterating
    gives every layer in order; prefill, decoding and `save_pretrained` use those.

    **Fields:**

    - `period`: the `p` layers of one period, every array with a leading axis of size `G`.
    - `rest`: the layers after the last whole period, unstacked.
    """

    period: tuple[AbstractDecoderLayer, ...]
    rest: tuple[AbstractDecoderLayer, ...]

    @classmethod
    def stack(cls, layers: Sequence[AbstractDecoderLayer]) -> "Qwen3_5LayerStack":
        """Stack `layers` (a model's, in order) by their shortest period (see
        `layer_period`); the stacked parameters are the layers' own, exactly."""
        layers = tuple(layers)
        if not layers:
            raise ValueError("`layers` is empty: there is nothing to stack.")
        p = layer_period(layers)
        groups = len(layers) // p
        period = tuple(jax.tree.map(_stack, *layers[j : groups * p : p]) for j in range(p))
        return cls(period, layers[groups * p :])

    @property
    def num_groups(self) -> int:
        """`G`, the number of stacked groups (whole periods)."""
        return next(x.shape[0] for x in jax.tree.leaves(self.period[0]) if _is_array(x))

    def __len__(self) -> int:
        return len(self.period) * self.num_groups + len(self.rest)

    def __getitem__(self, i: int) -> AbstractDecoderLayer:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"layer {i} out of range for {n} layers")
        i %= n
        p, stacked = len(self.period), len(self.period) * self.num_groups
        if i >= stacked:
            return self.rest[i - stacked]
        g = i // p
        return jax.tree.map(lambda a: _index(a, g), self.period[i % p])

    def __iter__(self) -> Iterator[AbstractDecoderLayer]:
        return (self[i] for i in range(len(self)))

    def unstack(self) -> tuple[AbstractDecoderLayer, ...]:
        """Every layer, unstacked, in order (the inverse of `stack`)."""
        return tuple(self)


def stack_layers(
    layers: tuple[AbstractDecoderLayer, ...], scan_layers: bool
) -> tuple[AbstractDecoderLayer, ...] | Qwen3_5LayerStack:
    """A model's `layers` field: the tuple, or with `scan_layers` its
    [`deltanet_cp.models.Qwen3_5LayerStack`][]."""
    if not isinstance(scan_layers, bool):
        raise TypeError(f"`scan_layers` must be True or False; got {scan_layers!r}.")
    return Qwen3_5LayerStack.stack(layers) if scan_layers else layers


def run_group(
    group: Sequence[AbstractDecoderLayer],
    x: jax.Array,
    stats: RouterStats | None,
    cp: ContextParallel | None,
    kv_schedule: KVSchedule,
    expert_axis: ExpertAxis,
    cu_seqlens,
    token_mask,
    remat: Remat,
    fsdp: FSDP | None = None,
) -> tuple[jax.Array, RouterStats | None]:
    """Run `group`'s layers in order on `x`, adding their router statistics to `stats`:
    the one place a group's parameters meet the activations, in the loop over layers (a
    group of one) and in the scan's body (one period's layers, sliced out of the stack by
    the scan). With `fsdp`, whose specs are those of `group`'s layers (a tuple, in order),
    each layer's parameters are gathered here just before it runs (`FSDP.apply`)."""
    for j, layer in enumerate(group):
        args = (x, cp, kv_schedule, expert_axis, cu_seqlens, token_mask)
        if fsdp is None:
            x, s = layer(*args, remat=remat)
        elif remat == "layer":
            # The whole layer recomputed in the backward, its parameters' gather included:
            # only its input is kept, and one layer's gathered weights live at a time.
            # (`FSDP.apply`'s policy keeps every activation, which would undo the remat.)
            x, s = eqx.filter_checkpoint(_gathered_call)(layer, fsdp, j, *args)
        else:
            x, s = fsdp.apply(
                layer, lambda specs: specs[j], *args, fn=lambda m, *a: m(*a, remat=remat)
            )
        if s is not None:
            stats = s if stats is None else jax.tree.map(jnp.add, stats, s)
    return x, stats


def _gathered_call(layer: AbstractDecoderLayer, fsdp: FSDP, j: int, *args):
    """Layer `j` of a group (its specs `fsdp.specs[j]`) gathered, then run on `args`."""
    return fsdp.gather(layer, lambda specs: specs[j])(*args, remat="none")


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _group_specs(specs: AbstractDecoderLayer) -> AbstractDecoderLayer:
    """The specs of one group's layer from those of its stack (the leading `None` of the
    group axis dropped)."""

    def drop(spec: P) -> P:
        if len(spec) and spec[0] is not None:
            raise ValueError(
                f"A stacked layer's parameter has the spec {spec}, which splits the group "
                "axis: take the specs from `deltanet_cp.nn.partition_specs` of the stacked "
                "model's parameters."
            )
        return P(*spec[1:])

    return jax.tree.map(drop, specs, is_leaf=_is_spec)


def check_fsdp_layers(
    layers: "tuple[AbstractDecoderLayer, ...] | Qwen3_5LayerStack", fsdp: FSDP
) -> None:
    """A `ValueError` if `fsdp`'s specs hold the layers otherwise than `layers` (stacked or a
    tuple): specs taken from the other form of the model."""
    stacked = isinstance(layers, Qwen3_5LayerStack)
    if isinstance(getattr(fsdp.specs, "layers", None), Qwen3_5LayerStack) != stacked:
        raise ValueError(
            "`fsdp.specs` are not of this model's structure: the model's layers are "
            f"{'' if stacked else 'not '}stacked (`scan_layers={stacked}`), the specs' "
            f"layers are {'not ' if stacked else ''}stacked. Take the specs from "
            "`deltanet_cp.nn.partition_specs` of this model's parameters."
        )


def _layer_fsdp(fsdp: FSDP | None, where: Callable[[Any], tuple[Any, ...]]) -> FSDP | None:
    """`fsdp` for the layers `where(specs.layers)` of the model's specs."""
    return None if fsdp is None else dataclasses.replace(fsdp, specs=where(fsdp.specs.layers))


def run_layers(
    layers: "tuple[AbstractDecoderLayer, ...] | Qwen3_5LayerStack",
    x: jax.Array,
    cp: ContextParallel | None,
    kv_schedule: KVSchedule,
    expert_axis: ExpertAxis,
    cu_seqlens,
    token_mask,
    remat: Remat,
    num_experts: int | None,
    fsdp: FSDP | None = None,
) -> tuple[jax.Array, RouterStats | None]:
    """Every layer on `x`: a Python loop over a tuple, a `jax.lax.scan` over the groups of a
    [`deltanet_cp.models.Qwen3_5LayerStack`][] (then its remainder). The router statistics
    are summed over the layers in order, as the loop sums them. With `fsdp` (the whole
    model's specs), each layer is gathered where it runs: in the scan's body, from the
    group's slices of the stacked parameters (their specs without the group axis)."""
    args = (cp, kv_schedule, expert_axis, cu_seqlens, token_mask, remat)
    if not isinstance(layers, Qwen3_5LayerStack):
        stats = None
        for i, layer in enumerate(layers):
            one = _layer_fsdp(fsdp, lambda specs: (specs[i],))
            x, stats = run_group((layer,), x, stats, *args, fsdp=one)
        return x, stats
    stats = None
    if any(isinstance(layer.mlp, SparseMoE) for layer in layers.period):
        assert num_experts is not None
        zero = jnp.zeros((num_experts,), jnp.float32)
        # 0 + s is s exactly: the sum over layers is the loop's, in the same order. Inside
        # `jax.shard_map` the sums vary over the axes the tokens do, so the carry does too.
        stats = varying(RouterStats(zero, zero, jnp.zeros((), jnp.float32)), x)
    params, static = eqx.partition(layers.period, eqx.is_array)
    group = _layer_fsdp(fsdp, lambda specs: tuple(map(_group_specs, specs.period)))
    rest = _layer_fsdp(fsdp, lambda specs: specs.rest)

    def body(carry, group_params):
        x, stats = carry
        return run_group(eqx.combine(group_params, static), x, stats, *args, fsdp=group), None

    (x, stats), _ = jax.lax.scan(body, (x, stats), params)
    return run_group(layers.rest, x, stats, *args, fsdp=rest)
