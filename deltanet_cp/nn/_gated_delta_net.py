"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5, with context parallelism."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._gated_delta import GatedDeltaRule
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractDeltaLayer,
    log_decay,
    one_sequence,
    project,
    RecurrentLayerState,
    Skeleton,
    split_qkv,
)
from ._norm import GatedRMSNorm


# The state's former name; the public one (`deltanet_cp.nn.GatedDeltaNetState`) warns.
GatedDeltaNetState = RecurrentLayerState


class GatedDeltaNet(AbstractDeltaLayer[RecurrentLayerState]):
    r"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5.

    For an input `x` of shape `(seq, hidden)`:

    1. projections `qkv = x W_qkv`, `z = x W_z`, `b = x W_b`, `a = x W_a`;
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over `qkv`,
        then a split into `q, k: (seq, H, K)` and `v: (seq, HV, V)`;
    3. gates $\beta = \sigma(b)$ and $g = -e^{A_{\log}} \, \mathrm{softplus}(a + \Delta_b)$
        (float32), one per value head;
    4. the chunked gated delta rule with q/k L2 normalisation, value head `j` reading key
        head `j // (HV // H)`;
    5. a gated RMSNorm per value head, $\mathrm{rms}(o) \odot w \odot \mathrm{silu}(z)$;
    6. the output projection back to `hidden`.

    Call it on one sequence and `jax.vmap` over the batch, as any Equinox layer. It computes
    in its parameters' dtype (the recurrence's state and gates in float32, or float64) and
    returns its input's dtype: a bfloat16 `x` through float32 parameters gives bfloat16.
    Inside `jax.shard_map` with time sharded over a mesh axis, pass a
    [`deltanet_cp.ContextParallel`][] as `cp`: the convolution fetches its
    `conv_kernel_size - 1` token halo from the previous piece by `ppermute` and the
    recurrence runs through [`deltanet_cp.run`][] with the same `cp`, whose payload does
    not grow with the sequence length.

    `__call__` maps a sequence to its output; `prefill` also returns the state after it
    (and, optionally, the states at fixed token boundaries); `step` does one token.

    The parameters use the Qwen3.5 layout (separate `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`); [`deltanet_cp.interop.gated_delta_net_from_hf`][] loads
    either Hugging Face layout into it.
    """

    in_proj_qkv: eqx.nn.Linear
    in_proj_z: eqx.nn.Linear
    in_proj_b: eqx.nn.Linear
    in_proj_a: eqx.nn.Linear
    conv1d: CausalConv1d
    A_log: Float[Array, " vheads"]
    dt_bias: Float[Array, " vheads"]
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_key_heads: int = eqx.field(static=True)
    num_value_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
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
        - `num_key_heads`: `H`, the number of query/key heads.
        - `num_value_heads`: `HV`, the number of value heads, a multiple of `H`.
        - `key_head_dim`: `K`, the query/key head size.
        - `value_head_dim`: `V`, the value head size.
        - `conv_kernel_size`: the length of the causal convolution.
        - `norm_eps`: the epsilon of the gated RMSNorm.
        - `chunk_size`: tokens per chunk of the gated delta rule (`None`: 64).
        - `block_size`: the engine's block, tokens whose chunk factors are formed together
            (the `block_size` of [`deltanet_cp.run`][]); `None` takes
            [`deltanet_cp.default_block_size`][] (the backend's default).
        - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
            `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `precision`: how the gated delta rule's large products multiply (the chunk
            Grams, the WY products, `q h`, `w h`, `k~^T v`): `"highest"` (float32 operands
            at `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32
            accumulation), `"default"` (`jax.default_matmul_precision`), or `None`: from
            the recurrence's inputs, which are in the parameters' dtype (`"bfloat16"` for
            bfloat16 parameters, `"highest"` otherwise). The recurrent state, the gates,
            the chunk maps and the norm stay float32 under every policy. The dense
            projections are `equinox.nn.Linear`s: they multiply in the parameters' dtype
            at JAX's default precision whatever the policy.
        - `options`: the four settings above as one [`deltanet_cp.EngineOptions`][]
            (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters. Linear layers and the convolution
            use the Equinox/torch defaults, $A_{\log} = \log U(1, 16)$ and $\Delta_b = 1$
            (Qwen3-Next's recipe), and the norm weight is ones.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int (NumPy integers are accepted), `ValueError` if it
        is not positive (`block_size` may also be `None`) or if `num_value_heads` is not a
        multiple of `num_key_heads`.
        """
        s = Skeleton.grouped(
            hidden_size,
            num_key_heads,
            num_value_heads,
            key_head_dim,
            value_head_dim,
            conv_kernel_size=conv_kernel_size,
            options=engine_options(options, chunk_size, block_size, memory, precision),
            dtype=dtype,
        )
        kqkv, kz, kb, ka, kconv, kA, kout = jr.split(key, 7)
        hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim = s.sizes.values()
        self.in_proj_qkv, self.conv1d = s.qkv(kqkv, kconv)
        self.in_proj_z = s.linear(hidden_size, s.value_dim, kz)
        self.in_proj_b = s.linear(hidden_size, num_value_heads, kb)
        self.in_proj_a = s.linear(hidden_size, num_value_heads, ka)
        self.A_log = jnp.log(jr.uniform(kA, (num_value_heads,), s.dtype, 1.0, 16.0))
        self.dt_bias = jnp.ones((num_value_heads,), s.dtype)
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(kout)
        s.fill(self)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        """Projections of `x: (seq, hidden)`, in the parameters' dtype:
        `(qkv (seq, conv_dim), (z, b, a))`."""
        qkv, z, b, a = project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        return qkv, (z, b, a)

    def _split(self, mixed, rest):
        """Post-convolution `(seq, conv_dim)` etc. to the recurrence inputs."""
        z, b, a = rest
        q, k, v = split_qkv(mixed, self.num_key_heads, self.key_head_dim, self.value_head_dim)
        z = z.reshape(v.shape)
        g = log_decay(a, self.A_log[None], self.dt_bias[None])
        return one_sequence(DeltaInputs, q, k, v, g, jax.nn.sigmoid(b)), z

    def _recurrence(self, chunk_size: int) -> GatedDeltaRule:
        return GatedDeltaRule(chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision)
