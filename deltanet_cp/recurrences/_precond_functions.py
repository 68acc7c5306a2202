r"""The preconditioned delta rules (flash-linear-attention's `precond_gated_delta_rule` and
`precond_kda`): a cascade of two recurrences on the engine (`_cascade.py`), behind the
public functions' argument checks.

Both stages, the preconditioner per key head and the main delta rule per value head
([`deltanet_cp.PrecondGatedDeltaRule`][] / [`deltanet_cp.PrecondKimiDeltaRule`][])
writing along the keys it preconditions, run on the engine: context parallelism, packed
documents and gradients go through both runs.
"""

from typing import TypeAlias

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import accumulation_dtype, as_precision, PrecisionName
from .._run import Memory
from .._validate import check_log_decay, check_range, check_step_sizes
from ._cascade import cascade, Center, check_squash, engine_stage
from ._delta_family import AbstractDeltaRule, DeltaInputs
from ._helpers import check_arrays
from ._precond import PrecondGatedDeltaRule, PrecondKimiDeltaRule


# A gate per token and key head (the preconditioner's), its state per key head.
KeyHeadGate: TypeAlias = Float[Array, "batch seq heads"]
AStates: TypeAlias = Float[Array, "batch_or_docs heads k"]


def _precond(
    main: AbstractDeltaRule,
    per_channel: bool,
    q,
    k,
    v,
    g_atk,
    g,
    beta_atk,
    beta,
    *,
    initial_state,
    initial_A_state,
    cu_seqlens,
    cp,
    x,
    eps,
    log_atk_scale,
    memory=None,
):
    named = {"q": q, "k": k, "v": v, "g_atk": g_atk, "g": g, "beta_atk": beta_atk, "beta": beta}
    for name, array in named.items():  # before the preconditioner's run, which would name `v`
        if array is None:
            raise ValueError(f"`{name}` must be an array; got None.")
        if 0 in tuple(getattr(array, "shape", ()))[2:]:
            raise ValueError(
                f"`{name}` has shape {tuple(array.shape)}, with an empty axis: every axis after "
                "(batch, seq) (heads, key or value size) must have at least one element."
            )
    sizes = check_arrays(
        {
            "q": (q, ("batch", "seq", "heads", "K")),
            "k": (k, ("batch", "seq", "heads", "K")),
            "v": (v, ("batch", "seq", "value_heads", "V")),
            "g_atk": (g_atk, ("batch", "seq", "heads")),
            "g": (g, ("batch", "seq", "value_heads", *(("K",) if per_channel else ()))),
            "beta_atk": (beta_atk, ("batch", "seq", "heads")),
            "beta": (beta, ("batch", "seq", "value_heads")),
        }
    )
    where = type(main).__name__
    check_log_decay(g_atk, "g_atk", where)
    check_range(
        beta_atk,
        "beta_atk",
        where,
        low=0.0,
        hint="the preconditioner's step sizes: its state sums beta_atk k^2 and must stay >= 0",
    )
    check_log_decay(g, "g", where)
    check_step_sizes(beta, "beta", where)
    heads, dk = sizes["heads"], sizes["K"]
    if initial_A_state is not None:
        shape = getattr(initial_A_state, "shape", None)
        dt = getattr(initial_A_state, "dtype", None)
        if shape is None or dt is None or not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(
                f"`initial_A_state` must be a floating-point array; got {initial_A_state!r}."
            )
        if cu_seqlens is None:
            lead, what = sizes["batch"], "B"
        else:
            lead, what = np.shape(cu_seqlens)[0] - 1, "N, one per document of `cu_seqlens`"
        if len(shape) != 3 or tuple(shape) != (lead, heads, dk):
            raise ValueError(
                f"`initial_A_state` must have shape ({what}, H, K) = {(lead, heads, dk)} "
                f"(one preconditioner state per key head); got {tuple(shape)}."
            )
    dtype = accumulation_dtype(q, k, v, g_atk, g, beta_atk, beta)
    x, eps = check_squash(x, eps, log_atk_scale, heads, dtype)
    o, final_state, a_final, _ = cascade(
        main,
        DeltaInputs(q, k, v, g, beta),
        g_atk,
        beta_atk,
        initial_state=initial_state,
        initial_A_state=initial_A_state,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
        stage=engine_stage(cu_seqlens, cp, memory),
        cp=cp,
        cu_seqlens=cu_seqlens,
    )
    return o, final_state, a_final


def chunk_precond_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g_atk: KeyHeadGate,
    g: GateTensor,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    initial_A_state: AStates | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
    memory: Memory | None = None,
) -> tuple[ValueTensor, States, AStates]:
    r"""The preconditioned gated delta rule in chunked (WY) form: the training path.

    Per token: the preconditioner $A \leftarrow e^{g^{atk}_t} A + \beta^{atk}_t k_t^2$ (per
    key head and channel), the write key $\hat k_t = k_t\, x^{-s}$ with
    $s = r / (1 + |r|)$, $r = \log(A + \epsilon) - c$; then per value head
    $h \leftarrow e^{g_t} h$, $h \leftarrow h + \hat k_t (\beta_t (v_t - h^\top k_t))^\top$,
    $o_t = h^\top (s\, q_t)$. flash-linear-attention's
    `fla.ops.precond_gated_delta_rule.chunk_precond_gated_delta_rule` in argument names,
    order and results.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` a multiple of `H`, value head `j` reads key
        head `j // (HV // H)` and its preconditioner.
    - `g_atk`: the preconditioner's log decays $\le 0$, one per key head, `(B, T, H)`.
    - `g`: the main log decays $\le 0$, `(B, T, HV)`.
    - `beta_atk`: the preconditioner's step sizes $\ge 0$, `(B, T, H)`.
    - `beta`: the main step sizes in $[0, 1]$ ($[0, 2]$ for negative eigenvalues),
        `(B, T, HV)`. The four gates' ranges are checked where the values are concrete
        (see [`deltanet_cp.run`][]).
    - `chunk_size`: tokens per chunk (both stages).
    - `scale`: query scale, default `K ** -0.5` (a Python float).
    - `initial_state`: the main state before the first token, `(B, HV, K, V)`; zeros if
        `None`.
    - `initial_A_state`: the preconditioner's state before the first token, `(B, H, K)`
        (one per key head); zeros if `None`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first (the
        preconditioner then accumulates the normalised keys). flash-linear-attention's
        default is on; so is its adapter's in `deltanet_cp.interop.fla`.
    - `cu_seqlens`: packed documents (batch size 1), as in
        [`deltanet_cp.chunk_gated_delta_rule`][]; both states are then per document,
        `(N, HV, K, V)` and `(N, H, K)`.
    - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][]; both stages
        run context-parallel under it.
    - `precision`: the products' policy, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    - `x`: the squash's range: the write key is `k` times a scale in $(1/x, x)$; a Python
        float $\ge 1$ ($x = 1$: no preconditioning). Default `1.5`.
    - `eps`: added to the preconditioner's state before the log, a Python float at least
        float32's smallest normal number (about `1.2e-38`). Default `1e-6`.
    - `log_atk_scale`: the squash's centre in log space: a float (default `-0.2`) or an
        array of shape `(H,)`, one per key head (differentiable); finite (in float32 for
        float32 inputs), checked where it is concrete.
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state, final_A_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, the
    final main state `(B, HV, K, V)` and the final preconditioner state `(B, H, K)` (one
    per key head; float32, float64 for float64 inputs; with `cu_seqlens`, one per
    document).
    """
    return _precond(
        PrecondGatedDeltaRule(
            chunk_size=chunk_size,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=as_precision(precision),
        ),
        False,
        q,
        k,
        v,
        g_atk,
        g,
        beta_atk,
        beta,
        initial_state=initial_state,
        initial_A_state=initial_A_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
        memory=memory,
    )


def recurrent_precond_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g_atk: KeyHeadGate,
    g: GateTensor,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    initial_A_state: AStates | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
) -> tuple[ValueTensor, States, AStates]:
    r"""The preconditioned gated delta rule token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_precond_gated_delta_rule`][], one token per
    step (both stages with `chunk_size=1`); the same arguments (without `chunk_size`) and
    results.
    """
    return chunk_precond_gated_delta_rule(
        q,
        k,
        v,
        g_atk,
        g,
        beta_atk,
        beta,
        scale=scale,
        initial_state=initial_state,
        initial_A_state=initial_A_state,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        chunk_size=1,
        cp=cp,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
    )


def chunk_precond_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    g_atk: KeyHeadGate,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    initial_A_state: AStates | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
    memory: Memory | None = None,
) -> tuple[ValueTensor, States, AStates]:
    r"""Preconditioned Kimi Delta Attention in chunked (WY) form: the training path.

    The preconditioner and write key of
    [`deltanet_cp.chunk_precond_gated_delta_rule`][], then per value head
    $h \leftarrow \mathrm{diag}(e^{g_t}) h$,
    $h \leftarrow h + \hat k_t (\beta_t (v_t - h^\top k_t))^\top$, $o_t = h^\top (s\, q_t)$.
    flash-linear-attention's `fla.ops.precond_kda.chunk_precond_kda` in argument names,
    order (`g` before `g_atk`, as there) and results.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` a multiple of `H`.
    - `g`: the main log decays per key channel, $\le 0$, `(B, T, HV, K)`.
    - `g_atk`: the preconditioner's log decays $\le 0$, one per key head, `(B, T, H)`.
    - `beta_atk`: the preconditioner's step sizes $\ge 0$, `(B, T, H)`.
    - `beta`: the main step sizes in $[0, 1]$ ($[0, 2]$ for negative eigenvalues),
        `(B, T, HV)`. The four gates' ranges are checked where the values are concrete
        (see [`deltanet_cp.run`][]).
    - `scale`, `initial_state`, `initial_A_state`, `use_qk_l2norm`, `cu_seqlens`,
        `chunk_size`, `cp`, `precision`, `x`, `eps`, `log_atk_scale`: as in
        [`deltanet_cp.chunk_precond_gated_delta_rule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state, final_A_state)`, as in
    [`deltanet_cp.chunk_precond_gated_delta_rule`][].
    """
    return _precond(
        PrecondKimiDeltaRule(
            chunk_size=chunk_size,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=as_precision(precision),
        ),
        True,
        q,
        k,
        v,
        g_atk,
        g,
        beta_atk,
        beta,
        initial_state=initial_state,
        initial_A_state=initial_A_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
        memory=memory,
    )


def recurrent_precond_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    g_atk: KeyHeadGate,
    beta_atk: KeyHeadGate,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    initial_A_state: AStates | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: Center = None,
) -> tuple[ValueTensor, States, AStates]:
    r"""Preconditioned Kimi Delta Attention token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_precond_kda`][], one token per step (both
    stages with `chunk_size=1`); the same arguments (without `chunk_size`) and results.
    """
    return chunk_precond_kda(
        q,
        k,
        v,
        g,
        g_atk,
        beta_atk,
        beta,
        scale=scale,
        initial_state=initial_state,
        initial_A_state=initial_A_state,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        chunk_size=1,
        cp=cp,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
    )
