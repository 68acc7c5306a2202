"""Kimi Delta Attention (KDA, Kimi Linear): the delta rule with a decay per key channel.

One token, per value head, with `g_t` a log decay per key channel:

    h <- diag(exp(g_t)) h                       (row i of h scaled by exp(g_t[i]))
    h <- h + k_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (diag(gamma) - k~^T w) h + k~^T u`
with `gamma = exp(G_C)` a vector over the key channels (see `_common.py`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._affine import AffineMap
from .._chunking import from_chunks, to_chunks
from .._custom_types import GateTensor, QKTensor, State, States, ValueTensor
from .._engine import AbstractChunkedRecurrence, run_context_parallel, run_local, run_packed
from .._layout import check_contiguous, Contiguous, ContiguousLayout
from ._common import (
    check_chunk_size,
    delta_advance,
    delta_chunk_map,
    delta_compose,
    delta_factors,
    delta_step,
    DeltaFactors,
    KeyGateTensor,
)
from ._gated_delta import _einsum, _head_major, check_inputs, compute_dtype, l2norm


class KimiDeltaAttention(AbstractChunkedRecurrence[DeltaFactors, AffineMap]):
    """Kimi Delta Attention as a chunked recurrence (one call's inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`, with `HV` a multiple of `H`.
    - `g`: log decays per key channel (`<= 0`), `(B, T, HV, K)`.
    - `beta`: delta-rule step sizes in `[0, 1]`, `(B, T, HV)`.
    - `scale`: query scale; defaults to `K ** -0.5`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` first.
    - `chunk_size`: tokens per chunk.
    """

    q: QKTensor
    k: QKTensor
    v: ValueTensor
    g: KeyGateTensor
    beta: GateTensor
    scale: float = eqx.field(static=True)
    use_qk_l2norm: bool = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __init__(
        self,
        q: QKTensor,
        k: QKTensor,
        v: ValueTensor,
        g: KeyGateTensor,
        beta: GateTensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        chunk_size: int = 64,
    ):
        check_inputs(q, k, v, g, beta, g_per_key=True)
        check_chunk_size(chunk_size)
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = chunk_size

    def state_shape(self) -> tuple[int, ...]:
        b, _, hv, dv = self.v.shape
        return (b, hv, self.q.shape[-1], dv)

    def state_dtype(self):
        return compute_dtype(self.q, self.k, self.v, self.g, self.beta)

    def prepare(self) -> DeltaFactors:
        dt = self.state_dtype()
        q, k = self.q.astype(dt), self.k.astype(dt)
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * jnp.asarray(self.scale, dt)
        r = self.v.shape[2] // self.q.shape[2]
        c = self.chunk_size
        return delta_factors(
            to_chunks(_head_major(q, r), c),
            to_chunks(_head_major(k, r), c),
            to_chunks(_head_major(self.v.astype(dt)), c),
            to_chunks(_head_major(self.beta.astype(dt)), c),
            to_chunks(_head_major(self.g.astype(dt)), c),  # (B, HV, N, C, K): per channel
        )

    def step(self, factors: DeltaFactors, h: State) -> tuple[State, Array]:
        return delta_step(factors, h)

    def advance(self, factors: DeltaFactors, h: State) -> State:
        return delta_advance(factors, h)

    def identity_map(self) -> AffineMap:
        b, hv, dk, dv = self.state_shape()
        return AffineMap.identity(dk, dv, (b, hv), self.state_dtype())

    def chunk_map(self, factors: DeltaFactors) -> AffineMap:
        return delta_chunk_map(factors)

    def compose(self, factors: DeltaFactors, running: AffineMap) -> AffineMap:
        return delta_compose(factors, running)

    def finalize(self, outputs: Array) -> ValueTensor:
        o = from_chunks(jnp.moveaxis(outputs, 0, 2), self.v.shape[1])  # (B, HV, T, V)
        return jnp.moveaxis(o, 1, 2).astype(self.q.dtype)  # like Kimi Linear: q's dtype


def chunk_kimi_delta_attention(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    chunk_size: int = 64,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    scale: float | None = None,
    cu_seqlens: Int[Array, " docs_plus_one"] | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""Kimi Delta Attention in chunked (WY) form: the training path.

    The arguments are those of Kimi Linear's `chunk_kimi_delta_attention` in Hugging Face
    transformers (plus `scale`), and so are the results. Per token and value head:
    $h \leftarrow \mathrm{diag}(e^{g_t}) h$, then
    $h \leftarrow h + k_t (\beta_t (v_t - h^\top k_t))^\top$, $o_t = h^\top (s\, q_t)$.

    Decays between tokens of a chunk are formed exactly for any gates, however negative
    (see `decayed_gram` in `deltanet_cp/recurrences/_common.py`). The math runs in float32
    (float64 for float64 inputs).

    **Arguments:**

    - `query`, `key`: shape `(B, T, H, K)`.
    - `value`: shape `(B, T, HV, V)`; `HV` must be a multiple of `H` (transformers has
        `HV = H`), and value head `j` reads key head `j // (HV // H)`.
    - `g`: natural-log decays per key channel, $\le 0$, shape `(B, T, HV, K)`.
    - `beta`: step sizes in $[0, 1]$, shape `(B, T, HV)`.
    - `chunk_size`: tokens per chunk.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
    - `use_qk_l2norm_in_kernel`: L2-normalise `query` and `key` over `K` (eps `1e-6`) first.
    - `scale`: query scale, default `K ** -0.5`.
    - `cu_seqlens`: packed documents (batch size 1): the document offsets
        `[0, len_0, len_0 + len_1, ..., T]`, shape `(N + 1,)`. The state resets at each
        document start, no chunk mixes two documents, and `initial_state` / the final
        state are per document, `(N, HV, K, V)`.

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `query`'s dtype, and the final
    state `(B, HV, K, V)` in float32 if `output_final_state`, else `None`.
    """
    if cu_seqlens is not None:
        check_inputs(query, key, value, g, beta, g_per_key=True)
        return run_packed(
            _builder(scale, use_qk_l2norm_in_kernel, chunk_size),
            (query, key, value, g, beta),
            cu_seqlens,
            initial_state,
            chunk_size=chunk_size,
            output_final_state=output_final_state,
        )
    check_inputs(query, key, value, g, beta, initial_state, g_per_key=True)
    rec = KimiDeltaAttention(
        query,
        key,
        value,
        g,
        beta,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        chunk_size=chunk_size,
    )
    o, h = run_local(rec, initial_state)
    return o, (h if output_final_state else None)


def chunk_kimi_delta_attention_cp(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    chunk_size: int = 64,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    axis_name: str,
    layout: ContiguousLayout = Contiguous(),
    strategy: str = "allgather",
    scale: float | None = None,
    cu_seqlens: Int[Array, " docs_plus_one"] | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""Chunked Kimi Delta Attention with context parallelism, called inside `jax.shard_map`.

    The sequence axis (axis 1 of every argument but `initial_state`) is sharded over
    `axis_name`, rank `r` holding a contiguous slice; each argument here is this rank's
    slice. Ranks exchange one `(K, K)` + `(K, V)` map per batch element and value head
    (or less, depending on `strategy`).

    **Arguments:**

    - `query`, `key`, `value`, `g`, `beta`, `chunk_size`, `use_qk_l2norm_in_kernel`,
        `scale`: as in [`deltanet_cp.chunk_kimi_delta_attention`][], for this rank's tokens.
    - `initial_state`: the state before the first token of the whole sequence, replicated;
        zeros if `None`.
    - `output_final_state`: also return the state after the last token of the sequence.
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `layout`: must be [`deltanet_cp.Contiguous`][] (the default).
    - `strategy`: `"allgather"`, `"ppermute"`, `"ring"` or `"auto"`.
    - `cu_seqlens`: packed documents: the *global* document offsets, the same array on
        every rank (replicated); documents may cross rank boundaries. `initial_state` and
        the final state are then per document, `(N, HV, K, V)`.

    **Returns:**

    `(o, final_state)`: this rank's outputs `(B, T_local, HV, V)` in `query`'s dtype, and
    the global final state `(B, HV, K, V)` (the same on every rank) or `None`.
    """
    check_contiguous(layout, "chunk_kimi_delta_attention_cp")
    if cu_seqlens is not None:
        check_inputs(query, key, value, g, beta, g_per_key=True)
        return run_packed(
            _builder(scale, use_qk_l2norm_in_kernel, chunk_size),
            (query, key, value, g, beta),
            cu_seqlens,
            initial_state,
            chunk_size=chunk_size,
            output_final_state=output_final_state,
            axis_name=axis_name,
            layout=layout,
            strategy=strategy,
        )
    check_inputs(query, key, value, g, beta, initial_state, g_per_key=True)
    rec = KimiDeltaAttention(
        query,
        key,
        value,
        g,
        beta,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        chunk_size=chunk_size,
    )
    return run_context_parallel(
        rec,
        initial_state,
        axis_name=axis_name,
        layout=layout,
        strategy=strategy,
        output_final_state=output_final_state,
    )


def _builder(scale, use_qk_l2norm, chunk_size):
    def build(q, k, v, g, beta):
        return KimiDeltaAttention(
            q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
        )

    return build


def recurrent_kimi_delta_attention(
    query: QKTensor,
    key: QKTensor,
    value: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    scale: float | None = None,
) -> tuple[ValueTensor, State | None]:
    r"""Kimi Delta Attention token by token (a `lax.scan` over time): the decoding path.

    Takes the same arguments as [`deltanet_cp.chunk_kimi_delta_attention`][] (without
    `chunk_size`) and returns the same `(o, final_state)`.
    """
    check_inputs(query, key, value, g, beta, initial_state, g_per_key=True)
    dt = compute_dtype(query, key, value, g, beta)
    b, _, h, dk = query.shape
    hv, dv = value.shape[2], value.shape[3]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = query.astype(dt), key.astype(dt)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    r = hv // h
    qf = jnp.repeat(qf * jnp.asarray(scale, dt), r, axis=2)
    kf = jnp.repeat(kf, r, axis=2)
    h0 = jnp.zeros((b, hv, dk, dv), dt) if initial_state is None else initial_state.astype(dt)

    def body(state, xs):
        q_t, k_t, v_t, g_t, beta_t = xs
        state = jnp.exp(g_t)[..., :, None] * state
        delta = beta_t[..., None] * (v_t - _einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q_t)

    xs = tuple(
        jnp.moveaxis(x, 1, 0) for x in (qf, kf, value.astype(dt), g.astype(dt), beta.astype(dt))
    )
    h_final, o = jax.lax.scan(body, h0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(query.dtype)
    return o, (h_final if output_final_state else None)
