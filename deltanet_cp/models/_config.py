"""The configurations of the Qwen3.5 dense, Qwen3-Next and Qwen3.5 MoE text models, read from a
Hugging Face `config.json`."""

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np

from .._validate import as_config_float, as_config_int


LayerType = Literal["linear_attention", "full_attention"]
_LAYER_TYPES = ("linear_attention", "full_attention")


def _bool(name: str, value: Any) -> bool:
    """A bool field: only a bool (JSON `true` / `false`), never a string or a number."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(
        f"The config's `{name}` must be a bool (JSON true or false); got {value!r} of type "
        f"{type(value).__name__}."
    )


_C = TypeVar("_C", bound="AbstractQwenTextConfig")


@dataclasses.dataclass(frozen=True)
class AbstractQwenTextConfig:
    """The fields the Qwen3.5 dense, Qwen3-Next and Qwen3.5 MoE text models share, their checks
    and their reading from transformers' `config.json`; each model's config adds its own
    (keyword-only) fields.

    **Fields:**

    - `vocab_size`, `hidden_size`, `num_hidden_layers`.
    - `num_attention_heads`, `num_key_value_heads`, `head_dim`: the attention layers.
    - `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
        `linear_value_head_dim`, `linear_conv_kernel_dim`: the Gated DeltaNet layers.
    - `rms_norm_eps`: every RMSNorm's epsilon.
    - `rope_theta`, `partial_rotary_factor`: the rotary embedding's base and the fraction
        of each head's features it turns.
    - `tie_word_embeddings`: the LM head is the embedding's transpose.
    - `layer_types`: `"linear_attention"` or `"full_attention"` per layer.
    - `mtp_num_hidden_layers`: the multi-token-prediction head's decoder layers (0: no
        head; the released checkpoints' configs say 1). Read from `mtp_num_hidden_layers`
        (Qwen3.5's name) or `num_nextn_predict_layers` (what vLLM reads for Qwen3-Next).

    Every field is typed: the sizes are positive ints (not bools, floats or strings), the
    floats numbers, `tie_word_embeddings` a bool (not the string `"false"`, which would
    read as true); a field of the wrong type or out of range raises a `ValueError` naming
    it.
    """

    # transformers' `model_type`s of this model (the text config's first), and of the others.
    _MODEL_TYPES: ClassVar[tuple[str, ...]] = ()

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    layer_types: tuple[LayerType, ...] = ()
    full_attention_interval: int = 4
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "mtp_num_hidden_layers":
                value = _count(f.name, value)
            elif f.type is int:
                value = as_config_int(f.name, value)
            elif f.type is float:
                value = as_config_float(f.name, value)
            elif f.type is bool:
                value = _bool(f.name, value)
            elif f.name == "mlp_only_layers":
                value = _layer_indices(f.name, value)
            elif isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"The config's `{f.name}` must be a list of layer types; got {value!r}."
                )
            object.__setattr__(self, f.name, value)
        if self.rms_norm_eps < 0 or self.rope_theta <= 0:
            raise ValueError(
                f"The config's `rms_norm_eps` ({self.rms_norm_eps}) must be at least 0 and "
                f"`rope_theta` ({self.rope_theta}) positive."
            )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                "The config's `partial_rotary_factor` must be in (0, 1]; got "
                f"{self.partial_rotary_factor}."
            )
        if not self.layer_types:
            interval = self.full_attention_interval
            types = tuple(
                _LAYER_TYPES[(i + 1) % interval == 0] for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers."
            )
        unknown = sorted({repr(t) for t in self.layer_types if t not in _LAYER_TYPES})
        if unknown:
            raise ValueError(f"Unknown layer types {unknown}; expected {list(_LAYER_TYPES)}.")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"head_dim * partial_rotary_factor = {self.rotary_dim} must be a positive even "
                "number."
            )

    @property
    def rotary_dim(self) -> int:
        """The features of each attention head the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the sparse mixture-of-experts block (else
        a dense SwiGLU MLP)."""
        del layer
        return False

    @classmethod
    def from_hf(cls: type[_C], config: Mapping[str, Any]) -> _C:
        """From a transformers config as a dict (the contents of `config.json`): the text
        model's config, or the multimodal model's with its `text_config` (the vision tower
        is not read).

        **Raises:**

        `ValueError` naming the field if one is missing, of the wrong type (a bool must be
        a JSON bool, a size a JSON int) or asks for what is not supported (an activation
        other than SiLU, attention biases, a rotary scaling); and if the config is another
        model's (its `model_type`), naming the class that reads it.
        """
        if not isinstance(config, Mapping):
            raise ValueError(
                f"The config must be a mapping (a JSON object); got {type(config).__name__}."
            )
        top = config
        text = config.get("text_config") or config
        if not isinstance(text, Mapping):
            raise ValueError(f"The config's `text_config` must be a mapping; got {text!r}.")
        cls._check_model_type(top, text)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in fields}
        if "mtp_num_hidden_layers" not in kwargs and "num_nextn_predict_layers" in text:
            kwargs["mtp_num_hidden_layers"] = text["num_nextn_predict_layers"]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ValueError(f"The config's `rope_parameters` must be a mapping; got {rope!r}.")
        rope = dict(rope)
        for name in ("rope_theta", "partial_rotary_factor"):
            if name in rope:
                kwargs[name] = rope[name]
        # Qwen3.5's multimodal rotary sections (`mrope_section`) turn the same position for
        # every section on text: the default rotary embedding.
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"Only the default rotary embedding is supported; the config asks for "
                f"rope_type={kind!r}."
            )
        if "tie_word_embeddings" in top:
            kwargs["tie_word_embeddings"] = top["tie_word_embeddings"]
        if text.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"Only hidden_act='silu' is supported; got {text['hidden_act']!r}.")
        if _bool("attention_bias", text.get("attention_bias", False)):
            raise ValueError("Attention biases (attention_bias=True) are not supported.")
        if "head_dim" not in kwargs and "num_attention_heads" in kwargs and "hidden_size" in kwargs:
            heads = as_config_int("num_attention_heads", kwargs["num_attention_heads"])
            kwargs["head_dim"] = as_config_int("hidden_size", kwargs["hidden_size"]) // heads
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if required:
            raise ValueError(f"The config is missing {', '.join(f'`{n}`' for n in required)}.")
        for name in ("layer_types", "mlp_only_layers"):
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The inverse of `from_hf`: this config as transformers' `config.json` of the text
        model writes it (`model_type`, the fields by transformers' names, `layer_types`
        spelled out, the rotary embedding's base and fraction in `rope_parameters`), read
        back by `from_hf` and by transformers to the same config."""
        out: dict[str, Any] = {
            "model_type": self._MODEL_TYPES[0],
            "hidden_act": "silu",
            "attention_bias": False,
        }
        for f in dataclasses.fields(self):
            if f.name in ("rope_theta", "partial_rotary_factor", "full_attention_interval"):
                continue
            if f.name == "mtp_num_hidden_layers" and not self.mtp_num_hidden_layers:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        return out

    @classmethod
    def _check_model_type(cls, top: Mapping[str, Any], text: Mapping[str, Any]) -> None:
        for where in (text, top):
            kind = where.get("model_type")
            if kind is None or kind in cls._MODEL_TYPES:
                continue
            owner = next((c for c in _CONFIGS if kind in c._MODEL_TYPES), None)
            hint = (
                f"; read it with deltanet_cp.models.{owner.__name__}" if owner is not None else ""
            )
            raise ValueError(
                f"The config is of model_type {kind!r}, not a {cls.__name__} (model_type "
                f"{' / '.join(repr(t) for t in cls._MODEL_TYPES)}){hint}."
            )

    @classmethod
    def from_json(cls: type[_C], path: str | os.PathLike) -> _C:
        """From a `config.json` file, or a directory holding one: see `from_hf`."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"Cannot read {str(path)!r} as JSON: {e}.") from None
        try:
            return cls.from_hf(config)
        except ValueError as e:
            raise ValueError(f"In {str(path)!r}: {e}") from None


def _count(name: str, value: Any) -> int:
    """An int at least 0 (a count that may be zero), never a bool, float or string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"The config's `{name}` must be an int at least 0; got {value!r}.")
    return int(value)


def _layer_indices(name: str, value: Any) -> tuple[int, ...]:
    """A list of layer indices (ints at least 0)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"The config's `{name}` must be a list of layer indices; got {value!r}.")
    bad = [
        v
        for v in value
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0
    ]
    if bad:
        raise ValueError(f"The config's `{name}` must hold layer indices (ints >= 0); got {bad}.")
    return tuple(int(v) for v in value)


def _check_experts(config: Any) -> None:
    if config.num_experts_per_tok > config.num_experts:
        raise ValueError(
            f"The config's `num_experts_per_tok` ({config.num_experts_per_tok}) is more than "
            f"its `num_experts` ({config.num_experts}): each token is routed to that many "
            "distinct experts."
        )
    if config.router_aux_loss_coef < 0:
        raise ValueError(
            f"The config's `router_aux_loss_coef` must be at least 0; got "
            f"{config.router_aux_loss_coef}."
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3_5Config(AbstractQwenTextConfig):
    """The sizes of a Qwen3.5 dense text model, with transformers' field names.

    A frozen dataclass: a static configuration, hashable. `layer_types` defaults to
    Qwen3.5's pattern, full attention every `full_attention_interval`-th layer (4: three
    Gated DeltaNet layers to one attention layer).

    **Fields:**

    - `vocab_size`, `hidden_size`, `intermediate_size` (the SwiGLU MLP's width),
        `num_hidden_layers`.
    - `num_attention_heads`, `num_key_value_heads`, `head_dim`: the attention layers.
    - `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
        `linear_value_head_dim`, `linear_conv_kernel_dim`: the Gated DeltaNet layers.
    - `rms_norm_eps`: every RMSNorm's epsilon.
    - `rope_theta`, `partial_rotary_factor`: the rotary embedding's base and the fraction
        of each head's features it turns.
    - `tie_word_embeddings`: the LM head is the embedding's transpose.
    - `layer_types`: `"linear_attention"` or `"full_attention"` per layer.
    - `mtp_num_hidden_layers`: the layers of the multi-token-prediction head
        ([`deltanet_cp.models.Qwen3_5MTP`][]); 0 (the default) for none.

    Every field is typed: the sizes are positive ints (not bools, floats or strings), the
    floats numbers, `tie_word_embeddings` a bool (not the string `"false"`, which would
    read as true); a field of the wrong type or out of range raises a `ValueError` naming
    it. `from_hf` refuses another model's config (a Qwen3-Next or Qwen3.5 MoE one).
    """

    _MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_5_text", "qwen3_5")

    intermediate_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(AbstractQwenTextConfig):
    """The sizes of a Qwen3-Next text model (transformers' `Qwen3NextConfig`), with its
    field names.

    The fields of [`deltanet_cp.models.Qwen3_5Config`][] (`intermediate_size` is the width
    of the dense MLP of the layers that have one), and:

    - `num_experts`, `num_experts_per_tok` (the top-k, at most `num_experts`),
        `moe_intermediate_size` (each routed expert's width),
        `shared_expert_intermediate_size`: the sparse mixture-of-experts blocks.
    - `norm_topk_prob`: renormalise the top-k router probabilities to sum to one.
    - `decoder_sparse_step`, `mlp_only_layers`: layer `i` is sparse if `(i + 1) %
        decoder_sparse_step == 0` and `i` is not in `mlp_only_layers` (those have the dense
        MLP).
    - `router_aux_loss_coef`: the load-balancing loss's weight in the training loss.
    """

    _MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_next",)

    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        super().__post_init__()
        _check_experts(self)
        beyond = [i for i in self.mlp_only_layers if i >= self.num_hidden_layers]
        if beyond:
            raise ValueError(
                f"The config's `mlp_only_layers` names layers {beyond}; the model has "
                f"{self.num_hidden_layers} (0 to {self.num_hidden_layers - 1})."
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the sparse mixture-of-experts block (else
        a dense SwiGLU MLP of `intermediate_size`)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3_5MoeConfig(AbstractQwenTextConfig):
    """The sizes of a Qwen3.5 MoE text model (transformers' `Qwen3_5MoeTextConfig`, or the
    `text_config` of its multimodal `Qwen3_5MoeConfig`), with its field names.

    The fields of [`deltanet_cp.models.Qwen3_5Config`][] except `intermediate_size` (every
    layer is sparse), and `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `shared_expert_intermediate_size`, `router_aux_loss_coef` as in
    [`deltanet_cp.models.Qwen3NextConfig`][]. The top-k router probabilities are always
    renormalised.
    """

    _MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text", "qwen3_5_moe")

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        super().__post_init__()
        _check_experts(self)

    @property
    def norm_topk_prob(self) -> bool:
        """Always: Qwen3.5 MoE renormalises the top-k router probabilities."""
        return True

    def is_sparse(self, layer: int) -> bool:
        """Always: every layer of Qwen3.5 MoE is sparse."""
        del layer
        return True


_CONFIGS: tuple[type[AbstractQwenTextConfig], ...] = (
    Qwen3_5Config,
    Qwen3NextConfig,
    Qwen3_5MoeConfig,
)


MLPType = Literal["dense", "sparse"]

# transformers' `KimiLinearConfig.attribute_map`: the `config.json` names (what its
# `save_pretrained` and Moonshot's checkpoints write) of fields read here by their attribute names.
_KIMI_JSON_NAMES = {
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KimiLinearConfig:
    """The sizes of a Kimi Linear model (transformers' `KimiLinearConfig`), with its field
    names.

    A frozen dataclass: a static configuration, hashable.

    **Fields:**

    - `vocab_size`, `hidden_size`, `intermediate_size` (the dense MLPs' width),
        `num_hidden_layers`, `rms_norm_eps` (every RMSNorm's epsilon).
    - `num_attention_heads`, `num_key_value_heads` (equal to it: transformers' latent
        attention expands the latent to every head), `kv_lora_rank`, `q_lora_rank` (`None`:
        a full-rank query projection), `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
        `attention_bias`: the multi-head latent attention layers (`"full_attention"`).
    - `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`: the Kimi Delta
        Attention layers (`"linear_attention"`).
    - `num_experts`, `num_experts_per_tok` (the top-k), `moe_intermediate_size` (each routed
        expert's width), `n_shared_experts` (the shared expert is
        `moe_intermediate_size * n_shared_experts` wide), `n_group`, `topk_group`,
        `norm_topk_prob`, `routed_scaling_factor`: the sparse layers' sigmoid router
        ([`deltanet_cp.nn.SigmoidTopKRouter`][]) and experts.
    - `layer_types`: `"linear_attention"` or `"full_attention"` per layer; by default
        transformers' pattern (full attention at every fourth layer from layer 4, 0-based).
    - `mlp_layer_types`: `"dense"` (a SwiGLU MLP of `intermediate_size`) or `"sparse"` per
        layer; by default the first `first_k_dense_replace` (1) layers dense.
    - `tie_word_embeddings`: must be false (transformers' model always has its own LM head).
    - `pad_token_id`, `bos_token_id`, `eos_token_id`: the special tokens, kept for
        `to_hf` (the model does not read them); `None` writes JSON null (transformers'
        defaults are ids of the released vocabulary, outside a smaller one).

    `from_hf` reads transformers' `config.json` (its names `num_experts_per_token`,
    `num_expert_group`, `num_shared_experts`, `moe_renormalize` or the attribute names) and
    Moonshot's (`linear_attn_config` with `num_heads`, `head_dim`, `short_conv_kernel_size`,
    `full_attn_layers` and `kda_layers` 1-based; `first_k_dense_replace`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.446
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    layer_types: tuple[LayerType, ...] = ()
    mlp_layer_types: tuple[MLPType, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        set_ = _setter(self)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_token_id"):
                if isinstance(value, (list, tuple)):
                    value = tuple(_count(f.name, v) for v in value)
                elif value is not None:
                    value = _count(f.name, value)
            elif f.type is int or (f.name.endswith(("_heads", "_rank")) and value is not None):
                value = as_config_int(f.name, value)
            elif f.type is float:
                value = as_config_float(f.name, value)
            elif f.type is bool:
                value = _bool(f.name, value)
            elif f.name in ("layer_types", "mlp_layer_types"):
                if isinstance(value, str) or not isinstance(value, (list, tuple)):
                    raise ValueError(
                        f"The config's `{f.name}` must be a list of layer types; got {value!r}."
                    )
                value = tuple(value)
            set_(f.name, value)
        n = self.num_hidden_layers
        if not self.layer_types:
            set_("layer_types", tuple(_LAYER_TYPES[bool(i and i % 4 == 0)] for i in range(n)))
        if not self.mlp_layer_types:
            set_("mlp_layer_types", tuple("dense" if i < 1 else "sparse" for i in range(n)))
        for name, allowed in (
            ("layer_types", _LAYER_TYPES),
            ("mlp_layer_types", ("dense", "sparse")),
        ):
            types = getattr(self, name)
            if len(types) != n:
                raise ValueError(f"`{name}` has {len(types)} entries for {n} layers.")
            unknown = sorted({repr(t) for t in types if t not in allowed})
            if unknown:
                raise ValueError(f"Unknown {name} {unknown}; expected {list(allowed)}.")
        if self.rms_norm_eps < 0:
            raise ValueError(
                f"The config's `rms_norm_eps` must be at least 0; got {self.rms_norm_eps}."
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"The config's `num_key_value_heads` ({self.num_key_value_heads}) must equal "
                f"`num_attention_heads` ({self.num_attention_heads}): the latent attention "
                "expands its latent to every head (transformers' model fails otherwise)."
            )
        if self.tie_word_embeddings:
            raise ValueError(
                "The config's `tie_word_embeddings` must be false: transformers' "
                "KimiLinearForCausalLM always has its own LM head."
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"The config's `num_experts_per_tok` ({self.num_experts_per_tok}) is more than "
                f"its `num_experts` ({self.num_experts})."
            )

    @property
    def mtp_num_hidden_layers(self) -> int:
        """0: Kimi Linear has no multi-token-prediction head."""
        return 0

    @property
    def router_aux_loss_coef(self) -> float:
        """0.0: transformers' Kimi Linear adds no load-balancing loss (its experts are
        balanced by the router's bias; see [`deltanet_cp.nn.SigmoidTopKRouter`][])."""
        return 0.0

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared expert's width, `moe_intermediate_size * n_shared_experts`."""
        return self.moe_intermediate_size * self.n_shared_experts

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the sparse mixture-of-experts block."""
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "KimiLinearConfig":
        """From transformers' or Moonshot's `config.json` as a dict.

        **Raises:**

        `ValueError` naming the field if one is missing, of the wrong type or asks for what
        is not supported (an activation other than SiLU, a router other than sigmoid, a
        latent attention with a rotary part, tied embeddings), and if the config is another
        model's (its `model_type`).
        """
        if not isinstance(config, Mapping):
            raise ValueError(
                f"The config must be a mapping (a JSON object); got {type(config).__name__}."
            )
        kind = config.get("model_type")
        if kind is not None and kind != "kimi_linear":
            owner = next((c for c in _CONFIGS if kind in c._MODEL_TYPES), None)
            hint = f"; read it with deltanet_cp.models.{owner.__name__}" if owner else ""
            raise ValueError(
                f"The config is of model_type {kind!r}, not a KimiLinearConfig (model_type "
                f"'kimi_linear'){hint}."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in fields}
        for name, json_name in _KIMI_JSON_NAMES.items():
            if json_name in config and name not in kwargs:
                kwargs[name] = config[json_name]
        if "num_local_experts" in config and "num_experts" not in kwargs:
            kwargs["num_experts"] = config["num_local_experts"]
        linear = config.get("linear_attn_config") or {}
        if not isinstance(linear, Mapping):
            raise ValueError(
                f"The config's `linear_attn_config` must be a mapping; got {linear!r}."
            )
        for name, nested in (
            ("linear_head_dim", "head_dim"),
            ("linear_num_heads", "num_heads"),
            ("linear_conv_kernel_dim", "short_conv_kernel_size"),
        ):
            if nested in linear:
                kwargs[name] = linear[nested]
        n = kwargs.get("num_hidden_layers")
        if "layer_types" not in kwargs and "full_attn_layers" in linear and isinstance(n, int):
            full = {as_config_int("full_attn_layers", i) for i in linear["full_attn_layers"]}
            kwargs["layer_types"] = tuple(_LAYER_TYPES[i + 1 in full] for i in range(n))
        if "mlp_layer_types" not in kwargs and isinstance(n, int):
            first = as_config_int("first_k_dense_replace", config.get("first_k_dense_replace", 1))
            kwargs["mlp_layer_types"] = tuple("dense" if i < first else "sparse" for i in range(n))
        if config.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"Only hidden_act='silu' is supported; got {config['hidden_act']!r}.")
        act = config.get("moe_router_activation_func", "sigmoid")
        if act != "sigmoid":
            raise ValueError(f"Only the sigmoid router is supported; the config asks for {act!r}.")
        if not _bool("mla_use_nope", config.get("mla_use_nope", True)):
            raise ValueError(
                "Only the latent attention without a rotary embedding (`mla_use_nope`: true, "
                "what transformers computes) is supported."
            )
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if required:
            raise ValueError(f"The config is missing {', '.join(f'`{n}`' for n in required)}.")
        for name in ("layer_types", "mlp_layer_types", "eos_token_id"):
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The inverse of `from_hf`: this config as transformers' `config.json` writes it
        (`model_type` `"kimi_linear"`, its names for the aliased fields, `layer_types` and
        `mlp_layer_types` spelled out), read back by `from_hf` and by transformers."""
        out: dict[str, Any] = {"model_type": "kimi_linear", "hidden_act": "silu"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            name = _KIMI_JSON_NAMES.get(f.name, f.name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "KimiLinearConfig":
        """From a `config.json` file, or a directory holding one: see `from_hf`."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"Cannot read {str(path)!r} as JSON: {e}.") from None
        try:
            return cls.from_hf(config)
        except ValueError as e:
            raise ValueError(f"In {str(path)!r}: {e}") from None


def _setter(obj):
    """A setter of a frozen dataclass's fields (inside its `__post_init__`)."""
    return lambda name, value: object.__setattr__(obj, name, value)
