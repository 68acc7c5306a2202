r"""The preconditioned delta rules' cascade: a diagonal preconditioner per key head on the
engine, a squash of it into write keys, then the main delta rule on the engine writing along
them. One room for what the functions (`_precond_functions.py`) and the token mixers
(`deltanet_cp.nn.PrecondGatedDeltaNet`, `PrecondKimiDeltaAttention`) both run.

Per token, first the preconditioner (`A: (B, H, K)`, shared by the value heads that read the
key head), then a squash of it into a write-key scale:

    A   <- exp(g_atk_t) A + beta_atk_t k_t^2                  (elementwise over K)
    r   =  log(A + eps) - log_atk_scale,   s = r / (1 + |r|)
    k^_t = k_t * exp(-log(x) s)                                (a scale in (1/x, x))

then the main recurrence per value head, a delta rule erasing along `k` and writing along
`k^`. The preconditioner is gated linear attention with a one-row state: `A` as a `(1, K)`
state with key `1`, value `beta_atk * k^2`, query `1` and decay `g_atk`, so both stages run
on the engine (context parallelism, packed documents, gradients). How a stage runs is the
caller's (`Stage`): the functions call `deltanet_cp.run`, the layers their own run, which
can also emit checkpoints.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Float

from .._mesh import mesh_to_run_on
from .._parallel import ContextParallel
from .._precision import accumulation_dtype, PrecisionName, resolve_precision
from .._recurrence import AbstractRecurrence
from .._run import Memory, run
from ..chunkops import l2norm
from ._delta_family import AbstractDeltaRule, DeltaInputs
from ._gla import GLAInputs, GLARule


# The squash's centre: one float, or one per key head.
Center: TypeAlias = float | Float[Array, " heads"] | Float[Array, ""] | None

# How the cascade runs one stage: `stage(recurrence, inputs, initial_state)` ->
# `(outputs, final state, checkpoints or None)`.
Stage: TypeAlias = Callable[[AbstractRecurrence, Any, Array | None], tuple[Any, Array, Any]]


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


def check_squash(x: Any, eps: Any, log_atk_scale: Center, heads: int, dtype: Any):
    """The squash's range and `eps` as Python floats, and its centre checked (finite in
    `dtype` where concrete, a float or one per key head of `heads`); else a `TypeError` or
    `ValueError` naming the argument."""
    x, eps = as_squash_range(x), as_squash_eps(eps)
    _center(log_atk_scale, heads, dtype)
    return x, eps


def engine_stage(cu_seqlens: Any, cp: ContextParallel | None, memory: Memory | None) -> Stage:
    """A `Stage` that is one call of `deltanet_cp.run` (no checkpoints)."""

    def stage(recurrence, inputs, initial_state):
        outputs, final = run(
            recurrence,
            inputs,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            cp=cp,
            memory=memory,
        )
        return outputs, final, None

    return stage


def precondition(
    k,
    g_atk,
    beta_atk,
    *,
    dtype: Any,
    use_qk_l2norm: bool,
    initial_A_state,
    chunk_size: int,
    precision: PrecisionName,
    x: float,
    eps: float,
    log_atk_scale: Center,
    stage: Stage,
    cp: ContextParallel | None = None,
    cu_seqlens: Any = None,
) -> tuple[Array, Array, Array | None]:
    """The first stage, the preconditioner run by `stage`, and the squash: the write keys
    `(B, T, H, K)` in `dtype`, the preconditioner's final state `(B, H, K)` (per document
    with `cu_seqlens`) and its checkpoints `(n, H, K)` if `stage` emits any. Every argument
    checked by the caller (`check_squash` for `x`, `eps`, `log_atk_scale`); `cp` and
    `cu_seqlens` only place the keys beside the preconditioner's states on `cp.mesh`."""
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
    a, a_final, a_saved = stage(recurrence, inputs, a0)
    if cp is not None and cp.mesh is not None:
        # Global arrays: the preconditioner's come back on the mesh the engine ran on
        # (`cp.mesh`, or its `Auto` copy where the caller's arrays are not typed on it); the
        # keys go there too before the two meet.
        spec = jax.sharding.PartitionSpec(cp.batch_axis, cp.axis_name)
        mesh = mesh_to_run_on(cp.mesh, k, g_atk, beta_atk, initial_A_state, cu_seqlens)
        on_mesh = jax.sharding.NamedSharding(mesh, spec)
        k_erase, a = jax.device_put(k_erase, on_mesh), jax.device_put(a, on_mesh)
    write_key = squash(k_erase, a, x=x, eps=eps, log_atk_scale=log_atk_scale)
    return write_key, a_final[..., 0, :], None if a_saved is None else a_saved[..., 0, :]


def cascade(
    main: AbstractDeltaRule,
    inputs: DeltaInputs,
    g_atk,
    beta_atk,
    *,
    initial_state,
    initial_A_state,
    x: float,
    eps: float,
    log_atk_scale: Center,
    stage: Stage,
    cp: ContextParallel | None = None,
    cu_seqlens: Any = None,
) -> tuple[Any, Array, Array, tuple[Array, Array] | None]:
    """Both stages: the preconditioner and the squash (`precondition`), then `main` writing
    along the keys it makes, each run by `stage` from its initial state, `main`'s products'
    policy resolved from the public inputs (`main`'s own hold the float32 write keys
    beside possibly bfloat16 ones). `inputs` without a write key; every argument checked by
    the caller.

    **Returns:**

    `(outputs, main's final state, the preconditioner's final state, checkpoints)`, the
    checkpoints `(main's, the preconditioner's (n, H, K))` if `stage` emits them, else
    `None`.
    """
    arrays = (inputs.q, inputs.k, inputs.v, g_atk, inputs.g, beta_atk, inputs.beta)
    precision = resolve_precision(main.precision, *arrays)
    write_key, a_final, a_saved = precondition(
        inputs.k,
        g_atk,
        beta_atk,
        dtype=accumulation_dtype(*arrays),
        use_qk_l2norm=main.use_qk_l2norm,
        initial_A_state=initial_A_state,
        chunk_size=main.chunk_size,
        precision=precision,
        x=x,
        eps=eps,
        log_atk_scale=log_atk_scale,
        stage=stage,
        cp=cp,
        cu_seqlens=cu_seqlens,
    )
    rule = dataclasses.replace(main, precision=precision)
    inputs = dataclasses.replace(inputs, write_key=write_key)
    o, h, h_saved = stage(rule, inputs, initial_state)
    saved = None if h_saved is None or a_saved is None else (h_saved, a_saved)
    return o, h, a_final, saved


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
