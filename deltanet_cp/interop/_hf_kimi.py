"""Hugging Face `transformers` weights for [`deltanet_cp.nn.KimiDeltaAttention`][]
(safetensors only)."""

import os
from collections.abc import Mapping
from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._run import Memory
from .._validate import as_config_int
from ..nn._kimi_delta_attention import KimiDeltaAttention
from ._checkpoint import (
    check_dtype,
    check_unexpected,
    config_float,
    config_value,
    find_prefix,
    layer_tensors,
    open_weights,
    text_config,
)


# transformers' `KimiLinearDeltaAttention` and Moonshot's checkpoint (`KimiDeltaAttention` of
# its remote code), which transformers converts on loading.
_TRANSFORMERS = (
    "conv1d.weight",
    "forget_gate.f_a_proj.weight",
    "forget_gate.f_b_proj.weight",
    "forget_gate.dt_bias",
    "forget_gate.A_log",
)
_MOONSHOT = (
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
    "f_a_proj.weight",
    "f_b_proj.weight",
    "dt_bias",
    "A_log",
)
_COMMON = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "b_proj.weight",
    "g_a_proj.weight",
    "g_b_proj.weight",
    "o_norm.weight",
    "o_proj.weight",
)
# transformers' config field, and the field of the checkpoint's `linear_attn_config`.
_FIELDS = (
    ("linear_num_heads", "num_heads"),
    ("linear_head_dim", "head_dim"),
    ("linear_conv_kernel_dim", "short_conv_kernel_size"),
)


def _kimi_config_int(config: Any, field: str, nested: str) -> int:
    """A field of transformers' config, or of the checkpoint's `linear_attn_config`."""
    value = config_value(config, field)
    if value is None:
        linear = config_value(config, "linear_attn_config") or {}
        value = config_value(linear, nested)
        if value is not None:
            field = f"linear_attn_config.{nested}"
    if value is None:
        if field == "linear_conv_kernel_dim":
            return 4
        raise ValueError(
            f"The config is missing `{field}` (or `linear_attn_config.{nested}`, as in "
            "Moonshot's config.json)."
        )
    return as_config_int(field, value)


def kimi_delta_attention_from_hf(
    config: Any,
    weights: Mapping[str, Any] | str | os.PathLike,
    *,
    prefix: str | None = None,
    chunk_size: int = 64,
    block_size: int | None = None,
    memory: Memory | None = None,
    dtype=None,
) -> KimiDeltaAttention:
    """Build a [`deltanet_cp.nn.KimiDeltaAttention`][] from Kimi Linear weights.

    Both layouts load exactly: transformers' `KimiLinearDeltaAttention` (one stacked
    `conv1d`, the gate under `forget_gate.`) and Moonshot's checkpoint (`q_conv1d`,
    `k_conv1d`, `v_conv1d`, `f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` beside the
    projections), with `q_proj`, `k_proj`, `v_proj`, `b_proj`, `g_a_proj`, `g_b_proj`,
    `o_norm` and `o_proj`.

    **Arguments:**

    - `config`: a mapping (or an object with attributes, such as a transformers config)
        with transformers' field names: `hidden_size`, `linear_num_heads`,
        `linear_head_dim`, and optionally `linear_conv_kernel_dim` (default 4),
        `rms_norm_eps` (default `1e-5`) and `hidden_act` (must be `"silu"`). Moonshot's
        `config.json`, with `num_heads`, `head_dim` and `short_conv_kernel_size` in a
        nested `linear_attn_config`, works too.
    - `weights`: a mapping from tensor names to arrays (numpy or JAX), or the path of a
        `.safetensors` file, of a directory of them, or of a sharded checkpoint's
        `model.safetensors.index.json`, as for
        [`deltanet_cp.interop.gated_delta_net_from_hf`][].
    - `prefix`: the prefix of this layer's tensor names, e.g.
        `"model.layers.0.self_attn."`. If `None`, the one prefix in front of an `A_log`
        tensor (possibly empty); it is an error if there are several.
    - `chunk_size`: the layer's chunk size for the delta rule.
    - `block_size`: the layer's engine block; `None` takes
        [`deltanet_cp.default_block_size`][].
    - `memory`: what the engine keeps for the backward, `"low"` (`None`, the
        default) or `"high"` (the `memory` of [`deltanet_cp.run`][]).
    - `dtype`: cast every parameter to this floating-point dtype; keep each tensor's
        dtype if `None`.

    **Returns:**

    A [`deltanet_cp.nn.KimiDeltaAttention`][] computing what transformers'
    `KimiLinearDeltaAttention` computes.

    **Raises:**

    `ValueError` naming the tensor if one is missing, misshapen, not floating-point,
    unexpected, or in two files with different values; naming the configuration field if
    one is missing, unsupported or not an integer; or naming `dtype` if it is not a
    floating-point dtype.
    """
    config = text_config(config)
    if config_value(config, "hidden_size") is None:
        raise ValueError("The config is missing `hidden_size`.")
    hidden = as_config_int("hidden_size", config_value(config, "hidden_size"))
    h, dk, width = (_kimi_config_int(config, *names) for names in _FIELDS)
    act = config_value(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"Only `hidden_act='silu'` is supported for the convolution; the config has {act!r}."
        )
    eps = config_float(config, "rms_norm_eps", 1e-5)
    check_dtype(dtype)

    checkpoint = open_weights(weights)
    prefix = find_prefix(checkpoint, prefix, ("forget_gate.A_log", "A_log"), "Kimi Delta Attention")
    check_unexpected(
        checkpoint, prefix, _TRANSFORMERS + _MOONSHOT + _COMMON, "Kimi Delta Attention"
    )
    if prefix + "forget_gate.A_log" in checkpoint or prefix + "conv1d.weight" in checkpoint:
        layout, names = "transformers", _TRANSFORMERS + _COMMON
    else:
        layout, names = "Moonshot", _MOONSHOT + _COMMON
    wide = h * dk
    a_log = ((1, 1, h, 1), (h,))
    expected = {
        "conv1d.weight": ((3 * wide, 1, width),),
        "A_log": a_log,
        "dt_bias": ((wide,),),
        "f_a_proj.weight": ((dk, hidden),),
        "f_b_proj.weight": ((wide, dk),),
        "b_proj.weight": ((h, hidden),),
        "g_a_proj.weight": ((dk, hidden),),
        "g_b_proj.weight": ((wide, dk),),
        "o_norm.weight": ((dk,),),
        "o_proj.weight": ((hidden, wide),),
    }
    for x in "qkv":
        expected[f"{x}_proj.weight"] = ((wide, hidden),)
        expected[f"{x}_conv1d.weight"] = ((wide, 1, width),)
    expected |= {f"forget_gate.{n}": expected[n] for n in _MOONSHOT[3:]}
    sizes = f"hidden_size={hidden}, H={h}, K={dk}, conv kernel {width}"
    tensors = layer_tensors(checkpoint, prefix, names, expected, layout, sizes, dtype)
    if layout == "transformers":
        tensors |= {n: tensors[f"forget_gate.{n}"] for n in _MOONSHOT[3:]}
        conv = tensors["conv1d.weight"]
    else:
        conv = jnp.concatenate([tensors[f"{x}_conv1d.weight"] for x in "qkv"])

    skeleton = eqx.filter_eval_shape(
        KimiDeltaAttention,
        hidden,
        h,
        dk,
        conv_kernel_size=width,
        norm_eps=eps,
        chunk_size=chunk_size,
        block_size=block_size,
        memory=memory,
        key=jr.key(0),
    )
    qkv = jnp.concatenate([tensors[f"{x}_proj.weight"] for x in "qkv"])
    leaves = [
        (lambda m: m.in_proj_qkv.weight, qkv),
        (lambda m: m.conv1d.weight, conv[:, 0, :]),
        (lambda m: m.f_a_proj.weight, tensors["f_a_proj.weight"]),
        (lambda m: m.f_b_proj.weight, tensors["f_b_proj.weight"]),
        (lambda m: m.A_log, tensors["A_log"].reshape(h)),
        (lambda m: m.dt_bias, tensors["dt_bias"].reshape(h, dk)),
        (lambda m: m.b_proj.weight, tensors["b_proj.weight"]),
        (lambda m: m.g_a_proj.weight, tensors["g_a_proj.weight"]),
        (lambda m: m.g_b_proj.weight, tensors["g_b_proj.weight"]),
        (lambda m: m.norm.weight, tensors["o_norm.weight"]),
        (lambda m: m.out_proj.weight, tensors["o_proj.weight"]),
    ]
    return eqx.tree_at(lambda m: [get(m) for get, _ in leaves], skeleton, [x for _, x in leaves])


def kimi_delta_attention_to_hf(
    layer: KimiDeltaAttention,
    *,
    layout: Literal["transformers", "moonshot"] = "transformers",
    prefix: str = "",
) -> dict[str, np.ndarray]:
    """The inverse of [`deltanet_cp.interop.kimi_delta_attention_from_hf`][]: Kimi Linear
    weights for `layer`.

    **Arguments:**

    - `layer`: the layer to export.
    - `layout`: `"transformers"` (transformers' `KimiLinearDeltaAttention`: one stacked
        `conv1d`, the gate under `forget_gate.`) or `"moonshot"` (Moonshot's checkpoint:
        `q_conv1d`, `k_conv1d`, `v_conv1d`, and `f_a_proj`, `f_b_proj`, `dt_bias`, `A_log`
        beside the projections).
    - `prefix`: put in front of every name, e.g. `"model.layers.0.self_attn."`.

    **Returns:**

    A dict from tensor names to numpy arrays (in the parameters' dtypes), ready for
    `safetensors.numpy.save_file`: `A_log` as `(1, 1, H, 1)` and `dt_bias` as `(H * K,)`,
    the shapes both layouts store.
    """
    if layout not in ("transformers", "moonshot"):
        raise ValueError(f"`layout` must be 'transformers' or 'moonshot'; got {layout!r}.")
    h, wide = layer.num_heads, layer.num_heads * layer.head_dim
    qkv = np.asarray(layer.in_proj_qkv.weight)
    conv = np.asarray(layer.conv1d.weight)[:, None, :]
    out: dict[str, np.ndarray] = {
        f"{x}_proj.weight": qkv[i * wide : (i + 1) * wide] for i, x in enumerate("qkv")
    }
    gate = {
        "f_a_proj.weight": np.asarray(layer.f_a_proj.weight),
        "f_b_proj.weight": np.asarray(layer.f_b_proj.weight),
        "dt_bias": np.asarray(layer.dt_bias).reshape(wide),
        "A_log": np.asarray(layer.A_log).reshape(1, 1, h, 1),
    }
    if layout == "transformers":
        out["conv1d.weight"] = conv
        out |= {f"forget_gate.{n}": x for n, x in gate.items()}
    else:
        out |= {f"{x}_conv1d.weight": conv[i * wide : (i + 1) * wide] for i, x in enumerate("qkv")}
        out |= gate
    out["b_proj.weight"] = np.asarray(layer.b_proj.weight)
    out["g_a_proj.weight"] = np.asarray(layer.g_a_proj.weight)
    out["g_b_proj.weight"] = np.asarray(layer.g_b_proj.weight)
    out["o_norm.weight"] = np.asarray(layer.norm.weight)
    out["o_proj.weight"] = np.asarray(layer.out_proj.weight)
    return {prefix + name: np.ascontiguousarray(x) for name, x in out.items()}
