"""The per-token MLPs of the models: the gated SwiGLU MLP of Llama / Qwen."""

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray


class SwiGLU(eqx.Module):
    """The gated MLP of Llama / Qwen: `down(silu(gate(x)) * up(x))`, on one token."""

    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, hidden_size: int, intermediate_size: int, *, key: PRNGKeyArray, dtype=None):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `intermediate_size`: the width of the hidden layer.
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        kg, ku, kd = jr.split(key, 3)
        self.gate_proj = eqx.nn.Linear(
            hidden_size, intermediate_size, use_bias=False, key=kg, dtype=dtype
        )
        self.up_proj = eqx.nn.Linear(
            hidden_size, intermediate_size, use_bias=False, key=ku, dtype=dtype
        )
        self.down_proj = eqx.nn.Linear(
            intermediate_size, hidden_size, use_bias=False, key=kd, dtype=dtype
        )

    def __call__(self, x: Float[Array, " hidden"]) -> Float[Array, " hidden"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
