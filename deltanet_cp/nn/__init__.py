"""Equinox layers: the Gated DeltaNet layer of Qwen3-Next / Qwen3.5, the Kimi Delta Attention
layer of Kimi Linear, a layer for each other recurrence (DeltaNet, gated linear attention,
Gated DeltaProduct, Gated DeltaNet-2, Momentum DeltaNet, the preconditioned Gated DeltaNet and
Kimi Delta Attention, RWKV-7's time mix), attention and Kimi Linear's multi-head latent
attention, a sparse mixture-of-experts block and a small hybrid model."""

from ._attention import CausalSelfAttention as CausalSelfAttention, KVCache as KVCache
from ._conv import CausalConv1d as CausalConv1d
from ._delta_layer import (
    AbstractRecurrentLayer as AbstractRecurrentLayer,
    RecurrentLayerState as RecurrentLayerState,
    Skeleton as Skeleton,
)
from ._delta_net import DeltaNet as DeltaNet
from ._fsdp import (
    FSDP as FSDP,
    gather_params as gather_params,
    partition_specs as partition_specs,
)
from ._gated_delta_net import GatedDeltaNet as GatedDeltaNet
from ._gated_delta_net_2 import GatedDeltaNet2 as GatedDeltaNet2
from ._gated_delta_product import GatedDeltaProduct as GatedDeltaProduct
from ._gated_linear_attention import (
    GatedLinearAttention as GatedLinearAttention,
    SimpleGatedLinearAttention as SimpleGatedLinearAttention,
)
from ._hybrid import HybridBlock as HybridBlock, HybridLM as HybridLM
from ._kimi_delta_attention import KimiDeltaAttention as KimiDeltaAttention
from ._latent_attention import (
    LatentKVCache as LatentKVCache,
    MultiHeadLatentAttention as MultiHeadLatentAttention,
)
from ._layer_stack import LayerStack as LayerStack
from ._mixer import (
    AbstractEngineMixer as AbstractEngineMixer,
    AbstractTokenMixer as AbstractTokenMixer,
)
from ._mlp import SwiGLU as SwiGLU
from ._moe import (
    expert_partition_specs as expert_partition_specs,
    load_balancing_loss as load_balancing_loss,
    RouterStats as RouterStats,
    SigmoidTopKRouter as SigmoidTopKRouter,
    SparseMoE as SparseMoE,
    SwiGLUExperts as SwiGLUExperts,
)
from ._momentum_delta_net import MomentumDeltaNet as MomentumDeltaNet
from ._norm import (
    GatedRMSNorm as GatedRMSNorm,
    GroupNorm as GroupNorm,
    RMSNorm as RMSNorm,
    SigmoidGatedRMSNorm as SigmoidGatedRMSNorm,
    ZeroCenteredRMSNorm as ZeroCenteredRMSNorm,
)
from ._precond import (
    PrecondGatedDeltaNet as PrecondGatedDeltaNet,
    PrecondKimiDeltaAttention as PrecondKimiDeltaAttention,
    PrecondLayerState as PrecondLayerState,
)
from ._rwkv7_attention import (
    RWKV7Attention as RWKV7Attention,
    RWKV7AttentionState as RWKV7AttentionState,
)


# Former names, kept importable for one release.
_DEPRECATED = {
    "GatedDeltaNetState": "RecurrentLayerState",
    "KimiDeltaAttentionState": "RecurrentLayerState",
}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import warnings

        new = _DEPRECATED[name]
        warnings.warn(
            f"`deltanet_cp.nn.{name}` is deprecated: it is `deltanet_cp.nn.{new}` (every "
            "recurrent layer's state); import that instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
