r"""The preconditioned delta rules (flash-linear-attention's `precond_gated_delta_rule` and
`precond_kda`): a cascade of two recurrences on the engine.

Per token, first a diagonal preconditioner per key head (`A: (B, H, K)`, shared by the
value heads that read the key head), then a squash of it into a write-key scale:

    A   <- exp(g_atk_t) A + beta_atk_t k_t^2                  (elementwise over K)
    r   =  log(A + eps) - log_atk_scale,   s = r / (1 + |r|)
    k^_t = k_t * exp(-log(x) s)                                (a scale in (1/x, x))

then the main recurrence per value head, a delta rule erasing along `k` and writing along
`k^` ([`deltanet_cp.PrecondGatedDeltaRule`][] / [`deltanet_cp.PrecondKimiDeltaRule`][]).

The preconditioner is a linear recurrence whose per-token output is its state: gated linear
attention with a one-row state, `A` as a `(1, K)` state with key `1`, value
`beta_atk * k^2`, query `1` and decay `g_atk`. So it runs on the engine as
[`deltanet_cp.GLARule`][]: its chunks are diagonal maps (`1 + K` numbers per
key head cross the ranks), its within-chunk sums are the exact segment-sum decays, and its
VJP is the engine's. The squash is elementwise; the main stage then runs on the engine from
the preconditioned keys. Context parallelism, packed documents and gradients go through
both runs.
"""

import math
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, States, ValueTensor
from .._mesh import mesh_to_run_on
from .._parallel import ContextParallel
from .._precision import accumulation_dtype, as_precision, PrecisionName, resolve_precision
from .._run import Memory, run
from .._validate import check_log_decay, check_range, check_step_sizes
from ..chunkops import l2norm
from ._delta_family import AbstractDeltaRule, DeltaInputs
from ._gla import GLAInputs, GLARule
from ._helpers import check_arrays
from ._precond import PrecondGatedDeltaRule, PrecondKimiDeltaRule


# A gate per token and key head (the preconditioner's), its state per key head, its centre.
KeyHeadGate: TypeAlias = Float[Array, "batch seq heads"]
AStates: TypeAlias = Float[Array, "batch_or_docs heads k"]
Center: TypeAlias = float | Float[Array, " heads"] | Float[Array, ""] | None


def _as_positive_float(value: Any, name: str, *, low: float, strict: bool) -> float:
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"`{name}` must be a Python float; got {value!r}.")
    try:
        number = float(value)
    except Exception:
        raise TypeError(
            f"`{name}` must be a Python float known when tracing; got {value!r}. Pass it as a "
            "static argument (close over it) instead of a jit argument."
        ) from None
    if not math.isfinite(number) or number < low or (strict and number == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"`{name}` must be a finite float {bound}; got {number}.")
    return number


# float32's smallest normal number: a smaller `eps` is flushed to zero there (log(0 + eps)).
_TINY = float(np.finfo(np.float32).tiny)
_HUGE = float(np.finfo(np.float32).max)


def as_squash_range(x: Any, name: str = "x") -> float:
    """`x`, the squash's range, as a Python float >= 1; else a `TypeError` or `ValueError`
    naming it `name`."""
    return _as_positive_float(x, name, low=1.0, strict=False)


def as_squash_eps(eps: Any, name: str = "eps") -> float:
    """`eps`, added to the preconditioner's state before the log, as a Python float within
    float32's normal range; else a `TypeError` or `ValueError` naming it `name`."""
    eps = _as_positive_float(eps, name, low=0.0, strict=True)
    if not _TINY <= eps <= _HUGE:
        raise ValueError(
            f"`{name}` must be between float32's smallest normal number ({_TINY:.6g}) and its "
            f"largest ({_HUGE:.6g}): a smaller one is flushed to zero there, and log(A + eps) "
            f"is -inf where the preconditioner's state A is 0; got {eps!r}."
        )
    return eps


def _check_finite_center(log_atk_scale: Any, dtype: Any) -> None:
    """A `ValueError` if the centre, where it is concrete, is not finite in `dtype`."""
    if isinstance(log_atk_scale, Tracer):
        return  # traced (a differentiated centre, say): not checked
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.asarray(log_atk_scale).astype(np.dtype(dtype))
    if not np.all(np.isfinite(values)):
        raise ValueError(
            f"`log_atk_scale` must be finite (in the computation's {np.dtype(dtype).name}); "
            f"got {log_atk_scale!r}. It is the squash's centre in log space: a value near "
            "the log of the preconditioner's typical state (default -0.2)."
        )


def _center(log_atk_scale: Center, heads: int, dtype: Any) -> Array:
    """The squash's centre as an array that broadcasts against `(B, T, H, K)`."""
    if log_atk_scale is None:
        return jnp.asarray(-0.2, dtype)
    if isinstance(log_atk_scale, (int, float)) and not isinstance(log_atk_scale, bool):
        _check_finite_center(log_atk_scale, dtype)
        return jnp.asarray(log_atk_scale, dtype)
    shape = getattr(log_atk_scale, "shape", None)
    dt = getattr(log_atk_scale, "dtype", None)
    if shape is None or dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            "`log_atk_scale` must be None, a float, or a floating-point array of shape "
            f"(H,) = ({heads},), one centre per key head; got {log_atk_scale!r}."
        )
    _check_finite_center(log_atk_scale, dtype)
    if tuple(shape) == ():
        return jnp.asarray(log_atk_scale, dtype)
    if tuple(shape) != (heads,):
        raise ValueError(
            "`log_atk_scale` must be a float or an array of shape (H,) = "
            f"({heads},), one centre per key head; got shape {tuple(shape)}."
        )
    return jnp.asarray(log_atk_scale, dtype).reshape(1, 1, heads, 1)


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
    inputs = (q, k, v, g_atk, g, beta_atk, beta)
    precision = resolve_precision(main.precision, *inputs)
    write_key, a_final = write_keys(
        k,
        g_atk,
        beta_atk,
        dtype=accumulation_dtype(*inputs),
        use_qk_l2norm=main.use_qk_l2norm,
        initial_A_state=initial_A_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        chunk_size=main.chunk_size,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
        memory=memory,
    )
    # Stage 2: the delta rule erasing along k and writing along the preconditioned key.
    o, final_state = run(
        _resolved(main, precision),
        DeltaInputs(q, k, v, g, beta, write_key=write_key),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        memory=memory,
    )
    return o, final_state, a_final


def write_keys(
    k,
    g_atk,
    beta_atk,
    *,
    dtype: Any,
    use_qk_l2norm: bool,
    initial_A_state,
    cu_seqlens,
    cp,
    chunk_size: int,
    precision: PrecisionName,
    x,
    eps,
    log_atk_scale,
    memory=None,
):
    """The preconditioner on the engine and the squash: the write keys `(B, T, H, K)` in
    `dtype` and the preconditioner's final state `(B, H, K)` (per document with
    `cu_seqlens`). `k`, `g_atk`, `beta_atk` and `initial_A_state` checked by the caller."""
    x, eps = as_squash_range(x), as_squash_eps(eps)
    _center(log_atk_scale, k.shape[2], dtype)  # checked before the run
    recurrence, inputs, k_erase = preconditioner(
        k,
        g_atk,
        beta_atk,
        dtype=dtype,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        precision=precision,
    )
    a0 = None if initial_A_state is None else initial_A_state[..., None, :]
    a, a_final = run(
        recurrence, inputs, initial_state=a0, cu_seqlens=cu_seqlens, cp=cp, memory=memory
    )
    if cp is not None and cp.mesh is not None:
        # Global arrays: the preconditioner's come back on the mesh the engine ran on
        # (`cp.mesh`, or its `Auto` copy where the caller's arrays are not typed on it); the
        # keys go there too before the two meet.
        spec = jax.sharding.PartitionSpec(cp.batch_axis, cp.axis_name)
        mesh = mesh_to_run_on(cp.mesh, k, g_atk, beta_atk, initial_A_state, cu_seqlens)
        on_mesh = jax.sharding.NamedSharding(mesh, spec)
        k_erase, a = jax.device_put(k_erase, on_mesh), jax.device_put(a, on_mesh)
    return squash(k_erase, a, x=x, eps=eps, log_atk_scale=log_atk_scale), a_final[..., 0, :]


def preconditioner(
    k, g_atk, beta_atk, *, dtype: Any, use_qk_l2norm: bool, chunk_size: int, precision
) -> tuple[GLARule, GLAInputs, Array]:
    """The preconditioner as gated linear attention with a one-row state (key 1, value
    `beta_atk k^2`, query 1, decay `g_atk`): `(recurrence, inputs, k_erase)`, its state
    per key head `(1, K)` and its output per token the state after it, `(B, T, H, K)`;
    `k_erase` the keys in `dtype` (L2-normalised with `use_qk_l2norm`), what the main stage
    erases along and `squash` scales."""
    k_erase = k.astype(dtype)
    if use_qk_l2norm:
        k_erase = l2norm(k_erase)  # what the main stage erases along: the same l2norm
    ones = jnp.ones((*k.shape[:-1], 1), dtype)
    recurrence = GLARule(chunk_size=chunk_size, scale=1.0, use_qk_l2norm=False, precision=precision)
    inputs = GLAInputs(ones, ones, beta_atk.astype(dtype)[..., None] * k_erase**2, g_atk)
    return recurrence, inputs, k_erase


def squash(k_erase: Array, a: Array, *, x: float, eps: float, log_atk_scale: Center) -> Array:
    """The write keys `(B, T, H, K)` from the erase keys and the preconditioner's state after
    each token `a` (both `(B, T, H, K)`, in one dtype): `k_erase` times a scale in
    `(1/x, x)` per key channel. `x` and `eps` checked by the caller (`as_squash_range`,
    `as_squash_eps`)."""
    dtype = k_erase.dtype
    center = _center(log_atk_scale, k_erase.shape[2], dtype)
    # Where the preconditioner's state is non-finite (a non-finite input at or before the
    # token), the write key is NaN, which the main stage takes as a non-finite input; the
    # squash itself is formed from a zero there, so that its VJP sends a zero, not NaN, back
    # into the preconditioner's run (whose backward would carry a NaN cotangent to the
    # tokens before).
    finite = jnp.isfinite(a)
    r = jnp.log(jnp.where(finite, a, 0) + jnp.asarray(eps, dtype)) - center
    s = r / (1 + jnp.abs(r))
    write_key = k_erase * jnp.exp(jnp.asarray(-math.log(x), dtype) * s)
    return _finite_cotangent(jnp.where(finite, write_key, jnp.nan))


@jax.custom_vjp
def _finite_cotangent(write_key: Array) -> Array:
    """`write_key` itself; its cotangent with non-finite entries read as zeros.

    After a non-finite input the main stage's states are NaN from that token on (to the end
    of its document), and so are the cotangents it sends to its inputs there, although no
    finite output depends on them (a loss on the tokens before has a zero gradient there).
    Within one run of the engine they stay at their own tokens; here they would reach the
    preconditioner's run, whose reverse pass carries a cotangent to every earlier token.
    """
    return write_key


def _finite_cotangent_fwd(write_key: Array) -> tuple[Array, None]:
    return write_key, None


def _finite_cotangent_bwd(_, cotangent: Array) -> tuple[Array]:
    return (jnp.where(jnp.isfinite(cotangent), cotangent, jnp.zeros((), cotangent.dtype)),)


_finite_cotangent.defvjp(_finite_cotangent_fwd, _finite_cotangent_bwd)


def _resolved(main: AbstractDeltaRule, precision: PrecisionName) -> AbstractDeltaRule:
    """`main` with its products' policy resolved from the public inputs (the main stage's
    own inputs hold the float32 preconditioned keys beside possibly bfloat16 ones)."""
    return type(main)(
        chunk_size=main.chunk_size,
        scale=main.scale,
        use_qk_l2norm=main.use_qk_l2norm,
        precision=precision,
    )  # pyright: ignore[reportCallIssue]


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
