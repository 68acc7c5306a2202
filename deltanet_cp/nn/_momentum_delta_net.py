"""The Momentum DeltaNet layer: a memory and a momentum per head, with context parallelism."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._options import engine_options, EngineOptions
from .._precision import accumulation_dtype, PrecisionName
from .._run import Memory
from ..recurrences._momentum import MomentumDeltaRule, MomentumInputs
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
)
from ._norm import GatedRMSNorm


class MomentumDeltaNet(AbstractRecurrentLayer[RecurrentLayerState]):
    r"""The Momentum DeltaNet token mixer: a delta rule whose update goes through a momentum,
    one state $[S; M]$ per value head.

    For an input `x` of shape `(seq, hidden)`, with `H` query/key heads of size `K` and
    `HV` value heads of size `V`:

    1. projections `q, k, v = x W_q, x W_k, x W_v`, then a depthwise causal convolution
        (kernel `conv_kernel_size`) and SiLU over each;
    2. per value head, from four projections `a, b, m, e` of `x` (one number per value head
        each): $\eta = \tanh(e / \tau) + 1$ with $\tau = \sqrt{\text{hidden} /
        \text{tau\_factor}}$; $\theta = \arctan(\eta \, e^{\phi})$;
        $\log\alpha = \log\cos^2\theta - e^{A_{\log}} \mathrm{softplus}(a + \Delta_b)$;
        $\beta = \sin^2\theta \, \sigma(b)$ (times 2 with `allow_neg_eigval`);
        $\log\mu = \max(-e^{M_{\log}} \mathrm{softplus}(m + \Delta_\mu), \log\mu_{\min})$
        ($A_{\log}$, $M_{\log}$ and $\phi$ per key head, shared by its value heads);
    3. with `use_output_correction`, the query $q - e^{D_{\log}} k$ per key head;
    4. the chunked momentum delta rule ([`deltanet_cp.chunk_momentum_delta_rule`][]) with
        the keys as probes, q/k/p L2 normalisation and `use_p_times_alpha`:
        $M_t = \mu_t M_{t-1} + \eta_t k_t (S_{t-1}^\top \alpha_t p_t - v_t)^\top$,
        $S_t = \alpha_t S_{t-1} - \beta_t M_t$, $o_t = S_t^\top q_t / \sqrt{K}$;
    5. a SiLU-gated RMSNorm per value head, $\mathrm{rms}(o) \odot w \odot
        \mathrm{silu}(x W_g)$;
    6. the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.MomentumDeltaNet` at its defaults
    (`qk_activation="silu"`, `qk_norm="l2"`, `use_gate=True`, `use_beta=True`, the short
    convolution), with `q_proj`, `k_proj` and `v_proj` as one `in_proj_qkv`. Its
    recurrent state is `[S; M]` stacked along the key axis, `(HV, 2K, V)` (FLA stacks
    them on a leading axis of two).

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]: what crosses ranks is one affine map of
    `[S; M]` per value head, `(2K, 2K + V)`. Its state is a
    [`deltanet_cp.nn.RecurrentLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    a_proj: eqx.nn.Linear
    b_proj: eqx.nn.Linear
    m_proj: eqx.nn.Linear
    e_proj: eqx.nn.Linear
    A_log: Float[Array, " heads"]
    dt_bias: Float[Array, " vheads"]
    Mu_log: Float[Array, " heads"]
    mu_bias: Float[Array, " vheads"]
    log_factor: Float[Array, " heads"]
    D_log: Float[Array, " heads"] | None
    g_proj: eqx.nn.Linear
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_key_heads: int = eqx.field(static=True)
    num_value_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    use_p_times_alpha: bool = eqx.field(static=True)
    min_log_mu: float | None = eqx.field(static=True)
    tau: float = eqx.field(static=True)
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
        use_p_times_alpha: bool = True,
        use_output_correction: bool = True,
        min_log_mu: float | None = -2.0,
        tau_factor: float = 1.0,
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
        - `use_p_times_alpha`: the memory is read along $\alpha_t k_t$ (FLA's default).
        - `use_output_correction`: the query $q - e^{D_{\log}} k$ (FLA's default).
        - `min_log_mu`: the lower bound of $\log\mu$, or `None` for none (FLA: `-2`).
        - `tau_factor`: $\tau = \sqrt{\text{hidden} / \text{tau\_factor}}$.
        - `allow_neg_eigval`: $\beta$ in $[0, 2]$ rather than $[0, 1]$.
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
            linear layers and the convolution; $A_{\log}$ and $M_{\log}$ as
            [`deltanet_cp.nn.GatedDeltaNet`][]'s $A_{\log}$ ($\log U(1, 16)$, where FLA
            draws from $U(0, 16)$), $\Delta_b$ and $\Delta_\mu$ the inverse softplus of
            log-uniform steps in $[10^{-3}, 10^{-1}]$, $\phi = \log U(0, 4)$ and
            $D_{\log} = \log U(0, 1)$ as FLA draws them; the norm weight ones.
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
        if not (isinstance(tau_factor, (int, float)) and tau_factor > 0):
            raise ValueError(f"`tau_factor` must be a positive number; got {tau_factor!r}.")
        if min_log_mu is not None and not (
            isinstance(min_log_mu, (int, float)) and min_log_mu <= 0
        ):
            raise ValueError(f"`min_log_mu` must be a number <= 0 or None; got {min_log_mu!r}.")
        keys = jr.split(key, 14)
        hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim = s.sizes.values()
        h, hv, dtype = num_key_heads, num_value_heads, s.dtype
        self.in_proj_qkv, self.conv1d = s.qkv(keys[0], keys[1])
        self.a_proj = s.linear(hidden_size, hv, keys[2])
        self.b_proj = s.linear(hidden_size, hv, keys[3])
        self.m_proj = s.linear(hidden_size, hv, keys[4])
        self.e_proj = s.linear(hidden_size, hv, keys[5])
        self.A_log, self.dt_bias = fla_decay_init(keys[6], keys[7], (h,), (hv,), dtype)
        self.Mu_log, self.mu_bias = fla_decay_init(keys[8], keys[9], (h,), (hv,), dtype)
        self.log_factor = jnp.log(jr.uniform(keys[10], (h,), dtype, 1e-3, 4.0))
        self.D_log = (
            jnp.log(jr.uniform(keys[11], (h,), dtype, 1e-3, 1.0)) if use_output_correction else None
        )
        self.g_proj = s.linear(hidden_size, s.value_dim, keys[12])
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[13])
        s.fill(self)
        self.use_p_times_alpha = bool(use_p_times_alpha)
        self.min_log_mu = None if min_log_mu is None else float(min_log_mu)
        self.tau = math.sqrt(hidden_size / tau_factor)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, 2 * self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, a, b, m, e, gate = project(
            x, self.in_proj_qkv, self.a_proj, self.b_proj, self.m_proj, self.e_proj, self.g_proj
        )
        return qkv, (a, b, m, e, gate)

    def _split(self, mixed, rest):
        a, b, m, e, gate = rest
        r = self.num_value_heads // self.num_key_heads
        q, k, v = split_qkv(mixed, self.num_key_heads, self.key_head_dim, self.value_head_dim)
        dtype = accumulation_dtype(a)

        def per_value_head(p):  # a key head's parameter for each of its value heads
            return jnp.repeat(p.astype(dtype), r)[None]

        log_alpha = log_decay(a, per_value_head(self.A_log), self.dt_bias[None])
        log_mu = log_decay(m, per_value_head(self.Mu_log), self.mu_bias[None])
        eta = jnp.tanh(e.astype(dtype) / self.tau) + 1
        theta = jnp.arctan(eta * jnp.exp(per_value_head(self.log_factor)))
        beta = jnp.sin(theta) ** 2 * jax.nn.sigmoid(b.astype(dtype))
        log_alpha = jnp.log(jnp.cos(theta) ** 2) + log_alpha
        if self.min_log_mu is not None:
            log_mu = jnp.maximum(log_mu, self.min_log_mu)
        if self.allow_neg_eigval:
            beta = 2 * beta
        if self.D_log is not None:
            q = q - jnp.exp(self.D_log)[None, :, None].astype(q.dtype) * k
        inputs = one_sequence(MomentumInputs, q, k, v, k, log_alpha, log_mu, beta, eta)
        return inputs, gate.reshape(v.shape)

    def _recurrence(self, chunk_size: int) -> MomentumDeltaRule:
        return MomentumDeltaRule(
            chunk_size=chunk_size,
            use_qk_l2norm=True,
            use_p_times_alpha=self.use_p_times_alpha,
            precision=self.precision,
        )
