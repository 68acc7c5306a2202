"""The Gated DeltaProduct layer: `n_h` delta-rule steps per token, with context parallelism."""

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._delta_product import GatedDeltaProductRule
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractRecurrentLayer,
    fla_decay_init,
    log_decay,
    one_sequence,
    project,
    RecurrentLayerState,
    Skeleton,
    step_sizes,
)
from ._norm import GatedRMSNorm


class GatedDeltaProduct(AbstractRecurrentLayer[RecurrentLayerState]):
    r"""The Gated DeltaProduct token mixer: per token one decay, then `n_h` delta-rule
    (generalised Householder) steps.

    For an input `x` of shape `(seq, hidden)`, with `H` query/key heads of size `K`, `HV`
    value heads of size `V` and `n_h` = `num_householder`:

    1. projections `q = x W_q` (`H K` wide), `k = x W_k` (`n_h H K`), `v = x W_v`
        (`n_h HV V`);
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over each;
    3. step sizes $\beta = \sigma(x W_b)$ per step and value head (times 2 with
        `allow_neg_eigval`), and a log decay per value head
        $g = -e^{A_{\log}} \, \mathrm{softplus}(x W_a + \Delta_b)$ (float32);
    4. the chunked Gated DeltaProduct ([`deltanet_cp.chunk_gated_delta_product`][]) with
        q/k L2 normalisation: $h \leftarrow e^{g_t} h$, then for $j = 1 \dots n_h$ a delta
        step along $k_{tj}$ towards $v_{tj}$, then $o_t = h^\top q_t / \sqrt{K}$;
    5. a gated RMSNorm per value head, $\mathrm{rms}(o) \odot w \odot \mathrm{silu}(x W_g)$;
    6. the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.GatedDeltaProduct` (with its forget gate,
    short convolution and output gate), with `q_proj`, `k_proj` and `v_proj` as one
    `in_proj_qkv`; the `n_h` keys of a token are laid out step-major (`(n_h, H, K)`), as
    there.

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]; its state is a
    [`deltanet_cp.nn.RecurrentLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    b_proj: eqx.nn.Linear
    a_proj: eqx.nn.Linear
    A_log: Float[Array, " vheads"]
    dt_bias: Float[Array, " vheads"]
    g_proj: eqx.nn.Linear
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_key_heads: int = eqx.field(static=True)
    num_value_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    num_householder: int = eqx.field(static=True)
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
        num_householder: int = 2,
        allow_neg_eigval: bool = True,
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
        - `num_householder`: `n_h`, the delta-rule steps per token.
        - `allow_neg_eigval`: step sizes in $[0, 2]$ (reflections with negative
            eigenvalues) rather than $[0, 1]$.
        - `conv_kernel_size`: the length of the causal convolution.
        - `norm_eps`: the epsilon of the gated RMSNorm.
        - `chunk_size`: tokens per chunk of the recurrence (each makes `n_h` steps).
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
            extra=dict(num_householder=num_householder),
            conv_kernel_size=conv_kernel_size,
            options=engine_options(options, chunk_size, block_size, memory, precision),
            dtype=dtype,
        )
        keys = jr.split(key, 8)
        hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim, n = (
            s.sizes.values()
        )
        conv_dim = s.key_dim + n * (s.key_dim + s.value_dim)
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1], conv_dim)
        self.b_proj = s.linear(hidden_size, n * num_value_heads, keys[2])
        self.a_proj = s.linear(hidden_size, num_value_heads, keys[3])
        self.A_log, self.dt_bias = fla_decay_init(
            keys[4], keys[5], (num_value_heads,), (num_value_heads,), s.dtype
        )
        self.g_proj = s.linear(hidden_size, s.value_dim, keys[6])
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[7])
        s.fill(self)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, b, a, gate = project(x, self.in_proj_qkv, self.b_proj, self.a_proj, self.g_proj)
        return qkv, (b, a, gate)

    def _split(self, mixed, rest):
        b, a, gate = rest
        t, n = mixed.shape[0], self.num_householder
        h, hv, dk, dv = (
            self.num_key_heads,
            self.num_value_heads,
            self.key_head_dim,
            self.value_head_dim,
        )
        q = mixed[:, : h * dk].reshape(t, h, dk)
        k = mixed[:, h * dk : (n + 1) * h * dk].reshape(t, n, h, dk)
        v = mixed[:, (n + 1) * h * dk :].reshape(t, n, hv, dv)
        beta = step_sizes(b, self.allow_neg_eigval).reshape(t, n, hv)
        g = log_decay(a, self.A_log[None], self.dt_bias[None])
        return one_sequence(DeltaInputs, q, k, v, g, beta), gate.reshape(t, hv, dv)

    def _recurrence(self, chunk_size: int) -> GatedDeltaProductRule:
        return GatedDeltaProductRule(
            chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision
        )
