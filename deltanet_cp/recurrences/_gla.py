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
from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import accumulation_dtype, as_precision, PrecisionName
from .._recurrence import AbstractRecurrence
from .._run import Memory, run
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ..chunkops import chunk_major, cumulative_decays, decayed_gram, einsum
from ._helpers import check_arrays, decay_cotangent, policy, prologue


class GLAInputs(eqx.Module):
    """The per-token inputs of gated linear attention (time on axis 1 of every array).

    **Arguments:**

    - `q`, `k`: queries and keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`, with `HV` a multiple of `H`.
    - `g`: log decays `<= 0`, per head `(B, T, HV)` or per key channel `(B, T, HV, K)`.
    """

    q: QKTensor = eqx.field(metadata={"output_only": True})
    k: QKTensor
    v: ValueTensor
    g: GateTensor | KeyGateTensor = eqx.field(metadata={"log_decay": True})


class GatedLinearAttentionFactors(eqx.Module):
    """The per-chunk quantities of gated linear attention that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`, then the chunk axis `c`,
    but `o_intra` (the outputs' share that does not depend on the state), which is in the
    outputs' layout `(n_chunks, batch, c, value_heads, v)`. `precision` is the policy the
    chunk's products with the state run under (resolved from the inputs by `prepare`).
    """

    v: Float[Array, "n b h c v"]
    o_intra: Float[Array, "n b c h v"]
    q_decayed: Float[Array, "n b h c k"]
    k_decayed_t: Float[Array, "n b h k c"]
    gamma: Float[Array, "n b h k"]
    precision: PrecisionName = eqx.field(default="highest", static=True)


class GLARule(AbstractRecurrence[GLAInputs, GatedLinearAttentionFactors, DiagonalAffineMap]):
    """Gated linear attention / Mamba-2: a decay per key channel or per head, no delta term.

    A static configuration; the inputs are a [`deltanet_cp.GLAInputs`][], handed to
    [`deltanet_cp.run`][] beside it.

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale; `K ** -0.5` if `None`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `precision`: how the large products multiply: `"highest"` (float32 operands at
        `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32 accumulation),
        `"default"` (`jax.default_matmul_precision`), or `None`: `"bfloat16"` for
        bfloat16 inputs, `"highest"` otherwise. The state, the decays and the chunk maps
        stay float32 under every policy.
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    use_qk_l2norm: bool = eqx.field(default=False, static=True, converter=as_l2norm_flag)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)

    def check(self, inputs: GLAInputs) -> None:
        g = inputs.g
        if not hasattr(g, "ndim") or g.ndim not in (3, 4):
            raise ValueError(
                "`g` must have layout (batch, seq, value_heads) for a decay per head (Mamba-2) "
                "or (batch, seq, value_heads, K) for a decay per key channel (GLA); got "
                f"{getattr(g, 'shape', type(g).__name__)}."
            )
        check_arrays(
            {
                "q": (inputs.q, ("batch", "seq", "heads", "K")),
                "k": (inputs.k, ("batch", "seq", "heads", "K")),
                "v": (inputs.v, ("batch", "seq", "value_heads", "V")),
                "g": (g, ("batch", "seq", "value_heads", "K")[: g.ndim]),
            }
        )

    def state(self, inputs: GLAInputs) -> jax.ShapeDtypeStruct:
        b, _, hv, dv = inputs.v.shape
        dtype = accumulation_dtype(*jax.tree.leaves(inputs))
        return jax.ShapeDtypeStruct((b, hv, inputs.q.shape[-1], dv), dtype)

    def prepare(self, chunks: GLAInputs) -> GatedLinearAttentionFactors:
        dt, precision = policy(self.precision, chunks)
        r = chunks.v.shape[3] // chunks.q.shape[3]
        q, k = prologue(chunks.q, chunks.k, dt, self.scale, self.use_qk_l2norm)
        # Value head j reads key head j // r: (N, B, HV, C, K).
        q, k = (chunk_major(jnp.repeat(x, r, axis=3)) for x in (q, k))
        v = chunk_major(chunks.v.astype(dt))
        per_channel = chunks.g.ndim == 5
        g = chunk_major(chunks.g.astype(dt), features=int(per_channel))
        decay_in, decay_out = cumulative_decays(g, per_channel)
        attn = decayed_gram(q, k, g, strict=False, precision=precision)
        o_intra = einsum("...ij,...jv->...iv", attn, v, precision=precision)
        return GatedLinearAttentionFactors(
            v=v,
            o_intra=jnp.swapaxes(o_intra, 2, 3),
            q_decayed=q * decay_in,
            k_decayed_t=jnp.swapaxes(k * decay_out, -1, -2),
            gamma=jnp.broadcast_to(decay_in[..., -1, :], k.shape[:-2] + k.shape[-1:]),
            precision=precision,
        )

    def step(self, factors: GatedLinearAttentionFactors, h: Array) -> tuple[Array, Array]:
        f = factors
        p = f.precision
        o = jnp.swapaxes(einsum("bhck,bhkv->bhcv", f.q_decayed, h, precision=p), 1, 2)
        write = einsum("bhkc,bhcv->bhkv", f.k_decayed_t, f.v, precision=p)
        return f.gamma[..., :, None] * h + write, o + f.o_intra

    def factor_cotangents(
        self,
        factors: GatedLinearAttentionFactors,
        states: Float[Array, "n b h k v"],
        d_next: Float[Array, "n b h k v"],
        d_outputs: Float[Array, "n b c h v"],
    ) -> GatedLinearAttentionFactors:
        # `step`'s VJP in its factors as batched products over the block's chunks:
        # d q_g = d o h^T, d k~^T = d_next v^T, d v = k~ d_next, d gamma = rows of d_next . h.
        f = factors
        p = f.precision
        d_o = jnp.swapaxes(d_outputs, 2, 3)  # (N, B, HV, C, V)
        return GatedLinearAttentionFactors(
            v=einsum("nbhkc,nbhkv->nbhcv", f.k_decayed_t, d_next, precision=p),
            o_intra=d_outputs,
            q_decayed=einsum("nbhcv,nbhkv->nbhck", d_o, states, precision=p),
            k_decayed_t=einsum("nbhkv,nbhcv->nbhkc", d_next, f.v, precision=p),
            gamma=decay_cotangent(d_next, states),
            precision=p,
        )

    def chunk_map(self, factors: GatedLinearAttentionFactors) -> DiagonalAffineMap:
        f = factors  # at Precision.HIGHEST under every policy, as the maps' composition
        return DiagonalAffineMap(f.gamma, einsum("bhkc,bhcv->bhkv", f.k_decayed_t, f.v))

    def finalize(self, outputs: Float[Array, "b t h v"], inputs: GLAInputs) -> Array:
        return outputs.astype(inputs.v.dtype)


def chunk_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | KeyGateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    memory: Memory | None = None,
) -> tuple[ValueTensor, States]:
    r"""Gated linear attention / Mamba-2 in chunked (WY) form: the training path.

    $h \leftarrow \mathrm{diag}(e^{g_t}) h + k_t v_t^\top$, $o_t = h^\top (s\, q_t)$, with a
    decay per key channel (GLA) or one per head (Mamba-2). For Mamba-2's SSD, pass
    `q = C`, `k = B * dt`, `v = x`, `g = dt * A` (per head) and `scale=1.0`.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays $\le 0$: shape `(B, T, HV)` for one per head, or
        `(B, T, HV, K)` for one per key channel.
    - `scale`, `initial_state`, `use_qk_l2norm`, `cu_seqlens`, `chunk_size`, `cp`,
        `precision`: as in
        [`deltanet_cp.chunk_gated_delta_rule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    """
    return run(
        GLARule(
            chunk_size=chunk_size,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        GLAInputs(q, k, v, g),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        memory=memory,
    )


def recurrent_gla(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor | KeyGateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""Gated linear attention / Mamba-2 token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_gla`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        GLARule(
            chunk_size=1,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        GLAInputs(q, k, v, g),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
    )
