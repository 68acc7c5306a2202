"""Hugging Face `transformers` weights for [`deltanet_cp.nn.GatedDeltaNet`][] (safetensors only)."""

import os
from collections.abc import Mapping
from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._run import Memory
from ..nn._gated_delta_net import GatedDeltaNet
from ._checkpoint import (
    check_dtype,
    check_unexpected,
    config_float,
    config_int,
    config_value,
    find_prefix,
    layer_tensors,
    open_weights,
    text_config,
)


_QWEN3_NEXT = ("in_proj_qkvz.weight", "in_proj_ba.weight")
_QWEN3_5 = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_COMMON = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")
_ALL = _QWEN3_NEXT + _QWEN3_5 + _COMMON
_REQUIRED_CONFIG = (
    "hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def split_qwen3_next_projections(
    qkvz: Any, ba: Any, h: int, hv: int, dk: int, dv: int
) -> tuple[Any, Any, Any, Any]:
    """Qwen3-Next's fused projections as Qwen3.5's: `(in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a)` weights (`None` for those of an absent input).

    Qwen3-Next groups the rows per key head: `in_proj_qkvz` is `[q (K) | k (K) | v (r V) |
    z (r V)]` per head and `in_proj_ba` `[b (r) | a (r)]`, with `r = HV / H`.
    """
    r = hv // h
    qkv = z = b = a = None
    if qkvz is not None:
        hidden = qkvz.shape[-1]
        qkvz = jnp.asarray(qkvz).reshape(h, 2 * dk + 2 * r * dv, hidden)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        qkv = jnp.concatenate(
            [q.reshape(h * dk, hidden), k.reshape(h * dk, hidden), v.reshape(hv * dv, hidden)]
        )
        z = z.reshape(hv * dv, hidden)
    if ba is not None:
        hidden = ba.shape[-1]
        ba = jnp.asarray(ba).reshape(h, 2 * r, hidden)
        b, a = ba[:, :r].reshape(hv, hidden), ba[:, r:].reshape(hv, hidden)
    return qkv, z, b, a


def fuse_qwen3_next_projections(
    qkv: Any, z: Any, b: Any, a: Any, h: int, hv: int, dk: int, dv: int
) -> tuple[Any, Any]:
    """The inverse of `split_qwen3_next_projections`, in numpy: Qwen3.5's `in_proj_qkv`,
    `in_proj_z`, `in_proj_b`, `in_proj_a` weights as Qwen3-Next's fused `(in_proj_qkvz,
    in_proj_ba)` (`None` for a pair that is `None`)."""
    r = hv // h
    qkvz = ba = None
    if qkv is not None and z is not None:
        qkv, z = np.asarray(qkv), np.asarray(z)
        hidden = qkv.shape[-1]
        q = qkv[: h * dk].reshape(h, dk, hidden)
        k = qkv[h * dk : 2 * h * dk].reshape(h, dk, hidden)
        v = qkv[2 * h * dk :].reshape(h, r * dv, hidden)
        qkvz = np.concatenate([q, k, v, z.reshape(h, r * dv, hidden)], axis=1)
        qkvz = qkvz.reshape(-1, hidden)
    if b is not None and a is not None:
        b, a = np.asarray(b), np.asarray(a)
        hidden = b.shape[-1]
        ba = np.concatenate([b.reshape(h, r, hidden), a.reshape(h, r, hidden)], axis=1)
        ba = ba.reshape(2 * hv, hidden)
    return qkvz, ba


def gated_delta_net_from_hf(
    config: Any,
    weights: Mapping[str, Any] | str | os.PathLike,
    *,
    prefix: str | None = None,
    chunk_size: int = 64,
    block_size: int | None = None,
    memory: Memory | None = None,
    dtype=None,
) -> GatedDeltaNet:
    """Build a [`deltanet_cp.nn.GatedDeltaNet`][] from Hugging Face transformers weights.

    Both layouts load exactly: Qwen3-Next (`in_proj_qkvz`, `in_proj_ba`, grouped per key
    head) and Qwen3.5 (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), together with
    `conv1d.weight`, `A_log`, `dt_bias`, `norm.weight` and `out_proj.weight`.

    **Arguments:**

    - `config`: a mapping (or an object with attributes, such as a transformers config)
        with transformers' field names: `hidden_size`, `linear_num_key_heads`,
        `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`,
        `linear_conv_kernel_dim` and optionally `rms_norm_eps` (default `1e-6`) and
        `hidden_act` (must be `"silu"`). A Qwen3.5 config with a nested `text_config`
        works too.
    - `weights`: a mapping from tensor names to arrays (numpy or JAX), or the path of a
        `.safetensors` file, of a directory of them, or of a sharded checkpoint's
        `model.safetensors.index.json` (only the tensors of this layer are read).
        In a directory, the index says which file holds each tensor when it is present;
        without it every `.safetensors` file is read and a tensor in several files must be
        the same in all. Pickle-based checkpoints are refused.
    - `prefix`: the prefix of this layer's tensor names, e.g.
        `"model.layers.0.linear_attn."`. If `None`, the one prefix in front of an `A_log`
        tensor (possibly empty); it is an error if there are several.
    - `chunk_size`: the layer's chunk size for the gated delta rule.
    - `block_size`: the layer's engine block (see [`deltanet_cp.nn.GatedDeltaNet`][]);
        `None` takes [`deltanet_cp.default_block_size`][].
    - `memory`: what the engine keeps for the backward, `"low"` (`None`, the
        default) or `"high"` (the `memory` of [`deltanet_cp.run`][]).
    - `dtype`: cast every parameter to this floating-point dtype; keep each tensor's
        dtype if `None`.

    **Returns:**

    A [`deltanet_cp.nn.GatedDeltaNet`][] computing what transformers'
    `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet` compute (without a cache).

    **Raises:**

    `ValueError` naming the tensor if one is missing, misshapen, not floating-point,
    unexpected, or in two files with different values; naming the configuration field if
    one is missing, unsupported or not an integer; or naming `dtype` if it is not a
    floating-point dtype.
    """
    config = text_config(config)
    missing = [n for n in _REQUIRED_CONFIG if config_value(config, n) is None]
    if missing:
        raise ValueError(f"The config is missing {', '.join(f'`{n}`' for n in missing)}.")
    act = config_value(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"Only `hidden_act='silu'` is supported for the convolution; the config has {act!r}."
        )
    hidden = config_int(config, "hidden_size")
    h = config_int(config, "linear_num_key_heads")
    hv = config_int(config, "linear_num_value_heads")
    dk = config_int(config, "linear_key_head_dim")
    dv = config_int(config, "linear_value_head_dim")
    width = config_int(config, "linear_conv_kernel_dim")
    check_dtype(dtype)
    eps = config_float(config, "rms_norm_eps", 1e-6)
    if hv % h != 0:
        raise ValueError(
            f"`linear_num_value_heads` ({hv}) must be a multiple of `linear_num_key_heads` ({h})."
        )

    checkpoint = open_weights(weights)
    prefix = find_prefix(checkpoint, prefix)
    check_unexpected(checkpoint, prefix, _ALL, "Gated DeltaNet")
    if prefix + "in_proj_qkvz.weight" in checkpoint or prefix + "in_proj_ba.weight" in checkpoint:
        layout, layout_names = "Qwen3-Next", _QWEN3_NEXT
    else:
        layout, layout_names = "Qwen3.5", _QWEN3_5
    conv_dim = 2 * h * dk + hv * dv
    expected = {
        "in_proj_qkvz.weight": (2 * h * dk + 2 * hv * dv, hidden),
        "in_proj_ba.weight": (2 * hv, hidden),
        "in_proj_qkv.weight": (conv_dim, hidden),
        "in_proj_z.weight": (hv * dv, hidden),
        "in_proj_b.weight": (hv, hidden),
        "in_proj_a.weight": (hv, hidden),
        "conv1d.weight": (conv_dim, 1, width),
        "A_log": (hv,),
        "dt_bias": (hv,),
        "norm.weight": (dv,),
        "out_proj.weight": (hidden, hv * dv),
    }
    sizes = f"hidden_size={hidden}, H={h}, HV={hv}, K={dk}, V={dv}, conv kernel {width}"
    shapes = {name: (shape,) for name, shape in expected.items()}
    tensors = layer_tensors(
        checkpoint, prefix, layout_names + _COMMON, shapes, layout, sizes, dtype
    )

    if layout == "Qwen3-Next":
        qkv, z, b, a = split_qwen3_next_projections(
            tensors["in_proj_qkvz.weight"], tensors["in_proj_ba.weight"], h, hv, dk, dv
        )
    else:
        qkv, z = tensors["in_proj_qkv.weight"], tensors["in_proj_z.weight"]
        b, a = tensors["in_proj_b.weight"], tensors["in_proj_a.weight"]

    skeleton = eqx.filter_eval_shape(
        GatedDeltaNet,
        hidden,
        h,
        hv,
        dk,
        dv,
        conv_kernel_size=width,
        norm_eps=eps,
        chunk_size=chunk_size,
        block_size=block_size,
        memory=memory,
        key=jr.key(0),
    )
    leaves = [
        (lambda m: m.in_proj_qkv.weight, qkv),
        (lambda m: m.in_proj_z.weight, z),
        (lambda m: m.in_proj_b.weight, b),
        (lambda m: m.in_proj_a.weight, a),
        (lambda m: m.conv1d.weight, tensors["conv1d.weight"][:, 0, :]),
        (lambda m: m.A_log, tensors["A_log"]),
        (lambda m: m.dt_bias, tensors["dt_bias"]),
        (lambda m: m.norm.weight, tensors["norm.weight"]),
        (lambda m: m.out_proj.weight, tensors["out_proj.weight"]),
    ]
    return eqx.tree_at(lambda m: [get(m) for get, _ in leaves], skeleton, [x for _, x in leaves])


def gated_delta_net_to_hf(
    layer: GatedDeltaNet,
    *,
    layout: Literal["qwen3_next", "qwen3_5"] = "qwen3_5",
    prefix: str = "",
) -> dict[str, np.ndarray]:
    """The inverse of [`deltanet_cp.interop.gated_delta_net_from_hf`][]: a transformers
    state dict for `layer`.

    **Arguments:**

    - `layer`: the layer to export.
    - `layout`: `"qwen3_next"` (`in_proj_qkvz`, `in_proj_ba`, grouped per key head) or
        `"qwen3_5"` (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
    - `prefix`: put in front of every name, e.g. `"model.layers.0.linear_attn."`.

    **Returns:**

    A dict from tensor names to numpy arrays, ready for `safetensors.numpy.save_file`.
    """
    h, hv = layer.num_key_heads, layer.num_value_heads
    dk, dv = layer.key_head_dim, layer.value_head_dim
    qkv = np.asarray(layer.in_proj_qkv.weight)
    z = np.asarray(layer.in_proj_z.weight)
    b, a = np.asarray(layer.in_proj_b.weight), np.asarray(layer.in_proj_a.weight)
    out: dict[str, np.ndarray] = {}
    if layout == "qwen3_next":
        out["in_proj_qkvz.weight"], out["in_proj_ba.weight"] = fuse_qwen3_next_projections(
            qkv, z, b, a, h, hv, dk, dv
        )
    elif layout == "qwen3_5":
        out["in_proj_qkv.weight"], out["in_proj_z.weight"] = qkv, z
        out["in_proj_b.weight"], out["in_proj_a.weight"] = b, a
    else:
        raise ValueError(f"`layout` must be 'qwen3_next' or 'qwen3_5'; got {layout!r}.")
    out["conv1d.weight"] = np.asarray(layer.conv1d.weight)[:, None, :]
    out["A_log"] = np.asarray(layer.A_log)
    out["dt_bias"] = np.asarray(layer.dt_bias)
    out["norm.weight"] = np.asarray(layer.norm.weight)
    out["out_proj.weight"] = np.asarray(layer.out_proj.weight)
    return {prefix + name: np.ascontiguousarray(x) for name, x in out.items()}
