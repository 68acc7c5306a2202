"""flash-linear-attention's `fla.ops` call shapes, as thin adapters over deltanet_cp's functions.

Each adapter converts its arguments (names, positions, layouts) and calls the deltanet_cp
function that computes the same recurrence; nothing is recomputed here.
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, ValueTensor
from ..recurrences import _delta, _delta_product, _gated_delta, _gla, _kda


# A state `(N, HV, K, V)`, or `(N, HV, V, K)` with `state_v_first=True`.
FLAStates = Float[Array, "batch_or_docs vheads _ _"]
# Gated DeltaProduct's per-step tensors in FLA's flat layout: the `num_householder` steps of
# token t are rows t * num_householder, ..., (t + 1) * num_householder - 1 of axis 1.
FlatKeyTensor = Float[Array, "batch seq_steps heads k"]
FlatValueTensor = Float[Array, "batch seq_steps vheads v"]
FlatBetaTensor = Float[Array, "batch seq_steps vheads"]

_GATE = "compute the log decay in JAX and pass it as `g`"
# FLA options with no counterpart here: the value that leaves FLA's result unchanged, and
# what to do instead. Any other value raises a `ValueError` naming the option.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "use_gate_in_kernel": (False, _GATE),
    "A_log": (None, f"it is read only with `use_gate_in_kernel=True`: {_GATE}"),
    "dt_bias": (None, f"it is read only with `use_gate_in_kernel=True`: {_GATE}"),
    "lower_bound": (None, f"it is read only with `use_gate_in_kernel=True`: {_GATE}"),
    "safe_gate": (False, _GATE),
    "use_beta_sigmoid_in_kernel": (False, "pass `jax.nn.sigmoid(beta)` as `beta`"),
    "allow_neg_eigval": (False, "pass `2 * jax.nn.sigmoid(beta)` as `beta`"),
    "return_intermediate_states": (False, "intermediate states are not returned"),
    "cp_context": (
        None,
        "for context parallelism call deltanet_cp's `chunk_*_cp` inside `jax.shard_map`, "
        "or `chunk_*_sharded` on global arrays",
    ),
    "gv": (None, "a decay per value channel is not supported"),
    "reverse": (False, "flip the time axis of the inputs and of the output instead"),
    "head_first": (False, "pass the inputs as `(B, T, H, ...)`"),
}
# FLA options that only steer how its kernels run; accepted and unused.
_HINTS = frozenset({"cu_seqlens_cpu", "chunk_indices", "disable_recompute"})


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"an array of shape {tuple(shape)}" if shape is not None else repr(value)


def _check_options(function: str, options: dict[str, Any], known: tuple[str, ...]) -> None:
    for name, value in options.items():
        if name not in known:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        if name in _HINTS:
            continue
        neutral, instead = _UNSUPPORTED[name]
        if value is not neutral:
            raise ValueError(
                f"flash-linear-attention's `{name}` is not supported by "
                f"`deltanet_cp.interop.fla.{function}` (got {_describe(value)}): {instead}."
            )


def _state_in(initial_state: Array | None, state_v_first: bool) -> Array | None:
    if initial_state is None or not state_v_first:
        return initial_state
    return jnp.swapaxes(initial_state, -1, -2)


def _state_out(
    result: tuple[Array, Array | None], state_v_first: bool
) -> tuple[Array, Array | None]:
    o, h = result
    if h is not None and state_v_first:
        h = jnp.swapaxes(h, -1, -2)
    return o, h


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (also `chunk_gdn`).

    Mirrors `chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False,
    cu_seqlens=None, ...)` and calls [`deltanet_cp.chunk_gated_delta_rule`][]. The arguments
    after `use_qk_l2norm_in_kernel` are keyword-only here.

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
    - `**options`: FLA's other options. `cu_seqlens_cpu` and `chunk_indices` are accepted
        and unused; `use_gate_in_kernel`, `A_log`, `dt_bias`, `use_beta_sigmoid_in_kernel`,
        `allow_neg_eigval`, `cp_context` and `head_first` raise a `ValueError` unless at their
        defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options(
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
    result = _gated_delta.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    return _state_out(result, state_v_first)


def fused_recurrent_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | None = None,
    gk: KeyGateTensor | None = None,
    gv: Array | None = None,
    beta: GateTensor | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    r"""FLA's `fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule` (also
    `fused_recurrent_gdn`): token by token.

    Mirrors `fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None,
    scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    ..., state_v_first=False, cu_seqlens=None)`. With `g` only it calls
    [`deltanet_cp.recurrent_gated_delta_rule`][]; with `gk` (alone or with `g`, the decays
    multiplied: $g_t + g^k_t$ per key channel) [`deltanet_cp.recurrent_kimi_delta_attention`][];
    with neither, [`deltanet_cp.recurrent_delta_rule`][]. The arguments after
    `use_qk_l2norm_in_kernel` are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per head, `(B, T, HV)`, or `None`.
    - `gk`: log decays per key channel, `(B, T, HV, K)`, or `None`.
    - `gv`: must be `None` (a decay per value channel is not supported).
    - `beta`: step sizes, `(B, T, HV)`; ones if `None`.
    - `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`,
        `state_v_first`, `cu_seqlens`: as in [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `use_gate_in_kernel`, `A_log`, `dt_bias`, `use_beta_sigmoid_in_kernel` and
        `allow_neg_eigval` raise a `ValueError` unless at their defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options(
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
    if beta is None:
        beta = jnp.ones(v.shape[:3], v.dtype)
    h0 = _state_in(initial_state, state_v_first)
    l2 = use_qk_l2norm_in_kernel
    if gk is not None:
        result = _kda.recurrent_kimi_delta_attention(
            q,
            k,
            v,
            gk if g is None else gk + g[..., None],
            beta,
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            use_qk_l2norm=l2,
            cu_seqlens=cu_seqlens,
        )
    elif g is not None:
        result = _gated_delta.recurrent_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            use_qk_l2norm=l2,
            cu_seqlens=cu_seqlens,
        )
    else:
        result = _delta.recurrent_delta_rule(
            q,
            k,
            v,
            beta,
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            use_qk_l2norm=l2,
            cu_seqlens=cu_seqlens,
        )
    return _state_out(result, state_v_first)


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.delta_rule.chunk_delta_rule`.

    Mirrors `chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, ...)` and calls
    [`deltanet_cp.chunk_delta_rule`][].

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`; `beta`: step sizes, `(B, T, HV)`.
    - `scale`, `initial_state` (`(N, HV, K, V)`), `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens`, `chunk_size`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused; `head_first` raises a
        `ValueError` unless `False`.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options("chunk_delta_rule", options, ("cu_seqlens_cpu", "head_first"))
    return _delta.chunk_delta_rule(
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def fused_recurrent_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor | None = None,
    scale: float | None = None,
    initial_state: FLAStates | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.delta_rule.fused_recurrent_delta_rule`: token by token.

    Mirrors `fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None)` and calls
    [`deltanet_cp.recurrent_delta_rule`][]. `beta` defaults to ones; the other arguments
    are as in [`deltanet_cp.interop.fla.chunk_delta_rule`][].
    """
    if beta is None:
        beta = jnp.ones(v.shape[:3], v.dtype)
    return _delta.recurrent_delta_rule(
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )


_KDA_OPTIONS = (
    "use_gate_in_kernel",
    "A_log",
    "dt_bias",
    "lower_bound",
    "safe_gate",
    "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval",
)


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.kda.chunk_kda`: Kimi Delta Attention.

    Mirrors `chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False,
    cu_seqlens=None, ...)` and calls [`deltanet_cp.chunk_kimi_delta_attention`][]. The
    arguments after `use_qk_l2norm_in_kernel` are keyword-only here.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per key channel, `(B, T, HV, K)`; `beta`: step sizes, `(B, T, HV)`.
    - `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`,
        `state_v_first`, `cu_seqlens`, `chunk_size`: as in
        [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu`, `chunk_indices` and `disable_recompute` are accepted
        and unused; `use_gate_in_kernel`, `A_log`, `dt_bias`, `lower_bound`, `safe_gate`,
        `use_beta_sigmoid_in_kernel`, `allow_neg_eigval`, `return_intermediate_states`,
        `cp_context` and `head_first` raise a `ValueError` unless at their defaults.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options(
        "chunk_kda",
        options,
        _KDA_OPTIONS
        + (
            "return_intermediate_states",
            "cp_context",
            "head_first",
            "cu_seqlens_cpu",
            "chunk_indices",
            "disable_recompute",
        ),
    )
    result = _kda.chunk_kimi_delta_attention(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    return _state_out(result, state_v_first)


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.kda.fused_recurrent_kda`: Kimi Delta Attention token by token.

    Mirrors `fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, ...,
    state_v_first=False, cu_seqlens=None)` (`scale` is the 8th positional argument) and calls
    [`deltanet_cp.recurrent_kimi_delta_attention`][]. `A_log` and `dt_bias` must be `None`
    (they serve FLA's in-kernel gate); the other arguments are as in
    [`deltanet_cp.interop.fla.chunk_kda`][]. `use_gate_in_kernel`, `lower_bound`,
    `use_beta_sigmoid_in_kernel` and `allow_neg_eigval` raise a `ValueError` unless at their
    defaults.
    """
    _check_options("fused_recurrent_kda", dict(options, A_log=A_log, dt_bias=dt_bias), _KDA_OPTIONS)
    result = _kda.recurrent_kimi_delta_attention(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )
    return _state_out(result, state_v_first)


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gla.chunk_gla`: gated linear attention.

    Mirrors `chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None)` and calls
    [`deltanet_cp.chunk_gla`][]. FLA's GLA has no `beta` and no query/key normalisation.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per key channel, `(B, T, HV, K)` (a decay per head, `(B, T, HV)`,
        is accepted too: FLA's `chunk_simple_gla`).
    - `scale`, `initial_state`, `output_final_state`, `state_v_first`, `cu_seqlens`,
        `chunk_size`: as in [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options("chunk_gla", options, ("cu_seqlens_cpu",))
    result = _gla.chunk_gla(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    return _state_out(result, state_v_first)


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
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gla.fused_recurrent_gla`: gated linear attention token by token.

    Mirrors `fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
    output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None)` and calls
    [`deltanet_cp.recurrent_gla`][] with `g = gk` (no decay if `None`). `gv` must be `None`
    and `reverse` `False` (a `ValueError` otherwise); the other arguments are as in
    [`deltanet_cp.interop.fla.chunk_gla`][].
    """
    _check_options("fused_recurrent_gla", dict(gv=gv, reverse=reverse), ("gv", "reverse"))
    g = jnp.zeros(v.shape[:3], k.dtype) if gk is None else gk
    result = _gla.recurrent_gla(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return _state_out(result, state_v_first)


def _head_decay(
    function: str, v: ValueTensor, g: GateTensor | None, g_gamma: Array | None, dtype: Any
) -> Array:
    if g is not None and g_gamma is not None:
        raise ValueError(f"{function}: pass one of `g` and `g_gamma`, not both (as FLA requires).")
    if g_gamma is not None:
        return jnp.broadcast_to(g_gamma, v.shape[:3])
    return jnp.zeros(v.shape[:3], dtype) if g is None else g


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.simple_gla.chunk_simple_gla`: a decay per head (Mamba-2, RetNet).

    Mirrors `chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
    output_final_state=False, state_v_first=False, cu_seqlens=None, ...)` and calls
    [`deltanet_cp.chunk_gla`][] with a decay per head.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, HV, V)`.
    - `g`: log decays per head, `(B, T, HV)`.
    - `g_gamma`: a constant log decay per head, `(HV,)` (RetNet); at most one of `g` and
        `g_gamma` (neither: no decay).
    - `scale`, `initial_state`, `output_final_state`, `state_v_first`, `cu_seqlens`,
        `chunk_size`: as in [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused; `head_first` raises a
        `ValueError` unless `False`.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options("chunk_simple_gla", options, ("cu_seqlens_cpu", "head_first"))
    result = _gla.chunk_gla(
        q,
        k,
        v,
        _head_decay("chunk_simple_gla", v, g, g_gamma, k.dtype),
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    return _state_out(result, state_v_first)


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
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.simple_gla.fused_recurrent_simple_gla`: token by token.

    Mirrors `fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None,
    initial_state=None, output_final_state=False, reverse=False, state_v_first=False,
    cu_seqlens=None)` and calls [`deltanet_cp.recurrent_gla`][] with a decay per head.
    `reverse` must be `False` (a `ValueError` otherwise); the other arguments are as in
    [`deltanet_cp.interop.fla.chunk_simple_gla`][].
    """
    _check_options("fused_recurrent_simple_gla", dict(reverse=reverse), ("reverse",))
    result = _gla.recurrent_gla(
        q,
        k,
        v,
        _head_decay("fused_recurrent_simple_gla", v, g, g_gamma, k.dtype),
        scale=scale,
        initial_state=_state_in(initial_state, state_v_first),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return _state_out(result, state_v_first)


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
    **options: Any,
) -> tuple[ValueTensor, FLAStates | None]:
    """FLA's `fla.ops.gated_delta_product.chunk_gated_delta_product`, in FLA's flat layout.

    Mirrors `chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    cu_seqlens=None, cu_seqlens_cpu=None)` and calls [`deltanet_cp.chunk_gated_delta_product`][]
    with `k`, `v`, `beta` reshaped to `(B, T, num_householder, ...)`: row
    `t * num_householder + j` of FLA's axis 1 is step `j` of token `t`.

    **Arguments:**

    - `q`: `(B, T, H, K)`.
    - `k`: `(B, T * num_householder, H, K)`; `v`: `(B, T * num_householder, HV, V)`.
    - `g`: log decays, `(B, T, HV)`, applied once per token before its steps; or `None`.
    - `beta`: step sizes, `(B, T * num_householder, HV)`.
    - `num_householder`: the number of delta steps per token.
    - `scale`, `initial_state` (`(N, HV, K, V)`), `output_final_state`,
        `use_qk_l2norm_in_kernel`, `cu_seqlens` (offsets in tokens of `q`), `chunk_size`:
        as in [`deltanet_cp.interop.fla.chunk_gated_delta_rule`][].
    - `**options`: `cu_seqlens_cpu` is accepted and unused.

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    _check_options("chunk_gated_delta_product", options, ("cu_seqlens_cpu",))
    n = num_householder
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"`num_householder` must be a positive int; got {n!r}.")
    b, t = q.shape[:2]
    for name, x in (("k", k), ("v", v), ("beta", beta)):
        if x.shape[:2] != (b, t * n):
            raise ValueError(
                f"`{name}` must have FLA's flat layout (B, T * num_householder, ...) = "
                f"({b}, {t * n}, ...) for `q` of shape {tuple(q.shape)} and "
                f"num_householder={n}; got {tuple(x.shape)}."
            )
    return _delta_product.chunk_gated_delta_product(
        q,
        k.reshape(b, t, n, *k.shape[2:]),
        v.reshape(b, t, n, *v.shape[2:]),
        g,
        beta.reshape(b, t, n, *beta.shape[2:]),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
