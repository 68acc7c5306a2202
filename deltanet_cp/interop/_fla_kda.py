"""flash-linear-attention's call shapes for the delta rules with a decay per key channel:
Kimi Delta Attention and Gated DeltaNet-2. Each builds the recurrence and its inputs and
calls the engine (`_convert.call`).
"""

from typing import Any

from jaxtyping import Array

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._gdn2 import GatedDeltaNet2Rule
from ..recurrences._kda import KimiDeltaRule
from ._convert import call, FLAStates
from ._fla_options import check_options


# The options of FLA's in-kernel gate, which both families' functions take.
_GATE_OPTIONS = ("use_gate_in_kernel", "A_log", "dt_bias", "lower_bound", "safe_gate")
_KDA_OPTIONS = _GATE_OPTIONS + ("use_beta_sigmoid_in_kernel", "allow_neg_eigval")
# The options of FLA's chunked functions only.
_CHUNK_OPTIONS = ("return_intermediate_states", "cp_context", "cu_seqlens_cpu", "disable_recompute")


def chunk_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.kda.chunk_kda`: Kimi Delta Attention.

    Mirrors `chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False,
    cu_seqlens=None, ...)` and runs [`deltanet_cp.KimiDeltaRule`][], the recurrence of
    [`deltanet_cp.chunk_kda`][]. The arguments after
    `use_qk_l2norm_in_kernel` are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per key channel, `(B, T, HV, K)`; `beta`: step sizes, `(B, T, HV)`.
    - `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`,
        `state_v_first`, `cu_seqlens`, `chunk_size`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu`, `chunk_indices` and `disable_recompute` are accepted
        and unused; `use_gate_in_kernel`, `A_log`, `dt_bias`, `lower_bound`, `safe_gate`,
        `use_beta_sigmoid_in_kernel`, `allow_neg_eigval`, `return_intermediate_states`,
        `cp_context` and `head_first` raise a `ValueError` unless at their defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    known = _KDA_OPTIONS + _CHUNK_OPTIONS + ("head_first", "chunk_indices")
    check_options("chunk_kda", options, known)
    config = KimiDeltaRule(
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        precision=precision,
    )
    inputs = DeltaInputs(q, k, v, g, beta)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


def fused_recurrent_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.kda.fused_recurrent_kda`: Kimi Delta Attention token by token.

    Mirrors `fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, ...,
    state_v_first=False, cu_seqlens=None)` (`scale` is the 8th positional argument) and runs
    the recurrence of [`deltanet_cp.recurrent_kda`][]. `A_log` and
    `dt_bias` must be `None` (they serve FLA's in-kernel gate); the other arguments are as
    in [`deltanet_cp.interop.fla.chunk_kda`][]. `use_gate_in_kernel`, `lower_bound`,
    `use_beta_sigmoid_in_kernel` and `allow_neg_eigval` raise a `ValueError` unless at their
    defaults.
    """
    check_options("fused_recurrent_kda", dict(options, A_log=A_log, dt_bias=dt_bias), _KDA_OPTIONS)
    config = KimiDeltaRule(
        chunk_size=1, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, precision=precision
    )
    inputs = DeltaInputs(q, k, v, g, beta)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


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
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gdn2.chunk_gdn2`: Gated DeltaNet-2.

    Mirrors `chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False)` and
    runs [`deltanet_cp.GatedDeltaNet2Rule`][], the recurrence of [`deltanet_cp.chunk_gdn2`][].
    The arguments after `use_qk_l2norm_in_kernel` are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)` (FLA: `HV = H`).
    - `g`: log decays per key channel, `(B, T, HV, K)`.
    - `b`: the erase gate per key channel, `(B, T, HV, K)`; `w`: the write gate per value
        channel, `(B, T, HV, V)`.
    - `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`,
        `state_v_first`, `cu_seqlens`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `chunk_size`: tokens per chunk (FLA takes it through `**kwargs` and requires 64).
    - `**options`: `cu_seqlens_cpu` and `disable_recompute` are accepted and unused;
        `use_gate_in_kernel`, `A_log`, `dt_bias`, `lower_bound`, `safe_gate`,
        `return_intermediate_states` and `cp_context` raise a `ValueError` unless at their
        defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_gdn2", options, _GATE_OPTIONS + _CHUNK_OPTIONS)
    config = GatedDeltaNet2Rule(
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        precision=precision,
    )
    inputs = DeltaInputs(q, k, v, g, b, w)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


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
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gdn2.fused_recurrent_gdn2`: Gated DeltaNet-2 token by token.

    Mirrors `fused_recurrent_gdn2(q, k, v, g, b, w, A_log=None, dt_bias=None, scale=None,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, ...,
    state_v_first=False, cu_seqlens=None)` and runs the recurrence of
    [`deltanet_cp.recurrent_gdn2`][]. `A_log` and `dt_bias` must be `None` (they serve FLA's
    in-kernel gate); the other arguments are as in [`deltanet_cp.interop.fla.chunk_gdn2`][].
    `use_gate_in_kernel`, `lower_bound` and `safe_gate` raise a `ValueError` unless at their
    defaults.
    """
    check_options(
        "fused_recurrent_gdn2", dict(options, A_log=A_log, dt_bias=dt_bias), _GATE_OPTIONS
    )
    config = GatedDeltaNet2Rule(
        chunk_size=1, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, precision=precision
    )
    inputs = DeltaInputs(q, k, v, g, b, w)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)
