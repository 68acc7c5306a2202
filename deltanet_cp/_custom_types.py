"""Shared jaxtyping aliases."""

from typing import TypeAlias

from jaxtyping import Array, Float, Int


# Per-token tensors in the (batch, time, head, feature) layout every recurrence uses.
QKTensor: TypeAlias = Float[Array, "batch seq heads k"]
ValueTensor: TypeAlias = Float[Array, "batch seq vheads v"]
GateTensor: TypeAlias = Float[Array, "batch seq vheads"]
# The recurrent state: one (K, V) matrix per batch element and value head.
State: TypeAlias = Float[Array, "batch vheads k v"]
# A state per batch element, or with packed documents (`cu_seqlens`) one per document.
States: TypeAlias = Float[Array, "batch_or_docs vheads k v"]
# A log decay per key channel, for every token and value head (KDA, GLA).
KeyGateTensor: TypeAlias = Float[Array, "batch seq vheads k"]
# Packed documents: the offsets [0, len_0, len_0 + len_1, ..., T], as an int array or a list.
CuSeqlens: TypeAlias = Int[Array, " docs_plus_one"] | list[int]
