"""The Gated DeltaNet-2 layer: erase and write gates per channel, with context parallelism."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._gdn2 import GatedDeltaNet2Rule
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractRecurrentLayer,
    fla_decay_init,
    log_decay,
    one_sequence,
    project,
    RecurrentLayerState,
    Skeleton,
    split_qkv,
    step_sizes,
)
from ._norm import SigmoidGatedRMSNorm


class GatedDeltaNet2(AbstractRecurrentLayer[RecurrentLayerState]):
    r"""The Gated DeltaNet-2 (GDN-2) token mixer: a delta rule that erases along
    $b \odot k$ and writes $w \odot v$, with a decay per key channel.

    For an input `x` of shape `(seq, hidden)`, with `H` query/key heads of size `K` and
    `HV` value heads of size `V`:

    1. projections `q, k, v = x W_q, x W_k, x W_v` (`H K`, `H K` and `HV V` wide);
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over each;
    3. per key head and channel a log decay from a low-rank projection (rank `V`),
        $g = -e^{A_{\log}} \, \mathrm{softplus}(x W_{f_a} W_{f_b} + \Delta_b)$, and the
        erase gate $b = \sigma(x W_b)$ (times 2 with `allow_neg_eigval`), both shared by
        the key head's value heads; per value head and channel the write gate
        $w = \sigma(x W_w)$;
    4. the chunked GDN-2 rule ([`deltanet_cp.chunk_gdn2`][]) with q/k L2 normalisation,
        $S_t = (I - k_t (b_t \odot k_t)^\top) \mathrm{diag}(e^{g_t}) S_{t-1} + k_t (w_t
        \odot v_t)^\top$;
    5. a sigmoid-gated RMSNorm per value head, the gate again low-rank,
        $\mathrm{rms}(o) \odot \mathrm{w} \odot \sigma(x W_{g_a} W_{g_b} + c)$;
    6. the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.GatedDeltaNet2` (with its short
    convolution), with `q_proj`, `k_proj` and `v_proj` as one `in_proj_qkv` and the
    low-rank `f_proj` and `g_proj` as two linear layers each.

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]; its state is a
    [`deltanet_cp.nn.RecurrentLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    f_a_proj: eqx.nn.Linear
    f_b_proj: eqx.nn.Linear
    b_proj: eqx.nn.Linear
    w_proj: eqx.nn.Linear
    A_log: Float[Array, " heads"]
    dt_bias: Float[Array, "heads k"]
    g_a_proj: eqx.nn.Linear
    g_b_proj: eqx.nn.Linear
    norm: SigmoidGatedRMSNorm
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
        - `value_head_dim`: `V`, the value head size and the rank of the low-rank decay
            and output gate.
        - `allow_neg_eigval`: an erase gate in $[0, 2]$ rather than $[0, 1]$.
        - `conv_kernel_size`: the length of the causal convolution.
        - `norm_eps`: the epsilon of the gated RMSNorm.
        - `chunk_size`: tokens per chunk of the recurrence.
        - `block_size`: the engine's block (the `block_size` of [`deltanet_cp.run`][]);
            `None` takes [`deltanet_cp.default_block_size`][].
        - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
            `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `precision`: how the recurrence's large products multiply, as for
            [`deltanet_cp.nn.GatedDeltaNet`][].
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters: the Equinox/torch defaults for the
            linear layers and the convolution, $A_{\log}$ and $\Delta_b$ as in
            flash-linear-attention (see [`deltanet_cp.nn.KimiDeltaAttention`][]), the norm
            weight ones.
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
        keys = jr.split(key, 11)
        hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim = s.sizes.values()
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1])
        self.f_a_proj = s.linear(hidden_size, value_head_dim, keys[2])
        self.f_b_proj = s.linear(value_head_dim, s.key_dim, keys[3])
        self.b_proj = s.linear(hidden_size, s.key_dim, keys[4])
        self.w_proj = s.linear(hidden_size, s.value_dim, keys[5])
        self.A_log, self.dt_bias = fla_decay_init(
            keys[6], keys[7], (num_key_heads,), (num_key_heads, key_head_dim), s.dtype
        )
        self.g_a_proj = s.linear(hidden_size, value_head_dim, keys[8])
        self.g_b_proj = s.linear(value_head_dim, s.value_dim, keys[9], bias=True)
        self.norm = s.norm(SigmoidGatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[10])
        s.fill(self)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, f, b, w, gate = project(
            x, self.in_proj_qkv, self.f_a_proj, self.b_proj, self.w_proj, self.g_a_proj
        )
        (f,) = project(f, self.f_b_proj)
        (gate,) = project(gate, self.g_b_proj)
        return qkv, (f, b, w, gate)

    def _split(self, mixed, rest):
        f, b, w, gate = rest
        h, r = self.num_key_heads, self.num_value_heads // self.num_key_heads
        q, k, v = split_qkv(mixed, h, self.key_head_dim, self.value_head_dim)
        g = log_decay(f.reshape(k.shape), self.A_log[None, :, None], self.dt_bias[None])
        erase = step_sizes(b, self.allow_neg_eigval).reshape(k.shape)
        # The key head's decay and erase gate serve each of its value heads.
        g, erase = (jnp.repeat(a, r, axis=1) for a in (g, erase))
        write = jax.nn.sigmoid(w).reshape(v.shape)
        inputs = one_sequence(DeltaInputs, q, k, v, g, erase, write)
        return inputs, gate.reshape(v.shape)

    def _recurrence(self, chunk_size: int) -> GatedDeltaNet2Rule:
        return GatedDeltaNet2Rule(
            chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision
        )
