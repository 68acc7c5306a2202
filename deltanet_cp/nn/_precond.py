"""The preconditioned delta rules' token mixers (flash-linear-attention's
`PrecondGatedDeltaNet` and `PrecondKDA`), with context parallelism.

Their recurrence is a cascade of two runs of the engine: the preconditioner, gated linear
attention with a one-row state `A: (H, K)` per key head, then the delta rule writing along
the keys it preconditions (`deltanet_cp.recurrences._cascade`). So their state has
three parts: the convolution's history, the main state and the preconditioner's; with
`checkpoint_every` each run is wrapped in `Checkpointed` and both emit their states at the
same boundaries, from the same pass.
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._dtype import param_dtype
from .._options import engine_options, EngineOptions
from .._precision import PrecisionName
from .._run import Memory
from ..recurrences._cascade import as_squash_eps, as_squash_range, cascade
from ..recurrences._delta_family import AbstractDeltaRule, DeltaInputs
from ..recurrences._precond import (
    PrecondGatedDeltaRule,
    PrecondKimiDeltaRule,
)
from ._conv import CausalConv1d
from ._delta_layer import (
    AbstractRecurrentLayer,
    fla_decay_init,
    log_decay,
    no_bias_linear,
    one_sequence,
    project,
    Skeleton,
    split_qkv,
    step_sizes,
)
from ._kda_gates import kda_project, kda_split
from ._kimi_delta_attention import KimiDeltaAttention
from ._norm import GatedRMSNorm, SigmoidGatedRMSNorm


class PrecondLayerState(eqx.Module):
    """What a preconditioned token mixer ([`deltanet_cp.nn.PrecondGatedDeltaNet`][],
    [`deltanet_cp.nn.PrecondKimiDeltaAttention`][]) carries from one segment to the next.

    **Fields:**

    - `conv`: the last `conv_kernel_size - 1` inputs of the convolution (the projected
        `concat(q, k, v)` before the convolution), `(conv_kernel_size - 1, conv_dim)`.
    - `recurrent`: the main delta rule's state, `(value_heads, K, V)`, float32 (float64
        for float64 parameters).
    - `A`: the preconditioner's state, one diagonal per key head, `(heads, K)`, in the
        same dtype (flash-linear-attention's `A_state`).

    All three may carry the same leading batch axes (to be `jax.vmap`ped over with the
    input).
    """

    conv: Float[Array, "*batch history conv_dim"]
    recurrent: Float[Array, "*batch vheads k v"]
    A: Float[Array, "*batch heads k"]


class _PrecondInputs(eqx.Module):
    """The inputs of both runs for one sequence (a batch of one): the main delta rule's
    (without its write key, which the preconditioner makes) and the preconditioner's gates,
    one per token and key head."""

    main: DeltaInputs
    g_atk: Float[Array, "1 seq heads"]
    beta_atk: Float[Array, "1 seq heads"]


def _precond_parameters(
    hidden_size: int,
    heads: int,
    *,
    squash_x: Any,
    squash_eps: Any,
    log_atk_scale_init: Any,
    key: PRNGKeyArray,
    dtype,
) -> dict[str, Any]:
    """The preconditioner's fields, by name, from the constructor's arguments (checked)."""
    squash_x = as_squash_range(squash_x, "squash_x")
    squash_eps = as_squash_eps(squash_eps, "squash_eps")
    if (
        isinstance(log_atk_scale_init, bool)
        or not isinstance(log_atk_scale_init, (int, float))
        or not math.isfinite(log_atk_scale_init)
    ):
        raise ValueError(
            f"`log_atk_scale_init` must be a finite float; got {log_atk_scale_init!r}. It is "
            "the squash's initial centre in log space (flash-linear-attention: -0.2)."
        )
    linear = no_bias_linear(dtype)
    dtype = param_dtype(dtype)
    ka, kb, kA, kdt = jr.split(key, 4)
    A_log_atk, dt_bias_atk = fla_decay_init(kA, kdt, (heads,), (heads,), dtype)
    return dict(
        a_atk_proj=linear(hidden_size, heads, ka),
        b_atk_proj=linear(hidden_size, heads, kb),
        A_log_atk=A_log_atk,
        dt_bias_atk=dt_bias_atk,
        log_atk_scale=jnp.full((heads,), log_atk_scale_init, dtype),
        squash_x=squash_x,
        squash_eps=squash_eps,
    )


class AbstractPrecondLayer(AbstractRecurrentLayer[PrecondLayerState]):
    """A token mixer around a preconditioned delta rule: an `AbstractRecurrentLayer` whose
    recurrence is two runs of the engine, the preconditioner (its gates from
    `a_atk_proj`, `b_atk_proj`, `A_log_atk`, `dt_bias_atk`, one per key head) and the main
    delta rule (`_recurrence`) writing along the keys it preconditions. Its state is a
    [`deltanet_cp.nn.PrecondLayerState`][]."""

    a_atk_proj: eqx.AbstractVar[eqx.nn.Linear]
    b_atk_proj: eqx.AbstractVar[eqx.nn.Linear]
    A_log_atk: eqx.AbstractVar[Array]
    dt_bias_atk: eqx.AbstractVar[Array]
    log_atk_scale: eqx.AbstractVar[Array]
    squash_x: eqx.AbstractVar[float]
    squash_eps: eqx.AbstractVar[float]

    def _with_preconditioner(self, main: DeltaInputs, a_atk, b_atk) -> _PrecondInputs:
        r"""`main` and the preconditioner's gates from its projections `(seq, H)`:
        $g^{atk} = -e^{A^{atk}_{\log}} \mathrm{softplus}(a^{atk} + \Delta^{atk}_b)$ and
        $\beta^{atk} = \sigma(b^{atk})$."""
        g_atk = log_decay(a_atk, self.A_log_atk[None], self.dt_bias_atk[None])
        return _PrecondInputs(main, g_atk[None], jax.nn.sigmoid(b_atk)[None])

    def _state(self, conv, recurrent) -> PrecondLayerState:
        main, a = recurrent
        return PrecondLayerState(conv=conv, recurrent=main, A=a)

    def _recurrent(self, state: PrecondLayerState) -> tuple[Array, Array]:
        return state.recurrent, state.A

    def _initial_recurrent(self, dtype) -> tuple[Array, Array]:
        heads, k = self.log_atk_scale.shape[0], self._recurrent_shape[1]
        return jnp.zeros(self._recurrent_shape, dtype), jnp.zeros((heads, k), dtype)

    def _recur(
        self, inputs, h0, chunk_size, every=None, cp=None, cu_seqlens=None
    ) -> tuple[Any, tuple[Array, Array], tuple[Array, Array] | None]:
        """The preconditioner's run, the squash, then the main run, each from its part of
        `h0 = (main state, A)`: `(outputs, (main state, A), checkpoints)`, the
        checkpoints `(main (n, HV, K, V), A (n, H, K))` from the same boundaries."""
        assert isinstance(inputs, _PrecondInputs)
        h0, a0 = (None, None) if h0 is None else h0
        main = self._recurrence(chunk_size)
        assert isinstance(main, AbstractDeltaRule)
        o, h, a_final, saved = cascade(
            main,
            inputs.main,
            inputs.g_atk,
            inputs.beta_atk,
            initial_state=h0,
            initial_A_state=a0,
            x=self.squash_x,
            eps=self.squash_eps,
            log_atk_scale=self.log_atk_scale,
            stage=lambda rule, xs, h0: self._run(rule, xs, h0, every, cp, cu_seqlens),
        )
        return o, (h, a_final), saved


class PrecondGatedDeltaNet(AbstractPrecondLayer):
    r"""The Preconditioned Gated DeltaNet token mixer: Gated DeltaNet writing along keys
    scaled by a diagonal preconditioner per key head.

    For an input `x` of shape `(seq, hidden)`, with `H` query/key heads of size `K` and
    `HV` value heads of size `V`:

    1. projections `qkv = x W_qkv`, `a = x W_a`, `b = x W_b` (one per value head),
        `a^atk = x W_{a,atk}`, `b^atk = x W_{b,atk}` (one per key head), `z = x W_g`;
    2. a depthwise causal convolution (kernel `conv_kernel_size`) and SiLU over `qkv`,
        then a split into `q, k: (seq, H, K)` and `v: (seq, HV, V)`;
    3. gates per value head, $g = -e^{A_{\log}} \, \mathrm{softplus}(a + \Delta_b)$ and
        $\beta = \sigma(b)$ ($2 \sigma(b)$ with `allow_neg_eigval`), and per key head,
        $g^{atk} = -e^{A^{atk}_{\log}} \, \mathrm{softplus}(a^{atk} + \Delta^{atk}_b)$ and
        $\beta^{atk} = \sigma(b^{atk})$ (the log decays float32);
    4. with L2-normalised `q` and `k`, the preconditioner per key head and channel,
        $A \leftarrow e^{g^{atk}_t} A + \beta^{atk}_t k_t^2$, the write key
        $\hat k_t = k_t\, x^{-s}$ with $s = r / (1 + |r|)$,
        $r = \log(A + \epsilon) - c$ ($x$ = `squash_x`, $\epsilon$ = `squash_eps`, $c$ the
        learnt `log_atk_scale` of the key head); then the gated delta rule per value head
        erasing along `k` and writing along $\hat k$
        ([`deltanet_cp.chunk_precond_gated_delta_rule`][]), value head `j` reading key
        head `j // (HV // H)` and its preconditioner;
    5. a gated RMSNorm per value head, $\mathrm{rms}(o) \odot w \odot \mathrm{silu}(z)$;
    6. the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.PrecondGatedDeltaNet` with `use_gate=True`
    (its default: the short convolution, SiLU, the L2 norm in the kernel, `squash_x=1.5`,
    `squash_eps=1e-6`, `log_atk_scale` initialised to `-0.2`), with `q_proj`, `k_proj`
    and `v_proj` as one `in_proj_qkv`.

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]: both runs go through [`deltanet_cp.run`][] with
    the same `cp` (what crosses ranks is one affine map of each state per head). Its state
    is a [`deltanet_cp.nn.PrecondLayerState`][]; `prefill(..., checkpoint_every=L)`'s
    checkpoints hold both recurrent states.
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    a_proj: eqx.nn.Linear
    b_proj: eqx.nn.Linear
    a_atk_proj: eqx.nn.Linear
    b_atk_proj: eqx.nn.Linear
    A_log: Float[Array, " vheads"]
    dt_bias: Float[Array, " vheads"]
    A_log_atk: Float[Array, " heads"]
    dt_bias_atk: Float[Array, " heads"]
    log_atk_scale: Float[Array, " heads"]
    g_proj: eqx.nn.Linear
    norm: GatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_key_heads: int = eqx.field(static=True)
    num_value_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    allow_neg_eigval: bool = eqx.field(static=True)
    squash_x: float = eqx.field(static=True)
    squash_eps: float = eqx.field(static=True)
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
        squash_x: float = 1.5,
        squash_eps: float = 1e-6,
        log_atk_scale_init: float = -0.2,
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
        - `num_key_heads`: `H`, the number of query/key heads (and preconditioners).
        - `num_value_heads`: `HV`, the number of value heads, a multiple of `H`.
        - `key_head_dim`: `K`, the query/key head size.
        - `value_head_dim`: `V`, the value head size.
        - `allow_neg_eigval`: the main step sizes in $[0, 2]$ rather than $[0, 1]$.
        - `squash_x`: the squash's range: the write key is `k` times a scale in
            $(1/x, x)$; a float $\ge 1$ (FLA notes $\le 2$ keeps the eigenvalues stable).
        - `squash_eps`: added to the preconditioner's state before the log, a float
            within float32's normal range.
        - `log_atk_scale_init`: the initial value of `log_atk_scale`, the squash's centre
            per key head in log space (learnt).
        - `conv_kernel_size`: the length of the causal convolution.
        - `norm_eps`: the epsilon of the gated RMSNorm.
        - `chunk_size`: tokens per chunk of both runs.
        - `block_size`: the engine's block (the `block_size` of [`deltanet_cp.run`][]);
            `None` takes [`deltanet_cp.default_block_size`][].
        - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
            `"high"` (the `memory` of [`deltanet_cp.run`][]).
        - `precision`: how both runs' large products multiply, as for
            [`deltanet_cp.nn.GatedDeltaNet`][].
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters: the Equinox/torch defaults for the
            linear layers and the convolution; $A_{\log}$ and $A^{atk}_{\log}$ as
            $\log U(1, 16)$ (where FLA draws from $U(0, 16)$), $\Delta_b$ and
            $\Delta^{atk}_b$ the inverse softplus of log-uniform steps in
            $[10^{-3}, 10^{-1}]$ as FLA draws them; the norm weight ones.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive, if
        `num_value_heads` is not a multiple of `num_key_heads`, or if `squash_x`,
        `squash_eps` or `log_atk_scale_init` is out of its range (each named).
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
        keys = jr.split(key, 9)
        hidden_size, num_key_heads, num_value_heads, key_head_dim, value_head_dim = s.sizes.values()
        precond = _precond_parameters(
            hidden_size,
            num_key_heads,
            squash_x=squash_x,
            squash_eps=squash_eps,
            log_atk_scale_init=log_atk_scale_init,
            key=keys[0],
            dtype=dtype,
        )
        s.fill(self)
        for name, value in precond.items():
            setattr(self, name, value)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        hv = num_value_heads
        self.in_proj_qkv, self.conv1d = s.qkv(keys[1], keys[2])
        self.a_proj = s.linear(hidden_size, hv, keys[3])
        self.b_proj = s.linear(hidden_size, hv, keys[4])
        self.A_log, self.dt_bias = fla_decay_init(keys[5], keys[6], (hv,), (hv,), s.dtype)
        self.g_proj = s.linear(hidden_size, s.value_dim, keys[7])
        self.norm = s.norm(GatedRMSNorm, norm_eps)
        self.out_proj = s.out_proj(keys[8])

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def _project(self, x):
        qkv, *rest = project(
            x,
            self.in_proj_qkv,
            self.a_proj,
            self.b_proj,
            self.a_atk_proj,
            self.b_atk_proj,
            self.g_proj,
        )
        return qkv, rest

    def _split(self, mixed, rest):
        a, b, a_atk, b_atk, gate = rest
        q, k, v = split_qkv(mixed, self.num_key_heads, self.key_head_dim, self.value_head_dim)
        g = log_decay(a, self.A_log[None], self.dt_bias[None])
        beta = step_sizes(b, self.allow_neg_eigval)
        main = one_sequence(DeltaInputs, q, k, v, g, beta)
        return self._with_preconditioner(main, a_atk, b_atk), gate.reshape(v.shape)

    def _recurrence(self, chunk_size: int) -> PrecondGatedDeltaRule:
        return PrecondGatedDeltaRule(
            chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision
        )


class PrecondKimiDeltaAttention(AbstractPrecondLayer):
    r"""The Preconditioned Kimi Delta Attention token mixer: [`deltanet_cp.nn.KimiDeltaAttention`][]
    writing along keys scaled by a diagonal preconditioner per head.

    For an input `x` of shape `(seq, hidden)`, with `H` heads of size `K`: the projections,
    convolution, gates and output of [`deltanet_cp.nn.KimiDeltaAttention`][] (its forget
    gate per head and key channel, $\beta = \sigma(x W_b)$, the sigmoid-gated RMSNorm with
    a low-rank gate), and per head the preconditioner's gates
    $g^{atk} = -e^{A^{atk}_{\log}} \, \mathrm{softplus}(x W_{a,atk} + \Delta^{atk}_b)$ and
    $\beta^{atk} = \sigma(x W_{b,atk})$; the recurrence is
    [`deltanet_cp.chunk_precond_kda`][] with q/k L2 normalisation: the preconditioner and
    write key of [`deltanet_cp.nn.PrecondGatedDeltaNet`][], then the Kimi delta rule
    erasing along `k` and writing along $\hat k$.

    This is flash-linear-attention's `fla.layers.PrecondKDA` with `num_v_heads =
    num_heads` and `expand_v = 1` (its defaults; then its preconditioner's parameters, per
    value head there, are per head), without `allow_neg_eigval` or the clamped gate
    (`lower_bound`), with its `a_proj` (the preconditioner's gate) named `a_atk_proj` and
    `q_proj`, `k_proj`, `v_proj` as one `in_proj_qkv`. The other differences are
    [`deltanet_cp.nn.KimiDeltaAttention`][]'s: no bias in the output gate's second
    projection, $\Delta_b$ drawn as for $A_{\log}$'s companion (FLA zeros it here).

    `__call__`, `prefill`, `step`, the precision policy and context parallelism are those
    of [`deltanet_cp.nn.GatedDeltaNet`][]. Its state is a
    [`deltanet_cp.nn.PrecondLayerState`][].
    """

    in_proj_qkv: eqx.nn.Linear
    conv1d: CausalConv1d
    f_a_proj: eqx.nn.Linear
    f_b_proj: eqx.nn.Linear
    A_log: Float[Array, " heads"]
    dt_bias: Float[Array, "heads k"]
    b_proj: eqx.nn.Linear
    a_atk_proj: eqx.nn.Linear
    b_atk_proj: eqx.nn.Linear
    A_log_atk: Float[Array, " heads"]
    dt_bias_atk: Float[Array, " heads"]
    log_atk_scale: Float[Array, " heads"]
    g_a_proj: eqx.nn.Linear
    g_b_proj: eqx.nn.Linear
    norm: SigmoidGatedRMSNorm
    out_proj: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    squash_x: float = eqx.field(static=True)
    squash_eps: float = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        squash_x: float = 1.5,
        squash_eps: float = 1e-6,
        log_atk_scale_init: float = -0.2,
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

        - `hidden_size`, `num_heads`, `head_dim`, `conv_kernel_size`, `norm_eps`,
            `chunk_size`, `block_size`, `memory`, `precision`, `dtype`: as for
            [`deltanet_cp.nn.KimiDeltaAttention`][] (`chunk_size` and `precision` for both
            runs).
        - `squash_x`, `squash_eps`, `log_atk_scale_init`: as for
            [`deltanet_cp.nn.PrecondGatedDeltaNet`][].
        - `options`: `chunk_size` (`None`: 64), `block_size`, `memory` and `precision` as
            one [`deltanet_cp.EngineOptions`][] (then pass none of them loose).
        - `key`: a PRNG key for the initial parameters: those of
            [`deltanet_cp.nn.KimiDeltaAttention`][], and for the preconditioner those of
            [`deltanet_cp.nn.PrecondGatedDeltaNet`][].

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive or if
        `squash_x`, `squash_eps` or `log_atk_scale_init` is out of its range (each named).
        """
        kkda, katk = jr.split(key)
        kda = KimiDeltaAttention(
            hidden_size,
            num_heads,
            head_dim,
            conv_kernel_size=conv_kernel_size,
            norm_eps=norm_eps,
            options=engine_options(options, chunk_size, block_size, memory, precision),
            key=kkda,
            dtype=dtype,
        )
        precond = _precond_parameters(
            kda.hidden_size,
            kda.num_heads,
            squash_x=squash_x,
            squash_eps=squash_eps,
            log_atk_scale_init=log_atk_scale_init,
            key=katk,
            dtype=dtype,
        )
        kda_fields = {f.name: getattr(kda, f.name) for f in dataclasses.fields(kda)}
        for name, value in {**kda_fields, **precond}.items():
            setattr(self, name, value)

    @property
    def _recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def _project(self, x):
        qkv, rest = kda_project(self, x)
        return qkv, (rest, *project(x, self.a_atk_proj, self.b_atk_proj))

    def _split(self, mixed, rest):
        rest, a_atk, b_atk = rest
        main, gate = kda_split(self, mixed, rest)
        return self._with_preconditioner(main, a_atk, b_atk), gate

    def _recurrence(self, chunk_size: int) -> PrecondKimiDeltaRule:
        return PrecondKimiDeltaRule(
            chunk_size=chunk_size, use_qk_l2norm=True, precision=self.precision
        )
