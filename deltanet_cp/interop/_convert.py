"""What every adapter does around the engine: one call of [`deltanet_cp.run`][], and the
other library's conventions for what goes in and what comes back.

An adapter builds the recurrence's configuration and its inputs from its own arguments and
hands them to `call`; the conventions shared by the adapters (the state's `(V, K)` order,
the final state only when asked for, the outputs' dtype, FLA's default `beta`) live here.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .._custom_types import CuSeqlens, GateTensor, ValueTensor
from .._parallel import ContextParallel
from .._recurrence import AbstractRecurrence
from .._run import run
from .._validate import as_flag


# A state `(N, HV, K, V)`, or `(N, HV, V, K)` with FLA's `state_v_first=True`.
FLAStates = Float[Array, "batch_or_docs vheads _ _"]


def call(
    config: AbstractRecurrence,
    inputs: PyTree,
    initial_state: Array | None,
    cu_seqlens: CuSeqlens | None,
    cp: ContextParallel | None,
    output_final_state: bool,
    state_v_first: bool = False,
    *,
    dtype: jnp.dtype | None = None,
) -> tuple[ValueTensor, Array | None]:
    """[`deltanet_cp.run`][] with another library's conventions.

    The adapters pass their own arguments of the same names, in this order.

    **Arguments:**

    - `config`, `inputs`, `initial_state`, `cu_seqlens`, `cp`: as `recurrence`, `inputs`,
        ... in [`deltanet_cp.run`][]; `initial_state` is `(..., V, K)` with `state_v_first`.
    - `output_final_state`: return the final state; `None` in its place otherwise.
    - `state_v_first`: the initial and final states are `(..., V, K)` (FLA's option).
    - `dtype`: the outputs' dtype; the recurrence's own if `None`.

    **Returns:**

    `(o, final_state)`, the final state `None` unless `output_final_state`.
    """
    output_final_state = as_flag(output_final_state, "`output_final_state`")
    state_v_first = as_flag(state_v_first, "`state_v_first`")
    if initial_state is not None and state_v_first:
        initial_state = jnp.swapaxes(initial_state, -1, -2)
    o, h = run(config, inputs, initial_state=initial_state, cu_seqlens=cu_seqlens, cp=cp)
    if dtype is not None:
        o = o.astype(dtype)
    if not output_final_state:
        return o, None
    return o, (jnp.swapaxes(h, -1, -2) if state_v_first else h)


def ones_if_none(beta: GateTensor | None, v: ValueTensor) -> GateTensor:
    """FLA's default step size of the fused recurrent delta rules: ones, `(B, T, HV)`."""
    return jnp.ones(v.shape[:3], v.dtype) if beta is None else beta
