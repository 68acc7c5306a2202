"""Hugging Face safetensors checkpoints for the Qwen3.5 dense, Qwen3-Next, Qwen3.5 MoE and Kimi
Linear models: every tensor by name."""

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
from ..nn._kimi_delta_attention import KimiDeltaAttention
from ..nn._latent_attention import MultiHeadLatentAttention
from ..nn._layer_stack import stack_layers
from ..nn._moe import SparseMoE
from ._config import KimiLinearConfig, Qwen3NextConfig


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
    # Kept in float32 whatever `dtype` a load or save asks for (Kimi Linear's router).
    float32: bool = False


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


def _split(names: tuple[str, ...], shapes, get: Callable, ours: tuple[int, ...], axis: int = 0):
    """Tensors concatenated along `axis` into one parameter (of shape `ours`)."""
    sizes = np.cumsum([s[axis] for s in shapes])[:-1]

    def convert(xs):
        return [jnp.concatenate([x.reshape(s) for x, s in zip(xs, shapes)], axis).reshape(ours)]

    def to_hf(ps):
        return [
            np.ascontiguousarray(x)
            for x in np.split(ps[0].reshape(_joined(shapes, axis)), sizes, axis)
        ]

    return _Group(names, tuple(shapes), (get,), convert, to_hf)


def _joined(shapes, axis: int) -> tuple[int, ...]:
    first = list(shapes[0])
    first[axis] = sum(s[axis] for s in shapes)
    return tuple(first)


def _kimi_groups(model, has: Callable[[str], bool], fused: bool) -> list[_Group]:
    """Every parameter's group of a Kimi Linear checkpoint's tensors. The names and layout
    of each layer as `has` (whether the checkpoint holds a name; `lambda _: False` when
    writing) finds them: Moonshot's (the released checkpoints', what transformers'
    `save_pretrained` writes: the KDA's `q_conv1d`, `k_conv1d`, `v_conv1d`, `f_a_proj`,
    `A_log` ... beside the projections, the sparse blocks under `block_sparse_moe.` with
    one tensor per expert, `w1` / `w3` / `w2`) or transformers' module names (`conv1d`, the
    gate under `forget_gate.`, `mlp.`, the experts fused when `fused`)."""
    out = [
        _one("model.embed_tokens.weight", lambda m: m.embed.weight, model.embed.weight.shape, None),
        _one("model.norm.weight", lambda m: m.norm.weight, model.norm.weight.shape, None),
    ]
    assert model.lm_head is not None
    out.append(_one("lm_head.weight", lambda m: m.lm_head.weight, model.lm_head.weight.shape, None))
    for i, block in enumerate(model.layers):
        prefix, at = f"model.layers.{i}.", _main_layer(i)
        for name, get in (
            ("input_layernorm.weight", lambda b: b.input_layernorm.weight),
            ("post_attention_layernorm.weight", lambda b: b.post_attention_layernorm.weight),
        ):
            out.append(_one(prefix + name, _at(at, get), get(block).shape, None))
        mixer = block.mixer
        if isinstance(mixer, KimiDeltaAttention):
            out += _kda(prefix + "self_attn.", at, mixer, has)
        else:
            out += _mla(prefix + "self_attn.", at, mixer)
        if isinstance(block.mlp, SparseMoE):
            moe = block.mlp
            per_expert = any(has(f"{prefix}block_sparse_moe.{n}") for n in ("gate.weight",))
            sparse = f"{prefix}mlp." if fused and not per_expert else f"{prefix}block_sparse_moe."
            for name, get in (
                ("gate.weight", lambda b: b.mlp.gate.weight),
                ("gate.e_score_correction_bias", lambda b: b.mlp.gate.e_score_correction_bias),
            ):
                g = _one(sparse + name, _at(at, get), get(block).shape, None)
                out.append(dataclasses.replace(g, float32=True))
            for part in ("gate_proj", "up_proj", "down_proj"):
                get = _shared(part)
                out.append(
                    _one(
                        f"{sparse}shared_experts.{part}.weight",
                        _at(at, get),
                        get(block).shape,
                        None,
                    )
                )
            out += _kimi_experts(sparse, at, moe, fused and not per_expert)
        else:
            dense = (
                f"{prefix}block_sparse_moe."
                if has(f"{prefix}block_sparse_moe.gate_proj.weight")
                else f"{prefix}mlp."
            )
            for part in ("gate_proj", "up_proj", "down_proj"):
                get = _dense(part)
                out.append(_one(f"{dense}{part}.weight", _at(at, get), get(block).shape, None))
    return out


def _shared(part: str) -> Callable:
    return lambda b: getattr(b.mlp.shared_expert, part).weight


def _dense(part: str) -> Callable:
    return lambda b: getattr(b.mlp, part).weight


def _kda(
    prefix: str, at: Callable, kda: KimiDeltaAttention, has: Callable[[str], bool]
) -> list[_Group]:
    """A Kimi Delta Attention layer's groups: Moonshot's names, or transformers' (one
    `conv1d`, the gate under `forget_gate.`) if the checkpoint holds those."""
    h, dk, width = kda.num_heads, kda.head_dim, kda.conv1d.weight.shape[-1]
    wide = h * dk
    transformers_layout = has(prefix + "conv1d.weight") or has(prefix + "forget_gate.A_log")
    gate = prefix + ("forget_gate." if transformers_layout else "")

    def field(get):
        return _at(at, lambda b: get(b.mixer))

    out = [
        _split(
            tuple(f"{prefix}{x}_proj.weight" for x in "qkv"),
            [(wide, kda.hidden_size)] * 3,
            field(lambda m: m.in_proj_qkv.weight),
            (3 * wide, kda.hidden_size),
        )
    ]
    if transformers_layout:
        out.append(
            _one(
                prefix + "conv1d.weight",
                field(lambda m: m.conv1d.weight),
                (3 * wide, width),
                lambda s: (s[0], 1, s[1]),
            )
        )
    else:
        out.append(
            _split(
                tuple(f"{prefix}{x}_conv1d.weight" for x in "qkv"),
                [(wide, 1, width)] * 3,
                field(lambda m: m.conv1d.weight),
                (3 * wide, width),
            )
        )
    out += [
        _one(
            gate + "f_a_proj.weight",
            field(lambda m: m.f_a_proj.weight),
            (dk, kda.hidden_size),
            None,
        ),
        _one(gate + "f_b_proj.weight", field(lambda m: m.f_b_proj.weight), (wide, dk), None),
        _one(gate + "dt_bias", field(lambda m: m.dt_bias), (h, dk), lambda s: (s[0] * s[1],)),
        _one(gate + "A_log", field(lambda m: m.A_log), (h,), lambda s: (1, 1, s[0], 1)),
    ]
    for name, get in (
        ("b_proj.weight", lambda m: m.b_proj.weight),
        ("g_a_proj.weight", lambda m: m.g_a_proj.weight),
        ("g_b_proj.weight", lambda m: m.g_b_proj.weight),
        ("o_norm.weight", lambda m: m.norm.weight),
        ("o_proj.weight", lambda m: m.out_proj.weight),
    ):
        out.append(_one(prefix + name, field(get), get(kda).shape, None))
    return out


def _mla(prefix: str, at: Callable, mla: MultiHeadLatentAttention) -> list[_Group]:
    """A multi-head latent attention layer's tensors: its parameters by transformers' names
    (`q_proj` or `q_a_proj` / `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa`,
    `kv_a_layernorm`, `kv_b_proj`, `o_proj`, with their biases if any)."""
    out = []
    for field in (
        "q_proj",
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
    ):
        module = getattr(mla, field)
        if module is None:
            continue
        for part in ("weight", "bias"):
            if getattr(module, part, None) is None:
                continue
            get = _mla_param(field, part)
            out.append(_one(f"{prefix}{field}.{part}", _at(at, get), get(mla).shape, None))
    return out


def _mla_param(field: str, part: str) -> Callable:
    """`mixer.field.part` of a decoder layer (or, given the mixer, of it)."""

    def get(b):
        mixer = b if isinstance(b, MultiHeadLatentAttention) else b.mixer
        return getattr(getattr(mixer, field), part)

    return get


def _kimi_experts(prefix: str, at: Callable, moe: SparseMoE, fused: bool) -> list[_Group]:
    """Kimi Linear's routed experts: transformers' fused `experts.gate_up_proj` /
    `experts.down_proj`, or Moonshot's `experts.{j}.w1` (gate), `w3` (up), `w2` (down)."""
    if fused:
        return _experts(prefix[: -len("mlp.")], at, moe, True)
    e, inter, hidden = moe.experts.gate_proj.shape

    def get(field):
        return lambda m: getattr(at(m).mlp.experts, field)

    shapes = {
        "w1": ("gate_proj", (inter, hidden)),
        "w3": ("up_proj", (inter, hidden)),
        "w2": ("down_proj", (hidden, inter)),
    }
    return [
        _Group(
            tuple(f"{prefix}experts.{j}.{w}.weight" for j in range(e)),
            (shape,) * e,
            (get(field),),
            lambda xs: [jnp.stack(xs)],
            lambda ps: list(ps[0]),
        )
        for w, (field, shape) in shapes.items()
    ]


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
    if isinstance(config, KimiLinearConfig):
        fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in tensors)
        groups = _kimi_groups(skeleton, tensors.__contains__, fused)
    else:
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
            keep = dtype is None or g.float32
            values.append(x.astype(jnp.float32) if g.float32 else x if keep else x.astype(dtype))
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
    kimi = isinstance(model.config, KimiLinearConfig)
    default_experts = "per_expert" if qwen3_next or kimi else "fused"
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
    if kimi:
        groups = _kimi_groups(model, lambda _: False, fused)
    else:
        groups = _groups(model, "model.", lambda _: qwen3_next, lambda _: fused)
    out_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    layout: dict[str, tuple[tuple[int, ...], Any]] = {}
    for g in groups:
        own = np.dtype(jnp.result_type(*(get(model).dtype for get in g.params)))
        kind = own if g.float32 or out_dtype is None else out_dtype
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
