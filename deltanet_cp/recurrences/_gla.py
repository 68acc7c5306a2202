"""Gated linear attention (GLA) and Mamba-2: a decayed linear attention, no delta term.

One token, per value head, with `g_t` a log decay per key channel (GLA) or one per head
(Mamba-2 / SSD, RetNet-like):

    h <- diag(exp(g_t)) h + k_t v_t^T
    o_t = h^T (scale q_t)

The transition is diagonal, so one chunk is the map `h -> diag(gamma) h + k~^T v`: a
[`deltanet_cp.DiagonalAffineMap`][], which costs `K + K V` numbers per head to exchange
instead of a dense map's `K (K + V)`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import DiagonalAffineMap
from .._chunking import from_chunks, to_chunks
from .._custom_types import GateTensor, QKTensor, State, ValueTensor
from .._engine import AbstractChunkedRecurrence, run_context_parallel, run_local
from .._layout import check_contiguous, Contiguous, ContiguousLayout
from ._common import (
    check_arrays,
    check_chunk_size,
    check_grouped_heads,
    cumulative_decays,
    decayed_gram,
    KeyGateTensor,
)
from ._gated_delta import _einsum, _head_major, compute_dtype


def check_gla_inputs(q, k, v, g, initial_state=None) -> None:
    """Raise a `ValueError` naming the problem if the GLA inputs don't fit together."""
    if hasattr(g, "ndim") and g.ndim not in (3, 4):
        raise ValueError(
            "`g` must have layout (batch, seq, value_heads) for a decay per head (Mamba-2) "
            f"or (batch, seq, value_heads, K) for a decay per key channel (GLA); got shape "
            f"{g.shape}."
        )
    g_axes = ("batch", "seq", "value_heads", "K")[: getattr(g, "ndim", 3)]
    sizes = check_arrays(
        {
            "q": (q, ("batch", "seq", "heads", "K")),
            "k": (k, ("batch", "seq", "heads", "K")),
            "v": (v, ("batch", "seq", "value_heads", "V")),
            "g": (g, g_axes),
            "initial_state": (initial_state, ("batch", "value_heads", "K", "V")),
        }
    )
    check_grouped_heads(sizes["heads"], sizes["value_heads"])


class GatedLinearAttentionFactors(eqx.Module):
    """The per-chunk quantities of gated linear attention that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`, then the chunk axis `c`.
    """

    v: Float[Array, "n b h c v"]
    attn: Float[Array, "n b h c c"]
    q_decayed: Float[Array, "n b h c k"]
    k_decayed: Float[Array, "n b h c k"]
    gamma: Float[Array, "n b h k"]


class GatedLinearAttention(
    AbstractChunkedRecurrence[GatedLinearAttentionFactors, DiagonalAffineMap]
):
    """Gated linear attention / Mamba-2 as a chunked recurrence (one call's inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`, with `HV` a multiple of `H`.
    - `g`: log decays (`<= 0`), per head `(B, T, HV)` or per key channel `(B, T, HV, K)`.
    - `scale`: query scale; defaults to `K ** -0.5`.
    - `chunk_size`: tokens per chunk.
    """

    q: QKTensor
    k: QKTensor
    v: ValueTensor
    g: GateTensor | KeyGateTensor
    scale: float = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __init__(
        self,
        q: QKTensor,
        k: QKTensor,
        v: ValueTensor,
        g: GateTensor | KeyGateTensor,
        *,
        scale: float | None = None,
        chunk_size: int = 64,
    ):
        check_gla_inputs(q, k, v, g)
        check_chunk_size(chunk_size)
        self.q, self.k, self.v, self.g = q, k, v, g
        self.scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        self.chunk_size = chunk_size

    def state_shape(self) -> tuple[int, ...]:
        b, _, hv, dv = self.v.shape
        return (b, hv, self.q.shape[-1], dv)

    def state_dtype(self):
        return compute_dtype(self.q, self.k, self.v, self.g)

    def prepare(self) -> GatedLinearAttentionFactors:
        dt = self.state_dtype()
        c = self.chunk_size
        r = self.v.shape[2] // self.q.shape[2]
        q = to_chunks(_head_major(self.q.astype(dt) * jnp.asarray(self.scale, dt), r), c)
        k = to_chunks(_head_major(self.k.astype(dt), r), c)
        v = to_chunks(_head_major(self.v.astype(dt)), c)
        g = to_chunks(_head_major(self.g.astype(dt)), c)  # (B, HV, N, C) or (B, HV, N, C, K)
        per_channel = g.ndim == k.ndim
        decay_in, decay_out = cumulative_decays(g, per_channel)
        gamma = jnp.broadcast_to(decay_in[..., -1, :], k.shape[:-2] + k.shape[-1:])

        def chunk_first(x):
            return jnp.moveaxis(x, 2, 0)

        return GatedLinearAttentionFactors(
            v=chunk_first(v),
            attn=chunk_first(decayed_gram(q, k, g, strict=False)),
            q_decayed=chunk_first(q * decay_in),
            k_decayed=chunk_first(k * decay_out),
            gamma=chunk_first(gamma),
        )

    def step(self, factors: GatedLinearAttentionFactors, h: State) -> tuple[State, Array]:
        f = factors
        o = _einsum("bhck,bhkv->bhcv", f.q_decayed, h) + _einsum("bhij,bhjv->bhiv", f.attn, f.v)
        return self.advance(f, h), o

    def advance(self, factors: GatedLinearAttentionFactors, h: State) -> State:
        f = factors
        return f.gamma[..., :, None] * h + _einsum("bhck,bhcv->bhkv", f.k_decayed, f.v)

    def identity_map(self) -> DiagonalAffineMap:
        b, hv, dk, dv = self.state_shape()
        return DiagonalAffineMap.identity(dk, dv, (b, hv), self.state_dtype())

    def chunk_map(self, factors: GatedLinearAttentionFactors) -> DiagonalAffineMap:
        f = factors
        return DiagonalAffineMap(f.gamma, _einsum("bhck,bhcv->bhkv", f.k_decayed, f.v))

    def compose(
        self, factors: GatedLinearAttentionFactors, running: DiagonalAffineMap
    ) -> DiagonalAffineMap:
        return DiagonalAffineMap(factors.gamma * running.decay, self.advance(factors, running.U))

    def finalize(self, outputs: Array) -> ValueTensor:
        o = from_chunks(jnp.moveaxis(outputs, 0, 2), self.v.shape[1])  # (B, HV, T, V)
        return jnp.moveaxis(o, 1, 2).astype(self.v.dtype)


def chunk_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | KeyGateTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[ValueTensor, State | None]:
    r"""Gated linear attention / Mamba-2 in chunked form: the training path.

    $h \leftarrow \mathrm{diag}(e^{g_t}) h + k_t v_t^\top$, $o_t = h^\top (s\, q_t)$, with a
    decay per key channel (GLA) or one per head (Mamba-2). For Mamba-2's SSD, pass
    `q = C`, `k = B * dt`, `v = x`, `g = dt * A` (per head) and `scale=1.0`.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays $\le 0$: shape `(B, T, HV)` for one per head, or
        `(B, T, HV, K)` for one per key channel.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
    - `chunk_size`: tokens per chunk.

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final state
    `(B, HV, K, V)` in float32 if `output_final_state`, else `None`.
    """
    check_gla_inputs(q, k, v, g, initial_state)
    rec = GatedLinearAttention(q, k, v, g, scale=scale, chunk_size=chunk_size)
    o, h = run_local(rec, initial_state)
    return o, (h if output_final_state else None)


def chunk_gla_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | KeyGateTensor,
    *,
    axis_name: str,
    layout: ContiguousLayout = Contiguous(),
    strategy: str = "allgather",
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
) -> tuple[ValueTensor, State | None]:
    r"""Chunked gated linear attention with context parallelism, inside `jax.shard_map`.

    The sequence axis (axis 1 of `q`, `k`, `v`, `g`) is sharded over `axis_name`, rank `r`
    holding a contiguous slice; each argument here is this rank's slice. The transition is
    diagonal, so a rank's map is `K + K V` numbers per batch element and value head (the
    `"allgather"` and `"ppermute"` strategies move that; `"ring"` moves one `K x V` state).

    **Arguments:**

    - `q`, `k`, `v`, `g`, `scale`, `chunk_size`: as in [`deltanet_cp.chunk_gla`][], for this
        rank's tokens.
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `layout`: must be [`deltanet_cp.Contiguous`][] (the default).
    - `strategy`: `"allgather"`, `"ppermute"`, `"ring"` or `"auto"`.
    - `initial_state`: the state before the first token of the whole sequence, replicated;
        zeros if `None`.
    - `output_final_state`: also return the state after the last token of the sequence.

    **Returns:**

    `(o, final_state)`: this rank's outputs `(B, T_local, HV, V)` in `v`'s dtype, and the
    global final state `(B, HV, K, V)` (the same on every rank) or `None`.
    """
    check_contiguous(layout, "chunk_gla_cp")
    check_gla_inputs(q, k, v, g, initial_state)
    rec = GatedLinearAttention(q, k, v, g, scale=scale, chunk_size=chunk_size)
    return run_context_parallel(
        rec,
        initial_state,
        axis_name=axis_name,
        layout=layout,
        strategy=strategy,
        output_final_state=output_final_state,
    )


def recurrent_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | KeyGateTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
) -> tuple[ValueTensor, State | None]:
    r"""Gated linear attention / Mamba-2 token by token (a `lax.scan` over time).

    Takes the same arguments as [`deltanet_cp.chunk_gla`][] (without `chunk_size`) and
    returns the same `(o, final_state)`.
    """
    check_gla_inputs(q, k, v, g, initial_state)
    dt = compute_dtype(q, k, v, g)
    b, _, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    r = hv // h
    qf = jnp.repeat(q.astype(dt) * jnp.asarray(scale, dt), r, axis=2)
    kf = jnp.repeat(k.astype(dt), r, axis=2)
    gf = g.astype(dt)
    if gf.ndim == 3:
        gf = gf[..., None]  # one decay per head: the same for every key channel
    h0 = jnp.zeros((b, hv, dk, dv), dt) if initial_state is None else initial_state.astype(dt)

    def body(state, xs):
        q_t, k_t, v_t, g_t = xs
        state = jnp.exp(g_t)[..., :, None] * state + k_t[..., :, None] * v_t[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, v.astype(dt), gf))
    h_final, o = jax.lax.scan(body, h0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (h_final if output_final_state else None)
