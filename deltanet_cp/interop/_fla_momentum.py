"""flash-linear-attention's call shapes for the momentum delta rule
(`fla.ops.momentum_delta_rule`). Each calls deltanet_cp's public function of the same
recurrence, which already takes FLA's argument order and stacked `(2, N, HV, K, V)` state.
"""

from .._custom_types import CuSeqlens, GateTensor, QKTensor, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._validate import as_flag
from ..recurrences._momentum_functions import (
    chunk_momentum_delta_rule as _chunk,
    MomentumStates,
    recurrent_momentum_delta_rule as _recurrent,
)


def chunk_momentum_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    log_alpha: GateTensor,
    log_mu: GateTensor,
    p: QKTensor | None = None,
    beta: GateTensor | None = None,
    eta: GateTensor | None = None,
    scale: float | None = None,
    initial_state: MomentumStates | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_p_times_alpha: bool = True,
    chunk_size: int = 64,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, MomentumStates | None]:
    r"""FLA's `fla.ops.momentum_delta_rule.chunk_momentum_delta_rule`.

    Mirrors `chunk_momentum_delta_rule(q, k, v, log_alpha, log_mu, p=None, beta=None,
    eta=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=True, use_p_times_alpha=True, chunk_size=64)` and runs
    [`deltanet_cp.MomentumDeltaRule`][], the recurrence of
    [`deltanet_cp.chunk_momentum_delta_rule`][]: per token
    $M \leftarrow \mu M + (\eta k)(S^\top \tilde p - v)^\top$,
    $S \leftarrow \alpha S - \beta M$, $o = S^\top (s\, q)$.

    **Arguments:**

    - `q`, `k`, `p`: `(B, T, H, K)` (`p` defaults to `k`); `v`: `(B, T, HV, V)`;
        `log_alpha`, `log_mu`, `beta`, `eta`: `(B, T, HV)` (`beta`, `eta` default to
        ones). FLA has `HV = H`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the memory and the momentum stacked, `(2, N, HV, K, V)`, `N` the
        batch size or the number of documents; zeros if `None`.
    - `output_final_state`: also return the final state, stacked the same way.
    - `cu_seqlens`: packed documents (batch size 1), `[0, ..., T]` (FLA's reference path
        refuses them; here they work).
    - `use_qk_l2norm_in_kernel`: L2-normalise `q`, `k` and `p` first.
    - `use_p_times_alpha`: read the memory along $\alpha_t p_t$.
    - `chunk_size`: tokens per chunk (any; FLA allows 16, 32 and 64).
    - `cp`: how the call is sharded (FLA has no context parallelism for this rule), as in
        [`deltanet_cp.ContextParallel`][]; `None`: one device.
    - `precision`: the products' policy, as in [`deltanet_cp.chunk_momentum_delta_rule`][].

    **Returns:**

    `(o, final_state)`: `o` `(B, T, HV, V)`, and the final state or `None`.
    """
    o, final = _chunk(
        q,
        k,
        v,
        log_alpha,
        log_mu,
        p,
        beta,
        eta,
        scale=scale,
        initial_state=initial_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        use_p_times_alpha=use_p_times_alpha,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        cp=cp,
        precision=precision,
    )
    return o, final if as_flag(output_final_state, "output_final_state") else None


def fused_recurrent_momentum_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    log_alpha: GateTensor,
    log_mu: GateTensor,
    p: QKTensor | None = None,
    beta: GateTensor | None = None,
    eta: GateTensor | None = None,
    scale: float | None = None,
    initial_state: MomentumStates | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_p_times_alpha: bool = True,
    *,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, MomentumStates | None]:
    """FLA's `fla.ops.momentum_delta_rule.fused_recurrent_momentum_delta_rule`.

    Mirrors `fused_recurrent_momentum_delta_rule(q, k, v, log_alpha, log_mu, p=None,
    beta=None, eta=None, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm_in_kernel=True, use_p_times_alpha=True)` and runs the
    recurrence of [`deltanet_cp.recurrent_momentum_delta_rule`][]; the arguments are as in
    [`deltanet_cp.interop.fla.chunk_momentum_delta_rule`][].
    """
    o, final = _recurrent(
        q,
        k,
        v,
        log_alpha,
        log_mu,
        p,
        beta,
        eta,
        scale=scale,
        initial_state=initial_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        use_p_times_alpha=use_p_times_alpha,
        cu_seqlens=cu_seqlens,
        cp=cp,
        precision=precision,
    )
    return o, final if as_flag(output_final_state, "output_final_state") else None
