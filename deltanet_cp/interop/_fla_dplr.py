"""flash-linear-attention's call shapes for the generalized delta rule (DPLR), RWKV-7 and Gated
DeltaNet-2, as thin adapters over deltanet_cp's functions (see `_fla.py` for the others).
"""

from typing import Any

from jaxtyping import Array

from .._custom_types import CuSeqlens, KeyGateTensor, QKTensor, ValueTensor
from ..recurrences import _dplr_functions, _gdn2
from ._fla import _check_options, _state_in, _state_out, FLAStates


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.generalized_delta_rule.chunk_dplr_delta_rule`.

    Mirrors `chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
    output_final_state=False, cu_seqlens=None, ...)` and calls
    [`deltanet_cp.chunk_dplr_delta_rule`][]: per token, $S \\leftarrow
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
    - `**options`: `cu_seqlens_cpu` and `disable_recompute` are accepted and unused;
        `safe_gate`, `lower_bound`, `cp_context` and `head_first` raise a `ValueError`
        unless at their defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options("chunk_dplr_delta_rule", options, _DPLR_OPTIONS)
    return _dplr_functions.chunk_dplr_delta_rule(
        q,
        k,
        v,
        a,
        b,
        gk,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


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
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.generalized_delta_rule.fused_recurrent_dplr_delta_rule`.

    Mirrors `fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None,
    initial_state=None, output_final_state=False, reverse=False, cu_seqlens=None)` and calls
    [`deltanet_cp.recurrent_dplr_delta_rule`][]; the arguments are as in
    [`deltanet_cp.interop.fla.chunk_dplr_delta_rule`][]. `reverse` must be `False`.
    """
    _check_options("fused_recurrent_dplr_delta_rule", {"reverse": reverse}, ("reverse",))
    return _dplr_functions.recurrent_dplr_delta_rule(
        q,
        k,
        v,
        a,
        b,
        gk,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.rwkv7.chunk_rwkv7`: RWKV-7's time mixing, the generalized delta rule.

    Mirrors `chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None,
    output_final_state=False, cu_seqlens=None, ...)` and calls
    [`deltanet_cp.chunk_dplr_delta_rule`][] with `q = r` and `gk = w`: per token,
    $S \\leftarrow \\mathrm{diag}(e^{w}) S + b (a^\\top S) + k v^\\top$,
    $o = S^\\top (s\\, r)$. RWKV-7 passes `a = -kk` and `b = kk * iclr` (`kk` the normalised
    keys, `iclr` the in-context learning rate).

    **Arguments:**

    - `r`: receptance (the queries), `(B, T, H, K)`.
    - `w`: the log decays per key channel, `(B, T, HV, K)` (FLA: `HV = H`).
    - `k`, `a`, `b`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `scale`: query scale, **1.0** by default as in FLA's `chunk_rwkv7`.
    - `initial_state`, `output_final_state`, `cu_seqlens`, `chunk_size`, `**options`: as in
        [`deltanet_cp.interop.fla.chunk_dplr_delta_rule`][].

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options("chunk_rwkv7", options, _DPLR_OPTIONS)
    return _dplr_functions.chunk_dplr_delta_rule(
        r,
        k,
        v,
        a,
        b,
        w,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.rwkv7.fused_recurrent_rwkv7`: RWKV-7 token by token.

    Mirrors `fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None,
    output_final_state=True, cu_seqlens=None)` (FLA's defaults differ from `chunk_rwkv7`'s:
    the scale is `K ** -0.5` and the final state is returned) and calls
    [`deltanet_cp.recurrent_dplr_delta_rule`][] with `q = r` and `gk = w`; the arguments
    are as in [`deltanet_cp.interop.fla.chunk_rwkv7`][]. `head_first` raises a
    `ValueError` unless `False`.
    """
    _check_options("fused_recurrent_rwkv7", options, ("head_first",))
    return _dplr_functions.recurrent_dplr_delta_rule(
        r,
        k,
        v,
        a,
        b,
        w,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


_GDN2_OPTIONS = ("use_gate_in_kernel", "A_log", "dt_bias", "lower_bound", "safe_gate")


def chunk_gdn2(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gdn2.chunk_gdn2`: Gated DeltaNet-2.

    Mirrors `chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False)` and
    calls [`deltanet_cp.chunk_gdn2`][]. The arguments after `use_qk_l2norm_in_kernel` are
    keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)` (FLA: `HV = H`).
    - `g`: log decays per key channel, `(B, T, HV, K)`.
    - `b`: the erase gate per key channel, `(B, T, HV, K)`; `w`: the write gate per value
        channel, `(B, T, HV, V)`.
    - `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`,
        `state_v_first`, `cu_seqlens`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `chunk_size`: tokens per chunk (FLA takes it through `**kwargs` and requires 64).
    - `**options`: `cu_seqlens_cpu` and `disable_recompute` are accepted and unused;
        `use_gate_in_kernel`, `A_log`, `dt_bias`, `lower_bound`, `safe_gate`,
        `return_intermediate_states` and `cp_context` raise a `ValueError` unless at their
        defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options(
        "chunk_gdn2",
        options,
        _GDN2_OPTIONS
        + ("return_intermediate_states", "cp_context", "cu_seqlens_cpu", "disable_recompute"),
    )
    result = _gdn2.chunk_gdn2(
        q,
        k,
        v,
        g,
        b,
        w,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    return _state_out(result, state_v_first)


def fused_recurrent_gdn2(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gdn2.fused_recurrent_gdn2`: Gated DeltaNet-2 token by token.

    Mirrors `fused_recurrent_gdn2(q, k, v, g, b, w, A_log=None, dt_bias=None, scale=None,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, ...,
    state_v_first=False, cu_seqlens=None)` and calls [`deltanet_cp.recurrent_gdn2`][].
    `A_log` and `dt_bias` must be `None` (they serve FLA's in-kernel gate); the other
    arguments are as in [`deltanet_cp.interop.fla.chunk_gdn2`][]. `use_gate_in_kernel`,
    `lower_bound` and `safe_gate` raise a `ValueError` unless at their defaults.
    """
    _check_options(
        "fused_recurrent_gdn2", dict(options, A_log=A_log, dt_bias=dt_bias), _GDN2_OPTIONS
    )
    result = _gdn2.recurrent_gdn2(
        q,
        k,
        v,
        g,
        b,
        w,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )
    return _state_out(result, state_v_first)
