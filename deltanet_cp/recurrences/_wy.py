r"""The WY chunk: one chunk of a delta-rule recurrence as a block-decay map plus a rank-`s`
update, what the delta family (`_delta_family.py`) and the momentum delta rule
(`_momentum.py`) share once their factors are formed.

A chunk of `s` delta updates emitting `c` outputs, with $D_C$ the chunk's decay of the
state (a diagonal per key channel, or the momentum rule's $2 \times 2$ block scalar),
$T = (I + A)^{-1}$ the unit lower-triangular WY inverse, `w` and `u` its products with the
rows the updates read the state along and with the values they write, $q'$ the rows the
outputs read the state along and $\tilde k$ the rows the updates write along (decayed to
the chunk's end):

    [w | u] = T [reads | values]
    v_new   = u - w h
    o       = q' h + attn v_new
    h_next  = D_C h + k~^T v_new

`step` forms `w h` and `q' h` in one product and `attn v_new` beside it, as
flash-linear-attention does: no `attn w` or `attn u` is formed ahead of the state. One chunk
is the affine map $h \mapsto (D_C - \tilde k^\top w) h + \tilde k^\top u$, which `compose`
keeps in that form.
"""

import abc
from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import AffineMap
from .._precision import PrecisionName, ProductPrecision, state_policy
from ..chunkops import einsum, unit_lower_solve
from ._helpers import lift


_Factors = TypeVar("_Factors", bound="AbstractWYFactors")


class AbstractWYFactors(eqx.Module):
    r"""The per-chunk factors of a WY chunk, leading axes `(n_chunks, batch, value_heads)`;
    a chunk makes `s` delta updates and emits `c` outputs, on a state of `R` rows.

    - `wq`: $w$ (rows `:s`) stacked over $q'$ (rows `s:`), `(..., s + c, R)`, so one
        product with the state gives both $w h$ and the state's direct share of the outputs.
    - `u`: $u$, `(..., s, V)`, so that $v_\text{new} = u - w h$.
    - `attn`: `(..., c, s)`, so that $o = q' h + \mathrm{attn}\, v_\text{new}$.
    - `k_decayed_t`: $\tilde k^\top$, `(..., R, s)`.
    - `precision`: the policy the chunk's products run under (`step`'s products with the
        state under `state_precision()`).

    A final class adds its chunk decay $D_C$ as a field and says how it acts (`decayed`)
    and what its cotangent is (`cotangents`).
    """

    wq: eqx.AbstractVar[Float[Array, "*chunks b h sc r"]]
    u: eqx.AbstractVar[Float[Array, "*chunks b h s v"]]
    attn: eqx.AbstractVar[Float[Array, "*chunks b h c s"]]
    k_decayed_t: eqx.AbstractVar[Float[Array, "*chunks b h r s"]]
    precision: eqx.AbstractVar[PrecisionName]

    @property
    def w(self) -> Float[Array, "*chunks b h s r"]:
        """The WY factor $w$ (the first `s` rows of `wq`)."""
        return self.wq[..., : self.u.shape[-2], :]

    def state_precision(self) -> ProductPrecision:
        """The policy of `step`'s three products with the state: `precision` (for a chunk
        that decays its state; see `state_policy`)."""
        return state_policy(self.precision, decays=True)

    @abc.abstractmethod
    def decayed(self, x: Array) -> Array:
        """$D_C x$: the chunk's decay applied to rows `x` of the state's shape `(..., R, D)`
        (any `D`; `x` may have unit leading axes)."""

    @abc.abstractmethod
    def cotangents(
        self: _Factors,
        wq: Array,
        u: Array,
        attn: Array,
        k_decayed_t: Array,
        states: Float[Array, "n b h r v"],
        d_next: Float[Array, "n b h r v"],
    ) -> _Factors:
        """Factors of this type holding the given cotangents of the four WY fields, the
        decay's cotangent from $D_C h$ (`states` entering the chunks, `d_next` the
        cotangents of the states leaving them), and these factors' static fields."""


def wy_solve(
    a: Float[Array, "*lead s s"],
    reads: Float[Array, "*lead s r"],
    values: Float[Array, "*lead s v"],
    queries: Float[Array, "*lead c r"],
    precision: PrecisionName,
) -> tuple[Float[Array, "*lead sc r"], Float[Array, "*lead s v"]]:
    """`(wq, u)` from the strictly lower-triangular `a`: `[w | u] = (I + a)^-1 [reads |
    values]` in one solve under `precision`, and `wq` the rows of `w` over `queries`."""
    wu = unit_lower_solve(a, jnp.concatenate([reads, values], axis=-1), precision)
    r = reads.shape[-1]
    return jnp.concatenate([wu[..., :r], queries], axis=-2), wu[..., r:]


class AbstractWYChunk(eqx.Module):
    """The engine's chunk methods of a recurrence whose factors are `AbstractWYFactors`:
    `step`, `chunk_map`, `compose` and `factor_cotangents`. A recurrence derives from it
    before `AbstractRecurrence[Inputs, Factors, AffineMap]`, which it completes."""

    def step(self, factors: AbstractWYFactors, h: Float[Array, "b h r v"]) -> tuple[Array, Array]:
        """The state leaving the chunk and its outputs `(B, C, HV, V)`; the three products
        with the state under the factors' `state_precision()`."""
        f = factors
        p = f.state_precision()
        s = f.u.shape[-2]
        y = einsum("bhck,bhkv->bhcv", f.wq, h, precision=p)  # [w h; q' h]
        v_new = f.u - y[..., :s, :]
        o = y[..., s:, :] + einsum("bhcs,bhsv->bhcv", f.attn, v_new, precision=p)
        write = einsum("bhks,bhsv->bhkv", f.k_decayed_t, v_new, precision=p)
        return f.decayed(h) + write, jnp.swapaxes(o, 1, 2)  # the state in its own dtype

    def chunk_map(self, factors: AbstractWYFactors) -> AffineMap:
        """`(D_C - k~^T w, k~^T u)`, at `Precision.HIGHEST` under every policy (under
        context parallelism the maps carry the state across ranks)."""
        f = factors
        rows = f.wq.shape[-1]
        eye = lift(jnp.eye(rows, dtype=f.wq.dtype), f.k_decayed_t.ndim)
        m = f.decayed(eye) - einsum("bhks,bhsj->bhkj", f.k_decayed_t, f.w)
        return AffineMap(m, einsum("bhks,bhsv->bhkv", f.k_decayed_t, f.u))

    def compose(self, factors: AbstractWYFactors, running: AffineMap) -> AffineMap:
        """`[M | U] <- D_C [M | U] + k~^T ([0 | u] - w [M | U])`: two products of
        `R (R + V) s` multiply-adds per chunk instead of a dense `R^3` one."""
        f = factors
        rows = running.M.shape[-1]
        mu = jnp.concatenate([running.M, running.U], axis=-1)
        rhs = jnp.concatenate([jnp.zeros_like(f.w), f.u], axis=-1)
        rhs = rhs - einsum("bhsk,bhkd->bhsd", f.w, mu)
        mu = f.decayed(mu) + einsum("bhks,bhsd->bhkd", f.k_decayed_t, rhs)
        return AffineMap(mu[..., :rows], mu[..., rows:])

    def factor_cotangents(
        self,
        factors: _Factors,
        states: Float[Array, "n b h r v"],
        d_next: Float[Array, "n b h r v"],
        d_outputs: Float[Array, "n b c h v"],
    ) -> _Factors:
        """`step`'s VJP in its factors as batched products over a block's chunks: `v_new =
        u - w h` again, then `d v_new = k~ d_next + attn^T d o`, `d[w; q'] = [-d v_new;
        d o] h^T`, `d attn = d o v_new^T`, `d k~^T = d_next v_new^T`, and the decay's from
        the factors' own `cotangents`."""
        f = factors
        p = f.precision
        v_new = f.u - einsum("nbhsk,nbhkv->nbhsv", f.w, states, precision=p)
        d_o = jnp.swapaxes(d_outputs, 2, 3)  # (N, B, HV, C, V)
        d_v_new = einsum("nbhks,nbhkv->nbhsv", f.k_decayed_t, d_next, precision=p)
        d_v_new = d_v_new + einsum("nbhcs,nbhcv->nbhsv", f.attn, d_o, precision=p)
        d_y = jnp.concatenate([-d_v_new, d_o], axis=-2)
        return f.cotangents(
            wq=einsum("nbhcv,nbhkv->nbhck", d_y, states, precision=p),
            u=d_v_new,
            attn=einsum("nbhcv,nbhsv->nbhcs", d_o, v_new, precision=p),
            k_decayed_t=einsum("nbhkv,nbhsv->nbhks", d_next, v_new, precision=p),
            states=states,
            d_next=d_next,
        )
