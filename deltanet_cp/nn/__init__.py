"""Equinox layers: the Gated DeltaNet layer of Qwen3-Next / Qwen3.5, the Kimi Delta Attention
layer of Kimi Linear, a layer for each other recurrence (DeltaNet, gated linear attention,
Gated DeltaProduct, Gated DeltaNet-2, Momentum DeltaNet, the preconditioned Gated DeltaNet and
Kimi Delta Attention, RWKV-7's time mix), attention, a sparse mixture-of-experts block and a
small hybrid model."""

from ._attention import CausalSelfAttention as CausalSelfAttention, KVCache as KVCache
from ._conv import CausalConv1d as CausalConv1d
from ._delta_layer import RecurrentLayerState as RecurrentLayerState
from ._delta_net import DeltaNet as DeltaNet
from ._gated_delta_net import (
    GatedDeltaNet as GatedDeltaNet,
    GatedDeltaNetState as GatedDeltaNetState,
)
from ._gated_delta_net_2 import GatedDeltaNet2 as GatedDeltaNet2
from ._gated_delta_product import GatedDeltaProduct as GatedDeltaProduct
from ._gated_linear_attention import (
    GatedLinearAttention as GatedLinearAttention,
    SimpleGatedLinearAttention as SimpleGatedLinearAttention,
)
from ._hybrid import HybridBlock as HybridBlock, HybridLM as HybridLM, SwiGLU as SwiGLU
from ._kimi_delta_attention import (
    KimiDeltaAttention as KimiDeltaAttention,
    KimiDeltaAttentionState as KimiDeltaAttentionState,
)
from ._moe import (
    expert_partition_specs as expert_partition_specs,
    load_balancing_loss as load_balancing_loss,
    RouterStats as RouterStats,
    SparseMoE as SparseMoE,
    SwiGLUExperts as SwiGLUExperts,
)
from ._momentum_delta_net import MomentumDeltaNet as MomentumDeltaNet
from ._norm import (
    GatedRMSNorm as GatedRMSNorm,
    GroupNorm as GroupNorm,
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
