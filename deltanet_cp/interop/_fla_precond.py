"""flash-linear-attention's preconditioned delta rules: `fla.ops.precond_gated_delta_rule` and
`fla.ops.precond_kda`."""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._validate import as_flag
from ..recurrences._precond_functions import (
    AStates,
    Center,
    chunk_precond_gated_delta_rule as _chunk_gdn,
    chunk_precond_kda as _chunk_kda,
    KeyHeadGate,
)
from ._convert import FLAStates
from ._fla_options import check_options


def _fla_results(
    results: tuple[Array, Array, Array], output_final_state: bool, transpose_state_layout: bool
) -> tuple[ValueTensor, Array | None, Array | None]:
    o, state, a_state = results
    if not output_final_state:
        return o, None, None
    return o, (jnp.swapaxes(state, -1, -2) if transpose_state_layout else state), a_state


def _flags(output_final_state: object, transpose_state_layout: object) -> None:
    """FLA's two flags as bools, before anything runs (a string such as `"no"` is true)."""
    as_flag(output_final_state, "`output_final_state`")
    as_flag(transpose_state_layout, "`transpose_state_layout`")


def _state_in(initial_state: Array | None, transpose_state_layout: bool) -> Array | None:
    if initial_state is not None and transpose_state_layout:
        return jnp.swapaxes(initial_state, -1, -2)
    return initial_state


def chunk_precond_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g_atk: KeyHeadGate,
    g: GateTensor,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    initial_A_state: AStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    *,
    cu_seqlens: CuSeqlens | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None, AStates | None]:
    """FLA's `fla.ops.precond_gated_delta_rule.chunk_precond_gated_delta_rule`.

    Mirrors `chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, scale=None,
    initial_state=None, initial_A_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=True, cu_seqlens=None, ..., transpose_state_layout=False,
    x=1.5, eps=1e-6, log_atk_scale=None)` and runs
    [`deltanet_cp.chunk_precond_gated_delta_rule`][]. The arguments after
    `use_qk_l2norm_in_kernel` are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g_atk`, `beta_atk`: the preconditioner's log decays and step sizes, `(B, T, H)`:
        one preconditioner per key head (FLA keys it per value head under GVA; the same
        when `HV = H`).
    - `g`, `beta`: the main log decays and step sizes, `(B, T, HV)`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: `(N, HV, K, V)` (`(N, HV, V, K)` with `transpose_state_layout`);
        zeros if `None`.
    - `initial_A_state`: the preconditioner's state, `(N, H, K)`; zeros if `None`.
    - `output_final_state`: also return both final states.
    - `use_qk_l2norm_in_kernel`: L2-normalise `q` and `k` first (FLA's default: on).
    - `cu_seqlens`: packed documents (batch size 1), `[0, ..., T]`.
    - `transpose_state_layout`: the initial and final main states are `(..., V, K)`.
    - `x`, `eps`, `log_atk_scale`: the squash's range, epsilon and centre (a float or one
        per key head, `(H,)`; `-0.2` if `None`).
    - `chunk_size`: tokens per chunk (FLA's is 64).
    - `cp`: how the call is sharded (what FLA's `cp_context` would be for; FLA has no
        context parallelism for this rule), as in [`deltanet_cp.ContextParallel`][].
    - `precision`: the products' policy, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused; `cp_context` raises a
        `ValueError` unless `None`.

    **Returns:**

    `(o, final_state, final_A_state)`: `o` `(B, T, HV, V)`; the final main state and the
    final preconditioner state `(N, H, K)`, or `None` for both.
    """
    check_options("chunk_precond_gated_delta_rule", options, ("cu_seqlens_cpu", "cp_context"))
    _flags(output_final_state, transpose_state_layout)
    results = _chunk_gdn(
        q,
        k,
        v,
        g_atk,
        g,
        beta_atk,
        beta,
        scale=scale,
        initial_state=_state_in(initial_state, transpose_state_layout),
        initial_A_state=initial_A_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        cp=cp,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
    )
    return _fla_results(results, output_final_state, transpose_state_layout)


def fused_recurrent_precond_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | None = None,
    gk: KeyGateTensor | None = None,
    gv: Array | None = None,
    beta: GateTensor | None = None,
    g_atk: KeyHeadGate | None = None,
    beta_atk: KeyHeadGate | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    initial_A_state: AStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    *,
    cu_seqlens: CuSeqlens | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, FLAStates | None, AStates | None]:
    r"""FLA's `fla.ops.precond_gated_delta_rule.fused_recurrent_precond_gated_delta_rule`:
    token by token.

    Mirrors `fused_recurrent_precond_gated_delta_rule(q, k, v, g=None, gk=None, gv=None,
    beta=None, g_atk=None, beta_atk=None, scale=None, initial_state=None,
    initial_A_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
    cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None)`.
    With `g` only (or neither `g` nor `gk`: no decay) it runs the recurrence of
    [`deltanet_cp.recurrent_precond_gated_delta_rule`][]; with `gk` (alone or with `g`, the
    decays multiplied: $g_t + g^k_t$ per key channel) that of
    [`deltanet_cp.recurrent_precond_kda`][]. The arguments after `use_qk_l2norm_in_kernel`
    are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per head, `(B, T, HV)`, or `None`.
    - `gk`: log decays per key channel, `(B, T, HV, K)`, or `None`.
    - `gv`: must be `None` (a decay per value channel is not supported).
    - `beta`: step sizes, `(B, T, HV)`; ones if `None`.
    - `g_atk`, `beta_atk`: the preconditioner's log decays and step sizes, `(B, T, H)`
        (required).
    - `scale`, `initial_state`, `initial_A_state`, `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens`, `transpose_state_layout`, `x`, `eps`,
        `log_atk_scale`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_precond_gated_delta_rule`][].

    **Returns:**

    `(o, final_state, final_A_state)`, as there.
    """
    check_options("fused_recurrent_precond_gated_delta_rule", {"gv": gv}, ("gv",))
    _flags(output_final_state, transpose_state_layout)
    if g_atk is None or beta_atk is None:
        raise ValueError(
            "fused_recurrent_precond_gated_delta_rule needs the preconditioner's `g_atk` and "
            "`beta_atk`, both (B, T, H); got None."
        )
    beta = jnp.ones(v.shape[:3], v.dtype) if beta is None else beta
    if gk is not None:
        fn, decay = _chunk_kda, gk if g is None else gk + g[..., None]
        gates = (decay, g_atk, beta_atk, beta)
    else:
        fn, decay = _chunk_gdn, jnp.zeros(v.shape[:3], v.dtype) if g is None else g
        gates = (g_atk, decay, beta_atk, beta)
    results = fn(
        q,
        k,
        v,
        *gates,
        scale=scale,
        initial_state=_state_in(initial_state, transpose_state_layout),
        initial_A_state=initial_A_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=1,
        cp=cp,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
    )
    return _fla_results(results, output_final_state, transpose_state_layout)


def chunk_precond_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    g_atk: KeyHeadGate,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    initial_A_state: AStates | None = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: CuSeqlens | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None, AStates | None]:
    """FLA's `fla.ops.precond_kda.chunk_precond_kda`.

    Mirrors `chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None,
    initial_state=None, initial_A_state=None, output_final_state=False, ...,
    cu_seqlens=None, ..., transpose_state_layout=False, x=1.5, eps=1e-6,
    log_atk_scale=None)` and runs [`deltanet_cp.chunk_precond_kda`][], with `q` and `k`
    L2-normalised (FLA's `chunk_precond_kda` always normalises them). The arguments after
    `output_final_state` are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`, `HV` a multiple of `H`. FLA's
        chunked kernel takes `HV = H` only. Under GVA (`HV > H`) this function keeps one
        preconditioner per key head, shared by its value heads, where FLA's fused
        recurrent kernel keeps one per value head: the two agree only at `HV = H`.
    - `g`: the main log decays per key channel, `(B, T, HV, K)`.
    - `g_atk`, `beta_atk`: the preconditioner's log decays and step sizes, `(B, T, H)`.
    - `beta`: the main step sizes, `(B, T, HV)`.
    - `use_qk_l2norm_in_kernel`: accepted as FLA's function accepts it (in its `**kwargs`)
        but must be `True`: FLA normalises `q` and `k` whatever it says, so `False`, which
        FLA would ignore, is a `ValueError` here (for keys as given, call
        [`deltanet_cp.chunk_precond_kda`][] with `use_qk_l2norm=False`).
    - `scale`, `initial_state`, `initial_A_state`, `output_final_state`, `cu_seqlens`,
        `transpose_state_layout`, `x`, `eps`, `log_atk_scale`, `chunk_size`, `cp`,
        `precision`: as in [`deltanet_cp.interop.fla.chunk_precond_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu`, `chunk_indices`, `solve_tril_precision` and
        `disable_recompute` are accepted and unused; `use_gate_in_kernel`, `A_log`,
        `dt_bias`, `safe_gate`, `lower_bound`, `return_intermediate_states` and
        `cp_context` raise a `ValueError` unless at their defaults.

    **Returns:**

    `(o, final_state, final_A_state)`, as in
    [`deltanet_cp.interop.fla.chunk_precond_gated_delta_rule`][].
    """
    check_options(
        "chunk_precond_kda",
        options,
        (
            "use_gate_in_kernel",
            "A_log",
            "dt_bias",
            "safe_gate",
            "lower_bound",
            "return_intermediate_states",
            "cp_context",
            "cu_seqlens_cpu",
            "chunk_indices",
            "solve_tril_precision",
            "disable_recompute",
        ),
    )
    _flags(output_final_state, transpose_state_layout)
    if not as_flag(use_qk_l2norm_in_kernel, "`use_qk_l2norm_in_kernel`"):
        raise ValueError(
            "chunk_precond_kda: FLA's `chunk_precond_kda` always L2-normalises `q` and `k` "
            "(it ignores `use_qk_l2norm_in_kernel=False`), and so does this adapter: pass "
            "`use_qk_l2norm_in_kernel=True` or leave it out, or call "
            "`deltanet_cp.chunk_precond_kda(..., use_qk_l2norm=False)` for keys as given."
        )
    results = _chunk_kda(
        q,
        k,
        v,
        g,
        g_atk,
        beta_atk,
        beta,
        scale=scale,
        initial_state=_state_in(initial_state, transpose_state_layout),
        initial_A_state=initial_A_state,
        use_qk_l2norm=True,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        cp=cp,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
    )
    return _fla_results(results, output_final_state, transpose_state_layout)


def fused_recurrent_precond_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    g_atk: KeyHeadGate,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    A_log: Float[Array, " heads"] | None = None,
    dt_bias: Array | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    initial_A_state: AStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    *,
    cu_seqlens: CuSeqlens | None = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None, AStates | None]:
    """FLA's `fla.ops.precond_kda.fused_recurrent_precond_kda`: token by token.

    Mirrors `fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, A_log=None,
    dt_bias=None, scale=None, initial_state=None, initial_A_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
    lower_bound=None, cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6,
    log_atk_scale=None)` and runs [`deltanet_cp.recurrent_precond_kda`][]. The arguments
    after `use_qk_l2norm_in_kernel` are keyword-only here.

    **Arguments:**

    - `q`, `k`, `v`, `g`, `g_atk`, `beta_atk`, `beta`: as in
        [`deltanet_cp.interop.fla.chunk_precond_kda`][].
    - `A_log`, `dt_bias`: must be `None` (the in-kernel gate is not supported: compute the
        log decay in JAX and pass it as `g`).
    - `scale`, `initial_state`, `initial_A_state`, `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens`, `transpose_state_layout`, `x`, `eps`,
        `log_atk_scale`, `cp`, `precision`: as in
        [`deltanet_cp.interop.fla.chunk_precond_gated_delta_rule`][].
    - `**options`: `use_gate_in_kernel` and `lower_bound` raise a `ValueError` unless at
        their defaults.

    **Returns:**

    `(o, final_state, final_A_state)`, as there.
    """
    check_options(
        "fused_recurrent_precond_kda",
        dict(options, A_log=A_log, dt_bias=dt_bias),
        ("A_log", "dt_bias", "use_gate_in_kernel", "lower_bound"),
    )
    _flags(output_final_state, transpose_state_layout)
    results = _chunk_kda(
        q,
        k,
        v,
        g,
        g_atk,
        beta_atk,
        beta,
        scale=scale,
        initial_state=_state_in(initial_state, transpose_state_layout),
        initial_A_state=initial_A_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=1,
        cp=cp,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
    )
    return _fla_results(results, output_final_state, transpose_state_layout)
