"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5, with context parallelism."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._parallel import ContextParallel
from .._precision import accumulation_dtype, as_precision, PrecisionName
from .._run import run
from .._validate import as_positive_index
from ..recurrences._delta_family import DeltaInputs
from ..recurrences._gated_delta import GatedDeltaRule, recurrent_gated_delta_rule
from ._checkpointed import Checkpointed, checkpoints
from ._context import layer_cp
from ._conv import CausalConv1d
from ._norm import GatedRMSNorm


class GatedDeltaNetState(eqx.Module):
    """What a [`deltanet_cp.nn.GatedDeltaNet`][] carries from one segment to the next.

    **Fields:**

    - `conv`: the last `conv_kernel_size - 1` inputs of the convolution (the projected
        `concat(q, k, v)` before the convolution), `(conv_kernel_size - 1, conv_dim)`.
    - `recurrent`: the gated-delta-rule state, `(value_heads, K, V)`, float32.

    Both may carry the same leading batch axes (to be `jax.vmap`ped over with the input).
    """

    conv: Float[Array, "*batch history conv_dim"]
    recurrent: Float[Array, "*batch vheads k v"]


class GatedDeltaNet(eqx.Module):
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
    chunk_size: int = eqx.field(static=True)
    block_size: int | None = eqx.field(static=True)
    precision: PrecisionName | None = eqx.field(static=True)

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
        chunk_size: int = 64,
        block_size: int | None = None,
        precision: PrecisionName | None = None,
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
        - `chunk_size`: tokens per chunk of the gated delta rule.
        - `block_size`: the engine's block, tokens whose chunk factors are formed together
            (the `block_size` of [`deltanet_cp.run`][]); `None` takes
            [`deltanet_cp.default_block_size`][] (the backend's default).
        - `precision`: how the gated delta rule's large products multiply (the chunk
            Grams, the WY products, `q h`, `w h`, `k~^T v`): `"highest"` (float32 operands
            at `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32
            accumulation), `"default"` (`jax.default_matmul_precision`), or `None`: from
            the recurrence's inputs, which are in the parameters' dtype (`"bfloat16"` for
            bfloat16 parameters, `"highest"` otherwise). The recurrent state, the gates,
            the chunk maps and the norm stay float32 under every policy. The dense
            projections are `equinox.nn.Linear`s: they multiply in the parameters' dtype
            at JAX's default precision whatever the policy.
        - `key`: a PRNG key for the initial parameters. Linear layers and the convolution
            use the Equinox/torch defaults, $A_{\log} = \log U(1, 16)$ and $\Delta_b = 1$
            (Qwen3-Next's recipe), and the norm weight is ones.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `TypeError` if a size is not an int (NumPy integers are accepted), `ValueError` if it
        is not positive (`block_size` may also be `None`) or if `num_value_heads` is not a
        multiple of `num_key_heads`.
        """
        hidden_size = as_positive_index(hidden_size, "hidden_size")
        num_key_heads = as_positive_index(num_key_heads, "num_key_heads")
        num_value_heads = as_positive_index(num_value_heads, "num_value_heads")
        key_head_dim = as_positive_index(key_head_dim, "key_head_dim")
        value_head_dim = as_positive_index(value_head_dim, "value_head_dim")
        conv_kernel_size = as_positive_index(conv_kernel_size, "conv_kernel_size")
        chunk_size = as_positive_index(chunk_size, "chunk_size")
        if block_size is not None:
            block_size = as_positive_index(block_size, "block_size")
        precision = as_precision(precision)
        if num_value_heads % num_key_heads != 0:
            raise ValueError(
                f"`num_value_heads` ({num_value_heads}) must be a multiple of "
                f"`num_key_heads` ({num_key_heads}): value head j reads key head "
                "j // (num_value_heads // num_key_heads)."
            )
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        kqkv, kz, kb, ka, kconv, kA, kout = jr.split(key, 7)
        key_dim = num_key_heads * key_head_dim
        value_dim = num_value_heads * value_head_dim
        conv_dim = 2 * key_dim + value_dim

        def linear(i, o, k):
            return eqx.nn.Linear(i, o, use_bias=False, key=k, dtype=dtype)

        self.in_proj_qkv = linear(hidden_size, conv_dim, kqkv)
        self.in_proj_z = linear(hidden_size, value_dim, kz)
        self.in_proj_b = linear(hidden_size, num_value_heads, kb)
        self.in_proj_a = linear(hidden_size, num_value_heads, ka)
        self.conv1d = CausalConv1d(conv_dim, conv_kernel_size, key=kconv, dtype=dtype)
        self.A_log = jnp.log(jr.uniform(kA, (num_value_heads,), dtype, 1.0, 16.0))
        self.dt_bias = jnp.ones((num_value_heads,), dtype)
        self.norm = GatedRMSNorm(value_head_dim, eps=norm_eps, dtype=dtype)
        self.out_proj = linear(value_dim, hidden_size, kout)
        self.hidden_size = hidden_size
        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.precision = precision

    @property
    def conv_dim(self) -> int:
        """The channels of the convolution: `2 * H * K + HV * V` (q, k and v)."""
        return (
            2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        )

    @property
    def conv_kernel_size(self) -> int:
        """The length of the causal convolution (the current token and the ones before it)."""
        return self.conv1d.kernel_size

    def init_state(self, dtype=None) -> GatedDeltaNetState:
        """The state before the first token: zeros.

        **Arguments:**

        - `dtype`: the dtype of the convolution state; the parameters' dtype if `None`.
            The recurrent state is float32 (float64 for float64 parameters).
        """
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        rdt = accumulation_dtype(dtype)
        return GatedDeltaNetState(
            conv=jnp.zeros((self.conv1d.history, self.conv_dim), dtype),
            recurrent=jnp.zeros(
                (self.num_value_heads, self.key_head_dim, self.value_head_dim), rdt
            ),
        )

    def _check_input(self, x, *, one_token: bool = False) -> None:
        """A `ValueError` naming `x` unless it is floating, `(seq, hidden)` or `(hidden,)`."""
        layout = "(hidden,)" if one_token else "(seq, hidden)"
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"`x` must be a floating-point array {layout}; got "
                f"{type(x).__name__ if dtype is None else dtype}. Cast it with `.astype(...)`."
            )
        if x.ndim != (1 if one_token else 2) or x.shape[-1] != self.hidden_size:
            batched = "" if one_token else " It takes one sequence: `jax.vmap` it over a batch."
            raise ValueError(
                f"`x` must have shape {layout} with hidden = {self.hidden_size}; got "
                f"{tuple(x.shape)}.{batched}"
            )

    def _project(self, x):
        """Projections of `x: (seq, hidden)`, in the parameters' dtype:
        `(qkv (seq, conv_dim), z, b, a)`."""
        x = x.astype(self.out_proj.weight.dtype)
        return tuple(
            jax.vmap(lin)(x)
            for lin in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        )

    def _split(self, mixed, z, b, a):
        """Post-convolution `(seq, conv_dim)` etc. to the recurrence inputs."""
        t = mixed.shape[0]
        h, hv, dk, dv = (
            self.num_key_heads,
            self.num_value_heads,
            self.key_head_dim,
            self.value_head_dim,
        )
        q = mixed[:, : h * dk].reshape(t, h, dk)
        k = mixed[:, h * dk : 2 * h * dk].reshape(t, h, dk)
        v = mixed[:, 2 * h * dk :].reshape(t, hv, dv)
        z = z.reshape(t, hv, dv)
        beta = jax.nn.sigmoid(b)
        gate_dt = accumulation_dtype(a)
        a_log = self.A_log.astype(gate_dt)[None]
        dt_bias = self.dt_bias.astype(gate_dt)[None]
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(gate_dt) + dt_bias)
        return q, k, v, z, g, beta

    def _finish(self, o, z):
        """Gated RMSNorm per value head and the output projection: `(seq, hidden)`."""
        t = o.shape[0]
        o = self.norm(o, z).reshape(t, self.num_value_heads * self.value_head_dim)
        return jax.vmap(self.out_proj)(o)

    def recurrence_inputs(
        self,
        x: Float[Array, "seq hidden"],
        state: GatedDeltaNetState | None = None,
        *,
        cp: ContextParallel | None = None,
    ) -> tuple[Array, Array, Array, Array, Array, Array]:
        """Everything the layer computes before the gated delta rule (for inspection).

        **Arguments:** as for `__call__`.

        **Returns:**

        `(q, k, v, z, g, beta)`: `q, k: (seq, H, K)` and `v: (seq, HV, V)` after the
        convolution and SiLU (before L2 normalisation and head repetition), the norm gate
        `z: (seq, HV, V)`, and the log decays `g` and step sizes `beta`, `(seq, HV)`.
        """
        self._check_input(x)
        mixed, z, b, a = self._project(x)
        conv_state = None if state is None else state.conv
        mixed, _ = self.conv1d(mixed, conv_state, cp=layer_cp(cp, "GatedDeltaNet"))
        return self._split(jax.nn.silu(mixed), z, b, a)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        state: GatedDeltaNetState | None = None,
        *,
        cp: ContextParallel | None = None,
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: one sequence, `(seq, hidden)`; with `cp`, this rank's shard of it under
            `cp.layout` (each of its pieces at least `conv_kernel_size - 1` tokens).
        - `state`: the state before the first token (a prefix already processed), or `None`
            to start from zeros. With `cp`, replicated on every rank.
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`; the convolution's halo and the recurrence follow the layout's pieces);
            `None` on one device.

        **Returns:**

        The output, `(seq, hidden)`, in `x`'s dtype (computed in the parameters' dtype).
        For the state after the last token as well, call `prefill`.

        **Raises:**

        `ValueError` naming `x` if it is not a floating-point `(seq, hidden)` array (a
        batch: `jax.vmap` the layer over it).
        """
        return self._forward(x, state, None, cp)[0]

    def prefill(
        self,
        x: Float[Array, "seq hidden"],
        state: GatedDeltaNetState | None = None,
        *,
        checkpoint_every: int | None = None,
        cp: ContextParallel | None = None,
    ) -> tuple[Float[Array, "seq hidden"], GatedDeltaNetState, GatedDeltaNetState | None]:
        """`__call__`, the state after the last token, and the states at fixed token
        boundaries.

        With `checkpoint_every = L`, the recurrence runs in chunks of `L` tokens and the
        engine's pass also emits the state after each of them (no extra pass, no extra
        collective under context parallelism): for prefix caching, the state after
        tokens `[0, L)`, `[0, 2 L)`, ... of `x` (counted from the first token of `x`).

        **Arguments:**

        - `x`, `state`, `cp`: as for `__call__`.
        - `checkpoint_every`: `L`, a multiple of `chunk_size` and at least
            `conv_kernel_size - 1`; with `cp` it must divide each contiguous piece of this
            rank's shard (the shard under `Contiguous`, each half under `Zigzag`), so that
            the boundaries fall at multiples of `L` of the whole sequence. `None` for no
            checkpoints.

        **Returns:**

        `(output, new_state, checkpoints)`. `new_state` is the state after the last token
        (replicated on every rank with `cp`), the convolution state in the given one's
        dtype (the parameters' without one). `checkpoints` is `None` without
        `checkpoint_every`; else a [`deltanet_cp.nn.GatedDeltaNetState`][] with a leading
        axis over the boundaries: `conv (n, conv_kernel_size - 1, conv_dim)` and
        `recurrent (n, HV, K, V)`, the state after `L`, `2 L`, ... tokens of this rank's
        tokens in the order they are laid out (`n = len(x) // L`; on one device, a last
        partial chunk has no checkpoint). Under context parallelism each rank holds the
        checkpoints of its own pieces: sharded over `cp.axis_name` they are in the
        layout's order (put them in sequence order with `cp.layout.from_layout` on
        axis 0).
        """
        return self._forward(x, state, checkpoint_every, cp)

    def _check_checkpoints(self, every: int, length: int, cp: ContextParallel | None) -> None:
        if every % self.chunk_size or every < self.conv1d.history:
            raise ValueError(
                f"`checkpoint_every` ({every}) must be a multiple of the layer's chunk_size "
                f"({self.chunk_size}) and at least conv_kernel_size - 1 "
                f"({self.conv1d.history})."
            )
        if cp is None:
            return
        piece = cp.layout.piece_length(length, jax.lax.axis_size(cp.axis_name))
        if piece % every:
            raise ValueError(
                f"Under context parallelism `checkpoint_every` ({every}) must divide each "
                f"contiguous piece of a rank's shard ({piece} tokens under {cp.layout!r}), so "
                "that the checkpoints fall at multiples of it in the whole sequence."
            )

    def _forward(
        self, x, state, checkpoint_every, cp
    ) -> tuple[Array, GatedDeltaNetState, GatedDeltaNetState | None]:
        cp = layer_cp(cp, "GatedDeltaNet")
        self._check_input(x)
        if checkpoint_every is not None:
            checkpoint_every = as_positive_index(checkpoint_every, "checkpoint_every")
            self._check_checkpoints(checkpoint_every, x.shape[0], cp)
        mixed, z, b, a = self._project(x)
        conv_state, h0 = (None, None) if state is None else (state.conv, state.recurrent)
        conv_out, new_conv = self.conv1d(mixed, conv_state, cp=cp)
        q, k, v, z, g, beta = self._split(jax.nn.silu(conv_out), z, b, a)
        recurrence = GatedDeltaRule(
            chunk_size=self.chunk_size, use_qk_l2norm=True, precision=self.precision
        )
        if checkpoint_every is not None:
            recurrence = Checkpointed(inner=recurrence, chunk_size=checkpoint_every)
        o, h = run(
            recurrence,
            DeltaInputs(q[None], k[None], v[None], g[None], beta[None]),
            initial_state=None if h0 is None else h0[None],
            cp=cp,
            block_size=self.block_size,
        )
        saved = None
        if checkpoint_every is not None:
            o, spread = o
            n, w = x.shape[0] // checkpoint_every, self.conv1d.history
            ends = checkpoint_every * jnp.arange(1, n + 1)
            shape = self.init_state().recurrent.shape
            saved = GatedDeltaNetState(
                conv=mixed[ends[:, None] - w + jnp.arange(w)[None, :]],
                recurrent=checkpoints(spread, checkpoint_every, shape)[0],
            )
        out = self._finish(o[0], z).astype(x.dtype)
        if conv_state is not None:
            new_conv = new_conv.astype(conv_state.dtype)
        return out, GatedDeltaNetState(conv=new_conv, recurrent=h[0]), saved

    def step(
        self, x: Float[Array, " hidden"], state: GatedDeltaNetState
    ) -> tuple[Float[Array, " hidden"], GatedDeltaNetState]:
        """One token of generation: the token-by-token form of `__call__`.

        **Arguments:**

        - `x`: the new token's input, `(hidden,)`.
        - `state`: the state before it (from [`deltanet_cp.nn.GatedDeltaNet.init_state`][],
            a `prefill`, or the previous `step`).

        **Returns:**

        `(y, new_state)`: the output `(hidden,)` in `x`'s dtype and the state after the
        token, in the dtypes of `state`.
        """
        self._check_input(x, one_token=True)
        mixed, z, b, a = self._project(x[None])
        mixed, new_conv = self.conv1d(mixed, state.conv)
        q, k, v, z, g, beta = self._split(jax.nn.silu(mixed), z, b, a)
        o, h = recurrent_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            initial_state=state.recurrent[None],
            use_qk_l2norm=True,
            precision=self.precision,
        )
        y = self._finish(o[0], z)[0].astype(x.dtype)
        new_state = GatedDeltaNetState(
            conv=new_conv.astype(state.conv.dtype), recurrent=h[0].astype(state.recurrent.dtype)
        )
        return y, new_state
