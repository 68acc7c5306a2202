"""flash-linear-attention's call shapes for gated linear attention, with a decay per key
channel (GLA) or per head (simple GLA: Mamba-2, RetNet). Each builds the recurrence and its
inputs and calls the engine (`_convert.call`).
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from ..recurrences._gla import GLAInputs, GLARule
from ._convert import call, FLAStates
from ._fla_options import check_options


def chunk_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor | GateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gla.chunk_gla`: gated linear attention.

    Mirrors `chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None)` and runs
    [`deltanet_cp.GLARule`][], the recurrence of [`deltanet_cp.chunk_gla`][].
    FLA's GLA has no `beta` and no query/key normalisation.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per key channel, `(B, T, HV, K)` (a decay per head, `(B, T, HV)`,
        is accepted too: FLA's `chunk_simple_gla`).
    - `scale`, `initial_state`, `output_final_state`, `state_v_first`, `cu_seqlens`,
        `chunk_size`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_gla", options, ("cu_seqlens_cpu",))
    config = GLARule(chunk_size=chunk_size, scale=scale, precision=precision)
    inputs = GLAInputs(q, k, v, g)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


def fused_recurrent_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    gk: KeyGateTensor | None = None,
    gv: Array | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gla.fused_recurrent_gla`: gated linear attention token by token.

    Mirrors `fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
    output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None)` and runs
    the recurrence of [`deltanet_cp.recurrent_gla`][] with `g = gk` (no decay if `None`).
    `gv` must be `None` and `reverse` `False` (a `ValueError` otherwise); the other
    arguments are as in [`deltanet_cp.interop.fla.chunk_gla`][].
    """
    check_options("fused_recurrent_gla", dict(gv=gv, reverse=reverse), ("gv", "reverse"))
    config = GLARule(chunk_size=1, scale=scale, precision=precision)
    inputs = GLAInputs(q, k, v, _no_decay(v, k) if gk is None else gk)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


def _no_decay(v: ValueTensor, k: QKTensor) -> GateTensor:
    return jnp.zeros(v.shape[:3], k.dtype)


def _simple_gla_inputs(
    function: str,
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | None,
    g_gamma: Float[Array, " vheads"] | None,
) -> GLAInputs:
    """FLA's simple GLA's inputs: one of `g` and `g_gamma` (a decay per head), or neither."""
    if g is not None and g_gamma is not None:
        raise ValueError(f"{function}: pass one of `g` and `g_gamma`, not both (as FLA requires).")
    if g_gamma is not None:
        g = jnp.broadcast_to(g_gamma, v.shape[:3])
    return GLAInputs(q, k, v, _no_decay(v, k) if g is None else g)


def chunk_simple_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | None = None,
    g_gamma: Float[Array, " vheads"] | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.simple_gla.chunk_simple_gla`: a decay per head (Mamba-2, RetNet).

    Mirrors `chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
    output_final_state=False, state_v_first=False, cu_seqlens=None, ...)` and runs the
    recurrence of [`deltanet_cp.chunk_gla`][] with a decay per head.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per head, `(B, T, HV)`.
    - `g_gamma`: a constant log decay per head, `(HV,)` (RetNet); at most one of `g` and
        `g_gamma` (neither: no decay).
    - `scale`, `initial_state`, `output_final_state`, `state_v_first`, `cu_seqlens`,
        `chunk_size`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused; `head_first` raises a
        `ValueError` unless `False`.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_simple_gla", options, ("cu_seqlens_cpu", "head_first"))
    config = GLARule(chunk_size=chunk_size, scale=scale, precision=precision)
    inputs = _simple_gla_inputs("chunk_simple_gla", q, k, v, g, g_gamma)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


def fused_recurrent_simple_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | None = None,
    g_gamma: Float[Array, " vheads"] | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.simple_gla.fused_recurrent_simple_gla`: token by token.

    Mirrors `fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None,
    initial_state=None, output_final_state=False, reverse=False, state_v_first=False,
    cu_seqlens=None)` and runs the recurrence of [`deltanet_cp.recurrent_gla`][] with a
    decay per head. `reverse` must be `False` (a `ValueError` otherwise); the other
    arguments are as in [`deltanet_cp.interop.fla.chunk_simple_gla`][].
    """
    check_options("fused_recurrent_simple_gla", dict(reverse=reverse), ("reverse",))
    config = GLARule(chunk_size=1, scale=scale, precision=precision)
    inputs = _simple_gla_inputs("fused_recurrent_simple_gla", q, k, v, g, g_gamma)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)
