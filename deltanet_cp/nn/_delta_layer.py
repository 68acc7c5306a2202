"""What the recurrent token mixers share: projections into a short causal convolution, a
chunked recurrence, an output gate and projection; the state carried from one segment to the
next; prefill, checkpoints and decoding; context parallelism."""

import abc
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._dtype import param_dtype
from .._options import EngineOptions
from .._parallel import ContextParallel
from .._precision import accumulation_dtype
from .._recurrence import AbstractRecurrence
from .._run import run
from .._validate import as_positive_index
from ..recurrences._delta_family import DeltaInputs
from ._checkpointed import Checkpointed, checkpoints
from ._context import layer_cp
from ._conv import CausalConv1d
from ._mixer import AbstractEngineMixer
from ._schedule import KVSchedule


_State = TypeVar("_State")
_Inputs = TypeVar("_Inputs", bound=eqx.Module)
_Norm = TypeVar("_Norm")


def check_sizes(**sizes: Any) -> dict[str, int]:
    """Each of `sizes` as a positive int (`as_positive_index`, naming it), in order."""
    return {name: as_positive_index(value, name) for name, value in sizes.items()}


def check_value_heads(num_value_heads: int, num_key_heads: int) -> None:
    """A `ValueError` unless `num_value_heads` is a multiple of `num_key_heads`."""
    if num_value_heads % num_key_heads:
        raise ValueError(
            f"`num_value_heads` ({num_value_heads}) must be a multiple of "
            f"`num_key_heads` ({num_key_heads}): value head j reads key head "
            "j // (num_value_heads // num_key_heads)."
        )


def no_bias_linear(dtype):
    """`eqx.nn.Linear(in, out, key)` without bias, in `dtype` (the default if `None`)."""
    dtype = param_dtype(dtype)
    return lambda i, o, key: eqx.nn.Linear(i, o, use_bias=False, key=key, dtype=dtype)


class Skeleton:
    """What every recurrent token mixer builds alike, in one place: its sizes checked, its
    engine options, the input projection of `concat(q, k, v)`, the short convolution, the
    gated norm per head and the output projection. A concrete layer's `__init__` makes one
    and takes its parts (in the order of its own PRNG keys); it builds only its gates.

    ```python { .fragment }
    sizes = dict(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim)
    s = Skeleton(sizes, heads="num_heads", dims="head_dim", options=options, dtype=dtype)
    self.in_proj_qkv, self.conv1d = s.qkv(k_qkv, k_conv)
    self.b_proj = s.linear(s.hidden_size, num_heads, k_b)
    self.norm, self.out_proj = s.norm(GatedRMSNorm, norm_eps), s.out_proj(k_out)
    ```
    """

    def __init__(
        self,
        sizes: dict[str, Any],
        *,
        heads: str | tuple[str, str] = ("num_key_heads", "num_value_heads"),
        dims: str | tuple[str, str] = ("key_head_dim", "value_head_dim"),
        conv_kernel_size: Any = 4,
        options: EngineOptions | None = None,
        dtype: Any = None,
    ):
        """**Arguments:**

        - `sizes`: the layer's sizes by argument name (`hidden_size` first), each checked
            to be a positive int (a `TypeError` / `ValueError` naming it); checked, in
            `sizes` (a dict in the same order).
        - `heads`, `dims`: the names in `sizes` of the query/key and value head counts
            `H`, `HV` and head sizes `K`, `V` (one name for both); `HV` must be a multiple
            of `H` (a `ValueError` otherwise).
        - `conv_kernel_size`: the length of the causal convolution.
        - `options`: the layer's [`deltanet_cp.EngineOptions`][], in `options`; the
            defaults if `None`.
        - `dtype`: the parameter dtype, in `dtype`; the default floating dtype if `None`.
        """
        self.sizes = check_sizes(**sizes, conv_kernel_size=conv_kernel_size)
        self.conv_kernel_size = self.sizes.pop("conv_kernel_size")
        self.hidden_size = self.sizes["hidden_size"]
        heads = (heads, heads) if isinstance(heads, str) else heads
        dims = (dims, dims) if isinstance(dims, str) else dims
        h, hv = (self.sizes[name] for name in heads)
        check_value_heads(hv, h)
        k, v = (self.sizes[name] for name in dims)
        self.key_dim, self.value_dim, self.value_head_dim = h * k, hv * v, v
        self.options = EngineOptions() if options is None else options
        self.dtype = param_dtype(dtype)

    @classmethod
    def grouped(
        cls,
        hidden_size: Any,
        num_key_heads: Any,
        num_value_heads: Any,
        key_head_dim: Any,
        value_head_dim: Any,
        **kwargs: Any,
    ) -> "Skeleton":
        """The skeleton of a layer whose value heads are grouped over its key heads, its
        sizes under these names; `kwargs` as for `__init__`, with `extra`: more sizes to
        check (by name, after these)."""
        sizes = dict(
            hidden_size=hidden_size,
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
            key_head_dim=key_head_dim,
            value_head_dim=value_head_dim,
            **kwargs.pop("extra", {}),
        )
        return cls(sizes, **kwargs)

    def fill(self, layer: Any) -> None:
        """Set the checked sizes and `options` as `layer`'s fields of the same names
        (inside its `__init__`)."""
        for name, value in {**self.sizes, "options": self.options}.items():
            setattr(layer, name, value)

    @property
    def conv_dim(self) -> int:
        """`2 H K + HV V`: the width of `concat(q, k, v)`."""
        return 2 * self.key_dim + self.value_dim

    def linear(self, i: int, o: int, key: PRNGKeyArray, *, bias: bool = False) -> eqx.nn.Linear:
        """An `eqx.nn.Linear(i, o)` in the parameter dtype, without bias unless `bias`."""
        return eqx.nn.Linear(i, o, use_bias=bias, key=key, dtype=self.dtype)

    def qkv(
        self, key_qkv: PRNGKeyArray, key_conv: PRNGKeyArray, conv_dim: int | None = None
    ) -> tuple[eqx.nn.Linear, CausalConv1d]:
        """`(in_proj_qkv, conv1d)`: the projection `hidden -> conv_dim` and the depthwise
        causal convolution over it (`conv_dim` the `concat(q, k, v)` width if `None`)."""
        conv_dim = self.conv_dim if conv_dim is None else conv_dim
        in_proj = self.linear(self.hidden_size, conv_dim, key_qkv)
        return in_proj, CausalConv1d(
            conv_dim, self.conv_kernel_size, key=key_conv, dtype=self.dtype
        )

    def norm(self, norm: Callable[..., _Norm], eps: float) -> _Norm:
        """The gated norm per value head: `norm(V, eps=eps, dtype=dtype)`."""
        return norm(self.value_head_dim, eps=eps, dtype=self.dtype)

    def out_proj(self, key: PRNGKeyArray) -> eqx.nn.Linear:
        """The output projection `HV V -> hidden`, without bias."""
        return self.linear(self.value_dim, self.hidden_size, key)


def project(x: Array, *linears: eqx.nn.Linear) -> tuple[Array, ...]:
    """Each linear layer over `x: (seq, in)`, in the parameters' dtype."""
    x = x.astype(linears[0].weight.dtype)
    return tuple(jax.vmap(linear)(x) for linear in linears)


def split_qkv(mixed: Array, heads: int, key_dim: int, value_dim: int) -> tuple[Array, Array, Array]:
    """`concat(q, k, v)`, `(seq, 2 H K + HV V)`, into `q, k: (seq, H, K)` and
    `v: (seq, HV, V)`."""
    t, hk = mixed.shape[0], heads * key_dim
    q = mixed[:, :hk].reshape(t, heads, key_dim)
    k = mixed[:, hk : 2 * hk].reshape(t, heads, key_dim)
    return q, k, mixed[:, 2 * hk :].reshape(t, -1, value_dim)


def finish(norm: Callable[[Array, Array], Array], out_proj: eqx.nn.Linear, o, gate) -> Array:
    """The gated norm per head of `o: (seq, heads, V)`, then the output projection:
    `(seq, hidden)`."""
    o = norm(o, gate)
    return jax.vmap(out_proj)(o.reshape(o.shape[0], -1))


def one_sequence(inputs: type[_Inputs], *arrays: Array | None) -> _Inputs:
    """`inputs(*arrays)` with a batch axis of one on each array (`None` stays `None`)."""
    return inputs(*(None if a is None else a[None] for a in arrays))


def fla_decay_init(key_a, key_dt, a_shape, dt_shape, dtype) -> tuple[Array, Array]:
    r"""`(A_log, dt_bias)` as flash-linear-attention initialises them: $A_{\log} =
    \log U(1, 16)$ and $\Delta_b$ the inverse softplus of $e^{U(\log 10^{-3}, \log
    10^{-1})}$."""
    a_log = jnp.log(jax.random.uniform(key_a, a_shape, dtype, 1.0, 16.0))
    dt = jnp.exp(jax.random.uniform(key_dt, dt_shape, dtype, math.log(1e-3), math.log(1e-1)))
    return a_log, dt + jnp.log(-jnp.expm1(-dt))


def log_decay(a: Array, a_log: Array, dt_bias: Array) -> Array:
    r"""The log decays $-e^{A_{\log}} \, \mathrm{softplus}(a + \Delta_b)$ in float32
    (float64 for float64 `a`), the arrays broadcast together."""
    dtype = accumulation_dtype(a)
    return -jnp.exp(a_log.astype(dtype)) * jax.nn.softplus(a.astype(dtype) + dt_bias.astype(dtype))


def step_sizes(b: Array, allow_neg_eigval: bool) -> Array:
    r"""The delta rule's step sizes from their logits: $\sigma(b)$ in $[0, 1]$, or
    $2 \sigma(b)$ in $[0, 2]$ with `allow_neg_eigval` (negative eigenvalues)."""
    beta = jax.nn.sigmoid(b)
    return 2 * beta if allow_neg_eigval else beta


def check_input(x: Any, hidden_size: int, *, one_token: bool = False) -> None:
    """A `ValueError` naming `x` unless it is a floating-point `(seq, hidden)` array (or
    `(hidden,)` with `one_token`)."""
    layout = "(hidden,)" if one_token else "(seq, hidden)"
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"`x` must be a floating-point array {layout}; got "
            f"{type(x).__name__ if dtype is None else dtype}. Cast it with `.astype(...)`."
        )
    if x.ndim != (1 if one_token else 2) or x.shape[-1] != hidden_size:
        batched = "" if one_token else " It takes one sequence: `jax.vmap` it over a batch."
        raise ValueError(
            f"`x` must have shape {layout} with hidden = {hidden_size}; got "
            f"{tuple(x.shape)}.{batched}"
        )


def check_documents_without_state(layer: str, state: Any, cu_seqlens: Any) -> None:
    """A `ValueError` naming `layer` if both `state` and `cu_seqlens` are given (with
    packed documents every document starts from zeros)."""
    if cu_seqlens is not None and state is not None:
        raise ValueError(
            f"{layer}: with `cu_seqlens` every document starts from zeros; pass `state=None` "
            "(to continue one sequence from a state, call it without `cu_seqlens`)."
        )


def check_checkpoints(
    every: int, length: int, cp: ContextParallel | None, chunk_size: int, history: int
) -> None:
    """A `ValueError` unless `checkpoint_every` suits a layer with chunks of `chunk_size`
    tokens and `history` tokens of input carried in its state, and with `cp` the pieces of a
    rank's `length` tokens."""
    if every % chunk_size or every < history:
        raise ValueError(
            f"`checkpoint_every` ({every}) must be a multiple of the layer's chunk_size "
            f"({chunk_size}) and at least conv_kernel_size - 1 ({history})."
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


class RecurrentLayerState(eqx.Module):
    """What a recurrent token mixer of `deltanet_cp.nn` carries from one segment to the next
    (the state of [`deltanet_cp.nn.GatedDeltaNet`][], [`deltanet_cp.nn.DeltaNet`][],
    [`deltanet_cp.nn.KimiDeltaAttention`][], [`deltanet_cp.nn.GatedLinearAttention`][],
    [`deltanet_cp.nn.SimpleGatedLinearAttention`][], [`deltanet_cp.nn.GatedDeltaProduct`][],
    [`deltanet_cp.nn.GatedDeltaNet2`][] and [`deltanet_cp.nn.MomentumDeltaNet`][]; the
    preconditioned layers carry one more array, see [`deltanet_cp.nn.PrecondLayerState`][]).
    `deltanet_cp.nn.GatedDeltaNetState` and `deltanet_cp.nn.KimiDeltaAttentionState` are
    deprecated names of this class.

    **Fields:**

    - `conv`: the last `conv_kernel_size - 1` inputs of the convolution (the projected
        `concat(q, k, v)` before the convolution), `(conv_kernel_size - 1, conv_dim)`.
    - `recurrent`: the recurrence's state, `(value_heads, K, V)` (Momentum DeltaNet:
        `(value_heads, 2K, V)`, the memory's rows over the momentum's), float32 (float64
        for float64 parameters).

    Both may carry the same leading batch axes (to be `jax.vmap`ped over with the input).
    """

    conv: Float[Array, "*batch history conv_dim"]
    recurrent: Float[Array, "*batch vheads k v"]


class AbstractRecurrentLayer(AbstractEngineMixer, Generic[_State]):
    """A token mixer built around a chunked linear recurrence (Gated DeltaNet, Kimi Delta
    Attention, gated linear attention, Gated DeltaProduct, Gated DeltaNet-2).

    For an input `x` of shape `(seq, hidden)`: projections, of which `concat(q, k, v)` goes
    through a depthwise causal convolution and SiLU; gates from the input; the chunked
    recurrence through [`deltanet_cp.run`][]; a gated norm per head and the output
    projection. A concrete layer builds its parameters with a `Skeleton` and says how it
    projects (`_project`), what it hands the recurrence (`_split`), which recurrence
    (`_recurrence`) and its state's shape (`_recurrent_shape`); everything else, the
    state, `prefill`, `step` and context parallelism, is here. Its engine settings are
    one [`deltanet_cp.EngineOptions`][] field, `options`.

    Its state is a module with `conv`, the last `conv_kernel_size - 1` inputs of the
    convolution, and the recurrence's state (`_state` builds it, `_recurrent` reads it):
    one array `recurrent`, or a pytree of them for a layer whose `_recur` runs more than
    one recurrence (the preconditioned delta rules: the preconditioner's and the main one's).
    """

    in_proj_qkv: eqx.AbstractVar[eqx.nn.Linear]
    conv1d: eqx.AbstractVar[CausalConv1d]
    # The gated norm per head, called as `norm(o, gate)`.
    norm: eqx.AbstractVar[Any]
    out_proj: eqx.AbstractVar[eqx.nn.Linear]
    hidden_size: eqx.AbstractVar[int]
    options: eqx.AbstractVar[EngineOptions]

    def _state(self, conv: Array, recurrent: Any) -> _State:
        """The layer's state holding `conv` and `recurrent` (as `_recur` returns it): a
        `RecurrentLayerState`."""
        return RecurrentLayerState(conv=conv, recurrent=recurrent)  # pyright: ignore[reportReturnType]

    def _recurrent(self, state: _State) -> Any:
        """The recurrence's part of `state`, as `_recur` takes it: `state.recurrent`."""
        return state.recurrent  # pyright: ignore[reportAttributeAccessIssue]

    def _project(self, x: Array) -> tuple[Array, Any]:
        """`(mixed, rest)`: `concat(q, k, v)` before the convolution, `(seq, conv_dim)` in
        the parameters' dtype, and whatever else `_split` needs from `x`. By default
        `in_proj_qkv`'s projection and `x` itself (in the parameters' dtype), from which
        `_split` projects its gates."""
        x = x.astype(self.in_proj_qkv.weight.dtype)
        return jax.vmap(self.in_proj_qkv)(x), x

    @abc.abstractmethod
    def _split(self, mixed: Array, rest: Any) -> tuple[eqx.Module, Array]:
        """`(inputs, gate)`: the recurrence's inputs for one sequence (with a batch axis of
        one, see `one_sequence`) from the convolution's output after SiLU, and the output
        gate for `_finish`."""

    def _finish(self, o: Array, gate: Array) -> Array:
        """The gated norm per head and the output projection of the recurrence's output."""
        return finish(self.norm, self.out_proj, o, gate)

    @property
    @abc.abstractmethod
    def _recurrent_shape(self) -> tuple[int, int, int]:
        """`(HV, K, V)`: the shape of the recurrence's state."""

    @abc.abstractmethod
    def _recurrence(self, chunk_size: int) -> AbstractRecurrence:
        """The recurrence, in chunks of `chunk_size` tokens."""

    def _initial_recurrent(self, dtype) -> Any:
        """The recurrence's state before the first token: zeros of `_recurrent_shape` in
        `dtype`."""
        return jnp.zeros(self._recurrent_shape, dtype)

    @property
    def conv_dim(self) -> int:
        """The channels of the convolution: `2 H K + HV V` (q, k and v)."""
        return self.conv1d.channels

    @property
    def conv_kernel_size(self) -> int:
        """The length of the causal convolution (the current token and the ones before it)."""
        return self.conv1d.kernel_size

    def init_state(self, dtype=None, *, capacity: int | None = None) -> _State:
        """The state before the first token: zeros.

        **Arguments:**

        - `dtype`: the dtype of the convolution state; the parameters' dtype if `None`.
            The recurrent state is float32 (float64 for float64 parameters).
        - `capacity`: ignored (attention's cache size; a recurrent state does not grow).
        """
        del capacity
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return self._state(
            jnp.zeros((self.conv1d.history, self.conv_dim), dtype),
            self._initial_recurrent(accumulation_dtype(dtype)),
        )

    def _check_input(self, x, *, one_token: bool = False) -> None:
        """A `ValueError` naming `x` unless it is floating, `(seq, hidden)` or `(hidden,)`."""
        check_input(x, self.hidden_size, one_token=one_token)

    def _inputs(self, x, conv_state, cp, cu_seqlens=None):
        """`(mixed, conv output after SiLU, new conv state, rest)` of `x: (seq, hidden)`."""
        mixed, rest = self._project(x)
        conv_out, new_conv = self.conv1d(mixed, conv_state, cp=cp, cu_seqlens=cu_seqlens)
        return mixed, jax.nn.silu(conv_out), new_conv, rest

    def _run(
        self, recurrence, inputs, h0, every=None, cp=None, cu_seqlens=None
    ) -> tuple[Any, Array, Array | None]:
        """`recurrence` over `inputs` of one sequence (a batch of one) from `h0` (no batch
        axis; zeros if `None`): `(outputs, final state, checkpoints)`, the outputs with
        their batch axis of one, the final state without it (the first document's with
        `cu_seqlens`), and with `every` the states after every `every` tokens, `(n,
        *state)`, from the same pass (the recurrence wrapped in `Checkpointed`); else
        `None`."""
        if every is not None:
            recurrence = Checkpointed(inner=recurrence, chunk_size=every)
        o, h = run(
            recurrence,
            inputs,
            initial_state=None if h0 is None else h0[None],
            cu_seqlens=cu_seqlens,
            cp=cp,
            **self.options.run_kwargs(),
        )
        if every is None:
            return o, h[0], None
        o, spread = o
        return o, h[0], checkpoints(spread, every, h.shape[1:])[0]

    def _recur(
        self, inputs, h0, chunk_size, every=None, cp=None, cu_seqlens=None
    ) -> tuple[Any, Any, Any]:
        """The layer's recurrence (`_recurrence(chunk_size)`) over `inputs`, from `h0` (as
        `_recurrent` reads it from a state): `(outputs, final state, checkpoints)` as
        `_run` returns them. A layer that runs more than one recurrence overrides it."""
        return self._run(self._recurrence(chunk_size), inputs, h0, every, cp, cu_seqlens)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        state: _State | None = None,
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Array | None = None,
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: one sequence, `(seq, hidden)`; with `cp`, this rank's shard of it under
            `cp.layout` (each of its pieces at least `conv_kernel_size - 1` tokens).
        - `state`: the state before the first token (a prefix already processed), or `None`
            to start from zeros. With `cp`, replicated on every rank.
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`; the convolution's halo and the recurrence follow the layout's pieces);
            `None` on one device.
        - `cu_seqlens`: packed documents in `x`, `[0, ..., T]` over the whole sequence (a
            list or an int array, as for [`deltanet_cp.run`][]; global under `cp`, the same
            on every rank): each document starts from zeros, the convolution reading no
            input across a document's start and the recurrence resetting there, as if each
            were its own call. Not with `state`.
        - `kv_schedule`, `v_first`: ignored (attention's and RWKV-7's; every token mixer
            takes them, see [`deltanet_cp.nn.AbstractTokenMixer`][]).

        **Returns:**

        The output, `(seq, hidden)`, in `x`'s dtype (computed in the parameters' dtype).
        For the state after the last token as well, call `prefill`.

        **Raises:**

        `ValueError` naming `x` if it is not a floating-point `(seq, hidden)` array (a
        batch: `jax.vmap` the layer over it), or for `cu_seqlens` with `state`.
        """
        del kv_schedule, v_first
        check_documents_without_state(type(self).__name__, state, cu_seqlens)
        return self._forward(x, state, None, cp, cu_seqlens)[0]

    def extend(
        self,
        x: Float[Array, "seq hidden"],
        state: _State | None,
        position: Int[Array, ""] | int,
        /,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Float[Array, "seq heads v"] | None = None,
        checkpoint_every: int | None = None,
    ) -> tuple[Float[Array, "seq hidden"], _State, _State | None]:
        """`prefill(x, state, checkpoint_every=checkpoint_every, cp=cp)`: the state continues
        by itself (see [`deltanet_cp.nn.AbstractTokenMixer.extend`][])."""
        del position, kv_schedule, v_first
        return self.prefill(x, state, checkpoint_every=checkpoint_every, cp=cp)

    def prefill(
        self,
        x: Float[Array, "seq hidden"],
        state: _State | None = None,
        *,
        checkpoint_every: int | None = None,
        cp: ContextParallel | None = None,
    ) -> tuple[Float[Array, "seq hidden"], _State, _State | None]:
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
        `checkpoint_every`; else the layer's state type with a leading axis over the
        boundaries: `conv (n, conv_kernel_size - 1, conv_dim)` and `recurrent (n, HV, K,
        V)`, the state after `L`, `2 L`, ... tokens of this rank's tokens in the order
        they are laid out (`n = len(x) // L`; on one device, a last partial chunk has no
        checkpoint). Under context parallelism each rank holds the checkpoints of its own
        pieces: sharded over `cp.axis_name` they are in the layout's order (put them in
        sequence order with `cp.layout.from_layout` on axis 0).
        """
        return self._forward(x, state, checkpoint_every, cp)

    def _check_checkpoints(self, every: int, length: int, cp: ContextParallel | None) -> None:
        check_checkpoints(every, length, cp, self.chunk_size, self.conv1d.history)

    def _forward(
        self, x, state, checkpoint_every, cp, cu_seqlens=None
    ) -> tuple[Array, _State, _State | None]:
        cp = layer_cp(cp, type(self).__name__)
        self._check_input(x)
        if checkpoint_every is not None:
            checkpoint_every = as_positive_index(checkpoint_every, "checkpoint_every")
            self._check_checkpoints(checkpoint_every, x.shape[0], cp)
        conv_state, h0 = (None, None) if state is None else (state.conv, self._recurrent(state))
        mixed, conv, new_conv, rest = self._inputs(x, conv_state, cp, cu_seqlens)
        inputs, gate = self._split(conv, rest)
        o, h, saved_h = self._recur(inputs, h0, self.chunk_size, checkpoint_every, cp, cu_seqlens)
        saved = None
        if checkpoint_every is not None:
            n, w = x.shape[0] // checkpoint_every, self.conv1d.history
            ends = checkpoint_every * jnp.arange(1, n + 1)
            saved = self._state(mixed[ends[:, None] - w + jnp.arange(w)[None, :]], saved_h)
        out = self._finish(o[0], gate).astype(x.dtype)
        if conv_state is not None:
            new_conv = new_conv.astype(conv_state.dtype)
        return out, self._state(new_conv, h), saved

    def step(
        self,
        x: Float[Array, " hidden"],
        state: _State,
        position: Int[Array, ""] | int | None = None,
        *,
        v_first: Array | None = None,
    ) -> tuple[Float[Array, " hidden"], _State]:
        """One token of generation: the token-by-token form of `__call__`.

        **Arguments:**

        - `x`: the new token's input, `(hidden,)`.
        - `state`: the state before it (from `init_state`, a `prefill`, or the previous
            `step`).
        - `position`, `v_first`: ignored (attention's and RWKV-7's; every token mixer
            takes them).

        **Returns:**

        `(y, new_state)`: the output `(hidden,)` in `x`'s dtype and the state after the
        token, in the dtypes of `state`.
        """
        del position, v_first
        self._check_input(x, one_token=True)
        conv_state, h0 = state.conv, self._recurrent(state)  # pyright: ignore[reportAttributeAccessIssue]
        _, conv, new_conv, rest = self._inputs(x[None], conv_state, None)
        inputs, gate = self._split(conv, rest)
        o, h, _ = self._recur(inputs, h0, 1)
        y = self._finish(o[0], gate)[0].astype(x.dtype)
        h = jax.tree.map(lambda new, old: new.astype(old.dtype), h, h0)
        return y, self._state(new_conv.astype(conv_state.dtype), h)


class AbstractDeltaLayer(AbstractRecurrentLayer[_State]):
    """A token mixer built around a delta rule with one step size per token and value head
    (Gated DeltaNet, Kimi Delta Attention): an `AbstractRecurrentLayer` whose `_split`
    hands a [`deltanet_cp.DeltaInputs`][] to the recurrence, with `recurrence_inputs` to
    inspect them."""

    def recurrence_inputs(
        self,
        x: Float[Array, "seq hidden"],
        state: _State | None = None,
        *,
        cp: ContextParallel | None = None,
    ) -> tuple[Array, Array, Array, Array, Array, Array]:
        """Everything the layer computes before the delta rule (for inspection).

        **Arguments:** as for `__call__`.

        **Returns:**

        `(q, k, v, gate, g, beta)`: `q, k: (seq, H, K)` and `v: (seq, HV, V)` after the
        convolution and SiLU (before L2 normalisation and head repetition), the gate of the
        output norm, `(seq, HV, V)`, and the log decays `g` and step sizes `beta` of the
        delta rule.
        """
        cp = layer_cp(cp, type(self).__name__)
        self._check_input(x)
        conv_state = None if state is None else state.conv  # pyright: ignore[reportAttributeAccessIssue]
        _, conv, _, rest = self._inputs(x, conv_state, cp)
        inputs, gate = self._split(conv, rest)
        assert isinstance(inputs, DeltaInputs)
        q, k, v, g, beta = (a[0] for a in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))  # pyright: ignore[reportOptionalSubscript]
        return q, k, v, gate, g, beta
