"""Gated linear attention layers: a decay per key channel (GLA) or one per head (the Mamba-2 /
RetNet form), with context parallelism."""

from typing import Any

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import accumulation_dtype, PrecisionName
from .._run import Memory
from ..recurrences._gla import GLAInputs, GLARule
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractRecurrentLayer,
    one_sequence,
    project,
    RecurrentLayerState,
    Skeleton,
    split_qkv,
)
from ._norm import GatedRMSNorm


def _normalizer(normalizer: Any) -> float:
    """`gate_logit_normalizer` as a positive float."""
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)) or normalizer <= 0:
        raise ValueError(f"`gate_logit_normalizer` must be a positive number; got {normalizer!r}.")
    return float(normalizer)


def _log_sigmoid_decay(logits: Array, normalizer: float) -> Array:
    r"""$\log \sigma(x) / n$ in float32 (float64 for float64 `x`): log decays below 0."""
    return jax.nn.log_sigmoid(logits.astype(accumulation_dtype(logits))) / normalizer


class GatedLinearAttention(AbstractRecurrentLayer[RecurrentLayerState]):
    r"""The gated linear attention (GLA) token mixer: a decay per head and key channel.

    For an input `x` of shape `(seq, hidden)`, with `H` heads of key size `K` and value
    size `V`:

    1. projections `q, k, v = x W_q, x W_k, x W_v` (`H K`, `H K` and `H V` wide);
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over each;
    3. a log decay per head and key channel from a low-rank projection,
        $g = \log \sigma(x W_{g_a} W_{g_b} + b) / n$ with $n$ = `gate_logit_normalizer`
        (float32);
    4. gated linear attention, $h_t = \mathrm{diag}(e^{g_t}) h_{t-1} + k_t v_t^\top$,
        $o_t = h_t^\top q_t / \sqrt{K}$, in chunks ([`deltanet_cp.chunk_gla`][]);
    5. a gated RMSNorm per head, $\mathrm{rms}(o) \odot w \odot \mathrm{silu}(x W_g)$;
    6. the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.GatedLinearAttention` with
    `use_short_conv=True` and its default swish output gate (no feature map, as many
    key/value heads as query heads), with `q_proj`, `k_proj` and `v_proj` as one
    `in_proj_qkv`.

    Call it on one sequence and `jax.vmap` over the batch. `__call__`, `prefill`, `step`,
    the precision policy and context parallelism (`cp` inside `jax.shard_map`, either
    layout) are those of [`deltanet_cp.nn.GatedDeltaNet`][]; its state is a
    [`deltanet_cp.nn.RecurrentLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    gk_a_proj: eqx.nn.Linear
    gk_b_proj: eqx.nn.Linear
    g_proj: eqx.nn.Linear
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    gate_logit_normalizer: float = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16,
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
        """**Arguments:**

        - `hidden_size`: the model width (input and output features).
        - `num_heads`: `H`, the number of heads.
        - `key_head_dim`: `K`, the query/key head size.
        - `value_head_dim`: `V`, the value head size.
        - `gate_low_rank_dim`: the rank of the decay's projection.
        - `gate_logit_normalizer`: `n`, the divisor of the log-sigmoid decays.
        - `conv_kernel_size`: the length of the causal convolution.
        - `norm_eps`: the epsilon of the gated RMSNorm.
        - `chunk_size`: tokens per chunk of the recurrence.
        - `block_size`: the engine's block (the `block_size` of [`deltanet_cp.run`][]);
            `None` takes [`deltanet_cp.default_block_size`][].
        - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
            `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `precision`: how the recurrence's large products multiply, as for
            [`deltanet_cp.nn.GatedDeltaNet`][]: `"highest"`, `"bfloat16"`, `"default"`,
            or `None` (from the parameters' dtype).
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters (the Equinox/torch defaults; the
            norm weight is ones).
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive or if
        `gate_logit_normalizer` is not a positive number.
        """
        normalizer = _normalizer(gate_logit_normalizer)
        options = engine_options(options, chunk_size, block_size, memory, precision)
        s = Skeleton(
            dict(
                hidden_size=hidden_size,
                num_heads=num_heads,
                key_head_dim=key_head_dim,
                value_head_dim=value_head_dim,
                gate_low_rank_dim=gate_low_rank_dim,
            ),
            heads=("num_heads", "num_heads"),
            conv_kernel_size=conv_kernel_size,
            options=options,
            dtype=dtype,
        )
        keys = jr.split(key, 6)
        hidden_size, num_heads, key_head_dim, value_head_dim, rank = s.sizes.values()
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1])
        self.gk_a_proj = s.linear(hidden_size, rank, keys[2])
        self.gk_b_proj = s.linear(rank, s.key_dim, keys[3], bias=True)
        self.g_proj = s.linear(hidden_size, s.value_dim, keys[4])
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[5])
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.gate_logit_normalizer = normalizer
        self.options = options

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, gk, gate = project(x, self.in_proj_qkv, self.gk_a_proj, self.g_proj)
        (gk,) = project(gk, self.gk_b_proj)
        return qkv, (gk, gate)

    def _split(self, mixed, rest):
        gk, gate = rest
        q, k, v = split_qkv(mixed, self.num_heads, self.key_head_dim, self.value_head_dim)
        g = _log_sigmoid_decay(gk.reshape(k.shape), self.gate_logit_normalizer)
        return one_sequence(GLAInputs, q, k, v, g), gate.reshape(v.shape)

    def _recurrence(self, chunk_size: int) -> GLARule:
        return GLARule(chunk_size=chunk_size, precision=self.precision)


class SimpleGatedLinearAttention(AbstractRecurrentLayer[RecurrentLayerState]):
    r"""Gated linear attention with one decay per head (the Mamba-2 / RetNet form).

    As [`deltanet_cp.nn.GatedLinearAttention`][], but the log decay is one number per
    head and token, $g = \log \sigma(x W_{g_k} + b) / n$: the state decays by the same
    factor on every key channel, the scalar-decay linear attention of Mamba-2's SSD.
    This is flash-linear-attention's `fla.layers.simple_gla.SimpleGatedLinearAttention`
    (as many key/value heads as query heads, its default short convolution and swish
    output gate), with `q_proj`, `k_proj` and `v_proj` as one `in_proj_qkv`.

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]; its state is a
    [`deltanet_cp.nn.RecurrentLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    gk_proj: eqx.nn.Linear
    g_proj: eqx.nn.Linear
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    gate_logit_normalizer: float = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        gate_logit_normalizer: float = 16,
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
        """**Arguments:** as for [`deltanet_cp.nn.GatedLinearAttention`][] (without
        `gate_low_rank_dim`: the decay's projection is `hidden -> H`, with a bias)."""
        normalizer = _normalizer(gate_logit_normalizer)
        options = engine_options(options, chunk_size, block_size, memory, precision)
        s = Skeleton(
            dict(
                hidden_size=hidden_size,
                num_heads=num_heads,
                key_head_dim=key_head_dim,
                value_head_dim=value_head_dim,
            ),
            heads=("num_heads", "num_heads"),
            conv_kernel_size=conv_kernel_size,
            options=options,
            dtype=dtype,
        )
        keys = jr.split(key, 5)
        hidden_size, num_heads, key_head_dim, value_head_dim = s.sizes.values()
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1])
        self.gk_proj = s.linear(hidden_size, num_heads, keys[2], bias=True)
        self.g_proj = s.linear(hidden_size, s.value_dim, keys[3])
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[4])
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.gate_logit_normalizer = normalizer
        self.options = options

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, gk, gate = project(x, self.in_proj_qkv, self.gk_proj, self.g_proj)
        return qkv, (gk, gate)

    def _split(self, mixed, rest):
        gk, gate = rest
        q, k, v = split_qkv(mixed, self.num_heads, self.key_head_dim, self.value_head_dim)
        g = _log_sigmoid_decay(gk, self.gate_logit_normalizer)
        return one_sequence(GLAInputs, q, k, v, g), gate.reshape(v.shape)

    def _recurrence(self, chunk_size: int) -> GLARule:
        return GLARule(chunk_size=chunk_size, precision=self.precision)
