"""The configuration of a Qwen3.5 dense text model, read from a Hugging Face `config.json`."""

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

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


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
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

    Every field is typed: the sizes are positive ints (not bools, floats or strings), the
    floats numbers, `tie_word_embeddings` a bool (not the string `"false"`, which would
    read as true); a field of the wrong type or out of range raises a `ValueError` naming
    it.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type is int:
                value = as_config_int(f.name, value)
            elif f.type is float:
                value = as_config_float(f.name, value)
            elif f.type is bool:
                value = _bool(f.name, value)
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

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Qwen3_5Config":
        """From a transformers config as a dict (the contents of `config.json`): a
        `Qwen3_5TextConfig` (`model_type` `"qwen3_5_text"`) or a `Qwen3_5Config` with its
        `text_config` (the vision tower is not read).

        **Raises:**

        `ValueError` naming the field if one is missing, of the wrong type (a bool must be
        a JSON bool, a size a JSON int) or asks for what is not supported (an activation
        other than SiLU, attention biases, a rotary scaling).
        """
        if not isinstance(config, Mapping):
            raise ValueError(
                f"The config must be a mapping (a JSON object); got {type(config).__name__}."
            )
        top = config
        text = config.get("text_config") or config
        if not isinstance(text, Mapping):
            raise ValueError(f"The config's `text_config` must be a mapping; got {text!r}.")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in fields}
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
        if isinstance(kwargs.get("layer_types"), list):
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Qwen3_5Config":
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
