"""The momentum delta rule's public functions: chunked and token by token.

The recurrence and its chunk algebra are in `_momentum.py`. The public state is
flash-linear-attention's: the memory and the momentum stacked on a new leading axis,
`(2, B, HV, K, V)`; the engine's is their rows stacked, `(B, HV, 2K, V)`.
"""

from typing import TypeAlias

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._recurrence import check_inputs
from .._run import Memory, run_checked
from ._momentum import MomentumDeltaRule, MomentumInputs


# The memory S and the momentum M stacked on a leading axis: per batch element, or with
# packed documents (`cu_seqlens`) per document.
MomentumStates: TypeAlias = Float[Array, "2 batch_or_docs vheads k v"]


def chunk_momentum_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    log_alpha: GateTensor,
    log_mu: GateTensor,
    p: QKTensor | None = None,
    beta: GateTensor | None = None,
    eta: GateTensor | None = None,
    *,
    scale: float | None = None,
    initial_state: MomentumStates | None = None,
    use_qk_l2norm: bool = False,
    use_p_times_alpha: bool = True,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    memory: Memory | None = None,
) -> tuple[ValueTensor, MomentumStates]:
    r"""The momentum delta rule in chunked (WY) form: the training path.

    Per token and value head, a memory $S$ and a momentum $M$:
    $M_t = \mu_t M_{t-1} + (\eta_t k_t)(S_{t-1}^\top \tilde p_t - v_t)^\top$,
    $S_t = \alpha_t S_{t-1} - \beta_t M_t$, $o_t = S_t^\top (s\, q_t)$, with
    $\alpha_t = e^{\log\alpha_t}$, $\mu_t = e^{\log\mu_t}$ and the probe
    $\tilde p_t = \alpha_t p_t$ (`use_p_times_alpha`) or $p_t$.
    flash-linear-attention's `fla.ops.momentum_delta_rule.chunk_momentum_delta_rule` in
    name, argument order, defaults and state layout; its call shape (with
    `output_final_state`) is `deltanet_cp.interop.fla.chunk_momentum_delta_rule`.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)` (flash-linear-attention has `HV = H`).
    - `log_alpha`: the memory's log decays $\log\alpha_t \le 0$, shape `(B, T, HV)`.
    - `log_mu`: the momentum's log decays $\log\mu_t \le 0$, shape `(B, T, HV)`.
    - `p`: probes, shape `(B, T, H, K)`; the keys if `None`.
    - `beta`: how much of the momentum enters the memory, `(B, T, HV)`; ones if `None`.
    - `eta`: the momentum's step sizes, `(B, T, HV)`; ones if `None`.
    - `scale`: query scale, default `K ** -0.5` (a Python float).
    - `initial_state`: $(S, M)$ before the first token, stacked: `(2, B, HV, K, V)`; zeros
        if `None`.
    - `use_qk_l2norm`: L2-normalise `q`, `k` and `p` over `K` (eps `1e-6`) first
        (flash-linear-attention's `use_qk_l2norm_in_kernel`; off by default, as for every
        recurrence here, while FLA's default is on: pass `True` to match it, or use
        [`deltanet_cp.interop.fla.chunk_momentum_delta_rule`][]).
    - `use_p_times_alpha`: the probe is $\alpha_t p_t$ (after the normalisation).
    - `cu_seqlens`: packed documents (batch size 1): the offsets
        `[0, len_0, len_0 + len_1, ..., T]`. The state resets at each document start and
        `initial_state` / the final state are per document, `(2, N, HV, K, V)`.
    - `chunk_size`: tokens per chunk.
    - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][]; `None`: one
        device. What crosses ranks is one affine map of the joint state $[S; M]$ per rank,
        `(2K, 2K + V)` per value head, whatever the sequence length.
    - `precision`: the products' policy: `"highest"`, `"bfloat16"`, `"default"`, or `None`
        (from the inputs' dtype); see [`deltanet_cp.MomentumDeltaRule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final
    $(S, M)$ stacked, `(2, B, HV, K, V)` (float32; float64 for float64 inputs), with
    `cu_seqlens` one per document, `(2, N, HV, K, V)`.
    """
    recurrence = MomentumDeltaRule(
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        use_p_times_alpha=use_p_times_alpha,
        precision=precision,
    )
    return _call(
        recurrence, q, k, v, log_alpha, log_mu, p, beta, eta, initial_state, cu_seqlens, cp, memory
    )


def recurrent_momentum_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    log_alpha: GateTensor,
    log_mu: GateTensor,
    p: QKTensor | None = None,
    beta: GateTensor | None = None,
    eta: GateTensor | None = None,
    *,
    scale: float | None = None,
    initial_state: MomentumStates | None = None,
    use_qk_l2norm: bool = False,
    use_p_times_alpha: bool = True,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, MomentumStates]:
    r"""The momentum delta rule token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_momentum_delta_rule`][], one token per step
    (the engine with `chunk_size=1`); the same arguments (without `chunk_size`) and
    results. flash-linear-attention calls it `fused_recurrent_momentum_delta_rule`.
    """
    recurrence = MomentumDeltaRule(
        chunk_size=1,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        use_p_times_alpha=use_p_times_alpha,
        precision=precision,
    )
    return _call(
        recurrence, q, k, v, log_alpha, log_mu, p, beta, eta, initial_state, cu_seqlens, cp
    )


def _call(
    recurrence, q, k, v, log_alpha, log_mu, p, beta, eta, initial_state, cu_seqlens, cp, memory=None
):
    # beta, eta default to ones, one per token and value head (a malformed `v` is reported
    # by the input checks first).
    ones = jnp.ones(tuple(getattr(v, "shape", (0,)))[:-1], getattr(v, "dtype", jnp.float32))
    inputs = MomentumInputs(
        q,
        k,
        v,
        k if p is None else p,
        log_alpha,
        log_mu,
        ones if beta is None else beta,
        ones if eta is None else eta,
    )
    check_inputs(recurrence, inputs)
    docs = None if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = None if initial_state is None else _joint(initial_state, inputs, docs)
    o, final = run_checked(  # the inputs checked above, once
        recurrence, inputs, initial_state=h0, cu_seqlens=cu_seqlens, cp=cp, memory=memory
    )
    dk = inputs.k.shape[-1]
    return o, jnp.stack([final[..., :dk, :], final[..., dk:, :]])


def _joint(initial_state, inputs: MomentumInputs, docs: int | None):
    """FLA's stacked `(2, B, HV, K, V)` state as the engine's `(B, HV, 2K, V)`, after a
    check of its shape that names what to change."""
    b, _, hv, dv = inputs.v.shape
    dk = inputs.k.shape[-1]
    lead, what = (b, "B") if docs is None else (docs, "N documents")
    expected = (2, lead, hv, dk, dv)
    shape = tuple(getattr(initial_state, "shape", ()))
    if shape != expected:
        raise ValueError(
            f"`initial_state` must be the memory S and the momentum M stacked, "
            f"(2, {what}, HV, K, V) = {expected}, as flash-linear-attention's "
            f"`torch.stack([S, M])`; got shape {shape}."
        )
    return jnp.concatenate([initial_state[0], initial_state[1]], axis=-2)
