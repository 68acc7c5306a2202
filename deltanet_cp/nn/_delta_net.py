"""The DeltaNet layer: the delta rule without a decay, with context parallelism."""

import equinox as eqx
import jax.random as jr
from jaxtyping import PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..recurrences._delta import DeltaRule
from ..recurrences._delta_family import DeltaInputs
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractRecurrentLayer,
    one_sequence,
    project,
    RecurrentLayerState,
    Skeleton,
    split_qkv,
    step_sizes,
)
from ._norm import GatedRMSNorm


class DeltaNet(AbstractRecurrentLayer[RecurrentLayerState]):
    r"""The DeltaNet token mixer: one delta-rule update per token, no decay.

    For an input `x` of shape `(seq, hidden)`:

    1. projections `qkv = x W_qkv`, `b = x W_b`, `z = x W_g`;
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over `qkv`,
        then a split into `q, k: (seq, H, K)` and `v: (seq, HV, V)`;
    3. the step size $\beta = \sigma(b)$ per value head ($2 \sigma(b)$ with
        `allow_neg_eigval`);
    4. the chunked delta rule ([`deltanet_cp.chunk_delta_rule`][]) with q/k L2
        normalisation, $S_t = S_{t-1} + \beta_t k_t (v_t - S_{t-1}^\top k_t)^\top$,
        value head `j` reading key head `j // (HV // H)`;
    5. a gated RMSNorm per value head, $\mathrm{rms}(o) \odot w \odot \mathrm{silu}(z)$;
    6. the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.DeltaNet` with `use_gate=True` (its
    default short convolution, SiLU on q and k, L2 norm, the sigmoid step size), with
    `q_proj`, `k_proj` and `v_proj` as one `in_proj_qkv` and value heads that may be grouped
    over the key heads, as Gated DeltaNet's.

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]; its state is a
    [`deltanet_cp.nn.RecurrentLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    b_proj: eqx.nn.Linear
    g_proj: eqx.nn.Linear
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_key_heads: int = eqx.field(static=True)
    num_value_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    allow_neg_eigval: bool = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        allow_neg_eigval: bool = False,
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
        - `num_key_heads`: `H`, the number of query/key heads.
        - `num_value_heads`: `HV`, the number of value heads, a multiple of `H`.
        - `key_head_dim`: `K`, the query/key head size.
        - `value_head_dim`: `V`, the value head size.
        - `allow_neg_eigval`: step sizes in $[0, 2]$ rather than $[0, 1]$.
        - `conv_kernel_size`: the length of the causal convolution.
        - `norm_eps`: the epsilon of the gated RMSNorm.
        - `chunk_size`: tokens per chunk of the delta rule.
        - `block_size`: the engine's block (the `block_size` of [`deltanet_cp.run`][]);
            `None` takes [`deltanet_cp.default_block_size`][].
        - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
            `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `precision`: how the recurrence's large products multiply, as for
            [`deltanet_cp.nn.GatedDeltaNet`][].
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters: the Equinox/torch defaults for the
            linear layers and the convolution, the norm weight ones.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive or if
        `num_value_heads` is not a multiple of `num_key_heads`.
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
        keys = jr.split(key, 5)
        hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim = s.sizes.values()
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1])
        self.b_proj = s.linear(hidden_size, num_value_heads, keys[2])
        self.g_proj = s.linear(hidden_size, s.value_dim, keys[3])
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[4])
        s.fill(self)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, b, gate = project(x, self.in_proj_qkv, self.b_proj, self.g_proj)
        return qkv, (b, gate)

    def _split(self, mixed, rest):
        b, gate = rest
        q, k, v = split_qkv(mixed, self.num_key_heads, self.key_head_dim, self.value_head_dim)
        beta = step_sizes(b, self.allow_neg_eigval)
        return one_sequence(DeltaInputs, q, k, v, None, beta), gate.reshape(v.shape)

    def _recurrence(self, chunk_size: int) -> DeltaRule:
        return DeltaRule(chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision)
