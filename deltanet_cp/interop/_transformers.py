"""transformers' torch kernels for Kimi Linear and Qwen3-Next: each builds the recurrence
and its inputs and calls the engine (`_convert.call`), the output in `query`'s dtype."""

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._validate import as_flag
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._gated_delta import GatedDeltaRule
from ..recurrences._kda import KimiDeltaRule
from ._convert import call


def _flags(use_qk_l2norm_in_kernel: object, output_final_state: object) -> None:
    """A `ValueError` naming the flag unless both are bools: a string such as `"no"` (true
    in Python) must not switch normalisation on."""
    as_flag(use_qk_l2norm_in_kernel, "`use_qk_l2norm_in_kernel`")
    as_flag(output_final_state, "`output_final_state`")


def chunk_kimi_delta_attention(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    chunk_size: int = 64,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""transformers' Kimi Linear `chunk_kimi_delta_attention` (newer releases:
    `torch_chunk_kda`).

    Mirrors `chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False)` of
    `transformers.models.kimi_linear.modeling_kimi_linear` and runs
    [`deltanet_cp.KimiDeltaRule`][], the recurrence of
    [`deltanet_cp.chunk_kda`][].

    **Arguments:**

    - `query`, `key`: `(B, T, H, K)`; `value`: `(B, T, HV, V)` (transformers: `HV = H`;
        here `HV` may be a multiple of `H`, value head `j` reading key head `j // (HV // H)`).
    - `g`: log decays per key channel, `(B, T, HV, K)`; `beta`: step sizes, `(B, T, HV)`.
    - `chunk_size`: tokens per chunk (any positive int here).
    - `initial_state`: `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the final state.
    - `use_qk_l2norm_in_kernel`: L2-normalise `query` and `key` (eps `1e-6`) first.
    - `cu_seqlens`, `cp`: not in transformers' torch function: packed documents (batch
        size 1) and context parallelism (a [`deltanet_cp.ContextParallel`][]), as in
        [`deltanet_cp.chunk_kda`][].

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)` cast to `query`'s dtype, as transformers does
    (deltanet_cp's own functions return `value`'s dtype); the final state (float32, float64
    for float64 inputs, where transformers stays float32) or `None`. The query scale is
    always `K ** -0.5`: transformers' function has no `scale` argument.
    """
    _flags(use_qk_l2norm_in_kernel, output_final_state)
    config = KimiDeltaRule(chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm_in_kernel)
    inputs = DeltaInputs(query, key, value, g, beta)
    return call(
        config, inputs, initial_state, cu_seqlens, cp, output_final_state, dtype=query.dtype
    )


def recurrent_kimi_delta_attention(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
) -> tuple[ValueTensor, States | None]:
    """transformers' Kimi Linear `recurrent_kimi_delta_attention` (newer releases:
    `torch_recurrent_kda`): token by token.

    Mirrors `recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state,
    output_final_state, use_qk_l2norm_in_kernel=False)` and runs the
    recurrence of [`deltanet_cp.recurrent_kda`][]. `initial_state` and
    `output_final_state` have defaults here (`None`, `False`); arguments and results as in
    [`deltanet_cp.interop.transformers.chunk_kimi_delta_attention`][], without `chunk_size`.
    """
    _flags(use_qk_l2norm_in_kernel, output_final_state)
    config = KimiDeltaRule(chunk_size=1, use_qk_l2norm=use_qk_l2norm_in_kernel)
    inputs = DeltaInputs(query, key, value, g, beta)
    return call(
        config, inputs, initial_state, cu_seqlens, cp, output_final_state, dtype=query.dtype
    )


def torch_chunk_gated_delta_rule(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    chunk_size: int = 64,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
) -> tuple[ValueTensor, States | None]:
    """transformers' Qwen3-Next / Qwen3.5 `torch_chunk_gated_delta_rule`.

    Mirrors `torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False)` of
    `transformers.models.qwen3_next.modeling_qwen3_next` and runs
    [`deltanet_cp.GatedDeltaRule`][], the recurrence of [`deltanet_cp.chunk_gated_delta_rule`][].

    **Arguments:**

    - `query`, `key`: `(B, T, H, K)`; `value`: `(B, T, HV, V)` with `HV` a multiple of `H`
        (value head `j` reads key head `j // (HV // H)`, as transformers'
        `repeat_interleave` does): there is no need to repeat `query` and `key` first.
    - `g`: log decays, `(B, T, HV)`; `beta`: step sizes, `(B, T, HV)`.
    - `chunk_size`, `initial_state` (`(B, HV, K, V)`), `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens`, `cp`: as in
        [`deltanet_cp.interop.transformers.chunk_kimi_delta_attention`][].

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)` cast to `query`'s dtype, as transformers does;
    the final state or `None`. The query scale is always `K ** -0.5`. `query` and `key` are
    normalised in float32 (float64 for float64 inputs).
    """
    _flags(use_qk_l2norm_in_kernel, output_final_state)
    config = GatedDeltaRule(chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm_in_kernel)
    inputs = DeltaInputs(query, key, value, g, beta)
    return call(
        config, inputs, initial_state, cu_seqlens, cp, output_final_state, dtype=query.dtype
    )


def torch_recurrent_gated_delta_rule(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
) -> tuple[ValueTensor, States | None]:
    """transformers' Qwen3-Next / Qwen3.5 `torch_recurrent_gated_delta_rule`: token by token.

    Mirrors `torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state,
    output_final_state, use_qk_l2norm_in_kernel=False)` and runs the recurrence of
    [`deltanet_cp.recurrent_gated_delta_rule`][]. `initial_state` and `output_final_state`
    have defaults here (`None`, `False`); arguments and results as in
    [`deltanet_cp.interop.transformers.torch_chunk_gated_delta_rule`][], without
    `chunk_size`.
    """
    _flags(use_qk_l2norm_in_kernel, output_final_state)
    config = GatedDeltaRule(chunk_size=1, use_qk_l2norm=use_qk_l2norm_in_kernel)
    inputs = DeltaInputs(query, key, value, g, beta)
    return call(
        config, inputs, initial_state, cu_seqlens, cp, output_final_state, dtype=query.dtype
    )
