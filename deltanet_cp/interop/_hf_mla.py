"""Hugging Face `transformers` weights for [`deltanet_cp.nn.MultiHeadLatentAttention`][],
Kimi Linear's full attention layer (safetensors only)."""

import os
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.random as jr
import numpy as np

from .._precision import PrecisionName
from .._validate import as_config_int
from ..nn import MultiHeadLatentAttention
from ._checkpoint import (
    check_dtype,
    check_unexpected,
    config_value,
    find_prefix,
    layer_tensors,
    open_weights,
    text_config,
)


_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_PLAIN_Q = ("q_proj.weight",)
_LORA_Q = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
_KV = (
    "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
)
_BIASES = ("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias")


def multi_head_latent_attention_from_hf(
    config: Any,
    weights: Mapping[str, Any] | str | os.PathLike,
    *,
    prefix: str | None = None,
    tile_size: int = 128,
    precision: PrecisionName | None = None,
    dtype=None,
) -> MultiHeadLatentAttention:
    """Build a [`deltanet_cp.nn.MultiHeadLatentAttention`][] from Kimi Linear weights
    (transformers' `KimiLinearAttention`; Moonshot's checkpoint names its tensors the same).

    **Arguments:**

    - `config`: a mapping (or an object with attributes, such as a transformers config)
        with transformers' field names: `hidden_size`, `num_attention_heads`,
        `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, and
        optionally `q_lora_rank` (default `None`: one `q_proj`), `attention_bias` (default
        `False`) and `num_key_value_heads` (if given, equal to `num_attention_heads`: the
        latent expands to every head).
    - `weights`: a mapping from tensor names to arrays (numpy or JAX), or the path of a
        `.safetensors` file, of a directory of them, or of a sharded checkpoint's
        `model.safetensors.index.json`, as for
        [`deltanet_cp.interop.gated_delta_net_from_hf`][].
    - `prefix`: the prefix of this layer's tensor names, e.g.
        `"model.layers.3.self_attn."`. If `None`, the one prefix in front of a
        `kv_a_proj_with_mqa.weight` tensor (possibly empty); it is an error if there are
        several.
    - `tile_size`, `precision`: the layer's (see
        [`deltanet_cp.nn.MultiHeadLatentAttention`][]).
    - `dtype`: cast every parameter to this floating-point dtype; keep each tensor's
        dtype if `None`.

    **Returns:**

    A [`deltanet_cp.nn.MultiHeadLatentAttention`][] computing what transformers'
    `KimiLinearAttention` computes (its RMSNorms' epsilon is transformers' fixed `1e-6`).

    **Raises:**

    `ValueError` naming the tensor if one is missing, misshapen, not floating-point or
    unexpected; naming the configuration field if one is missing, unsupported or not an
    integer; or naming `dtype` if it is not a floating-point dtype.
    """
    config = text_config(config)
    for field in _SIZES:
        if config_value(config, field) is None:
            raise ValueError(f"The config is missing `{field}` (Kimi Linear's attention).")
    hidden, h, r, dn, dr, dv = (as_config_int(f, config_value(config, f)) for f in _SIZES)
    kv_heads = config_value(config, "num_key_value_heads")
    if kv_heads is not None and as_config_int("num_key_value_heads", kv_heads) != h:
        raise ValueError(
            f"The config's `num_key_value_heads` ({kv_heads}) must equal "
            f"`num_attention_heads` ({h}): the latent expands to every head."
        )
    q_lora = config_value(config, "q_lora_rank")
    q_lora = None if q_lora is None else as_config_int("q_lora_rank", q_lora)
    bias = config_value(config, "attention_bias", False)
    if not isinstance(bias, (bool, np.bool_)):
        raise ValueError(f"The config's `attention_bias` must be a bool; got {bias!r}.")
    bias = bool(bias)
    check_dtype(dtype)

    checkpoint = open_weights(weights)
    prefix = find_prefix(
        checkpoint, prefix, ("kv_a_proj_with_mqa.weight",), "multi-head latent attention"
    )
    names = (_PLAIN_Q if q_lora is None else _LORA_Q) + _KV
    if bias:
        names += _BIASES if q_lora is not None else _BIASES[1:]
    check_unexpected(checkpoint, prefix, names, "multi-head latent attention")
    dq = dn + dr
    expected = {
        "q_proj.weight": ((h * dq, hidden),),
        "q_a_proj.weight": ((q_lora, hidden),),
        "q_a_proj.bias": ((q_lora,),),
        "q_a_layernorm.weight": ((q_lora,),),
        "q_b_proj.weight": ((h * dq, q_lora),),
        "kv_a_proj_with_mqa.weight": ((r + dr, hidden),),
        "kv_a_proj_with_mqa.bias": ((r + dr,),),
        "kv_a_layernorm.weight": ((r,),),
        "kv_b_proj.weight": ((h * (dn + dv), r),),
        "o_proj.weight": ((hidden, h * dv),),
        "o_proj.bias": ((hidden,),),
    }
    layout = "q_lora_rank" if q_lora is not None else "no q_lora_rank"
    layout += ", attention_bias" if bias else ""
    sizes = (
        f"hidden_size={hidden}, heads={h}, kv_lora_rank={r}, qk_nope_head_dim={dn}, "
        f"qk_rope_head_dim={dr}, v_head_dim={dv}, q_lora_rank={q_lora}"
    )
    tensors = layer_tensors(checkpoint, prefix, names, expected, layout, sizes, dtype)

    skeleton = eqx.filter_eval_shape(
        MultiHeadLatentAttention,
        hidden,
        h,
        kv_lora_rank=r,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=dv,
        q_lora_rank=q_lora,
        attention_bias=bias,
        tile_size=tile_size,
        precision=precision,
        key=jr.key(0),
    )
    where = {
        "q_proj.weight": lambda m: m.q_proj.weight,
        "q_a_proj.weight": lambda m: m.q_a_proj.weight,
        "q_a_proj.bias": lambda m: m.q_a_proj.bias,
        "q_a_layernorm.weight": lambda m: m.q_a_layernorm.weight,
        "q_b_proj.weight": lambda m: m.q_b_proj.weight,
        "kv_a_proj_with_mqa.weight": lambda m: m.kv_a_proj_with_mqa.weight,
        "kv_a_proj_with_mqa.bias": lambda m: m.kv_a_proj_with_mqa.bias,
        "kv_a_layernorm.weight": lambda m: m.kv_a_layernorm.weight,
        "kv_b_proj.weight": lambda m: m.kv_b_proj.weight,
        "o_proj.weight": lambda m: m.o_proj.weight,
        "o_proj.bias": lambda m: m.o_proj.bias,
    }
    return eqx.tree_at(
        lambda m: [where[n](m) for n in names], skeleton, [tensors[n] for n in names]
    )


def multi_head_latent_attention_to_hf(
    layer: MultiHeadLatentAttention, *, prefix: str = ""
) -> dict[str, np.ndarray]:
    """The inverse of [`deltanet_cp.interop.multi_head_latent_attention_from_hf`][]:
    transformers' `KimiLinearAttention` weights for `layer`.

    **Arguments:**

    - `layer`: the layer to export.
    - `prefix`: put in front of every name, e.g. `"model.layers.3.self_attn."`.

    **Returns:**

    A dict from tensor names to numpy arrays (in the parameters' dtypes), ready for
    `safetensors.numpy.save_file`: `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`),
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`, and the biases the
    layer has.
    """
    modules = {
        "q_proj": layer.q_proj,
        "q_a_proj": layer.q_a_proj,
        "q_a_layernorm": layer.q_a_layernorm,
        "q_b_proj": layer.q_b_proj,
        "kv_a_proj_with_mqa": layer.kv_a_proj_with_mqa,
        "kv_a_layernorm": layer.kv_a_layernorm,
        "kv_b_proj": layer.kv_b_proj,
        "o_proj": layer.o_proj,
    }
    out: dict[str, np.ndarray] = {}
    for name, module in modules.items():
        if module is None:
            continue
        out[f"{name}.weight"] = np.asarray(module.weight)
        bias = getattr(module, "bias", None)
        if bias is not None:
            out[f"{name}.bias"] = np.asarray(bias)
    return {prefix + name: np.ascontiguousarray(x) for name, x in out.items()}
