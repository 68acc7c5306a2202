"""The library's one default-dtype rule for parameters."""

from typing import Any

import jax.numpy as jnp


def param_dtype(dtype: Any = None) -> Any:
    """`dtype`, or the default floating dtype (float32, or float64 under `jax_enable_x64`)
    if it is `None`: the dtype of a layer's parameters built with `dtype=dtype`."""
    return jnp.zeros(()).dtype if dtype is None else dtype
