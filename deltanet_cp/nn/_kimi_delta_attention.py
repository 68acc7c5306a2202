"""The Kimi Delta Attention layer of Kimi Linear, with context parallelism."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._precision import PrecisionName
from .._run import as_memory, Memory
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._kda import KimiDeltaRule
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractDeltaLayer,
    check_sizes,
    fla_decay_init,
    log_decay,
    no_bias_linear,
    one_sequence,
    project,
    split_qkv,
)
from ._norm import SigmoidGatedRMSNorm


class KimiDeltaAttentionState(eqx.Module):
    """What a [`deltanet_cp.nn.KimiDeltaAttention`][] carries from one segment to the next.

    **Fields:**

    - `conv`: the last `conv_kernel_size - 1` inputs of the convolution (the projected
        `concat(q, k, v)` before the convolution), `(conv_kernel_size - 1, 3 H K)`.
    - `recurrent`: the delta rule's state, `(heads, K, K)`, float32.

    Both may carry the same leading batch axes (to be `jax.vmap`ped over with the input).
    """

    conv: Float[Array, "*batch history conv_dim"]
    recurrent: Float[Array, "*batch heads k v"]


class KimiDeltaAttention(AbstractDeltaLayer[KimiDeltaAttentionState]):
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
    chunk_size: int = eqx.field(static=True)
    block_size: int | None = eqx.field(static=True)
    memory: Memory | None = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
        block_size: int | None = None,
        memory: Memory | None = None,
        precision: PrecisionName | None = None,
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
        - `key`: a PRNG key for the initial parameters. Linear layers and the convolution
            use the Equinox/torch defaults, $A_{\log} = \log U(1, 16)$ and $\Delta_b$ the
            inverse softplus of $e^{U(\log 10^{-3}, \log 10^{-1})}$ (flash-linear-attention's
            recipe), and the norm weight is ones.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive
        (`block_size` may also be `None`).
        """
        sizes = dict(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            conv_kernel_size=conv_kernel_size,
            chunk_size=chunk_size,
        )
        checked = check_sizes(sizes, block_size, precision)
        hidden_size, num_heads, head_dim, conv_kernel_size, chunk_size = checked[:5]
        block_size, precision = checked[5:]
        linear = no_bias_linear(dtype)
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        keys = jr.split(key, 10)
        width = num_heads * head_dim

        self.in_proj_qkv = linear(hidden_size, 3 * width, keys[0])
        self.conv1d = CausalConv1d(3 * width, conv_kernel_size, key=keys[1], dtype=dtype)
        self.f_a_proj = linear(hidden_size, head_dim, keys[2])
        self.f_b_proj = linear(head_dim, width, keys[3])
        self.A_log, self.dt_bias = fla_decay_init(
            keys[4], keys[5], (num_heads,), (num_heads, head_dim), dtype
        )
        self.b_proj = linear(hidden_size, num_heads, keys[6])
        self.g_a_proj = linear(hidden_size, head_dim, keys[7])
        self.g_b_proj = linear(head_dim, width, keys[8])
        self.norm = SigmoidGatedRMSNorm(head_dim, eps=norm_eps, dtype=dtype)
        self.out_proj = linear(width, hidden_size, keys[9])
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.memory = as_memory(memory)
        self.precision = precision

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def _project(self, x):
        return kda_project(self, x)

    def _split(self, mixed, rest):
        return kda_split(self, mixed, rest)

    def _state(self, conv, recurrent) -> KimiDeltaAttentionState:
        return KimiDeltaAttentionState(conv=conv, recurrent=recurrent)

    def _recurrence(self, chunk_size: int) -> KimiDeltaRule:
        return KimiDeltaRule(chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision)


def kda_project(layer, x):
    """Kimi Delta Attention's projections of `x: (seq, hidden)` (those of `layer`, which has
    its fields): `(qkv (seq, 3 H K), (f, b, gate))`."""
    qkv, f, b, gate = project(x, layer.in_proj_qkv, layer.f_a_proj, layer.b_proj, layer.g_a_proj)
    (f,) = project(f, layer.f_b_proj)
    (gate,) = project(gate, layer.g_b_proj)
    return qkv, (f, b, gate)


def kda_split(layer, mixed, rest) -> tuple[DeltaInputs, Array]:
    """Kimi Delta Attention's recurrence inputs (a batch of one) and output gate from the
    convolution's output after SiLU, `(seq, 3 H K)`, and the rest of `kda_project`."""
    f, b, gate = rest
    h, dk = layer.num_heads, layer.head_dim
    q, k, v = split_qkv(mixed, h, dk, dk)
    g = log_decay(f.reshape(v.shape), layer.A_log[None, :, None], layer.dt_bias[None])
    return one_sequence(DeltaInputs, q, k, v, g, jax.nn.sigmoid(b)), gate.reshape(v.shape)
