"""RMSNorms: the plain one of Kimi Linear's latent attention, the gated ones of the Gated
DeltaNet and Kimi Delta Attention layers, and the zero-centred one of Qwen3.5; the group
norm per head of RWKV-7."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._dtype import param_dtype
from .._precision import accumulation_dtype


def _normalise(x: Array, eps: float) -> Array:
    """`x / rms(x)` over the last axis, in float32 (float64 for float64 `x`)."""
    h = x.astype(accumulation_dtype(x))
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)


class RMSNorm(eqx.Module):
    r"""RMSNorm over the last axis: $w \, x / \mathrm{rms}(x)$.

    The normalisation runs in float32 (float64 for float64 inputs) and is rounded to `x`'s
    dtype before the weight multiplies it, as Kimi Linear's `KimiLinearRMSNorm` (Llama's
    `LlamaRMSNorm`) does; the result has `x`'s dtype. Weight initialised to ones.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None):
        """**Arguments:**

        - `dim`: the size of the normalised (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        dtype = param_dtype(dtype)
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: the values to normalise over the last axis.

        **Returns:**

        An array of `x`'s shape and dtype.
        """
        h = _normalise(x, self.eps).astype(x.dtype)
        w = self.weight.reshape((1,) * (h.ndim - 1) + self.weight.shape)
        wt = jnp.promote_types(w.dtype, x.dtype)
        return (w.astype(wt) * h.astype(wt)).astype(x.dtype)


class GatedRMSNorm(eqx.Module):
    r"""RMSNorm over the last axis, then a SiLU gate: $w \, \mathrm{rms}(x) \, \mathrm{silu}(z)$.

    The normalisation and the gate run in float32 (float64 for float64 inputs); the result
    has `x`'s dtype. This is `Qwen3NextRMSNormGated` (weight initialised to ones, no `1 +`
    offset).
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None):
        """**Arguments:**

        - `dim`: the size of the normalised (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        dtype = param_dtype(dtype)
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(
        self, x: Float[Array, "*batch dim"], gate: Float[Array, "*batch dim"]
    ) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: the values to normalise over the last axis.
        - `gate`: the gate, same shape as `x`.

        **Returns:**

        An array of `x`'s shape and dtype.
        """
        dtype = x.dtype
        ct = accumulation_dtype(dtype)
        h = _normalise(x, self.eps)
        w = self.weight.reshape((1,) * (h.ndim - 1) + self.weight.shape)
        # The reference rounds to x's dtype before the weight, then gates in float32 (torch
        # promotes each product; here the casts are explicit).
        wt = jnp.promote_types(w.dtype, dtype)
        h = w.astype(wt) * h.astype(dtype).astype(wt)
        h = h.astype(ct) * jax.nn.silu(gate.astype(ct))
        return h.astype(dtype)


class SigmoidGatedRMSNorm(eqx.Module):
    r"""RMSNorm over the last axis, then a sigmoid gate: $w \, \mathrm{rms}(x) \, \sigma(z)$.

    Everything runs in float32 (float64 for float64 inputs), the weight included, and the
    result has `x`'s dtype. This is Kimi Linear's output norm, `KimiLinearRMSNormGated`
    (flash-linear-attention's `FusedRMSNormGated` with `activation="sigmoid"`; weight
    initialised to ones).
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=None):
        """**Arguments:**

        - `dim`: the size of the normalised (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        dtype = param_dtype(dtype)
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(
        self, x: Float[Array, "*batch dim"], gate: Float[Array, "*batch dim"]
    ) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: the values to normalise over the last axis.
        - `gate`: the gate, same shape as `x`.

        **Returns:**

        An array of `x`'s shape and dtype.
        """
        h = _normalise(x, self.eps)
        w = self.weight.astype(h.dtype).reshape((1,) * (h.ndim - 1) + self.weight.shape)
        return (w * h * jax.nn.sigmoid(gate.astype(h.dtype))).astype(x.dtype)


class ZeroCenteredRMSNorm(eqx.Module):
    r"""RMSNorm with a zero-centred weight: $x / \mathrm{rms}(x) \cdot (1 + w)$.

    The convention of Qwen3.5 (`Qwen3_5RMSNorm`, and Gemma's): the weight is initialised to
    zeros, so the initial norm scales by one. Normalisation and scaling run in float32
    (float64 for float64 inputs) and the result is cast back to `x`'s dtype.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None):
        """**Arguments:**

        - `dim`: the size of the normalised (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.
        """
        dtype = param_dtype(dtype)
        self.weight = jnp.zeros((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: the values to normalise over the last axis.

        **Returns:**

        An array of `x`'s shape and dtype.
        """
        ct = accumulation_dtype(x)
        h = _normalise(x, self.eps)
        w = (1 + self.weight.astype(ct)).reshape((1,) * (h.ndim - 1) + self.weight.shape)
        return (h * w).astype(x.dtype)


class GroupNorm(eqx.Module):
    r"""Group normalisation over the last axis: its `dim` features in `num_groups` equal
    groups, each standardised on its own, then a weight and a bias per feature:
    $(x - \mu_g) / \sqrt{\sigma_g^2 + \epsilon} \cdot w + b$ (biased variance).

    On `(..., heads * V)` with `num_groups = heads` this is a LayerNorm per head, RWKV-7's
    output norm (`torch.nn.GroupNorm(heads, heads * V)` on one token per row, as
    flash-linear-attention's `RWKV7Attention` applies it; weight ones and bias zeros at
    initialisation). The statistics and the affine map run in float32 (float64 for float64
    inputs); the result has `x`'s dtype.
    """

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    num_groups: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, num_groups: int, dim: int, *, eps: float = 1e-5, dtype=None):
        """**Arguments:**

        - `num_groups`: the number of groups; it must divide `dim`.
        - `dim`: the size of the normalised (last) axis.
        - `eps`: added to each group's variance before the reciprocal square root.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `ValueError` if `num_groups` does not divide `dim`.
        """
        if dim % num_groups:
            raise ValueError(f"`num_groups` ({num_groups}) must divide `dim` ({dim}).")
        dtype = param_dtype(dtype)
        self.weight = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype)
        self.num_groups = num_groups
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: the values to normalise, in groups along the last axis.

        **Returns:**

        An array of `x`'s shape and dtype.
        """
        ct = accumulation_dtype(x)
        shape = x.shape
        h = x.astype(ct).reshape(*shape[:-1], self.num_groups, -1)
        h = h - jnp.mean(h, axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        lead = (1,) * (len(shape) - 1)
        w, b = (p.astype(ct).reshape(lead + p.shape) for p in (self.weight, self.bias))
        return (h.reshape(shape) * w + b).astype(x.dtype)
