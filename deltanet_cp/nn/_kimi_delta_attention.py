"""The Kimi Delta Attention layer of Kimi Linear, with context parallelism."""

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..recurrences._kda import KimiDeltaRule
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractDeltaLayer,
    fla_decay_init,
    RecurrentLayerState,
    Skeleton,
)
from ._kda_gates import kda_project, kda_split
from ._norm import SigmoidGatedRMSNorm


# The state's former name; the public one (`deltanet_cp.nn.KimiDeltaAttentionState`) warns.
KimiDeltaAttentionState = RecurrentLayerState


class KimiDeltaAttention(AbstractDeltaLayer[RecurrentLayerState]):
    r"""The Kimi Delta Attention (KDA) token mixer of Kimi Linear.

    For an input `x` of shape `(seq, hidden)`, with `H` heads of size `K`:

    1. projections `q, k, v = x W_q, x W_k, x W_v` (each `H K` wide);
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over each;
    3. a forget gate per head and key channel, from a low-rank projection (rank `K`):
        $g = -e^{A_{\log}} \, \mathrm{softplus}(x W_{f_a} W_{f_b} + \Delta_b)$, and
        $\beta = \sigma(x W_b)$ per head (both float32);
    4. the chunked Kimi delta rule ([`deltanet_cp.chunk_kda`][]) with q/k
        L2 normalisation;
    5. a sigmoid-gated RMSNorm per head, $\mathrm{rms}(o) \odot w \odot \sigma(x W_{g_a}
        W_{g_b})$, the gate again low-rank;
    6. the output projection back to `hidden`.

    Call it on one sequence and `jax.vmap` over the batch, as any Equinox layer. It computes
    in its parameters' dtype (the recurrence's state and gates in float32, or float64) and
    returns its input's dtype. Inside `jax.shard_map` with time sharded over a mesh axis,
    pass a [`deltanet_cp.ContextParallel`][] as `cp`: the convolution fetches its
    `conv_kernel_size - 1` token halo from the previous piece by `ppermute` and the
    recurrence runs through [`deltanet_cp.run`][] with the same `cp`, whose payload does
    not grow with the sequence length.

    `__call__` maps a sequence to its output; `prefill` also returns the state after it
    (and, optionally, the states at fixed token boundaries); `step` does one token. These,
    and context parallelism, are those of [`deltanet_cp.nn.GatedDeltaNet`][].

    [`deltanet_cp.interop.kimi_delta_attention_from_hf`][] loads transformers'
    `KimiLinearDeltaAttention` weights (or Moonshot's checkpoint names) into it; the one
    difference in layout is that `q_proj`, `k_proj` and `v_proj` are one `in_proj_qkv`
    here.
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    f_a_proj: eqx.nn.Linear
    f_b_proj: eqx.nn.Linear
    A_log: Float[Array, " heads"]
    dt_bias: Float[Array, "heads k"]
    b_proj: eqx.nn.Linear
    g_a_proj: eqx.nn.Linear
    g_b_proj: eqx.nn.Linear
    norm: SigmoidGatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-5,
        chunk_size: int | None = None,
        block_size: int | None = None,
        memory: Memory | None = None,
        precision: PrecisionName | None = None,
        options: EngineOptions | None = None,
        key: PRNGKeyArray,
        dtype=None,
    ):
        r"""**Arguments:**

        - `hidden_size`: the model width (input and output features).
        - `num_heads`: `H`, the number of heads (queries, keys and values alike).
        - `head_dim`: `K`, the head size of queries, keys and values, and the rank of the
            low-rank forget and output gates (as in Kimi Linear).
        - `conv_kernel_size`: the length of the causal convolutions.
        - `norm_eps`: the epsilon of the gated RMSNorm (`rms_norm_eps` of the config).
        - `chunk_size`: tokens per chunk of the delta rule.
        - `block_size`: the engine's block (the `block_size` of [`deltanet_cp.run`][]);
            `None` takes [`deltanet_cp.default_block_size`][].
        - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
            `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `precision`: how the delta rule's large products multiply, as for
            [`deltanet_cp.nn.GatedDeltaNet`][]: `"highest"`, `"bfloat16"`, `"default"`,
            or `None` (from the parameters' dtype). The state, the gates and the norm stay
            float32 under every policy.
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters. Linear layers and the convolution
            use the Equinox/torch defaults, $A_{\log} = \log U(1, 16)$ and $\Delta_b$ the
            inverse softplus of $e^{U(\log 10^{-3}, \log 10^{-1})}$ (flash-linear-attention's
            recipe), and the norm weight is ones.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive
        (`block_size` may also be `None`).
        """
        s = Skeleton(
            dict(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim),
            heads="num_heads",
            dims="head_dim",
            conv_kernel_size=conv_kernel_size,
            options=engine_options(options, chunk_size, block_size, memory, precision),
            dtype=dtype,
        )
        keys = jr.split(key, 10)
        hidden_size, num_heads, head_dim = s.sizes.values()
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1])
        self.f_a_proj = s.linear(hidden_size, head_dim, keys[2])
        self.f_b_proj = s.linear(head_dim, s.key_dim, keys[3])
        self.A_log, self.dt_bias = fla_decay_init(
            keys[4], keys[5], (num_heads,), (num_heads, head_dim), s.dtype
        )
        self.b_proj = s.linear(hidden_size, num_heads, keys[6])
        self.g_a_proj = s.linear(hidden_size, head_dim, keys[7])
        self.g_b_proj = s.linear(head_dim, s.value_dim, keys[8])
        self.norm = s.norm(SigmoidGatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[9])
        s.fill(self)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def _project(self, x):
        return kda_project(self, x)

    def _split(self, mixed, rest):
        return kda_split(self, mixed, rest)

    def _recurrence(self, chunk_size: int) -> KimiDeltaRule:
        return KimiDeltaRule(chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision)
