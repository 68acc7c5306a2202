"""Hugging Face safetensors checkpoints for the Qwen3.5 dense, Qwen3-Next and Qwen3.5 MoE models:
every tensor by name."""

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.experimental import multihost_utils

from .._run import Memory
from ..interop._checkpoint import check_dtype, open_folder, save_folder
from ..interop._hf import fuse_qwen3_next_projections, split_qwen3_next_projections
from ..nn._gated_delta_net import GatedDeltaNet
from ..nn._layer_stack import stack_layers
from ..nn._moe import SparseMoE
from ._config import Qwen3NextConfig


# Tensors transformers itself skips when loading the text model: multi-token prediction
# heads (`mtp.*`, in the released Qwen3-Next and Qwen3.5 checkpoints; read into the model's
# `mtp` when its config has `mtp_num_hidden_layers`) and the multimodal checkpoint's vision
# tower.
_SKIPPED = ("mtp.", "model.visual.")

# (suffix after the layer prefix, the parameter in the decoder layer, HF shape from ours)
_Entry = tuple[str, Callable[[Any], Any], Callable[[tuple[int, ...]], tuple[int, ...]] | None]

_COMMON: list[_Entry] = [
    ("input_layernorm.weight", lambda b: b.input_layernorm.weight, None),
    ("post_attention_layernorm.weight", lambda b: b.post_attention_layernorm.weight, None),
]
_DENSE_MLP: list[_Entry] = [
    ("mlp.gate_proj.weight", lambda b: b.mlp.gate_proj.weight, None),
    ("mlp.up_proj.weight", lambda b: b.mlp.up_proj.weight, None),
    ("mlp.down_proj.weight", lambda b: b.mlp.down_proj.weight, None),
]
_SPARSE_MLP: list[_Entry] = [
    ("mlp.gate.weight", lambda b: b.mlp.gate.weight, None),
    ("mlp.shared_expert.gate_proj.weight", lambda b: b.mlp.shared_expert.gate_proj.weight, None),
    ("mlp.shared_expert.up_proj.weight", lambda b: b.mlp.shared_expert.up_proj.weight, None),
    ("mlp.shared_expert.down_proj.weight", lambda b: b.mlp.shared_expert.down_proj.weight, None),
    ("mlp.shared_expert_gate.weight", lambda b: b.mlp.shared_expert_gate.weight, None),
]
_QWEN3_5_PROJECTIONS: list[_Entry] = [
    ("linear_attn.in_proj_qkv.weight", lambda b: b.mixer.in_proj_qkv.weight, None),
    ("linear_attn.in_proj_z.weight", lambda b: b.mixer.in_proj_z.weight, None),
    ("linear_attn.in_proj_b.weight", lambda b: b.mixer.in_proj_b.weight, None),
    ("linear_attn.in_proj_a.weight", lambda b: b.mixer.in_proj_a.weight, None),
]
_LINEAR: list[_Entry] = [
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


@dataclasses.dataclass(frozen=True)
class _Group:
    """Checkpoint tensors (`names`, of `shapes`) that `convert` turns into parameters (read
    from the model by `params`): one to one, or fused tensors split, or per-expert ones
    stacked; `to_hf` is the inverse (the parameters' values, as numpy arrays, to the
    tensors), exact: reshapes, slices and concatenations only."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    params: tuple[Callable, ...]
    convert: Callable[[list[Any]], list[Any]]
    to_hf: Callable[[list[np.ndarray]], list[np.ndarray]]


def _one(name: str, get: Callable, ours: tuple[int, ...], to_hf: Callable | None) -> _Group:
    want = ours if to_hf is None else tuple(to_hf(ours))
    return _Group(
        (name,), (want,), (get,), lambda xs: [xs[0].reshape(ours)], lambda ps: [ps[0].reshape(want)]
    )


def _qwen3_next_projections(prefix: str, i: int, gdn: GatedDeltaNet) -> list[_Group]:
    """Qwen3-Next's fused, head-interleaved `in_proj_qkvz` and `in_proj_ba`."""
    h, hv = gdn.num_key_heads, gdn.num_value_heads
    dk, dv, hidden = gdn.key_head_dim, gdn.value_head_dim, gdn.hidden_size

    def get(field):
        return lambda m: getattr(m.layers[i].mixer, field).weight

    def qkvz(xs):
        qkv, z, _, _ = split_qwen3_next_projections(xs[0], None, h, hv, dk, dv)
        return [qkv, z]

    def ba(xs):
        _, _, b, a = split_qwen3_next_projections(None, xs[0], h, hv, dk, dv)
        return [b, a]

    def fuse_qkvz(ps):
        return [fuse_qwen3_next_projections(ps[0], ps[1], None, None, h, hv, dk, dv)[0]]

    def fuse_ba(ps):
        return [fuse_qwen3_next_projections(None, None, ps[0], ps[1], h, hv, dk, dv)[1]]

    return [
        _Group(
            (prefix + "linear_attn.in_proj_qkvz.weight",),
            ((2 * h * dk + 2 * hv * dv, hidden),),
            (get("in_proj_qkv"), get("in_proj_z")),
            qkvz,
            fuse_qkvz,
        ),
        _Group(
            (prefix + "linear_attn.in_proj_ba.weight",),
            ((2 * hv, hidden),),
            (get("in_proj_b"), get("in_proj_a")),
            ba,
            fuse_ba,
        ),
    ]


def _experts(prefix: str, at: Callable, moe: SparseMoE, fused: bool) -> list[_Group]:
    """The routed experts of the layer `at(model)`: fused (`mlp.experts.gate_up_proj`
    `(E, 2I, H)`, gate first, and `mlp.experts.down_proj` `(E, H, I)`) or one tensor per
    expert and projection."""
    e, inter, hidden = moe.experts.gate_proj.shape

    def get(field):
        return lambda m: getattr(at(m).mlp.experts, field)

    if fused:
        return [
            _Group(
                (prefix + "mlp.experts.gate_up_proj",),
                ((e, 2 * inter, hidden),),
                (get("gate_proj"), get("up_proj")),
                lambda xs: [xs[0][:, :inter], xs[0][:, inter:]],
                lambda ps: [np.concatenate(ps, axis=1)],
            ),
            _Group(
                (prefix + "mlp.experts.down_proj",),
                ((e, hidden, inter),),
                (get("down_proj"),),
                lambda xs: [xs[0]],
                lambda ps: [ps[0]],
            ),
        ]
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    return [
        _Group(
            tuple(f"{prefix}mlp.experts.{j}.{field}.weight" for j in range(e)),
            (shape,) * e,
            (get(field),),
            lambda xs: [jnp.stack(xs)],
            lambda ps: list(ps[0]),
        )
        for field, shape in shapes.items()
    ]


def _groups(
    model, base: str, qwen3_next: Callable[[str], bool], fused: Callable[[str], bool]
) -> list[_Group]:
    """Every parameter's group of checkpoint tensors, in transformers' order (embedding,
    final norm, LM head, the layers); the layouts as the two predicates of a layer's
    prefix say: Qwen3-Next's fused Gated DeltaNet projections (`qwen3_next`), fused experts
    (`fused`)."""
    out = [
        _one(
            base + "embed_tokens.weight", lambda m: m.embed.weight, model.embed.weight.shape, None
        ),
        _one(base + "norm.weight", lambda m: m.norm.weight, model.norm.weight.shape, None),
    ]
    if model.lm_head is not None:
        out.append(
            _one("lm_head.weight", lambda m: m.lm_head.weight, model.lm_head.weight.shape, None)
        )
    for i, block in enumerate(model.layers):
        out += _layer(f"{base}layers.{i}.", i, _main_layer(i), block, qwen3_next, fused)
    if model.mtp is not None:
        # The multi-token-prediction head: top-level `mtp.*` in every checkpoint layout.
        for name, get in (
            ("mtp.pre_fc_norm_embedding.weight", lambda m: m.mtp.pre_fc_norm_embedding.weight),
            ("mtp.pre_fc_norm_hidden.weight", lambda m: m.mtp.pre_fc_norm_hidden.weight),
            ("mtp.fc.weight", lambda m: m.mtp.fc.weight),
            ("mtp.norm.weight", lambda m: m.mtp.norm.weight),
        ):
            out.append(_one(name, get, get(model).shape, None))
        for k, block in enumerate(model.mtp.layers):
            out += _layer(f"mtp.layers.{k}.", k, _mtp_layer(k), block, qwen3_next, fused)
    return out


def _main_layer(i: int) -> Callable:
    return lambda m: m.layers[i]


def _mtp_layer(k: int) -> Callable:
    return lambda m: m.mtp.layers[k]


def _layer(
    prefix: str,
    i: int,
    at: Callable,
    block,
    qwen3_next: Callable[[str], bool],
    fused: Callable[[str], bool],
) -> list[_Group]:
    """The groups of the decoder layer `at(model)` (`block`, layer `i` of its stack), its
    tensors named `prefix...`."""
    out = []
    entries = list(_COMMON)
    if isinstance(block.mixer, GatedDeltaNet):
        entries += _LINEAR
        if qwen3_next(prefix):
            out += _qwen3_next_projections(prefix, i, block.mixer)
        else:
            entries += _QWEN3_5_PROJECTIONS
    else:
        entries += _ATTENTION
    if isinstance(block.mlp, SparseMoE):
        entries += _SPARSE_MLP
        out += _experts(prefix, at, block.mlp, fused(prefix))
    else:
        entries += _DENSE_MLP
    for suffix, get, to_hf in entries:
        out.append(_one(prefix + suffix, _at(at, get), get(block).shape, to_hf))
    return out


def _at(at: Callable, get: Callable) -> Callable:
    return lambda m: get(at(m))


def load(
    cls,
    config_cls: type[Any],  # the model's config class: its `from_json` reads config.json
    path: str | os.PathLike,
    *,
    dtype,
    chunk_size: int,
    block_size: int | None,
    memory: Memory | None = None,
    tile_size: int,
    precision,
    scan_layers: bool = False,
):
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"from_pretrained takes a checkpoint directory (config.json and safetensors); "
            f"got {str(path)!r}."
        )
    config = config_cls.from_json(path)
    skeleton = eqx.filter_eval_shape(
        cls,
        config,
        chunk_size=chunk_size,
        block_size=block_size,
        memory=memory,
        tile_size=tile_size,
        precision=precision,
        key=jr.key(0),
        dtype=dtype,
    )
    tensors = open_folder(path)
    if skeleton.mtp is not None and not any(n.startswith("mtp.") for n in tensors):
        # The config asks for a head the checkpoint does not hold (transformers writes its
        # config's `mtp_num_hidden_layers` but no `mtp.*` tensors): the model has none.
        skeleton = eqx.tree_at(lambda m: m.mtp, skeleton, None)
    nested = any(n.startswith("model.language_model.") for n in tensors)
    base = "model.language_model." if nested else "model."
    groups = _groups(
        skeleton,
        base,
        lambda prefix: any(
            prefix + "linear_attn." + n in tensors
            for n in ("in_proj_qkvz.weight", "in_proj_ba.weight")
        ),
        lambda prefix: any(
            prefix + "mlp.experts." + n in tensors for n in ("gate_up_proj", "down_proj")
        ),
    )
    expected = {name for g in groups for name in g.names}
    skipped = tuple(p for p in _SKIPPED if p != "mtp." or skeleton.mtp is None)
    skipped += ("lm_head.weight",) if skeleton.lm_head is None else ()
    missing = [name for g in groups for name in g.names if name not in tensors]
    unexpected = sorted(n for n in tensors if n not in expected and not n.startswith(skipped))
    misshapen = []
    for g in groups:
        for name, want in zip(g.names, g.shapes):
            if name not in tensors:
                continue
            info = tensors.info(name)
            if tuple(info.shape) != tuple(want):
                misshapen.append(f"{name}: {tuple(info.shape)}, expected {tuple(want)}")
            elif not info.floating:
                misshapen.append(f"{name}: dtype {info.dtype}, expected floating-point")
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
    getters, values = [], []
    for g in groups:
        xs = [jnp.asarray(tensors[name]) for name in g.names]
        for get, x in zip(g.params, g.convert(xs)):
            assert x.shape == get(skeleton).shape, (g.names[0], x.shape)
            getters.append(get)
            values.append(x if dtype is None else x.astype(dtype))
    model = eqx.tree_at(lambda m: [get(m) for get in getters], skeleton, values)
    left = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    assert not left, f"{len(left)} parameters were not loaded"
    # Loaded layer by layer, then stacked (a copy of the layers' parameters, exact).
    return eqx.tree_at(lambda m: m.layers, model, stack_layers(model.layers, scan_layers))


ExpertLayout = Literal["fused", "per_expert"]


def _host(x) -> np.ndarray:
    """A parameter's values on this host: gathered across processes if this process does
    not hold all of it (a collective: every process calls it, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save(
    model,
    path: str | os.PathLike,
    *,
    dtype,
    experts: ExpertLayout | None,
    max_shard_size: int | str,
) -> None:
    """`save_pretrained` of the Qwen3.5 family's models: see its docstring. Qwen3-Next
    writes its own checkpoints' layout (fused, head-grouped Gated DeltaNet projections; one
    tensor per expert), Qwen3.5 (MoE) its own (separate projections; fused experts)."""
    qwen3_next = isinstance(model.config, Qwen3NextConfig)
    default_experts = "per_expert" if qwen3_next else "fused"
    check_dtype(dtype)
    sparse = any(isinstance(block.mlp, SparseMoE) for block in model.layers)
    if experts is not None and experts not in ("fused", "per_expert"):
        raise ValueError(f"`experts` must be 'fused', 'per_expert' or None; got {experts!r}.")
    if experts is not None and not sparse:
        raise ValueError(
            f"`experts={experts!r}` is for a mixture-of-experts model; this "
            f"{type(model).__name__} has none. Pass `experts=None`."
        )
    fused = (experts or default_experts) == "fused"
    groups = _groups(model, "model.", lambda _: qwen3_next, lambda _: fused)
    out_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    layout: dict[str, tuple[tuple[int, ...], Any]] = {}
    for g in groups:
        kind = out_dtype or np.dtype(jnp.result_type(*(get(model).dtype for get in g.params)))
        for name, shape in zip(g.names, g.shapes):
            layout[name] = (shape, kind)
    config = {"architectures": [type(model).__name__], **model.config.to_hf()}
    config["dtype"] = str(out_dtype or np.dtype(model.embed.weight.dtype))

    def tensors():
        for g in groups:
            params = [_host(get(model)) for get in g.params]
            for name, x in zip(g.names, g.to_hf(params)):
                yield name, np.ascontiguousarray(x.astype(layout[name][1], copy=False))

    save_folder(
        path,
        config,
        layout,
        tensors(),
        max_shard_size=max_shard_size,
        write=jax.process_index() == 0,
    )
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"deltanet_cp save_pretrained {os.fspath(path)}")
