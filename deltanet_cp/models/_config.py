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
