"""flash-linear-attention's call shapes for the gated delta rule, the delta rule and Gated
DeltaProduct: each builds the recurrence and its inputs and calls the engine (`_convert.call`).
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._validate import as_flag, as_positive_index
from ..recurrences._delta import DeltaRule
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._delta_product import GatedDeltaProductRule
from ..recurrences._gated_delta import GatedDeltaRule
from ..recurrences._kda import KimiDeltaRule
from ._convert import call, FLAStates, ones_if_none
from ._fla_options import check_options


# Gated DeltaProduct's per-step tensors in FLA's flat layout: the `num_householder` steps of
# token t are rows t * num_householder, ..., (t + 1) * num_householder - 1 of axis 1.
FlatKeyTensor = Float[Array, "batch seq_steps heads k"]
FlatValueTensor = Float[Array, "batch seq_steps vheads v"]
FlatBetaTensor = Float[Array, "batch seq_steps vheads"]


def chunk_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
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
    """FLA's `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (also `chunk_gdn`).

    Mirrors `chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False,
    cu_seqlens=None, ...)` and runs [`deltanet_cp.GatedDeltaRule`][], the recurrence of
    [`deltanet_cp.chunk_gated_delta_rule`][]. The arguments after `use_qk_l2norm_in_kernel`
    are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays, `(B, T, HV)`; `beta`: step sizes, `(B, T, HV)`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: `(N, HV, K, V)` (`(N, HV, V, K)` with `state_v_first`), `N` the batch
        size or the number of documents; zeros if `None`.
    - `output_final_state`: also return the final state.
    - `use_qk_l2norm_in_kernel`: L2-normalise `q` and `k` first.
    - `state_v_first`: the initial and final states are `(..., V, K)`.
    - `cu_seqlens`: packed documents (batch size 1), `[0, ..., T]`.
    - `chunk_size`: tokens per chunk (FLA takes it through `**kwargs`).
    - `cp`: how the call is sharded (what FLA's `cp_context` is for), as in
        [`deltanet_cp.ContextParallel`][]; `None`: one device.
    - `precision`: the products' policy, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    - `**options`: FLA's other options. `cu_seqlens_cpu` and `chunk_indices` are accepted
        and unused; `use_gate_in_kernel`, `A_log`, `dt_bias`, `use_beta_sigmoid_in_kernel`,
        `allow_neg_eigval`, `cp_context` and `head_first` raise a `ValueError` unless at their
        defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options(
        "chunk_gated_delta_rule",
        options,
        (
            "use_beta_sigmoid_in_kernel",
            "allow_neg_eigval",
            "use_gate_in_kernel",
            "A_log",
            "dt_bias",
            "cp_context",
            "head_first",
            "cu_seqlens_cpu",
            "chunk_indices",
        ),
    )
    config = GatedDeltaRule(
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        precision=precision,
    )
    inputs = DeltaInputs(q, k, v, g, beta)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state, state_v_first)


def fused_recurrent_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | None = None,
    gk: KeyGateTensor | None = None,
    gv: Array | None = None,
    beta: GateTensor | ValueTensor | None = None,
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
    r"""FLA's `fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule` (also
    `fused_recurrent_gdn`): token by token.

    Mirrors `fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None,
    scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    ..., state_v_first=False, cu_seqlens=None)`. With `g` only it runs the recurrence of
    [`deltanet_cp.recurrent_gated_delta_rule`][]; with `gk` (alone or with `g`, the decays
    multiplied: $g_t + g^k_t$ per key channel) that of
    [`deltanet_cp.recurrent_kda`][]; with neither, that of
    [`deltanet_cp.recurrent_delta_rule`][]. The arguments after `use_qk_l2norm_in_kernel`
    are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per head, `(B, T, HV)`, or `None`.
    - `gk`: log decays per key channel, `(B, T, HV, K)`, or `None`.
    - `gv`: must be `None` (a decay per value channel is not supported).
    - `beta`: step sizes, `(B, T, HV)`, or one per value channel `(B, T, HV, V)` (FLA's
        headwise-vector beta: value channel `j` takes the delta step
        `beta[..., j] * (v[..., j] - (S^T k)[j])`; run as `HV * V` heads of one value
        channel each, so the gates are formed `V` times); ones if `None`.
    - `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`,
        `state_v_first`, `cu_seqlens`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `use_gate_in_kernel`, `A_log`, `dt_bias`, `use_beta_sigmoid_in_kernel` and
        `allow_neg_eigval` raise a `ValueError` unless at their defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options(
        "fused_recurrent_gated_delta_rule",
        dict(options, gv=gv),
        (
            "gv",
            "use_gate_in_kernel",
            "A_log",
            "dt_bias",
            "use_beta_sigmoid_in_kernel",
            "allow_neg_eigval",
        ),
    )
    if gk is not None:
        kind, g = KimiDeltaRule, gk if g is None else gk + g[..., None]
    else:
        kind = DeltaRule if g is None else GatedDeltaRule
    config = kind(
        chunk_size=1, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, precision=precision
    )
    return _call_fused(
        config, q, k, v, g, beta, initial_state, cu_seqlens, cp, output_final_state, state_v_first
    )


def _call_fused(
    config, q, k, v, g, beta, initial_state, cu_seqlens, cp, output_final_state, state_v_first
):
    """`call` for the fused recurrent adapters, whose `beta` may be one per value channel.

    With `beta` `(B, T, HV, V)` each value channel `j` of value head `h` is a delta rule of
    its own (the same keys, gates and queries, the step `beta[..., h, j]`), run as head
    `h * V + j` of one value channel: the state `(K, V)` of head `h` is those heads' `(K, 1)`
    states side by side, and the key head of `h * V + j` is that of `h` under GVA.
    """
    if beta is None or beta.ndim == 3:
        inputs = DeltaInputs(q, k, v, g, ones_if_none(beta, v))
        final = output_final_state
        return call(config, inputs, initial_state, cu_seqlens, cp, final, state_v_first)
    if beta.shape != v.shape:
        raise ValueError(
            f"`beta` must be one step per value head {v.shape[:3]} or per value channel "
            f"{v.shape} (the shape of `v`); got {beta.shape}."
        )
    output_final_state = as_flag(output_final_state, "`output_final_state`")
    state_v_first = as_flag(state_v_first, "`state_v_first`")
    b, t, hv, dv = v.shape
    if g is not None:
        g = jnp.repeat(g, dv, axis=2)  # (B, T, HV * V) or per key channel (B, T, HV * V, K)
    if initial_state is not None:  # (N, HV, K, V) -> (N, HV * V, K, 1)
        kv = jnp.swapaxes(initial_state, -1, -2) if state_v_first else initial_state
        n, _, dk, _ = kv.shape
        initial_state = jnp.swapaxes(kv, -1, -2).reshape(n, hv * dv, dk, 1)
    inputs = DeltaInputs(q, k, v.reshape(b, t, hv * dv, 1), g, beta.reshape(b, t, hv * dv))
    o, h = call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)
    o = o.reshape(b, t, hv, dv)
    if h is None:
        return o, None
    h = h.reshape(h.shape[0], hv, dv, h.shape[2])  # (N, HV, V, K)
    return o, (h if state_v_first else jnp.swapaxes(h, -1, -2))


def chunk_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.delta_rule.chunk_delta_rule`.

    Mirrors `chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, ...)` and runs
    [`deltanet_cp.DeltaRule`][], the recurrence of [`deltanet_cp.chunk_delta_rule`][].

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`; `beta`: step sizes, `(B, T, HV)`.
    - `scale`, `initial_state` (`(N, HV, K, V)`), `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens`, `chunk_size`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused; `head_first` raises a
        `ValueError` unless `False`.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_delta_rule", options, ("cu_seqlens_cpu", "head_first"))
    config = DeltaRule(
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        precision=precision,
    )
    inputs = DeltaInputs(q, k, v, None, beta)
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)


def fused_recurrent_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor | ValueTensor | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.delta_rule.fused_recurrent_delta_rule`: token by token.

    Mirrors `fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None)` and runs the
    recurrence of [`deltanet_cp.recurrent_delta_rule`][]. `beta` defaults to ones and may
    be one per value channel, `(B, T, HV, V)`, as in
    [`deltanet_cp.interop.fla.fused_recurrent_gated_delta_rule`][]; the other arguments are
    as in [`deltanet_cp.interop.fla.chunk_delta_rule`][].
    """
    config = DeltaRule(
        chunk_size=1, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, precision=precision
    )
    return _call_fused(
        config, q, k, v, None, beta, initial_state, cu_seqlens, cp, output_final_state, False
    )


def chunk_gated_delta_product(
    q: QKTensor,
    k: FlatKeyTensor,
    v: FlatValueTensor,
    g: GateTensor | None,
    beta: FlatBetaTensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    *,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gated_delta_product.chunk_gated_delta_product`, in FLA's flat layout.

    Mirrors `chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    cu_seqlens=None, cu_seqlens_cpu=None)` and runs [`deltanet_cp.GatedDeltaProductRule`][], the
    recurrence of [`deltanet_cp.chunk_gated_delta_product`][], with `k`, `v`, `beta`
    reshaped to `(B, T, num_householder, ...)`: row `t * num_householder + j` of FLA's
    axis 1 is step `j` of token `t`.

    **Arguments:**

    - `q`: `(B, T, H, K)`.
    - `k`: `(B, T * num_householder, H, K)`; `v`: `(B, T * num_householder, HV, V)`.
    - `g`: log decays, `(B, T, HV)`, applied once per token before its steps; or `None`.
    - `beta`: step sizes, `(B, T * num_householder, HV)`.
    - `num_householder`: the number of delta steps per token.
    - `scale`, `initial_state` (`(N, HV, K, V)`), `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens` (offsets in tokens of `q`), `chunk_size`,
        `cp`, `precision`: as in [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    check_options("chunk_gated_delta_product", options, ("cu_seqlens_cpu",))
    n = as_positive_index(num_householder, "num_householder")
    b, t = q.shape[:2]
    for name, x in (("k", k), ("v", v), ("beta", beta)):
        if x.shape[:2] != (b, t * n):
            raise ValueError(
                f"`{name}` must have FLA's flat layout (B, T * num_householder, ...) = "
                f"({b}, {t * n}, ...) for `q` of shape {tuple(q.shape)} and "
                f"num_householder={n}; got {tuple(x.shape)}."
            )

    def steps(x):
        return x.reshape(b, t, n, *x.shape[2:])

    config = GatedDeltaProductRule(
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        precision=precision,
    )
    inputs = DeltaInputs(q, steps(k), steps(v), g, steps(beta))
    return call(config, inputs, initial_state, cu_seqlens, cp, output_final_state)
