"""Hugging Face `transformers` weights for [`deltanet_cp.nn.GatedDeltaNet`][] (safetensors only)."""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._run import Memory
from .._validate import as_config_float, as_config_int
from ..nn._gated_delta_net import GatedDeltaNet


_QWEN3_NEXT = ("in_proj_qkvz.weight", "in_proj_ba.weight")
_QWEN3_5 = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_COMMON = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")
_ALL = _QWEN3_NEXT + _QWEN3_5 + _COMMON
_INDEX = "model.safetensors.index.json"
_REQUIRED_CONFIG = (
    "hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _config_value(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return value


def _config_int(config: Any, name: str, default: Any = None) -> int:
    """A positive int field of the config (`as_config_int`: an int or a NumPy integer)."""
    return as_config_int(name, _config_value(config, name, default))


def _config_float(config: Any, name: str, default: float) -> float:
    """A float field of the config: a number (an int too), never a bool or a string."""
    return as_config_float(name, _config_value(config, name, default))


def _text_config(config: Any) -> Any:
    # Qwen3.5's top-level config nests the language model's fields in `text_config`.
    if _config_value(config, "hidden_size") is None:
        nested = _config_value(config, "text_config")
        if nested is not None:
            return nested
    return config


class _Reader:
    """Tensors by name, from a mapping or from `.safetensors` files (read lazily).

    A sharded checkpoint says which file holds each tensor in its
    `model.safetensors.index.json`; that is read when present (in a directory, or given as
    the path). Without it, every `.safetensors` file of the directory is read, and a tensor
    found in several files must be identical in all of them.
    """

    def __init__(self, weights: Any):
        self._mapping: Mapping[str, Any] | None = None
        self._files: dict[str, list[Path]] = {}
        if isinstance(weights, Mapping):
            self._mapping = weights
            return
        if not isinstance(weights, (str, os.PathLike)):
            raise TypeError(
                "`weights` must be a mapping from tensor names to arrays, or the path of a "
                f"`.safetensors` file or of a directory of them; got {type(weights).__name__}."
            )
        path = Path(weights)
        index = None
        if path.is_dir() and (path / _INDEX).is_file():
            index = path / _INDEX
        elif path.name.endswith(".safetensors.index.json"):
            index = path
        if index is not None:
            files = None
        elif path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"No `.safetensors` files in the directory {str(path)!r}.")
        elif path.suffix == ".safetensors":
            if not path.exists():
                raise FileNotFoundError(f"No such weights file: {str(path)!r}.")
            files = [path]
        else:
            raise ValueError(
                f"Only safetensors checkpoints are read (never pickle); got {str(path)!r}. "
                "Convert it to `.safetensors` first, or pass a mapping of arrays."
            )
        try:
            from safetensors import safe_open
        except ImportError as e:  # pragma: no cover
            raise ImportError(
                "Reading `.safetensors` files needs the `safetensors` package: "
                '`pip install "deltanet_cp[hf]"` (or `pip install safetensors`).'
            ) from e
        self._safe_open = safe_open
        if index is not None:
            self._files = _read_index(index)
            return
        assert files is not None
        for file in files:
            for name in self._keys(file):
                self._files.setdefault(name, []).append(file)

    def _keys(self, file: Path) -> list[str]:
        try:
            with self._safe_open(str(file), framework="numpy") as f:
                return list(f.keys())
        except Exception as e:  # safetensors' own errors name no file
            raise ValueError(
                f"Cannot read the safetensors file {str(file)!r} (corrupt or truncated?): "
                f"{type(e).__name__}: {e}"
            ) from None

    def keys(self) -> list[str]:
        if self._mapping is not None:
            return list(self._mapping.keys())
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        if self._mapping is not None:
            return name in self._mapping
        return name in self._files

    def __getitem__(self, name: str) -> Any:
        if self._mapping is not None:
            return self._mapping[name]
        first, *others = self._files[name]
        x = self._read(first, name)
        for other in others:
            y = self._read(other, name)
            if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
                raise ValueError(
                    f"Tensor {name!r} is in both {first.name!r} and {other.name!r}, with "
                    "different values: remove the stale file, or add the checkpoint's "
                    f"`{_INDEX}` (which says which file holds each tensor)."
                )
        return x

    def _read(self, file: Path, name: str) -> Any:
        if name not in self._keys(file):
            raise ValueError(f"Tensor {name!r} is not in {str(file)!r}, as the index says.")
        try:
            with self._safe_open(str(file), framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as e:  # safetensors' own errors name no file
            raise ValueError(
                f"Cannot read tensor {name!r} of the safetensors file {str(file)!r} (corrupt "
                f"or truncated?): {type(e).__name__}: {e}"
            ) from None


def _read_index(index: Path) -> dict[str, list[Path]]:
    """The file of each tensor, from a `model.safetensors.index.json` (its `weight_map`)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"Cannot read the `weight_map` of the index {str(index)!r}: {e!r}."
        ) from None
    if not isinstance(weight_map, Mapping) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise ValueError(f"The `weight_map` of {str(index)!r} must map tensor names to file names.")
    files = {}
    folder = index.parent.resolve()
    for name, file in weight_map.items():
        path = index.parent / file
        if (
            Path(file).name != file
            or path.suffix != ".safetensors"
            or path.resolve().parent != folder
        ):
            raise ValueError(
                f"The index {str(index)!r} puts {name!r} in {file!r}: expected the name of a "
                "`.safetensors` file next to it (no other folder, absolute path or link out "
                "of it)."
            )
        if not path.is_file():
            raise FileNotFoundError(
                f"The index {str(index)!r} puts {name!r} in {file!r}, which does not exist."
            )
        files[name] = [path]
    return files


def _find_prefix(
    reader: _Reader,
    prefix: str | None,
    markers: tuple[str, ...] = ("A_log",),
    what: str = "Gated DeltaNet",
) -> str:
    """`prefix`, or the one prefix in front of a tensor named by one of `markers`."""
    if prefix is not None:
        return prefix
    found = set()
    for name in reader.keys():
        marker = next((m for m in markers if name.endswith(m)), None)
        if marker is not None:
            found.add(name[: -len(marker)])
    candidates = sorted(found)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"No {what} weights found: expected a tensor named `{markers[0]}` (optionally "
            "behind a prefix such as `model.layers.0.linear_attn.`)."
        )
    raise ValueError(
        f"The weights hold {len(candidates)} {what} layers ({candidates[:4]}"
        f"{' ...' if len(candidates) > 4 else ''}); pass `prefix=` to choose one."
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


def _check_dtype(dtype) -> None:
    """A `ValueError` naming `dtype` unless it is `None` or a floating-point dtype."""
    if dtype is None:
        return
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(
            f"`dtype` must be a floating-point dtype (jnp.float32, jnp.bfloat16, ...) or "
            f"None; got {dtype!r}."
        )


def _check_unexpected(reader: _Reader, prefix: str, allowed: tuple[str, ...], what: str) -> None:
    """A `ValueError` naming the tensors behind `prefix` that are not in `allowed`."""
    names = [n for n in reader.keys() if n.startswith(prefix)]
    unexpected = sorted(n for n in names if n[len(prefix) :] not in allowed)
    if unexpected:
        raise ValueError(
            f"Unexpected tensor(s) {unexpected} for a {what} layer with prefix "
            f"{prefix!r}; expected only {list(allowed)} (in one of the two layouts)."
        )


def _read_tensors(
    reader: _Reader,
    prefix: str,
    shorts: tuple[str, ...],
    expected: Mapping[str, tuple[tuple[int, ...], ...]],
    layout: str,
    sizes: str,
    dtype,
) -> dict[str, Any]:
    """The tensors `prefix + short` for each of `shorts`, as JAX arrays in `dtype` (their own
    if `None`); a `ValueError` naming one that is missing, misshapen (its shape not one of
    `expected[short]`) or not floating-point."""
    tensors = {}
    for short in shorts:
        name = prefix + short
        if name not in reader:
            raise ValueError(f"Missing tensor {name!r} ({layout} layout: {', '.join(shorts)}).")
        x = reader[name]
        if tuple(x.shape) not in expected[short]:
            shapes = " or ".join(str(e) for e in expected[short])
            raise ValueError(
                f"Tensor {name!r} has shape {tuple(x.shape)}; expected {shapes} for this "
                f"config ({sizes})."
            )
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"Tensor {name!r} has dtype {x.dtype}; the layer's weights must be "
                "floating-point (is the checkpoint quantised?)."
            )
        tensors[short] = x if dtype is None else x.astype(dtype)
    return tensors


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
    config = _text_config(config)
    missing = [n for n in _REQUIRED_CONFIG if _config_value(config, n) is None]
    if missing:
        raise ValueError(f"The config is missing {', '.join(f'`{n}`' for n in missing)}.")
    act = _config_value(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"Only `hidden_act='silu'` is supported for the convolution; the config has {act!r}."
        )
    hidden = _config_int(config, "hidden_size")
    h = _config_int(config, "linear_num_key_heads")
    hv = _config_int(config, "linear_num_value_heads")
    dk = _config_int(config, "linear_key_head_dim")
    dv = _config_int(config, "linear_value_head_dim")
    width = _config_int(config, "linear_conv_kernel_dim")
    _check_dtype(dtype)
    eps = _config_float(config, "rms_norm_eps", 1e-6)
    if hv % h != 0:
        raise ValueError(
            f"`linear_num_value_heads` ({hv}) must be a multiple of `linear_num_key_heads` ({h})."
        )

    reader = _Reader(weights)
    prefix = _find_prefix(reader, prefix)
    _check_unexpected(reader, prefix, _ALL, "Gated DeltaNet")
    if prefix + "in_proj_qkvz.weight" in reader or prefix + "in_proj_ba.weight" in reader:
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
    tensors = _read_tensors(reader, prefix, layout_names + _COMMON, shapes, layout, sizes, dtype)

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
    r, hidden = hv // h, layer.hidden_size
    qkv = np.asarray(layer.in_proj_qkv.weight)
    z = np.asarray(layer.in_proj_z.weight)
    b, a = np.asarray(layer.in_proj_b.weight), np.asarray(layer.in_proj_a.weight)
    out: dict[str, np.ndarray] = {}
    if layout == "qwen3_next":
        q = qkv[: h * dk].reshape(h, dk, hidden)
        k = qkv[h * dk : 2 * h * dk].reshape(h, dk, hidden)
        v = qkv[2 * h * dk :].reshape(h, r * dv, hidden)
        zz = z.reshape(h, r * dv, hidden)
        out["in_proj_qkvz.weight"] = np.concatenate([q, k, v, zz], axis=1).reshape(-1, hidden)
        ba = np.concatenate([b.reshape(h, r, hidden), a.reshape(h, r, hidden)], axis=1)
        out["in_proj_ba.weight"] = ba.reshape(2 * hv, hidden)
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
