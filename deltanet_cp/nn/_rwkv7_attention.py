"""RWKV-7's time-mix layer: a token shift, low-rank gates and the generalized delta rule, with
context parallelism."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._dtype import param_dtype
from .._options import engine_options, EngineOptions
from .._parallel import ContextParallel
from .._precision import accumulation_dtype, PrecisionName
from .._run import Memory, run
from .._shift import previous_tokens
from .._validate import as_index, as_positive_index
from ..recurrences._dplr import DPLRDeltaRule, DPLRInputs
from ._checkpointed import Checkpointed, checkpoints
from ._context import layer_cp, local_positions
from ._delta_layer import (
    check_checkpoints,
    check_documents_without_state,
    check_input,
    check_sizes,
    one_sequence,
)
from ._mixer import AbstractEngineMixer
from ._norm import GroupNorm
from ._schedule import KVSchedule


# The log decays are w = -e^{-1/2} sigmoid(.), in (-e^{-1/2}, 0): RWKV-7's
# exp(-exp(-softplus(-x) - 1/2)) decay, as flash-linear-attention writes it.
_DECAY = -0.6065306597126334


def _orthogonal(key: PRNGKeyArray, shape: tuple[int, int], gain: float, dtype) -> Array:
    """A (semi-)orthogonal `(out, in)` matrix times `gain`, as `torch.nn.init.orthogonal_`."""
    return jax.nn.initializers.orthogonal(gain)(key, shape, jnp.float32).astype(dtype)


class LoRA(eqx.Module):
    """A low-rank projection, `up(activation(down(x)))` (flash-linear-attention's RWKV
    `LoRA`): `down` without bias, `up` with an optional bias."""

    down: eqx.nn.Linear
    up: eqx.nn.Linear
    activation: str | None = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        activation: str | None,
        bias: Array | None,
        key: PRNGKeyArray,
        dtype,
    ):
        """`down` zeros and `up` orthogonal with gain `0.1 max(1, sqrt(rank / out))`, as
        flash-linear-attention initialises it; `bias` the bias of `up` (`None`: none)."""
        kd, ku = jr.split(key)
        down = eqx.nn.Linear(in_features, rank, use_bias=False, key=kd, dtype=dtype)
        up = eqx.nn.Linear(rank, out_features, use_bias=bias is not None, key=ku, dtype=dtype)
        gain = 0.1 * max(1.0, (rank / out_features) ** 0.5)
        self.down = eqx.tree_at(lambda m: m.weight, down, jnp.zeros_like(down.weight))
        up = eqx.tree_at(lambda m: m.weight, up, _orthogonal(ku, (out_features, rank), gain, dtype))
        if bias is not None:
            up = eqx.tree_at(lambda m: m.bias, up, jnp.asarray(bias, dtype))
        self.up = up
        self.activation = activation

    def __call__(self, x: Float[Array, "seq in"]) -> Float[Array, "seq out"]:
        h = jax.vmap(self.down)(x)
        if self.activation == "tanh":
            h = jnp.tanh(h)
        elif self.activation == "sigmoid":
            h = jax.nn.sigmoid(h)
        return jax.vmap(self.up)(h)


class RWKV7AttentionState(eqx.Module):
    """What a [`deltanet_cp.nn.RWKV7Attention`][] carries from one segment to the next.

    **Fields:**

    - `shift`: the last token's input `x`, `(hidden,)`, what the next token's token shift
        reads.
    - `recurrent`: the generalized delta rule's state, `(heads, K, V)`, float32 (float64
        for float64 parameters).

    Both may carry the same leading batch axes (to be `jax.vmap`ped over with the input).
    """

    shift: Float[Array, "*batch hidden"]
    recurrent: Float[Array, "*batch heads k v"]


def _default_rank(hidden: int, scale: float, factor: float) -> int:
    """flash-linear-attention's default LoRA rank: `scale sqrt(hidden) factor`, rounded to a
    multiple of 32, at least 32."""
    return max(32, int(round((scale * hidden**0.5) * factor / 32) * 32))


def _ramp(n: int) -> np.ndarray:
    """`i / (n - 1) - 1/2` for `i < n`: from -1/2 to 1/2."""
    return np.arange(n) / max(n - 1, 1) - 0.5


class RWKV7Attention(AbstractEngineMixer):
    r"""RWKV-7's time-mix token mixer ("Goose"): a token shift, low-rank gates and the
    generalized (diagonal-plus-low-rank) delta rule.

    For an input `x` of shape `(seq, hidden)`, with `H` heads of key size `K` and value
    size `V`, and $x'_t$ the token before (zeros before the first token, before each
    packed document's first token, and the state's `shift` when continuing a sequence):

    1. the token shift: $x_\ast = x + (x' - x) \odot \mu_\ast$ for each of
        $\ast \in \{r, w, k, v, a, g\}$ (`x_r`, ..., `x_g`, one weight per feature);
    2. projections $r = x_r W_r$, $k = x_k W_k$, $v = x_v W_v$;
    3. low-rank gates: the log decay $w = -e^{-1/2} \sigma(\mathrm{LoRA}_w(x_w))$ with a
        tanh inside the LoRA (float32), the in-context learning rate $a =
        \sigma(\mathrm{LoRA}_a(x_a))$, the output gate $g = \mathrm{LoRA}_g(x_g)$ with a
        sigmoid inside;
    4. on every layer but the first, the values mixed with the first layer's,
        $v \leftarrow v + (v_{\text{first}} - v) \odot \sigma(\mathrm{LoRA}_v(x_v))$;
    5. the removal key $\hat k = \mathrm{l2norm}(k \odot k_k)$ per head and the
        replacement key $k \leftarrow k + k \odot (a - 1) \odot k_a$;
    6. the generalized delta rule, `chunk_dplr_delta_rule(r, k, v, -k_hat, k_hat * a, w,
        scale=1.0)` ([`deltanet_cp.chunk_dplr_delta_rule`][]), per head:
        $S_t = (\mathrm{diag}(e^{w_t}) - (\hat k_t \odot a_t) \hat k_t^\top) S_{t-1} +
        k_t v_t^\top$ (the read $\hat k_t^\top S_{t-1}$ before the decay), $o_t = S_t^\top
        r_t$;
    7. a LayerNorm per head ([`deltanet_cp.nn.GroupNorm`][] with `H` groups, epsilon
        `K * norm_eps`), plus the bonus $\big(\sum_c r_c k_c (r_k)_c\big) v$ per head;
    8. the gate, $o \odot g$, and the output projection back to `hidden`.

    This is flash-linear-attention's `fla.layers.rwkv7.RWKV7Attention` (its defaults,
    `fuse_norm=False`, no padding mask), its parameters under the same names; its
    `key_dim` is `H K` (flash-linear-attention fixes it to `hidden`), its value dim
    `H V`.

    **The first layer's values.** Every layer after the first mixes its values with those
    of the model's first RWKV-7 layer, $v_{\text{first}}$ (step 4): build the first layer
    with `layer_idx=0` (`is_first` is then true and the layer has no `v_lora`), get its
    values with `values`, and pass them as `v_first=` to every later layer, on the same
    tokens (and the same shards under context parallelism):

    ```python
    v_first = first.values(x0, cp=cp)           # (seq, heads, V)
    h = first(x0, cp=cp)
    ...
    h = later(x1, v_first=v_first, cp=cp)
    ```

    Call it on one sequence and `jax.vmap` over the batch. `__call__`, `prefill`, `step`,
    the precision policy and context parallelism (`cp` inside `jax.shard_map`, either
    layout) are those of [`deltanet_cp.nn.GatedDeltaNet`][], with the token shift in place
    of the short convolution: under context parallelism each piece of a rank's shard reads
    the one token before it from the rank that holds it. Its state is a
    [`deltanet_cp.nn.RWKV7AttentionState`][].
    """

    # The token shift is `deltanet_cp.previous_tokens` on the input, not the recurrent base's
    # short convolution: that base projects first, convolves with learned taps and applies
    # SiLU, while RWKV-7 shifts the input itself (no taps, no activation) before six
    # different mixes of it, and threads `v_first` through every call. The one-token halo,
    # both layouts and packed documents are `previous_tokens`'s; this layer adds the
    # final shift state and shares the base's checks and checkpoints.
    x_r: Float[Array, " hidden"]
    x_w: Float[Array, " hidden"]
    x_k: Float[Array, " hidden"]
    x_v: Float[Array, " hidden"]
    x_a: Float[Array, " hidden"]
    x_g: Float[Array, " hidden"]
    k_k: Float[Array, " key_dim"]
    k_a: Float[Array, " key_dim"]
    r_k: Float[Array, "heads k"]
    r_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    w_lora: LoRA
    v_lora: LoRA | None
    a_lora: LoRA
    g_lora: LoRA
    g_norm: GroupNorm
    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    options: EngineOptions = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        layer_idx: int = 0,
        num_layers: int = 1,
        decay_low_rank_dim: int | None = None,
        a_low_rank_dim: int | None = None,
        v_low_rank_dim: int | None = None,
        gate_low_rank_dim: int | None = None,
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
        - `num_heads`: `H`, the number of heads.
        - `key_head_dim`: `K`, the receptance/key head size (flash-linear-attention's
            `head_dim`, 64 by default there, with `H = hidden / K`).
        - `value_head_dim`: `V`, the value head size (`K` there by default).
        - `layer_idx`: this layer's place among the model's RWKV-7 layers, from 0. Layer 0
            is the first (`is_first`): it has no `v_lora` and its `values` are every later
            layer's `v_first`. With `num_layers`, it also sets the initial parameters.
        - `num_layers`: the number of RWKV-7 layers in the model (for the initialisation).
        - `decay_low_rank_dim`, `a_low_rank_dim`, `v_low_rank_dim`, `gate_low_rank_dim`:
            the LoRA ranks of $w$, $a$, the value mix and $g$; `None` takes
            flash-linear-attention's defaults, $c \sqrt{\text{hidden}}$ rounded to a
            multiple of 32 and at least 32, with $c = 2.5 K / 64$, $2.5 K / 64$,
            $1.7 K / 64$ and $5$.
        - `norm_eps`: the norm's epsilon is `K * norm_eps`.
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
        - `key`: a PRNG key for the initial parameters, drawn as flash-linear-attention's
            `RWKV7Attention` initialises them for `layer_idx` of `num_layers`: the shift
            weights $\mu_\ast = 1 - (i / \text{hidden})^{p_\ast (1 - \ell / L)}$, $k_k$,
            $k_a = 1.02$, $r_k = -0.04$, the LoRA biases (the decay's spread over the
            channels), zero first LoRA factors and orthogonal second ones, orthogonal
            $W_r$, $W_k$ (gain 0.1) and $W_v$, a zero output projection and the norm's
            weight $((\ell + 1) / L)^{0.7}$.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int, `ValueError` if it is not positive or if
        `layer_idx` is not in `[0, num_layers)`.
        """
        sizes = dict(
            hidden_size=hidden_size,
            num_heads=num_heads,
            key_head_dim=key_head_dim,
            value_head_dim=value_head_dim,
            num_layers=num_layers,
        )
        options = engine_options(options, chunk_size, block_size, memory, precision)
        hidden, h, dk, dv, num_layers = check_sizes(**sizes).values()
        factor = dk / 64
        ranks = {
            "decay_low_rank_dim": (decay_low_rank_dim, 2.5, factor),
            "a_low_rank_dim": (a_low_rank_dim, 2.5, factor),
            "v_low_rank_dim": (v_low_rank_dim, 1.7, factor),
            "gate_low_rank_dim": (gate_low_rank_dim, 5.0, 1.0),
        }
        rank_w, rank_a, rank_v, rank_g = (
            _default_rank(hidden, c, f) if rank is None else as_positive_index(rank, name)
            for name, (rank, c, f) in ranks.items()
        )
        layer_idx = as_index(layer_idx, "layer_idx")
        if not 0 <= layer_idx < num_layers:
            raise ValueError(
                f"`layer_idx` ({layer_idx}) must be in [0, num_layers) = [0, {num_layers})."
            )
        dtype = param_dtype(dtype)
        key_dim, value_dim = h * dk, h * dv
        keys = jr.split(key, 8)

        # flash-linear-attention's RWKV7Attention._initialize_weights, for any key_dim.
        late = layer_idx / max(num_layers - 1, 1)  # 0 to 1
        early = 1.0 - layer_idx / num_layers  # 1 to almost 0
        ddd = np.arange(hidden) / hidden
        ramp = _ramp(key_dim)
        centre = (dk - 1) / 2
        zigzag = (np.arange(key_dim) % dk - centre) / max(centre, 1e-30)
        zigzag = zigzag * np.abs(zigzag)
        www = -6 + 6 * (np.arange(key_dim) / max(key_dim - 1, 1)) ** (1 + late**0.3)

        def const(x):
            return jnp.asarray(x, dtype)

        self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g = (
            const(1.0 - ddd ** (p * early)) for p in (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)
        )
        self.k_k = const(0.71 - ramp * 0.1)
        self.k_a = const(np.full(key_dim, 1.02))
        self.r_k = const(np.full((h, dk), -0.04))

        def linear(i, o, k, gain):
            layer = eqx.nn.Linear(i, o, use_bias=False, key=k, dtype=dtype)
            weight = jnp.zeros((o, i), dtype) if gain == 0 else _orthogonal(k, (o, i), gain, dtype)
            return eqx.tree_at(lambda m: m.weight, layer, weight)

        self.r_proj = linear(hidden, key_dim, keys[0], 1.0)
        self.k_proj = linear(hidden, key_dim, keys[1], 0.1)
        self.v_proj = linear(hidden, value_dim, keys[2], 1.0)
        self.o_proj = linear(value_dim, hidden, keys[3], 0.0)
        self.w_lora = LoRA(
            hidden,
            key_dim,
            rank_w,
            activation="tanh",
            bias=const(www + 0.5 + zigzag * 2.5),
            key=keys[4],
            dtype=dtype,
        )
        self.v_lora = (
            None
            if layer_idx == 0
            else LoRA(
                hidden,
                value_dim,
                rank_v,
                activation=None,
                bias=const(0.73 - _ramp(value_dim) * 0.4),
                key=keys[5],
                dtype=dtype,
            )
        )
        self.a_lora = LoRA(
            hidden,
            key_dim,
            rank_a,
            activation=None,
            bias=const(-0.19 + zigzag * 0.3 + ramp * 0.4),
            key=keys[6],
            dtype=dtype,
        )
        self.g_lora = LoRA(
            hidden, value_dim, rank_g, activation="sigmoid", bias=None, key=keys[7], dtype=dtype
        )
        norm = GroupNorm(h, value_dim, eps=dk * norm_eps, dtype=dtype)
        weight = jnp.full((value_dim,), ((layer_idx + 1) / num_layers) ** 0.7, dtype)
        self.g_norm = eqx.tree_at(lambda m: m.weight, norm, weight)
        self.hidden_size = hidden
        self.num_heads = h
        self.key_head_dim = dk
        self.value_head_dim = dv
        self.options = options

    @property
    def is_first(self) -> bool:
        """Whether this is the model's first RWKV-7 layer (`layer_idx=0`): its values are
        the later layers' `v_first`, and it takes none."""
        return self.v_lora is None

    def init_state(self, dtype=None, *, capacity: int | None = None) -> RWKV7AttentionState:
        """The state before the first token: zeros.

        **Arguments:**

        - `dtype`: the dtype of the shift state; the parameters' dtype if `None`. The
            recurrent state is float32 (float64 for float64 parameters).
        - `capacity`: ignored (attention's cache size).
        """
        del capacity
        dtype = self.o_proj.weight.dtype if dtype is None else dtype
        shape = (self.num_heads, self.key_head_dim, self.value_head_dim)
        return RWKV7AttentionState(
            jnp.zeros((self.hidden_size,), dtype), jnp.zeros(shape, accumulation_dtype(dtype))
        )

    # --------------------------------------------------------------------------------------
    # the layer's pieces
    # --------------------------------------------------------------------------------------
    def _shift(self, x, shift, cp, cu_seqlens) -> tuple[Array, Array]:
        """`(x, x' - x)` in the parameters' dtype, `x'` each token's predecessor."""
        x = x.astype(self.r_proj.weight.dtype)
        initial = None if shift is None else shift.astype(x.dtype)[None]
        prev = previous_tokens(x[None], cp=cp, cu_seqlens=cu_seqlens, initial=initial)[0]
        return x, prev - x

    def _values(self, x, delta) -> Array:
        """The projected values before any mixing, `(seq, H, V)`."""
        v = jax.vmap(self.v_proj)(x + delta * self.x_v[None])
        return v.reshape(x.shape[0], self.num_heads, self.value_head_dim)

    def _inputs(self, x, delta, v_first) -> tuple[DPLRInputs, tuple[Array, ...]]:
        """The recurrence's inputs (a batch of one) and `(r, k, v, g)` for `_finish`."""
        t, h, dk = x.shape[0], self.num_heads, self.key_head_dim

        def mixed(mu):
            return x + delta * mu[None]

        r = jax.vmap(self.r_proj)(mixed(self.x_r)).reshape(t, h, dk)
        k = jax.vmap(self.k_proj)(mixed(self.x_k))
        v = self._values(x, delta)
        ct = accumulation_dtype(x)
        w = _DECAY * jax.nn.sigmoid(self.w_lora(mixed(self.x_w)).astype(ct))
        if self.v_lora is not None:
            mix = jax.nn.sigmoid(self.v_lora(mixed(self.x_v))).reshape(v.shape)
            v = v + (v_first.astype(v.dtype) - v) * mix
        a = jax.nn.sigmoid(self.a_lora(mixed(self.x_a)))
        g = self.g_lora(mixed(self.x_g))
        kk = (k * self.k_k[None]).reshape(t, h, dk).astype(ct)
        # F.normalize: kk / max(|kk|, 1e-12), with a gradient at zero.
        kk = kk * jax.lax.rsqrt(jnp.maximum(jnp.sum(kk * kk, axis=-1, keepdims=True), 1e-24))
        kk = kk.astype(k.dtype)
        k = (k + k * (a - 1) * self.k_a[None]).reshape(t, h, dk)
        a = a.reshape(t, h, dk)
        inputs = one_sequence(DPLRInputs, r, k, v, -kk, kk * a, w.reshape(t, h, dk))
        return inputs, (r, k, v, g)

    def _finish(self, o, r, k, v, g) -> Array:
        """The norm per head, the bonus, the gate and the output projection."""
        t = o.shape[0]
        o = self.g_norm(o.reshape(t, -1))
        bonus = jnp.sum(r * k * self.r_k.astype(r.dtype)[None], axis=-1, keepdims=True) * v
        return jax.vmap(self.o_proj)((o + bonus.reshape(t, -1)) * g)

    def _recurrence(self, chunk_size: int) -> DPLRDeltaRule:
        return DPLRDeltaRule(chunk_size=chunk_size, scale=1.0, precision=self.precision)

    def _last_token(self, x, shift, cp) -> Array:
        """The sequence's last token, on every rank (`shift`, or zeros, for no tokens)."""
        t = x.shape[0]
        if t == 0:
            return jnp.zeros(x.shape[1:], x.dtype) if shift is None else shift.astype(x.dtype)
        if cp is None:
            return x[-1]
        last = local_positions(cp, t) == t * jax.lax.axis_size(cp.axis_name) - 1
        mine = jnp.sum(jnp.where(last[:, None], x, jnp.zeros((), x.dtype)), axis=0)
        return jax.lax.psum(mine, cp.axis_name)

    def _check_v_first(self, v_first, length: int | None) -> None:
        name = type(self).__name__
        if self.is_first:
            if v_first is not None:
                raise ValueError(
                    f"This {name} is the first layer (`layer_idx=0`): it makes `v_first` "
                    "(`values`) and takes none; pass `v_first=None`."
                )
            return
        shape = (self.num_heads, self.value_head_dim)
        shape = shape if length is None else (length, *shape)
        if v_first is None:
            raise ValueError(
                f"This {name} is not the first layer: pass `v_first=`, the first layer's "
                f"`values` on the same tokens, {shape}."
            )
        if tuple(v_first.shape) != shape:
            raise ValueError(
                f"`v_first` must be the first layer's values on the same tokens, {shape}; "
                f"got {tuple(v_first.shape)}."
            )

    def _forward(self, x, state, v_first, checkpoint_every, cp, cu_seqlens=None):
        cp = layer_cp(cp, type(self).__name__)
        check_input(x, self.hidden_size)
        self._check_v_first(v_first, x.shape[0])
        if checkpoint_every is not None:
            checkpoint_every = as_positive_index(checkpoint_every, "checkpoint_every")
            check_checkpoints(checkpoint_every, x.shape[0], cp, self.chunk_size, 1)
        shift0, h0 = (None, None) if state is None else (state.shift, state.recurrent)
        x_p, delta = self._shift(x, shift0, cp, cu_seqlens)
        inputs, parts = self._inputs(x_p, delta, v_first)
        recurrence = self._recurrence(self.chunk_size)
        if checkpoint_every is not None:
            recurrence = Checkpointed(inner=recurrence, chunk_size=checkpoint_every)
        o, h = run(
            recurrence,
            inputs,
            initial_state=None if h0 is None else h0[None],
            cu_seqlens=cu_seqlens,
            cp=cp,
            **self.options.run_kwargs(),
        )
        saved = None
        if checkpoint_every is not None:
            o, spread = o
            ends = checkpoint_every * jnp.arange(1, x.shape[0] // checkpoint_every + 1)
            saved = RWKV7AttentionState(
                x_p[ends - 1], checkpoints(spread, checkpoint_every, h.shape[1:])[0]
            )
        out = self._finish(o[0], *parts).astype(x.dtype)
        shift = self._last_token(x_p, shift0, cp)
        if shift0 is not None:
            shift = shift.astype(shift0.dtype)
        return out, RWKV7AttentionState(shift, h[0]), saved

    # --------------------------------------------------------------------------------------
    # the public calls
    # --------------------------------------------------------------------------------------
    def values(
        self,
        x: Float[Array, "seq hidden"],
        state: RWKV7AttentionState | None = None,
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> Float[Array, "seq heads v"]:
        """The layer's values before they are mixed with anything: $v = x_v W_v$ (steps 1
        and 2). On the first layer (`is_first`) these are `v_first`, what every later
        layer takes.

        **Arguments:** `x`, `state`, `cp` and `cu_seqlens` as for `__call__` (the same
        ones the layer is called with). For one token of generation, `x[None]` and the
        state before it, and `[0]` of the result.

        **Returns:**

        `(seq, heads, V)`, in the parameters' dtype, in `x`'s layout under `cp`.
        """
        cp = layer_cp(cp, type(self).__name__)
        check_input(x, self.hidden_size)
        shift = None if state is None else state.shift
        return self._values(*self._shift(x, shift, cp, cu_seqlens))

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        state: RWKV7AttentionState | None = None,
        *,
        v_first: Float[Array, "seq heads v"] | None = None,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
        kv_schedule: KVSchedule = "allgather",
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: one sequence, `(seq, hidden)`; with `cp`, this rank's shard of it under
            `cp.layout`.
        - `state`: the state before the first token (a prefix already processed), or
            `None` to start from zeros. With `cp`, replicated on every rank.
        - `v_first`: the first layer's `values` on the same tokens, `(seq, heads, V)`
            (this rank's shard under `cp`); `None` on the first layer, required on the
            others.
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`); `None` on one device.
        - `cu_seqlens`: packed documents in `x`, `[0, ..., T]` over the whole sequence (a
            list or an int array; global under `cp`, the same on every rank): each
            document starts from zeros, its first token shifting in zeros and the
            recurrence resetting there, as if each were its own call. Not with `state`.
        - `kv_schedule`: ignored (attention's; every token mixer takes it, see
            [`deltanet_cp.nn.AbstractTokenMixer`][]).

        **Returns:**

        The output, `(seq, hidden)`, in `x`'s dtype (computed in the parameters' dtype).
        For the state after the last token as well, call `prefill`.

        **Raises:**

        `ValueError` naming `x` if it is not a floating-point `(seq, hidden)` array (a
        batch: `jax.vmap` the layer over it); for a missing, unexpected or misshapen
        `v_first`; for `cu_seqlens` with `state`.
        """
        del kv_schedule
        check_documents_without_state(type(self).__name__, state, cu_seqlens)
        return self._forward(x, state, v_first, None, cp, cu_seqlens)[0]

    def first_values(
        self,
        x: Float[Array, "seq hidden"],
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> Float[Array, "seq heads v"] | None:
        """`values(x, cp=cp, cu_seqlens=cu_seqlens)` on the model's first RWKV-7 layer
        (`is_first`): the `v_first` of the later ones; `None` on the others."""
        return self.values(x, cp=cp, cu_seqlens=cu_seqlens) if self.is_first else None

    def extend(
        self,
        x: Float[Array, "seq hidden"],
        state: RWKV7AttentionState | None,
        position: Int[Array, ""] | int,
        /,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Float[Array, "seq heads v"] | None = None,
        checkpoint_every: int | None = None,
    ) -> tuple[Float[Array, "seq hidden"], RWKV7AttentionState, RWKV7AttentionState | None]:
        """`prefill(x, state, v_first=v_first, checkpoint_every=checkpoint_every, cp=cp)`
        (see [`deltanet_cp.nn.AbstractTokenMixer.extend`][])."""
        del position, kv_schedule
        return self.prefill(x, state, v_first=v_first, checkpoint_every=checkpoint_every, cp=cp)

    def prefill(
        self,
        x: Float[Array, "seq hidden"],
        state: RWKV7AttentionState | None = None,
        *,
        v_first: Float[Array, "seq heads v"] | None = None,
        checkpoint_every: int | None = None,
        cp: ContextParallel | None = None,
    ) -> tuple[Float[Array, "seq hidden"], RWKV7AttentionState, RWKV7AttentionState | None]:
        """`__call__`, the state after the last token, and the states at fixed token
        boundaries.

        **Arguments:**

        - `x`, `state`, `v_first`, `cp`: as for `__call__`.
        - `checkpoint_every`: `L`, a multiple of `chunk_size`, as for
            [`deltanet_cp.nn.GatedDeltaNet.prefill`][]; `None` for no checkpoints.

        **Returns:**

        `(output, new_state, checkpoints)`: `new_state` the state after the last token
        (replicated on every rank with `cp`), its `shift` in the given state's dtype (the
        parameters' without one); `checkpoints` `None` without `checkpoint_every`, else an
        [`deltanet_cp.nn.RWKV7AttentionState`][] with a leading axis over the boundaries
        (`shift (n, hidden)`, `recurrent (n, heads, K, V)`), the state after `L`, `2 L`,
        ... of this rank's tokens in the order they are laid out.
        """
        return self._forward(x, state, v_first, checkpoint_every, cp)

    def step(
        self,
        x: Float[Array, " hidden"],
        state: RWKV7AttentionState,
        position: Int[Array, ""] | int | None = None,
        *,
        v_first: Float[Array, "heads v"] | None = None,
    ) -> tuple[Float[Array, " hidden"], RWKV7AttentionState]:
        """One token of generation: the token-by-token form of `__call__`.

        **Arguments:**

        - `x`: the new token's input, `(hidden,)`.
        - `state`: the state before it (from `init_state`, a `prefill`, or the previous
            `step`).
        - `v_first`: the first layer's values of this token, `(heads, V)`
            (`first.values(x0[None], state0)[0]` with that layer's input and state before
            the token); `None` on the first layer.
        - `position`: ignored (attention's; every token mixer takes it).

        **Returns:**

        `(y, new_state)`: the output `(hidden,)` in `x`'s dtype and the state after the
        token, in the dtypes of `state`.
        """
        del position
        check_input(x, self.hidden_size, one_token=True)
        self._check_v_first(v_first, None)
        x_p, delta = self._shift(x[None], state.shift, None, None)
        inputs, parts = self._inputs(x_p, delta, None if v_first is None else v_first[None])
        o, h = run(
            self._recurrence(1),
            inputs,
            initial_state=state.recurrent[None],
            **self.options.run_kwargs(),
        )
        y = self._finish(o[0], *parts)[0].astype(x.dtype)
        new = RWKV7AttentionState(
            x_p[0].astype(state.shift.dtype), h[0].astype(state.recurrent.dtype)
        )
        return y, new
