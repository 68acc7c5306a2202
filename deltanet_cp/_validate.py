"""Checks at the library's boundary: each raises a `TypeError` or a `ValueError` that names
the argument and says what to pass instead, where the computation would otherwise fail deep
inside (an `AttributeError`, a `ZeroDivisionError`) or silently do something else.
"""

import math
import operator
from typing import Any, SupportsFloat, SupportsIndex

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer


def as_index(value: Any, name: str) -> int:
    """`value` as a Python `int`: an `int`, a NumPy integer, a concrete 0-d integer array.

    **Arguments:**

    - `value`: the value to convert.
    - `name`: the argument's name, for the error message.

    **Returns:**

    `operator.index(value)`.

    **Raises:**

    `TypeError` naming `name` for a bool, a float (even an integral one), a string or a
    traced value.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be an int; got the bool {value!r}.")
    try:
        return operator.index(value)
    except jax.errors.TracerIntegerConversionError:
        raise TypeError(
            f"`{name}` must be a Python int known when tracing; got a traced value. Pass it as "
            "a static argument (`static_argnums`, or close over it) instead of a jit argument."
        ) from None
    except TypeError:
        raise TypeError(
            f"`{name}` must be an int (or a NumPy integer); got {value!r} of type "
            f"{type(value).__name__}. Pass `{name}=int(...)` if the value is integral."
        ) from None


def as_positive_index(value: Any, name: str) -> int:
    """`value` as a Python `int` of at least 1: the library's one rule for a count or a size.

    Accepts what `as_index` accepts (an `int`, a NumPy integer, a concrete 0-d integer
    array) and refuses the same: `TypeError` naming `name` for a bool, a float (even an
    integral one), a string or a traced value; then `ValueError` naming `name` for a value
    below 1.
    """
    index = as_index(value, name)
    if index < 1:
        raise ValueError(f"`{name}` must be a positive int; got {index}.")
    return index


def as_chunk_size(value: SupportsIndex) -> int:
    """The converter of a recurrence's `chunk_size` field: `as_positive_index` (so
    `np.int64(64)` is accepted and `0` refused)."""
    return as_positive_index(value, "chunk_size")


def as_config_int(name: str, value: Any) -> int:
    """A positive int field of a model config: `as_positive_index`'s rule, each refusal a
    `ValueError` naming the field (the config is a value read from a file)."""
    try:
        return as_positive_index(value, name)
    except (TypeError, ValueError) as error:
        raise ValueError(f"The config's {error}") from None


def as_config_float(name: str, value: Any) -> float:
    """A finite float field of a model config: a float or an int, never a bool or a string;
    a `ValueError` naming the field otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            f"The config's `{name}` must be a number; got {value!r} of type {type(value).__name__}."
        )
    if not math.isfinite(value):
        raise ValueError(f"The config's `{name}` must be finite; got {value!r}.")
    return float(value)


def as_flag(value: Any, name: str) -> bool:
    """`value` as a Python `bool`: a Python or NumPy bool only (a string such as `"no"`
    would otherwise read as true); a `ValueError` naming `name` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False; got {value!r}.")


def as_l2norm_flag(value: Any) -> bool:
    """The converter of a recurrence's `use_qk_l2norm` field: `as_flag`."""
    return as_flag(
        value,
        "`use_qk_l2norm` (`use_qk_l2norm_in_kernel` in the flash-linear-attention adapters)",
    )


def as_scale(value: SupportsFloat | None) -> float | None:
    """The converter of a recurrence's `scale` field: a finite Python `float`, or `None`.

    A recurrence is a static configuration (hashed to find its compiled program), so its
    query scale is a Python number: a NumPy scalar or a concrete 0-d array is converted,
    and a traced value is refused with the way round it. The outputs are linear in the
    scale (it multiplies `q`, which enters only the outputs) and the final state does not
    depend on it, so `scale=1.0` followed by `o * scale` is the same computation.
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"`scale` must be a float or None; got {value!r}.")
    try:
        scale = float(value)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            "`scale` must be a Python float known when tracing (it is part of the static "
            "configuration); got a traced value. The outputs are linear in the scale and the "
            "final state does not depend on it: pass `scale=1.0` and multiply the outputs by "
            "your traced scale."
        ) from None
    except (TypeError, ValueError):
        raise TypeError(
            f"`scale` must be a float or None (a number or a 0-d array); got {value!r} of "
            f"type {type(value).__name__}."
        ) from None
    if not math.isfinite(scale):
        raise ValueError(f"`scale` must be finite; got {scale}.")
    return scale


@jax.jit
def _finite_extremes(x: jax.Array) -> jax.Array:
    """The smallest and the largest finite value of `x` (`inf` and `-inf` if none)."""
    finite = jnp.isfinite(x)
    return jnp.stack(
        [jnp.min(jnp.where(finite, x, jnp.inf)), jnp.max(jnp.where(finite, x, -jnp.inf))]
    )


def check_range(
    x: Any, name: str, where: str, *, low: float | None = None, high: float | None = None, hint: str
) -> None:
    """A `ValueError` from `where` naming `name` if a finite value of `x` is below `low` or
    above `high`, with `hint` (what the argument is and how to make it).

    Only where the values are known now: an array that is concrete (outside `jax.jit`,
    `grad`, `vmap` and `shard_map`: not a tracer), floating and not empty. A traced one is
    not checked (an `eqx.error_if` would add a callback to every compiled call). Non-finite
    values are left to the library's rule for them (they make the outputs non-finite from
    their token on). The cost, eagerly: one small reduction, compiled once per shape and
    dtype, and a wait for `x` to be computed (two numbers back to the host).
    """
    if x is None or isinstance(x, Tracer):
        return
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or math.prod(x.shape) == 0:
        return
    with jax.ensure_compile_time_eval():  # a concrete array closed over by a trace: now
        extremes = _finite_extremes(x)
    smallest, largest = (float(v) for v in np.asarray(extremes))
    if (low is not None and smallest < low) or (high is not None and largest > high):
        if low is None:
            bounds = f"<= {high:g}"
        elif high is None:
            bounds = f">= {low:g}"
        else:
            bounds = f"in [{low:g}, {high:g}]"
        raise ValueError(
            f"{where}: `{name}` must be {bounds} ({hint}); got values from {smallest:g} to "
            f"{largest:g}."
        )


LOG_DECAY_HINT = (
    "log decays: the state is multiplied by exp(g) <= 1 per token; make them with "
    "`jax.nn.log_sigmoid(x)` or `-jax.nn.softplus(x)`"
)


def check_log_decay(x: Any, name: str, where: str) -> None:
    """`check_range` for log decays: every finite value `<= 0`."""
    check_range(x, name, where, high=0.0, hint=LOG_DECAY_HINT)


STEP_SIZE_HINT = (
    "step sizes: with unit keys each update's eigenvalue 1 - beta stays in [-1, 1]; make "
    "them with `jax.nn.sigmoid(x)`, or `2 * jax.nn.sigmoid(x)` for negative eigenvalues"
)


def check_step_sizes(x: Any, name: str, where: str) -> None:
    """`check_range` for a delta rule's step sizes: every finite value in `[0, 2]`."""
    check_range(x, name, where, low=0.0, high=2.0, hint=STEP_SIZE_HINT)
