"""A model's layers stacked by their repeating pattern and run with `jax.lax.scan` (Equinox's
stacked-module pattern), so a deep model compiles its repeated group of layers once; the loop
over layers both forms share; and what each layer keeps for the backward (`remat`).

The models of `deltanet_cp.models` and [`deltanet_cp.nn.HybridLM`][] all build on these: a model
says how one layer runs on its carry, these run the layers (gathered under FSDP, rematerialised
as asked) in a loop or a scan."""

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ._fsdp import FSDP


# What a layer keeps for the backward pass (see `check_remat`).
Remat = Literal["none", "layer", "feed_forward"]
REMAT_POLICIES: tuple[str, ...] = ("none", "layer", "feed_forward")

_Carry = TypeVar("_Carry")


def check_remat(remat: Any) -> None:
    """A `ValueError` unless `remat` is one of `REMAT_POLICIES`: `"none"` (a layer keeps
    every intermediate its backward needs), `"layer"` (only its input: the whole layer is
    recomputed in the backward, `jax.checkpoint`) or `"feed_forward"` (the token mixer's
    intermediates and output: the MLP or mixture-of-experts block is recomputed)."""
    if not isinstance(remat, str) or remat not in REMAT_POLICIES:
        raise ValueError(
            f"`remat` must be one of {', '.join(map(repr, REMAT_POLICIES))}; got {remat!r}."
        )


def _signature(layer: Any) -> tuple[Any, ...]:
    """What two layers must share to be stacked: the tree (static fields included) and
    every array's shape and dtype."""
    leaves, treedef = jax.tree.flatten(layer)
    return (treedef, tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves))


def layer_period(layers: Sequence[Any]) -> int:
    """The shortest period `p` of the layers' pattern: layer `i` and layer `i + p` are alike
    (the same modules, static fields, shapes and dtypes) for every `i`; `len(layers)` if the
    pattern does not repeat."""
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


class LayerStack(eqx.Module):
    """A model's layers stacked by their repeating pattern: the `p` layers of one period
    (e.g. three Gated DeltaNet layers and one attention layer, Qwen3.5's and Qwen3-Next's
    `full_attention_interval = 4`; any pattern of [`deltanet_cp.nn.HybridLM`][]'s blocks)
    each hold the parameters of all `G` groups along a leading axis, and the forward runs
    the group with `jax.lax.scan` over that axis: one compiled group, whatever the depth.
    Layers past the last whole period (`n - G p`) are kept as they are and run after the
    scan.

    A model built or loaded with `scan_layers=True` holds one as its layers (`layers` of
    the Qwen models, `blocks` of `HybridLM`). It reads as the tuple of layers it replaces:
    `len(stack)` is the number of layers, `stack[i]` is layer `i` (its parameters sliced out
    of the stack: a new module, so edit a stacked model's layers with `stack.unstack()` and
    `LayerStack.stack(...)`), iterating gives every layer in order; prefill, decoding and
    `save_pretrained` use those. (`deltanet_cp.models.Qwen3_5LayerStack` is this class.)

    **Fields:**

    - `period`: the `p` layers of one period, every array with a leading axis of size `G`.
    - `rest`: the layers after the last whole period, unstacked.
    """

    period: tuple[Any, ...]
    rest: tuple[Any, ...]

    @classmethod
    def stack(cls, layers: Sequence[Any]) -> "LayerStack":
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

    def __getitem__(self, i: int) -> Any:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"layer {i} out of range for {n} layers")
        i %= n
        p, stacked = len(self.period), len(self.period) * self.num_groups
        if i >= stacked:
            return self.rest[i - stacked]
        g = i // p
        return jax.tree.map(lambda a: _index(a, g), self.period[i % p])

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def unstack(self) -> tuple[Any, ...]:
        """Every layer, unstacked, in order (the inverse of `stack`)."""
        return tuple(self)


def stack_layers(layers: tuple[Any, ...], scan_layers: bool) -> tuple[Any, ...] | LayerStack:
    """A model's layers field: the tuple, or with `scan_layers` its
    [`deltanet_cp.nn.LayerStack`][]."""
    if not isinstance(scan_layers, bool):
        raise TypeError(f"`scan_layers` must be True or False; got {scan_layers!r}.")
    return LayerStack.stack(layers) if scan_layers else layers


def call_layer(
    call: Callable[..., Any],
    layer: Any,
    *args: Any,
    remat: Remat,
    fsdp: FSDP | None = None,
) -> Any:
    """`call(layer, *args, remat=remat)`, the layer's parameters gathered first with `fsdp`
    (an [`deltanet_cp.nn.FSDP`][] whose specs are `layer`'s): the one place a layer's
    parameters meet the activations, in the loop over layers and in the scan's body.
    `call` applies `remat` itself without `fsdp`."""
    if fsdp is None:
        return call(layer, *args, remat=remat)
    if remat == "layer":
        # The whole layer recomputed in the backward, its parameters' gather included:
        # only its input is kept, and one layer's gathered weights live at a time.
        # (`FSDP.apply`'s policy keeps every activation, which would undo the remat.)
        return eqx.filter_checkpoint(_gathered_call)(call, layer, fsdp, *args)
    return fsdp.apply(layer, lambda specs: specs, *args, fn=lambda m, *a: call(m, *a, remat=remat))


def _gathered_call(call: Callable[..., Any], layer: Any, fsdp: FSDP, *args: Any) -> Any:
    """`layer` gathered (its specs `fsdp.specs`), then called on `args`."""
    return call(fsdp.gather(layer, lambda specs: specs), *args, remat="none")


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _group_specs(specs: Any) -> Any:
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


def check_fsdp_layers(layers: tuple[Any, ...] | LayerStack, specs: Any) -> None:
    """A `ValueError` if `specs` (the FSDP specs of a model's layers) hold the layers
    otherwise than `layers` (stacked or a tuple): specs taken from the other form of the
    model."""
    stacked = isinstance(layers, LayerStack)
    if isinstance(specs, LayerStack) != stacked:
        raise ValueError(
            "`fsdp.specs` are not of this model's structure: the model's layers are "
            f"{'' if stacked else 'not '}stacked (`scan_layers={stacked}`), the specs' "
            f"layers are {'not ' if stacked else ''}stacked. Take the specs from "
            "`deltanet_cp.nn.partition_specs` of this model's parameters."
        )


def _with_specs(fsdp: FSDP | None, where: Callable[[Any], Any]) -> FSDP | None:
    """`fsdp` for the part of the layers whose specs are `where(fsdp.specs)`."""
    return None if fsdp is None else dataclasses.replace(fsdp, specs=where(fsdp.specs))


def _run_group(
    group: Sequence[Any],
    carry: _Carry,
    run_layer: Callable[[Any, _Carry, FSDP | None], _Carry],
    fsdp: FSDP | None,
) -> _Carry:
    """`group`'s layers in order on `carry`, `fsdp` holding their specs (a tuple)."""
    for j, layer in enumerate(group):
        carry = run_layer(layer, carry, _with_specs(fsdp, lambda specs: specs[j]))
    return carry


def run_stack(
    layers: tuple[Any, ...] | LayerStack,
    carry: _Carry,
    run_layer: Callable[[Any, _Carry, FSDP | None], _Carry],
    fsdp: FSDP | None = None,
) -> _Carry:
    """Every layer on `carry`, in order: a Python loop over a tuple, a `jax.lax.scan` over
    the groups of a [`deltanet_cp.nn.LayerStack`][] (each step one period's layers, sliced
    out of the stack), then the stack's remainder. `run_layer(layer, carry, fsdp)` runs one
    layer (through `call_layer`), `fsdp` holding that layer's specs (`None` without FSDP):
    under the scan, the specs of the group's slices (the stack's without the group axis).

    **Arguments:**

    - `layers`: the model's layers, a tuple or stacked.
    - `carry`: what flows from layer to layer (the hidden states, and whatever the model
        sums or hands on); its structure must not change from group to group when
        scanned. A stack of a single group runs its period once, without a scan.
    - `run_layer`: one layer on the carry.
    - `fsdp`: an [`deltanet_cp.nn.FSDP`][] whose specs are those of `layers` (from
        [`deltanet_cp.nn.partition_specs`][] of the model: e.g. `specs.layers`), or `None`.
    """
    if not isinstance(layers, LayerStack):
        return _run_group(layers, carry, run_layer, fsdp)
    params, static = eqx.partition(layers.period, eqx.is_array)
    group = _with_specs(fsdp, lambda specs: tuple(map(_group_specs, specs.period)))

    def body(carry, group_params):
        return _run_group(eqx.combine(group_params, static), carry, run_layer, group), None

    if layers.num_groups == 1:
        # Nothing repeats: the period once (its carry may change structure, as a model's
        # first RWKV-7 block starts its `v_first`).
        carry = body(carry, jax.tree.map(lambda a: a[0], params))[0]
    else:
        carry, _ = jax.lax.scan(body, carry, params)
    return _run_group(layers.rest, carry, run_layer, _with_specs(fsdp, lambda s: s.rest))
