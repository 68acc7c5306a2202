r"""The momentum delta rule (flash-linear-attention's `fla.ops.momentum_delta_rule`).

Per value head, a memory `S (K, V)` and a momentum `M (K, V)`; per token, with
$\alpha_t = e^{\log\alpha_t}$, $\mu_t = e^{\log\mu_t}$, step sizes $\beta_t$, $\eta_t$ and a
probe $\tilde p_t$ (the probe `p`, times $\alpha_t$ with `use_p_times_alpha`):

    M_t = mu_t M_{t-1} + (eta_t k_t) (S_{t-1}^T p~_t - v_t)^T
    S_t = alpha_t S_{t-1} - beta_t M_t
    o_t = S_t^T (scale q_t)

The joint state $h = [S; M]$ `(2K, V)` is affine per token: a $2 \times 2$ upper-triangular
scalar matrix $D_t = [[\alpha_t, -\beta_t \mu_t], [0, \mu_t]]$ on the two blocks, plus a
rank-one delta term that reads the state along $[\tilde p_t; 0]$ and writes along
$\eta_t [-\beta_t k_t; k_t]$. Products of the $D_t$ stay upper triangular: from token
$j$ to token $t$ of a chunk their diagonal is $(P^\alpha_{tj}, P^\mu_{tj})$ (direct
segment sums of the log decays) and their corner is
$-\Sigma_{tj} + \beta_j P^\alpha_{tj}$ with

    Sigma_tj = sum_{j <= i <= t} P^alpha_ti beta_i P^mu_ij      (one C x C x C product)

so the share of token $j$'s write in $S_t$ is $-\eta_j \Sigma_{tj} k_j$ and in $M_t$ is
$\eta_j P^\mu_{tj} k_j$. With $A_t, B_t, \mu_t$ the first row and the corner of the product
from the chunk start to token $t$, the residuals $r_t = S_{t-1}^\top \tilde p_t - v_t$
solve a unit lower-triangular system, and with $v_\text{new} = -r$:

    a_tj   = pi_t eta_j Sigma_{t-1,j} (p_t . k_j)      (t > j; pi_t = alpha_t or 1)
    [w | u] = (I + a)^-1 [pi A_{t-1} p | pi B_{t-1} p | v]    (w is C x 2K)
    v_new  = u - w h
    o      = [A q | B q] h + attn v_new,   attn_tj = eta_j Sigma_tj (q_t . k_j)   (t >= j)
    h_next = D_C h + k~^T v_new,   k~_j = eta_j [Sigma_Cj k_j ; -P^mu_Cj k_j]

One chunk is the map $h \mapsto (D_C \otimes I - \tilde k^\top w) h + \tilde k^\top u$: a
block-scalar matrix plus a rank-`C` update, which `compose` keeps in that form.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import AffineMap
from .._precision import accumulation_dtype, as_precision, PrecisionName
from .._recurrence import AbstractRecurrence
from .._validate import as_chunk_size, as_flag, as_l2norm_flag, as_scale
from ..chunkops import (
    chunk_major,
    cumulative_decays,
    decay_matrix,
    einsum,
    exclusive_decays,
    l2norm,
)
from ..chunkops._decays import shift_down
from ._helpers import check_arrays, flat_heads, policy, prologue, value_heads
from ._wy import AbstractWYChunk, AbstractWYFactors, wy_solve


class MomentumInputs(eqx.Module):
    """The per-token inputs of the momentum delta rule (time on axis 1 of every array).

    **Arguments:**

    - `q`: queries, `(B, T, H, K)`.
    - `k`: keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`.
    - `p`: probes, the direction the memory is read along, `(B, T, H, K)`.
    - `log_alpha`: the memory's log decays $\\le 0$, `(B, T, HV)`.
    - `log_mu`: the momentum's log decays $\\le 0$, `(B, T, HV)`.
    - `beta`: how much of the momentum the memory takes, `(B, T, HV)`.
    - `eta`: the momentum's step sizes, `(B, T, HV)`.
    """

    q: Float[Array, "batch seq heads k"] = eqx.field(metadata={"output_only": True})
    k: Float[Array, "batch seq heads k"]
    v: Float[Array, "batch seq vheads v"]
    p: Float[Array, "batch seq heads k"]
    log_alpha: Float[Array, "batch seq vheads"] = eqx.field(metadata={"log_decay": True})
    log_mu: Float[Array, "batch seq vheads"] = eqx.field(metadata={"log_decay": True})
    beta: Float[Array, "batch seq vheads"]
    eta: Float[Array, "batch seq vheads"]


class MomentumFactors(AbstractWYFactors):
    r"""The per-chunk quantities of the momentum delta rule that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`; `C` is the chunk size
    and the state is $h = [S; M]$, `(2K, V)`.

    - `wq`: $w$ (rows `:C`) stacked over $[A q \mid B q]$ (rows `C:`), both `(C, 2K)`, so
        one product with the state gives $w h$ and the state's direct share of the outputs.
    - `u`: $u$, so that $v_\text{new} = u - w h$.
    - `attn`: $\eta_j \Sigma_{tj} (q_t \cdot k_j)$ for $t \ge j$, so that
        $o = [A q \mid B q] h + \mathrm{attn}\, v_\text{new}$.
    - `k_decayed_t`: $\tilde k^\top$, `(2K, C)`: the chunk's writes to $S$ (rows `:K`) and
        to $M$ (rows `K:`).
    - `decay`: the chunk's $2 \times 2$ upper-triangular decay $D_C$ as
        $(A_C, B_C, \mu_C)$: $S \leftarrow A_C S + B_C M$, $M \leftarrow \mu_C M$.
    - `precision`: the policy the chunk's products with the state run under.
    """

    wq: Float[Array, "n b h cc kk"]
    u: Float[Array, "n b h c v"]
    attn: Float[Array, "n b h c c"]
    k_decayed_t: Float[Array, "n b h kk c"]
    decay: Float[Array, "n b h 3"]
    precision: PrecisionName = eqx.field(default="highest", static=True)

    def decayed(self, x: Array) -> Array:
        return _decayed(self.decay, x)

    def cotangents(self, wq, u, attn, k_decayed_t, states, d_next) -> "MomentumFactors":
        # The decay's three scalars from D_C h = [A h_S + B h_M; mu h_M].
        dk = states.shape[-2] // 2
        h_s, h_m = states[..., :dk, :], states[..., dk:, :]
        d_s, d_m = d_next[..., :dk, :], d_next[..., dk:, :]
        d_decay = jnp.stack(
            [
                jnp.sum(d_s * h_s, axis=(-2, -1)),
                jnp.sum(d_s * h_m, axis=(-2, -1)),
                jnp.sum(d_m * h_m, axis=(-2, -1)),
            ],
            axis=-1,
        )
        return type(self)(
            wq=wq, u=u, attn=attn, k_decayed_t=k_decayed_t, decay=d_decay, precision=self.precision
        )


def _as_p_times_alpha(value: object) -> bool:
    return as_flag(value, "use_p_times_alpha")


class MomentumDeltaRule(
    AbstractWYChunk, AbstractRecurrence[MomentumInputs, MomentumFactors, AffineMap]
):
    """The momentum delta rule: a memory and a momentum, one `(B, HV, 2K, V)` state.

    A static configuration; the inputs are a [`deltanet_cp.MomentumInputs`][], handed to
    [`deltanet_cp.run`][] beside it. The state is $[S; M]$, the memory's `K` rows over the
    momentum's.

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale, a Python float; `K ** -0.5` if `None`.
    - `use_qk_l2norm`: L2-normalise `q`, `k` and `p` over `K` (eps `1e-6`) first.
    - `use_p_times_alpha`: read the memory along $\\alpha_t p_t$ instead of $p_t$ (after
        the normalisation), as flash-linear-attention does by default.
    - `precision`: how the large products multiply: `"highest"`, `"bfloat16"` (bfloat16
        operands, float32 accumulation), `"default"`, or `None`: `"bfloat16"` for
        bfloat16 inputs, `"highest"` otherwise. The state, the decays, the unit-lower
        inverse and the chunk maps stay float32 under every policy.
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    use_qk_l2norm: bool = eqx.field(default=False, static=True, converter=as_l2norm_flag)
    use_p_times_alpha: bool = eqx.field(default=True, static=True, converter=_as_p_times_alpha)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)

    def check(self, inputs: MomentumInputs) -> None:
        check_arrays(
            {
                "q": (inputs.q, ("batch", "seq", "heads", "K")),
                "k": (inputs.k, ("batch", "seq", "heads", "K")),
                "v": (inputs.v, ("batch", "seq", "value_heads", "V")),
                "p": (inputs.p, ("batch", "seq", "heads", "K")),
                "log_alpha": (inputs.log_alpha, ("batch", "seq", "value_heads")),
                "log_mu": (inputs.log_mu, ("batch", "seq", "value_heads")),
                "beta": (inputs.beta, ("batch", "seq", "value_heads")),
                "eta": (inputs.eta, ("batch", "seq", "value_heads")),
            }
        )

    def state(self, inputs: MomentumInputs) -> jax.ShapeDtypeStruct:
        b, _, hv, dv = inputs.v.shape
        dtype = accumulation_dtype(*jax.tree.leaves(inputs))
        return jax.ShapeDtypeStruct((b, hv, 2 * inputs.q.shape[-1], dv), dtype)

    def prepare(self, chunks: MomentumInputs) -> MomentumFactors:
        dt, prec = policy(self.precision, chunks)
        b, n, c, h, dk = chunks.q.shape
        hv, dv = chunks.v.shape[-2:]
        r = hv // h
        q, k = prologue(chunks.q, chunks.k, dt, self.scale, self.use_qk_l2norm)
        p = chunks.p.astype(dt)
        if self.use_qk_l2norm:
            p = l2norm(p)

        def keys(x):  # (B, N, C, H, K) -> (N, B, H, 1, C, K): broadcasts over the r value heads
            return chunk_major(x)[:, :, :, None]

        def gates(x):  # (B, N, C, HV) -> (N, B, H, r, C)
            return chunk_major(x.astype(dt).reshape(b, n, c, h, r), features=0)

        q, k, p = flat_heads(keys(q)), flat_heads(keys(k)), flat_heads(keys(p))
        v = flat_heads(
            chunk_major(chunks.v.astype(dt).reshape(b, n, c, h, r, dv))
        )  # (NBH, r, C, V)
        la, lm = flat_heads(gates(chunks.log_alpha)), flat_heads(gates(chunks.log_mu))
        beta, eta = flat_heads(gates(chunks.beta)), flat_heads(gates(chunks.eta))
        pm, sigma, a_in, b_in, mu_in, a_before, b_before = _momentum_decays(la, lm, beta)
        if self.use_p_times_alpha:
            read = jnp.exp(la)  # pi_t: the probe is alpha_t p_t
            read_s, read_m = a_in, read * b_before  # pi A_{t-1} = A_t
        else:
            read = jnp.ones_like(la)
            read_s, read_m = a_before, b_before
        pk = einsum("...ik,...jk->...ij", p, k, precision=prec)  # (N B H, 1, C, C)
        qk = einsum("...ik,...jk->...ij", q, k, precision=prec)
        sigma_before = shift_down(sigma)  # Sigma_{t-1, j}: strictly lower
        a = read[..., :, None] * sigma_before * eta[..., None, :] * pk
        attn = sigma * eta[..., None, :] * qk
        reads = jnp.concatenate([read_s[..., None] * p, read_m[..., None] * p], axis=-1)
        q_state = jnp.concatenate([a_in[..., None] * q, b_in[..., None] * q], axis=-1)
        wq, u = wy_solve(a, reads, v, q_state, prec)  # (N B H, r, ., .)
        write_s = (eta * sigma[..., -1, :])[..., None] * k  # k~ rows for S
        write_m = -(eta * pm[..., -1, :])[..., None] * k  # and for M
        k_out = jnp.concatenate([write_s, write_m], axis=-1)  # (N B H, r, C, 2K)
        decay = jnp.stack([a_in[..., -1], b_in[..., -1], mu_in[..., -1]], axis=-1)

        def heads(x):
            return value_heads(x, n, b)

        return MomentumFactors(
            wq=heads(wq),
            u=heads(u),
            attn=heads(attn),
            k_decayed_t=heads(jnp.swapaxes(k_out, -1, -2)),
            decay=heads(decay),
            precision=prec,
        )

    def finalize(self, outputs: Float[Array, "b t h v"], inputs: MomentumInputs) -> Array:
        return outputs.astype(inputs.v.dtype)


def _momentum_decays(la: Array, lm: Array, beta: Array) -> tuple[Array, ...]:
    """The scalar decays of a chunk from its log decays and `beta`, `(..., C)` each, all in
    float32 at `Precision.HIGHEST` under every policy: `P^mu (C, C)`, `Sigma (C, C)`, the
    first row and corner of the products from the chunk start `A_t, B_t, mu_t` and the
    state's before each token `A_{t-1}, B_{t-1}`.

    Decays between tokens come from direct segment sums (masked before exp), never from
    differences of prefix sums; every other term is a sum of products of them, all of one
    sign: no cancellation."""
    pa, pm = decay_matrix(la), decay_matrix(lm)  # P^alpha_ti, P^mu_ij (lower, inclusive)
    pa_beta = pa * beta[..., None, :]
    sigma = einsum("...ti,...ij->...tj", pa_beta, pm)
    a_in = cumulative_decays(la, per_channel=False)[0][..., 0]  # A_t = e^{sum_{s<=t} la}
    mu_in = cumulative_decays(lm, per_channel=False)[0][..., 0]
    b_in = -einsum("...ti,...i->...t", pa_beta, mu_in)  # B_t
    a_before = exclusive_decays(la, per_channel=False)[..., 0]  # A_{t-1}
    b_before = shift_down(b_in[..., None])[..., 0]  # B_{t-1}
    return pm, sigma, a_in, b_in, mu_in, a_before, b_before


def _decayed(decay: Array, x: Array) -> Array:
    """`D_C x` for `x = [x_S; x_M]` `(..., 2K, D)` and `decay = (A, B, mu)` `(..., 3)`:
    `[A x_S + B x_M; mu x_M]`."""
    dk = x.shape[-2] // 2
    x_s, x_m = x[..., :dk, :], x[..., dk:, :]
    a, b, mu = (decay[..., i, None, None] for i in range(3))
    return jnp.concatenate([a * x_s + b * x_m, mu * x_m], axis=-2)
