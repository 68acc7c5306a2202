r"""What Gated DeltaNet, DeltaNet, KDA, Gated DeltaNet-2 and Gated DeltaProduct share: their
inputs, their chunk factors, one chunk step, and the abstract class the final classes derive
from.

They differ only in their decays, in their gates and in how many delta updates a token
makes. With per-channel log decays $g_t$ (one per head is the same decay on every channel;
none is $g = 0$), $G_i = \sum_{t \le i} g_t$ from the chunk start, an erase gate $b_i$ and a
write gate $w_i$ (both the scalar $\beta_i$, except for Gated DeltaNet-2 where $b_i$ has one
value per key channel and $w_i$ one per value channel), and $s$ updates emitting $c$
outputs, one chunk is an affine map of the incoming state (with $\hat k$ the write key: the
key $k$ itself, except for the preconditioned rules, which erase along $k$ and write along
$\hat k = k \odot m$):

    A_ij   = sum_c (b_i k_i)_c k^_jc exp(G_ic - G_jc)    (i > j)
    T      = (I + A)^-1                                   (unit lower triangular)
    w      = T (b * exp(G) * k),   u = T (w_gate * v)
    attn   = tril_inclusive(sum_c q_ic k^_jc exp(G_ic - G_jc)),   q_g = q * exp(G)
    v_new  = u - w h
    o      = q_g h + attn v_new
    h_next = diag(gamma) h + k~^T v_new,   gamma = exp(G_C),   k~ = k^ * exp(G_C - G)

The chunk step forms `w h` and `q_g h` in one product and `attn v_new` beside it, as
flash-linear-attention does: no `attn w` or `attn u` is formed ahead of the state, which
saves a `C x C x (K + V)` product per chunk in the forward and two in the backward.

$T$ comes from [`unit_lower_solve`][deltanet_cp.chunkops.unit_lower_solve] (recursive
blocking, batched matmuls; its VJP never differentiates the inverse), the decays
from direct segment sums (per token) or the blocked exact Gram (per channel).
"""

from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import AffineMap
from .._precision import accumulation_dtype, PrecisionName, ProductPrecision, state_policy
from .._recurrence import AbstractRecurrence
from .._validate import check_step_sizes
from ..chunkops import (
    chunk_major,
    cumulative_decays,
    decayed_grams,
    einsum,
    segment_sums,
)
from ._helpers import (
    check_arrays,
    decay_cotangent,
    flat_heads,
    lift,
    policy,
    prologue,
    value_heads,
)
from ._wy import AbstractWYChunk, AbstractWYFactors, wy_solve


# How a delta-rule recurrence decays its state: per head, per key channel, optionally per
# head, or not at all.
GateKind = Literal["head", "key", "optional", "none"]


class DeltaInputs(eqx.Module):
    """The per-token inputs of a delta-rule recurrence (time on axis 1 of every array).

    **Arguments:**

    - `q`: queries, `(B, T, H, K)`.
    - `k`: keys, `(B, T, H, K)`; `(B, T, n_h, H, K)` for Gated DeltaProduct.
    - `v`: values, `(B, T, HV, V)`; `(B, T, n_h, HV, V)` for Gated DeltaProduct.
    - `g`: log decays `<= 0`: `(B, T, HV)` per head, `(B, T, HV, K)` per key channel
        (KDA), or `None` (DeltaNet).
    - `beta`: step sizes in `[0, 2]` (`[0, 1]` usually; above 1, negative eigenvalues),
        `(B, T, HV)`; `(B, T, n_h, HV)` for Gated DeltaProduct. For Gated DeltaNet-2, the
        erase gate `b`, one per key channel: `(B, T, HV, K)`.

    Both ranges are checked, with a `ValueError`, where the values are concrete (an eager
    call); under `jax.jit`, `grad`, `vmap` or `shard_map` they are not (a check there
    would add a callback to every call): there a positive log decay or a step size outside
    `[0, 2]` makes the state grow without bound.
    - `write`: Gated DeltaNet-2's write gate `w`, one per value channel, `(B, T, HV, V)`;
        `None` for the others (the write gate is `beta`).
    - `write_key`: the preconditioned rules' write key `k^`, `(B, T, H, K)`, taken as
        given (not normalised with `use_qk_l2norm`); `None` for the others (the write key
        is `k`).
    """

    q: Float[Array, "batch seq heads k"] = eqx.field(metadata={"output_only": True})
    k: Float[Array, "batch seq *nh heads k"]
    v: Float[Array, "batch seq *nh vheads v"]
    g: Float[Array, "batch seq vheads *k"] | None = eqx.field(metadata={"log_decay": True})
    beta: Float[Array, "batch seq *nh vheads"] | Float[Array, "batch seq vheads k"]
    write: Float[Array, "batch seq vheads v"] | None = None
    write_key: Float[Array, "batch seq heads k"] | None = None


class DeltaFactors(AbstractWYFactors):
    r"""The per-chunk quantities of a delta-rule recurrence that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`. A chunk makes `s` delta
    updates (its tokens; for Gated DeltaProduct `n_h` per token) and emits `c` outputs.

    - `wq`: $w$ (rows `:s`) stacked over $q_g = q e^{G}$ (rows `s:`), so one product with
        the state gives both $w h$ and the state's direct share of the outputs.
    - `u`: $u$, so that $v_\text{new} = u - w h$.
    - `attn`: the masked decayed $q k^\top$, `(..., c, s)`, so that
        $o = q_g h + \mathrm{attn}\, v_\text{new}$.
    - `k_decayed_t`: $\tilde k^\top = (k e^{G_C - G})^\top$, shape `(..., K, s)`.
    - `gamma`: $e^{G_C}$, the decay over the whole chunk per key channel.
    - `precision`: the policy the chunk's products with the state run under (resolved from
        the inputs by `prepare`); every field is in the accumulation dtype whatever it is.
    - `decays`: whether the recurrence decays its state (`False`: DeltaNet, an ungated
        Gated DeltaProduct). Without decay, `step`'s three products under `"bfloat16"`
        are compensated: each operand split into two bfloat16 halves, three bfloat16
        products, and so are their VJPs (the state and its cotangent forget no rounding).
    """

    wq: Float[Array, "n b h sc k"]
    u: Float[Array, "n b h s v"]
    attn: Float[Array, "n b h c s"]
    k_decayed_t: Float[Array, "n b h k s"]
    gamma: Float[Array, "n b h k"]
    precision: PrecisionName = eqx.field(default="highest", static=True)
    decays: bool = eqx.field(default=True, static=True)

    def state_precision(self) -> ProductPrecision:
        return state_policy(self.precision, decays=self.decays)

    def decayed(self, x: Array) -> Array:
        return self.gamma[..., None] * x

    def cotangents(self, wq, u, attn, k_decayed_t, states, d_next) -> "DeltaFactors":
        return type(self)(
            wq=wq,
            u=u,
            attn=attn,
            k_decayed_t=k_decayed_t,
            gamma=decay_cotangent(d_next, states),
            precision=self.precision,
            decays=self.decays,
        )


class AbstractDeltaRule(AbstractWYChunk, AbstractRecurrence[DeltaInputs, DeltaFactors, AffineMap]):
    """The delta-rule family: a delta update per step, with or without decay.

    Final subclasses hold the fields `chunk_size`, `scale`, `use_qk_l2norm` and `precision`, and say
    with `gate` whether decays are per head (`"head"`), per key channel (`"key"`), optional
    per head (`"optional"`) or absent (`"none"`), with `householder` whether a token makes
    several updates (the `n_h` axis of Gated DeltaProduct), and with `channel_gates`
    whether the erase gate is per key channel and the write gate per value channel (Gated
    DeltaNet-2; the default: one `beta` per token for both), and with `write_key` whether
    it writes along a key of its own, `DeltaInputs.write_key` (the preconditioned rules; the
    default: along `k`).
    """

    scale: eqx.AbstractVar[float | None]
    use_qk_l2norm: eqx.AbstractVar[bool]
    precision: eqx.AbstractVar[PrecisionName | None]
    gate: ClassVar[GateKind]
    householder: ClassVar[bool]
    channel_gates: ClassVar[bool] = False
    write_key: ClassVar[bool] = False

    def check(self, inputs: DeltaInputs) -> None:
        name = type(self).__name__
        nh = ("householder_steps",) if self.householder else ()
        if self.gate == "none" and inputs.g is not None:
            raise ValueError(f"{name} has no decay: pass `g=None`.")
        if self.gate in ("head", "key") and inputs.g is None:
            raise ValueError(f"{name} needs the log decays `g`; got None.")
        per_key = ("K",) if self.gate == "key" else ()
        erase, write = ("b", "w") if self.channel_gates else ("beta", "write")
        if self.channel_gates and inputs.write is None:
            raise ValueError(f"{name} needs the write gate `w` (`DeltaInputs.write`); got None.")
        if not self.channel_gates and inputs.write is not None:
            raise ValueError(f"{name} writes with `beta`: pass `write=None`.")
        if self.write_key and inputs.write_key is None:
            raise ValueError(f"{name} needs the write key (`DeltaInputs.write_key`); got None.")
        if not self.write_key and inputs.write_key is not None:
            raise ValueError(f"{name} writes along `k`: pass `write_key=None`.")
        check_arrays(
            {
                "q": (inputs.q, ("batch", "seq", "heads", "K")),
                "k": (inputs.k, ("batch", "seq", *nh, "heads", "K")),
                "v": (inputs.v, ("batch", "seq", *nh, "value_heads", "V")),
                "g": (inputs.g, ("batch", "seq", "value_heads", *per_key)),
                erase: (
                    inputs.beta,
                    ("batch", "seq", *nh, "value_heads", *(("K",) if self.channel_gates else ())),
                ),
                write: (inputs.write, ("batch", "seq", "value_heads", "V")),
                "write_key": (inputs.write_key, ("batch", "seq", "heads", "K")),
            }
        )
        check_step_sizes(inputs.beta, erase, name)

    def state(self, inputs: DeltaInputs) -> jax.ShapeDtypeStruct:
        b, hv, dv = inputs.v.shape[0], inputs.v.shape[-2], inputs.v.shape[-1]
        dtype = accumulation_dtype(*jax.tree.leaves(inputs))
        return jax.ShapeDtypeStruct((b, hv, inputs.q.shape[-1], dv), dtype)

    def prepare(self, chunks: DeltaInputs) -> DeltaFactors:
        # Batched over whatever chunks it is given (the engine gives one at a time), chunk
        # axis first; products of keys are formed once per key head.
        dt, precision = policy(self.precision, chunks)
        b, n, c, h, dk = chunks.q.shape
        nh = chunks.k.shape[3] if self.householder else 1
        hv, dv = chunks.v.shape[-2], chunks.v.shape[-1]
        r = hv // h
        q, k = prologue(chunks.q, chunks.k, dt, self.scale, self.use_qk_l2norm)
        # A token's n_h updates are n_h pseudo-tokens in a row: the decay on the first, the
        # output after the last.
        s = c * nh
        k = chunk_major(k.reshape(b, n, s, h, dk))  # (N, B, H, S, K)
        k_write = None
        if chunks.write_key is not None:  # taken as given: no l2norm
            k_write = chunk_major(chunks.write_key.astype(dt).reshape(b, n, s, h, dk))
        v = chunk_major(chunks.v.astype(dt).reshape(b, n, s, h, r, dv))  # (N, B, H, r, S, V)
        channels = int(self.channel_gates)  # erase per key channel, write per value channel
        beta = chunks.beta.astype(dt).reshape(b, n, s, h, r, *((dk,) if channels else ()))
        beta = chunk_major(beta, features=channels)
        write = beta
        if chunks.write is not None:
            write = chunks.write.astype(dt).reshape(b, n, s, h, r, dv)
            write = chunk_major(write)
        g = chunks.g
        if g is not None:
            g = g.astype(dt)
            if nh > 1:  # (B, N, C, HV) -> (B, N, C, n_h, HV), the decay on the first step
                g = jnp.concatenate([g[:, :, :, None], jnp.zeros((b, n, c, nh - 1, hv), dt)], 3)
            per_key = self.gate == "key"
            g = g.reshape(b, n, s, h, r, *((dk,) if per_key else ()))
            g = chunk_major(g, features=int(per_key))
        rows = slice(nh - 1, None, nh)
        return _factors(
            chunk_major(q), k, v, g, beta, write, rows=rows, precision=precision, k_write=k_write
        )

    def finalize(self, outputs: Float[Array, "b t h v"], inputs: DeltaInputs) -> Array:
        return outputs.astype(inputs.v.dtype)


def _factors(
    q, k, v, g, beta, write, *, rows: slice, precision: PrecisionName, k_write=None
) -> DeltaFactors:
    """The factors from chunk-major inputs: `q: (N, B, H, C, K)`, `k: (N, B, H, S, K)`,
    `v: (N, B, H, r, S, V)`, `g: None`, `(N, B, H, r, S)` or `(N, B, H, r, S, K)`; the
    erase gate `beta: (N, B, H, r, S)` or, per key channel, `(N, B, H, r, S, K)` (per
    channel decays only) and the write gate `write: (N, B, H, r, S)` or, per value
    channel, `(N, B, H, r, S, V)`; `rows` picks the `C` output positions among the `S`
    updates; `precision` is the policy of the Grams and the WY products; `k_write`, of
    `k`'s shape, the write key (`None`: `k`): the Grams' right factor and `k~`, while `w`
    erases along `k`.

    Products of keys with keys or queries are formed once per key head and broadcast over
    its `r` value heads, unless the decay is per channel (it then differs per value head).
    """
    n, b = k.shape[:2]
    q, k, v, beta = flat_heads(q), flat_heads(k), flat_heads(v), flat_heads(beta)
    g = None if g is None else flat_heads(g)
    write = flat_heads(write)
    dt = k.dtype
    s, dk = k.shape[-2], k.shape[-1]
    lead = v.shape[:2]  # (N B H, r)
    incl = lift(jnp.tril(jnp.ones((s, s), dtype=bool)), 4)
    strict = lift(jnp.tril(jnp.ones((s, s), dtype=bool), k=-1), 4)
    zero = jnp.zeros((), dt)
    kr, qr = k[:, None], q[:, None]  # (N B H, 1, ., K)
    kwr = kr if k_write is None else flat_heads(k_write)[:, None]  # the write key
    if g is not None and g.ndim == k.ndim + 1:  # one decay per key channel: exact blocked Gram
        kb, qb = jnp.broadcast_to(kr, (*lead, s, dk)), jnp.broadcast_to(qr, (*lead, s, dk))
        kwb = kb if k_write is None else jnp.broadcast_to(kwr, (*lead, s, dk))
        x = jnp.stack([_gated(kb, beta), qb], -2)
        grams = decayed_grams(x, kwb[..., None, :], g, False, precision)
        a = jnp.where(strict, grams[..., :, 0, :, 0], zero)
        attn = grams[..., rows, 1, :, 0]
        decay_in, decay_out = cumulative_decays(g, per_channel=True)
        q_decayed, k_decayed = qb * decay_in[..., rows, :], kwb * decay_out
        bk = _gated(decay_in * kb, beta)
        gamma = decay_in[..., -1, :]
    else:
        if beta.ndim != v.ndim - 1:
            raise ValueError("An erase gate per key channel needs a decay per key channel.")
        qk = einsum("...ik,...jk->...ij", qr, kwr, precision=precision)  # (N B H, 1, C, S)
        kk = einsum("...ik,...jk->...ij", kr, kwr, precision=precision)
        if g is None:
            attn = jnp.where(incl[..., rows, :], qk, zero)
            a = jnp.where(strict, kk, zero) * beta[..., :, None]
            q_decayed, k_decayed, bk = qr, kwr, beta[..., None] * kr
            gamma = jnp.ones((*lead, dk), dt)
        else:
            # G_i - G_j summed directly over (j, i], never as a difference of prefix sums:
            # exact to a relative epsilon however negative the gates before j.
            decay = jnp.exp(jnp.where(incl, segment_sums(g), -jnp.inf))  # masked before exp
            decay_in = jnp.exp(jnp.cumsum(g, axis=-1))  # e^{G_i}
            attn = qk * decay[..., rows, :]
            a = jnp.where(strict, kk * decay, zero) * beta[..., :, None]
            q_decayed = decay_in[..., rows, None] * qr
            k_decayed = kwr * decay[..., -1, :, None]  # k^ e^{G_C - G_i}
            bk = (beta * decay_in)[..., None] * kr
            gamma = jnp.broadcast_to(decay_in[..., -1:], (*lead, dk))
    q_decayed = jnp.broadcast_to(q_decayed, (*lead, *q_decayed.shape[-2:]))
    wq, u = wy_solve(a, bk, _gated(v, write), q_decayed, precision)  # (N B H, r, ., .)
    attn = jnp.broadcast_to(attn, (*lead, *attn.shape[-2:]))
    k_decayed = jnp.broadcast_to(k_decayed, (*lead, s, dk))

    def heads(x):
        return value_heads(x, n, b)

    return DeltaFactors(
        wq=heads(wq),
        u=heads(u),
        attn=heads(attn),
        k_decayed_t=heads(jnp.swapaxes(k_decayed, -1, -2)),
        gamma=heads(gamma),
        precision=precision,
        decays=g is not None,
    )


def _gated(x: Array, gate: Array) -> Array:
    """Rows of `x` `(..., S, D)` times a gate per row `(..., S)` or per entry `(..., S, D)`."""
    return x * (gate if gate.ndim == x.ndim else gate[..., None])
