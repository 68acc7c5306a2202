"""Hugging Face safetensors checkpoints for `Qwen3_5ForCausalLM`: every tensor by name."""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from ..interop._safetensors import read_header, read_tensor, TensorInfo
from ..nn._gated_delta_net import GatedDeltaNet
from ._config import Qwen3_5Config


# Tensors transformers itself skips when loading the text model: multi-token prediction
# heads and the multimodal checkpoint's vision tower.
_SKIPPED = ("mtp.", "model.visual.")

# (suffix after the layer prefix, the parameter in the decoder layer, HF shape from ours)
_Entry = tuple[str, Callable[[Any], Any], Callable[[tuple[int, ...]], tuple[int, ...]] | None]

_COMMON: list[_Entry] = [
    ("input_layernorm.weight", lambda b: b.input_layernorm.weight, None),
    ("post_attention_layernorm.weight", lambda b: b.post_attention_layernorm.weight, None),
    ("mlp.gate_proj.weight", lambda b: b.mlp.gate_proj.weight, None),
    ("mlp.up_proj.weight", lambda b: b.mlp.up_proj.weight, None),
    ("mlp.down_proj.weight", lambda b: b.mlp.down_proj.weight, None),
]
_LINEAR: list[_Entry] = [
    ("linear_attn.in_proj_qkv.weight", lambda b: b.mixer.in_proj_qkv.weight, None),
    ("linear_attn.in_proj_z.weight", lambda b: b.mixer.in_proj_z.weight, None),
    ("linear_attn.in_proj_b.weight", lambda b: b.mixer.in_proj_b.weight, None),
    ("linear_attn.in_proj_a.weight", lambda b: b.mixer.in_proj_a.weight, None),
    # torch's depthwise Conv1d weight is (channels, 1, kernel); ours (channels, kernel).
    ("linear_attn.conv1d.weight", lambda b: b.mixer.conv1d.weight, lambda s: (s[0], 1, s[1])),
    ("linear_attn.A_log", lambda b: b.mixer.A_log, None),
    ("linear_attn.dt_bias", lambda b: b.mixer.dt_bias, None),
    ("linear_attn.norm.weight", lambda b: b.mixer.norm.weight, None),
    ("linear_attn.out_proj.weight", lambda b: b.mixer.out_proj.weight, None),
]
_ATTENTION: list[_Entry] = [
    ("self_attn.q_proj.weight", lambda b: b.mixer.q_proj.weight, None),
    ("self_attn.k_proj.weight", lambda b: b.mixer.k_proj.weight, None),
    ("self_attn.v_proj.weight", lambda b: b.mixer.v_proj.weight, None),
    ("self_attn.o_proj.weight", lambda b: b.mixer.o_proj.weight, None),
    ("self_attn.q_norm.weight", lambda b: b.mixer.q_norm.weight, None),
    ("self_attn.k_norm.weight", lambda b: b.mixer.k_norm.weight, None),
]


def _header(file: Path) -> dict[str, TensorInfo]:
    """`read_header`, its errors naming the file (a corrupt or truncated header)."""
    try:
        return read_header(file)
    except OSError as e:
        raise ValueError(f"Cannot read the safetensors file {str(file)!r}: {e}") from None
    except (ValueError, KeyError, TypeError, OverflowError, MemoryError) as e:
        raise ValueError(
            f"The safetensors file {str(file)!r} is corrupt (its header does not parse: "
            f"{type(e).__name__}: {e}). Download it again."
        ) from None


def _tensor(name: str, info: TensorInfo):
    """`read_tensor`, its errors naming the tensor and its file (a truncated file)."""
    size = info.file.stat().st_size
    if not 0 <= info.start <= info.end <= size:
        raise ValueError(
            f"Tensor {name!r} of the safetensors file {str(info.file)!r} lies at bytes "
            f"[{info.start}, {info.end}), past the file's {size} bytes: the file is truncated "
            "or corrupt. Download it again."
        )
    try:
        return read_tensor(info)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"Cannot read tensor {name!r} of the safetensors file {str(info.file)!r}: {e}"
        ) from None


def _shard(index: Path, name: Any, file: Any) -> Path:
    """The file of one `weight_map` entry, confined to the index's folder."""
    if not isinstance(name, str) or not isinstance(file, str):
        raise ValueError(
            f"The `weight_map` of {str(index)!r} must map tensor names to file names; it maps "
            f"{name!r} to {file!r}."
        )
    folder = index.parent.resolve()
    path = (index.parent / file).resolve()
    if Path(file).is_absolute() or path.parent != folder or not file.endswith(".safetensors"):
        raise ValueError(
            f"The index {str(index)!r} puts {name!r} in {file!r}: expected the name of a "
            "`.safetensors` file in the checkpoint folder (no other folder, absolute path or "
            "link out of it)."
        )
    if not path.is_file():
        raise ValueError(
            f"The index {str(index)!r} puts {name!r} in {file!r}, which does not exist."
        )
    return path


def _tensors(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint directory, by name."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"Cannot read the `weight_map` of the index {str(index)!r}: {e!r}."
            ) from None
        if not isinstance(weight_map, dict):
            raise ValueError(
                f"The `weight_map` of {str(index)!r} must map tensor names to file names; got "
                f"{type(weight_map).__name__}."
            )
        files = {n: _shard(index, n, f) for n, f in weight_map.items()}
        headers = {f: _header(f) for f in sorted(set(files.values()))}
        absent = sorted(n for n, f in files.items() if n not in headers[f])
        if absent:
            raise ValueError(f"The index of {str(path)!r} lists tensors its shards lack: {absent}.")
        return {n: headers[f][n] for n, f in files.items()}
    if single.exists():
        return _header(single)
    found = sorted(p.name for p in path.iterdir())
    pickled = [f for f in found if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    hint = (
        f" It holds {pickled}: pickle-based checkpoints are never read; convert them to "
        "safetensors first."
        if pickled
        else ""
    )
    raise ValueError(
        f"No model.safetensors or model.safetensors.index.json in {str(path)!r} (found "
        f"{found}).{hint}"
    )


def _entries(model, base: str) -> list[tuple[str, Callable, Callable | None]]:
    """`(tensor name, parameter getter, HF shape from ours)` for every parameter."""
    out: list[tuple[str, Callable, Callable | None]] = [
        (base + "embed_tokens.weight", lambda m: m.embed.weight, None),
        (base + "norm.weight", lambda m: m.norm.weight, None),
    ]
    if model.lm_head is not None:
        out.append(("lm_head.weight", lambda m: m.lm_head.weight, None))
    for i, block in enumerate(model.layers):
        own = _LINEAR if isinstance(block.mixer, GatedDeltaNet) else _ATTENTION
        for suffix, get, shape in _COMMON + own:
            out.append((f"{base}layers.{i}.{suffix}", _at(i, get), shape))
    return out


def _at(i: int, get: Callable) -> Callable:
    return lambda m: get(m.layers[i])


def load(
    cls,
    path: str | os.PathLike,
    *,
    dtype,
    chunk_size: int,
    block_size: int | None,
    tile_size: int,
    precision,
):
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"from_pretrained takes a checkpoint directory (config.json and safetensors); "
            f"got {str(path)!r}."
        )
    config = Qwen3_5Config.from_json(path)
    skeleton = eqx.filter_eval_shape(
        cls,
        config,
        chunk_size=chunk_size,
        block_size=block_size,
        tile_size=tile_size,
        precision=precision,
        key=jr.key(0),
        dtype=dtype,
    )
    tensors = _tensors(path)
    nested = any(n.startswith("model.language_model.") for n in tensors)
    base = "model.language_model." if nested else "model."
    entries = _entries(skeleton, base)
    expected = {name for name, _, _ in entries}
    skipped = _SKIPPED + (("lm_head.weight",) if skeleton.lm_head is None else ())
    missing = [name for name, _, _ in entries if name not in tensors]
    unexpected = sorted(n for n in tensors if n not in expected and not n.startswith(skipped))
    misshapen = []
    for name, get, to_hf in entries:
        if name in tensors:
            ours = get(skeleton).shape
            want = ours if to_hf is None else to_hf(ours)
            if tuple(tensors[name].shape) != tuple(want):
                misshapen.append(f"{name}: {tuple(tensors[name].shape)}, expected {tuple(want)}")
            elif not tensors[name].dtype.startswith(("F", "BF")):
                misshapen.append(f"{name}: dtype {tensors[name].dtype}, expected floating-point")
    if missing or unexpected or misshapen:
        lines = [f"The checkpoint in {str(path)!r} does not fit its config.json:"]
        for what, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("misshapen", misshapen),
        ):
            if names:
                lines.append(f"- {len(names)} {what}: " + "; ".join(names))
        raise ValueError("\n".join(lines))
    values = []
    for name, get, to_hf in entries:
        x = _tensor(name, tensors[name])
        if to_hf is not None:
            x = x.reshape(get(skeleton).shape)
        x = jnp.asarray(x)
        values.append(x if dtype is None else x.astype(dtype))
    model = eqx.tree_at(lambda m: [get(m) for _, get, _ in entries], skeleton, values)
    left = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    assert not left, f"{len(left)} parameters were not loaded"
    return model
