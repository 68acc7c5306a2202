"""The decoder layers of a Qwen3.5-family model run in a loop or, stacked by their repeating
pattern ([`deltanet_cp.nn.LayerStack`][]), with `jax.lax.scan`: what the models add to the
layers' common runner (`run_stack`) is the routers' statistics, summed over the layers in
order."""

import jax
import jax.numpy as jnp

from .._parallel import ContextParallel
from .._sharding import varying
from ..nn import FSDP
from ..nn._layer_stack import call_layer, LayerStack, Remat, run_stack
from ..nn._moe import ExpertAxis, RouterStats, SparseMoE
from ..nn._schedule import KVSchedule
from ._decoder_layer import AbstractDecoderLayer


Qwen3_5LayerStack = LayerStack
"""The stacked decoder layers of a model built with `scan_layers=True`: the layer stack every
model of the package uses, [`deltanet_cp.nn.LayerStack`][] (this name is that class)."""


def run_layers(
    layers: tuple[AbstractDecoderLayer, ...] | LayerStack,
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
    [`deltanet_cp.nn.LayerStack`][] (then its remainder). The router statistics are summed
    over the layers in order, as the loop sums them. With `fsdp` (the whole model's specs),
    each layer is gathered where it runs: in the scan's body, from the group's slices of the
    stacked parameters (their specs without the group axis)."""
    args = (cp, kv_schedule, expert_axis, cu_seqlens, token_mask)
    stats = None
    if isinstance(layers, LayerStack) and any(
        isinstance(layer.mlp, SparseMoE) for layer in layers.period
    ):
        assert num_experts is not None
        zero = jnp.zeros((num_experts,), jnp.float32)
        # 0 + s is s exactly: the sum over layers is the loop's, in the same order. Inside
        # `jax.shard_map` the sums vary over the axes the tokens do, so the carry does too.
        stats = varying(RouterStats(zero, zero, jnp.zeros((), jnp.float32)), x)

    def run_layer(layer, carry, fsdp):
        x, stats = carry
        call = AbstractDecoderLayer.__call__
        x, s = call_layer(call, layer, x, *args, remat=remat, fsdp=fsdp)
        if s is not None:
            stats = s if stats is None else jax.tree.map(jnp.add, stats, s)
        return x, stats

    layer_fsdp = None if fsdp is None else FSDP(fsdp.axis, fsdp.specs.layers)
    return run_stack(layers, (x, stats), run_layer, layer_fsdp)
