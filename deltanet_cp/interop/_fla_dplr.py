"""flash-linear-attention's call shapes for the generalized delta rule (DPLR) and RWKV-7. Each
builds the recurrence and its inputs and calls the engine (`_convert.call`).
"""

from typing import Any

from .._custom_types import CuSeqlens, KeyGateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from ..recurrences._dplr import DPLRDeltaRule, DPLRInputs
from ._convert import call, FLAStates
from ._fla_options import check_options


_DPLR_OPTIONS = (
    "cu_seqlens_cpu",
    "safe_gate",
    "disable_recompute",
    "cp_context",
    "lower_bound",
    "head_first",
)


def chunk_dplr_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.generalized_delta_rule.chunk_dplr_delta_rule`.

    Mirrors `chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
    output_final_state=False, cu_seqlens=None, ...)` and runs [`deltanet_cp.DPLRDeltaRule`][],
    the recurrence of [`deltanet_cp.chunk_dplr_delta_rule`][]: per token, $S \\leftarrow
    \\mathrm{diag}(e^{gk}) S + b (a^\\top S) + k v^\\top$, $o = S^\\top (s\\, q)$.

    **Arguments:**

    - `q`, `k`, `a`, `b`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`; `gk`: log decays per key
        channel, `(B, T, HV, K)` (FLA: `HV = H`).
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: `(N, HV, K, V)`, `N` the batch size or the number of documents;
        zeros if `None`.
    - `output_final_state`: also return the final state.
    - `cu_seqlens`: packed documents (batch size 1), `[0, ..., T]`.
    - `chunk_size`: tokens per chunk (any; FLA's default of 16 is a kernel detail).
    - `cp`: how the call is sharded (what FLA's `cp_context` is for), as in
        [`deltanet_cp.ContextParallel`][]; `None`: one device.
    - `precision`: the products' policy, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` and `disable_recompute` are accepted and unused;
        `safe_gate`, `lower_bound`, `cp_context` and `head_first` raise a `ValueError`
        unless at their defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_dplr_delta_rule", options, _DPLR_OPTIONS)
    config = DPLRDeltaRule(chunk_size=chunk_size, scale=scale, precision=precision)
    inputs = DPLRInputs(q, k, v, a, b, gk)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)


def fused_recurrent_dplr_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.generalized_delta_rule.fused_recurrent_dplr_delta_rule`.

    Mirrors `fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None,
    initial_state=None, output_final_state=False, reverse=False, cu_seqlens=None)` and runs
    the recurrence of [`deltanet_cp.recurrent_dplr_delta_rule`][]; the arguments are as in
    [`deltanet_cp.interop.fla.chunk_dplr_delta_rule`][]. `reverse` must be `False`.
    """
    check_options("fused_recurrent_dplr_delta_rule", {"reverse": reverse}, ("reverse",))
    config = DPLRDeltaRule(chunk_size=1, scale=scale, precision=precision)
    inputs = DPLRInputs(q, k, v, a, b, gk)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)


def chunk_rwkv7(
    r: QKTensor,
    w: KeyGateTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    scale: float = 1.0,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.rwkv7.chunk_rwkv7`: RWKV-7's time mixing, the generalized delta rule.

    Mirrors `chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None,
    output_final_state=False, cu_seqlens=None, ...)` and runs the recurrence of
    [`deltanet_cp.chunk_dplr_delta_rule`][] with `q = r` and `gk = w`: per token,
    $S \\leftarrow \\mathrm{diag}(e^{w}) S + b (a^\\top S) + k v^\\top$,
    $o = S^\\top (s\\, r)$. RWKV-7 passes `a = -kk` and `b = kk * iclr` (`kk` the normalised
    keys, `iclr` the in-context learning rate).

    **Arguments:**

    - `r`: receptance (the queries), `(B, T, H, K)`.
    - `w`: the log decays per key channel, `(B, T, HV, K)` (FLA: `HV = H`).
    - `k`, `a`, `b`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `scale`: query scale, **1.0** by default as in FLA's `chunk_rwkv7`.
    - `initial_state`, `output_final_state`, `cu_seqlens`, `chunk_size`, `cp`,
        `precision`, `**options`: as in [`deltanet_cp.interop.fla.chunk_dplr_delta_rule`][].

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_rwkv7", options, _DPLR_OPTIONS)
    config = DPLRDeltaRule(chunk_size=chunk_size, scale=scale, precision=precision)
    inputs = DPLRInputs(r, k, v, a, b, w)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)


def fused_recurrent_rwkv7(
    r: QKTensor,
    w: KeyGateTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = True,
    cu_seqlens: CuSeqlens | None = None,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.rwkv7.fused_recurrent_rwkv7`: RWKV-7 token by token.

    Mirrors `fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None,
    output_final_state=True, cu_seqlens=None)` (FLA's defaults differ from `chunk_rwkv7`'s:
    the scale is `K ** -0.5` and the final state is returned) and runs the recurrence
    of [`deltanet_cp.recurrent_dplr_delta_rule`][] with `q = r` and `gk = w`; the arguments
    are as in [`deltanet_cp.interop.fla.chunk_rwkv7`][]. `head_first` raises a
    `ValueError` unless `False`.
    """
    check_options("fused_recurrent_rwkv7", options, ("head_first",))
    config = DPLRDeltaRule(chunk_size=1, scale=scale, precision=precision)
    inputs = DPLRInputs(r, k, v, a, b, w)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)
