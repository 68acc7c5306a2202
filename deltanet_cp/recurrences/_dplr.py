r"""The generalized delta rule: a diagonal-plus-low-rank (DPLR) transition, RWKV-7's core.

One token, per value head, with `gk_t` a log decay per key channel and `a_t`, `b_t` two
vectors over the key channels (flash-linear-attention's `fla.ops.generalized_delta_rule`):

    h <- diag(exp(gk_t)) h + b_t (a_t^T h) + k_t v_t^T
    o_t = h^T (scale q_t)

that is `S_t = (diag(exp(gk_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T` (`a_t^T h` reads the state
before the token's decay). RWKV-7 is `a = -kk`, `b = kk * iclr`.

One chunk, with $G_i = \sum_{t \le i} gk_t$ from the chunk start: the rank-one reads
$r_i = a_i^\top h_{i-1}$ solve a unit lower-triangular system,

    A_ab[i, j] = sum_c a_ic b_jc exp(G_{i-1,c} - G_jc),  A_ak likewise with k  (i > j)
    T  = (I - A_ab)^-1
    r  = T A_ak v + w h_0,   w = T (a * exp(G_{i-1}))

and then, with $A_{qk}$, $A_{qb}$ the inclusive decayed products of the queries with `k`, `b`:

    o      = (q * exp(G) + A_qb w) h_0 + (A_qk + A_qb T A_ak) v
    h_next = diag(gamma) h_0 + b~^T r + k~^T v,   gamma = exp(G_C),   x~ = x * exp(G_C - G)
           = (diag(gamma) + b~^T w) h_0 + (k~ + (T A_ak)^T b~)^T v

so the chunk is an affine map `h -> M h + U`, `M` a rank-C update of a diagonal. Every
product with the C x C matrices comes before the one with `v` (C < K, V), and the step keeps
the delta rule's two products with the state.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import AffineMap
from .._precision import accumulation_dtype, as_precision, PrecisionName
from .._recurrence import AbstractRecurrence
from .._validate import as_chunk_size, as_scale
from ..chunkops import chunk_major, cumulative_decays, decayed_grams, einsum, unit_lower_inverse
from ..chunkops._decays import shift_down
from ._helpers import (
    check_arrays,
    decay_cotangent,
    flat_heads,
    lift,
    policy,
    prologue,
    value_heads,
)


class DPLRInputs(eqx.Module):
    """The per-token inputs of the generalized delta rule (time on axis 1 of every array).

    **Arguments:**

    - `q`: queries, `(B, T, H, K)`.
    - `k`: keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`.
    - `a`: the vector the state is read along, `(B, T, H, K)`.
    - `b`: the vector that read is written back along, `(B, T, H, K)`.
    - `gk`: log decays per key channel, `<= 0`, `(B, T, HV, K)`.
    """

    q: Float[Array, "batch seq heads k"] = eqx.field(metadata={"output_only": True})
    k: Float[Array, "batch seq heads k"]
    v: Float[Array, "batch seq vheads v"]
    a: Float[Array, "batch seq heads k"]
    b: Float[Array, "batch seq heads k"]
    gk: Float[Array, "batch seq vheads k"] = eqx.field(metadata={"log_decay": True})


class DPLRFactors(eqx.Module):
    r"""The per-chunk quantities of the generalized delta rule that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`; `C` is the chunk size.

    - `wq`: $w$ (rows `:C`) stacked over $q e^{G} + A_{qb} w$ (rows `C:`), so one product
        with the state gives both the reads' share $w h$ and the outputs' share.
    - `o_intra`: $(A_{qk} + A_{qb} T A_{ak}) v$, the outputs' share that does not depend on
        the state, in the outputs' layout `(n_chunks, batch, C, value_heads, V)`.
    - `b_decayed_t`: $\tilde b^\top = (b e^{G_C - G})^\top$, shape `(..., K, C)`.
    - `U`: $(\tilde k + (T A_{ak})^\top \tilde b)^\top v$, the chunk's writes to the
        state when it enters at zero, `(..., K, V)`.
    - `gamma`: $e^{G_C}$, the decay over the whole chunk per key channel.
    - `precision`: the policy the chunk's products with the state run under (resolved from
        the inputs by `prepare`).
    """

    wq: Float[Array, "n b h cc k"]
    o_intra: Float[Array, "n b c h v"]
    b_decayed_t: Float[Array, "n b h k c"]
    U: Float[Array, "n b h k v"]
    gamma: Float[Array, "n b h k"]
    precision: PrecisionName = eqx.field(default="highest", static=True)

    @property
    def w(self) -> Float[Array, "*chunks b h c k"]:
        """The WY factor $w$ (the first `C` rows of `wq`)."""
        return self.wq[..., : self.b_decayed_t.shape[-1], :]


class DPLRDeltaRule(AbstractRecurrence[DPLRInputs, DPLRFactors, AffineMap]):
    """The generalized delta rule: a diagonal-plus-low-rank transition per token (RWKV-7).

    A static configuration; the inputs are a [`deltanet_cp.DPLRInputs`][], handed to
    [`deltanet_cp.run`][] beside it. Decays between tokens of a chunk are formed exactly
    for any gates (a blocked segment sum, as for Kimi Delta Attention).

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale; `K ** -0.5` if `None`.
    - `precision`: how the large products multiply: `"highest"` (float32 operands at
        `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32 accumulation),
        `"default"` (`jax.default_matmul_precision`), or `None`: `"bfloat16"` for
        bfloat16 inputs, `"highest"` otherwise. The state, the decays and the chunk maps
        stay float32 under every policy.
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)

    def check(self, inputs: DPLRInputs) -> None:
        check_arrays(
            {
                "q": (inputs.q, ("batch", "seq", "heads", "K")),
                "k": (inputs.k, ("batch", "seq", "heads", "K")),
                "v": (inputs.v, ("batch", "seq", "value_heads", "V")),
                "a": (inputs.a, ("batch", "seq", "heads", "K")),
                "b": (inputs.b, ("batch", "seq", "heads", "K")),
                "gk": (inputs.gk, ("batch", "seq", "value_heads", "K")),
            }
        )

    def state(self, inputs: DPLRInputs) -> jax.ShapeDtypeStruct:
        b, _, hv, dv = inputs.v.shape
        dtype = accumulation_dtype(*jax.tree.leaves(inputs))
        return jax.ShapeDtypeStruct((b, hv, inputs.q.shape[-1], dv), dtype)

    def prepare(self, chunks: DPLRInputs) -> DPLRFactors:
        dt, p = policy(self.precision, chunks)
        b, n, c, h, dk = chunks.q.shape
        hv, dv = chunks.v.shape[-2:]
        r = hv // h

        def keys(x):  # (B, N, C, H, K) -> (N B H, 1, C, K): broadcasts over the r value heads
            return flat_heads(chunk_major(x.astype(dt)))[:, None]

        q, k = (keys(x) for x in prologue(chunks.q, chunks.k, dt, self.scale, False))
        a, bb = keys(chunks.a), keys(chunks.b)
        v = flat_heads(
            chunk_major(chunks.v.astype(dt).reshape(b, n, c, h, r, dv))
        )  # (N B H, r, C, V)
        g = flat_heads(
            chunk_major(chunks.gk.astype(dt).reshape(b, n, c, h, r, dk))
        )  # (N B H, r, C, K)
        decay_in, decay_out = cumulative_decays(g, per_channel=True)  # e^{G_i}, e^{G_C - G_i}
        # A_a.[i, j] pairs a_i with the decays up to token i - 1: the inclusive product of
        # the next row's a, shifted down a row (exact for any gates, nothing overflows).
        a_next = jnp.concatenate([a[..., 1:, :], jnp.zeros_like(a[..., :1, :])], -2)
        grams = decayed_grams(jnp.stack([q, a_next], -2), jnp.stack([k, bb], -2), g, False, p)
        a_qk, a_qb = grams[..., :, 0, :, 0], grams[..., :, 0, :, 1]
        a_ak, a_ab = shift_down(grams[..., :, 1, :, 0]), shift_down(grams[..., :, 1, :, 1])
        t = unit_lower_inverse(-a_ab)  # at Precision.HIGHEST under every policy
        a_in = a * shift_down(decay_in, fill=1.0)
        w = einsum("...ij,...jk->...ik", t, a_in, precision=p)  # T (a e^{G_{i-1}})
        t_ak = einsum("...ij,...jl->...il", t, a_ak, precision=p)  # the reads: T A_ak v + w h
        a_qb_w = einsum("...ij,...jk->...ik", a_qb, w, precision=p)
        # o_intra = A_qk v + A_qb T A_ak v, and the writes k~^T v + b~^T T A_ak v: C x C
        # products first (C < K, V), then one product with v each.
        a_out = a_qk + einsum("...ij,...jl->...il", a_qb, t_ak, precision=p)
        b_decayed = bb * decay_out
        k_out = k * decay_out + einsum("...ji,...jk->...ik", t_ak, b_decayed, precision=p)

        def heads(x):
            return value_heads(x, n, b)

        return DPLRFactors(
            wq=heads(jnp.concatenate([w, q * decay_in + a_qb_w], -2)),
            o_intra=jnp.swapaxes(heads(einsum("...ij,...jv->...iv", a_out, v, precision=p)), 2, 3),
            b_decayed_t=heads(jnp.swapaxes(b_decayed, -1, -2)),
            U=heads(einsum("...ck,...cv->...kv", k_out, v, precision=p)),
            gamma=heads(decay_in[..., -1, :]),
            precision=p,
        )

    def step(self, factors: DPLRFactors, h: Float[Array, "b h k v"]) -> tuple[Array, Array]:
        f = factors
        c = f.b_decayed_t.shape[-1]
        y = einsum("bhck,bhkv->bhcv", f.wq, h, precision=f.precision)  # [w h; (q_g + A_qb w) h]
        o = jnp.swapaxes(y[..., c:, :], 1, 2) + f.o_intra  # (B, C, HV, V)
        reads = einsum("bhkc,bhcv->bhkv", f.b_decayed_t, y[..., :c, :], precision=f.precision)
        h_next = f.gamma[..., None] * h + reads
        return h_next + f.U, o

    def factor_cotangents(
        self,
        factors: DPLRFactors,
        states: Float[Array, "n b h k v"],
        d_next: Float[Array, "n b h k v"],
        d_outputs: Float[Array, "n b c h v"],
    ) -> DPLRFactors:
        # `step`'s VJP in its factors as batched products over the block's chunks: the
        # reads' share r = w h again, d b~^T = d_next r^T, d[w; q'] = [b~ d_next; d o] h^T,
        # d U = d_next, d gamma = rows of d_next . h.
        f = factors
        p = f.precision
        reads = einsum("nbhck,nbhkv->nbhcv", f.w, states, precision=p)
        d_o = jnp.swapaxes(d_outputs, 2, 3)  # (N, B, HV, C, V)
        d_reads = einsum("nbhkc,nbhkv->nbhcv", f.b_decayed_t, d_next, precision=p)
        d_y = jnp.concatenate([d_reads, d_o], axis=-2)
        return DPLRFactors(
            wq=einsum("nbhcv,nbhkv->nbhck", d_y, states, precision=p),
            o_intra=d_outputs,
            b_decayed_t=einsum("nbhkv,nbhcv->nbhkc", d_next, reads, precision=p),
            U=d_next,
            gamma=decay_cotangent(d_next, states),
            precision=p,
        )

    def chunk_map(self, factors: DPLRFactors) -> AffineMap:
        f = factors  # the maps and their composition at Precision.HIGHEST under every policy
        dk = f.wq.shape[-1]
        eye = lift(jnp.eye(dk, dtype=f.wq.dtype), f.gamma.ndim + 1)
        m = f.gamma[..., None] * eye + einsum("bhkc,bhcj->bhkj", f.b_decayed_t, f.w)
        return AffineMap(m, f.U)

    def compose(self, factors: DPLRFactors, running: AffineMap) -> AffineMap:
        # [M | U] <- diag(gamma) [M | U] + b~^T (w [M | U]) + [0 | U_c]: two products of
        # 2 K (K + V) C multiply-adds per chunk instead of a dense K^3 one.
        f = factors
        dk = running.M.shape[-1]
        mu = jnp.concatenate([running.M, running.U], axis=-1)
        reads = einsum("bhck,bhkd->bhcd", f.w, mu)
        mu = f.gamma[..., None] * mu + einsum("bhkc,bhcd->bhkd", f.b_decayed_t, reads)
        return AffineMap(mu[..., :dk], mu[..., dk:] + f.U)

    def finalize(self, outputs: Float[Array, "b t h v"], inputs: DPLRInputs) -> Array:
        return outputs.astype(inputs.v.dtype)
