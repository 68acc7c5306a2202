"""Gated DeltaProduct: `n_h` delta-rule (generalised Householder) steps per token.

One token, per value head (the convention of the DeltaProduct paper and of
flash-linear-attention: the decay once, before the `n_h` steps; the output after the last):

    h <- exp(g_t) h
    for j = 1..n_h:  h <- h + k_tj (beta_tj (v_tj - h^T k_tj))^T
    o_t = h^T (scale q_t)

So the transition of a token is `exp(g_t)` times a product of `n_h` generalised Householder
matrices `(I - beta_tj k_tj k_tj^T)`. In a chunk, the `n_h` steps of each token are
`n_h` pseudo-tokens in a row (decay on the first, query on the last): the delta rule's
WY algebra applies unchanged, with outputs read only after each token's last step.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._affine import AffineMap
from .._chunking import from_chunks, to_chunks
from .._custom_types import GateTensor, QKTensor, State, ValueTensor
from .._engine import AbstractChunkedRecurrence, run_context_parallel, run_local
from .._layout import check_contiguous, Contiguous, ContiguousLayout
from ._common import (
    check_arrays,
    check_chunk_size,
    check_grouped_heads,
    delta_advance,
    delta_chunk_map,
    delta_compose,
    delta_factors,
    delta_step,
    DeltaFactors,
)
from ._gated_delta import _einsum, _head_major, compute_dtype, l2norm


# Per-token tensors with the householder steps on axis 2.
ProductKeyTensor = Float[Array, "batch seq nh heads k"]
ProductValueTensor = Float[Array, "batch seq nh vheads v"]
ProductBetaTensor = Float[Array, "batch seq nh vheads"]


def check_delta_product_inputs(q, k, v, g, beta, initial_state=None) -> None:
    """Raise a `ValueError` naming the problem if the Gated DeltaProduct inputs don't fit."""
    sizes = check_arrays(
        {
            "q": (q, ("batch", "seq", "heads", "K")),
            "k": (k, ("batch", "seq", "householder_steps", "heads", "K")),
            "v": (v, ("batch", "seq", "householder_steps", "value_heads", "V")),
            "g": (g, ("batch", "seq", "value_heads")),
            "beta": (beta, ("batch", "seq", "householder_steps", "value_heads")),
            "initial_state": (initial_state, ("batch", "value_heads", "K", "V")),
        }
    )
    check_grouped_heads(sizes["heads"], sizes["value_heads"])


class GatedDeltaProduct(AbstractChunkedRecurrence[DeltaFactors, AffineMap]):
    """Gated DeltaProduct as a chunked recurrence (one call's inputs).

    **Arguments:**

    - `q`: queries, `(B, T, H, K)`.
    - `k`: keys, `(B, T, n_h, H, K)`: `n_h` householder steps per token.
    - `v`: values, `(B, T, n_h, HV, V)`, with `HV` a multiple of `H`.
    - `g`: log decays (`<= 0`), one per token and value head, `(B, T, HV)`; `None` for
        DeltaProduct without a gate.
    - `beta`: step sizes in `[0, 2]`, `(B, T, n_h, HV)`.
    - `scale`: query scale; defaults to `K ** -0.5`.
    - `use_qk_l2norm`: L2-normalise `q` and every `k` over `K` first.
    - `chunk_size`: tokens per chunk (each makes `n_h` updates).
    """

    q: QKTensor
    k: ProductKeyTensor
    v: ProductValueTensor
    g: GateTensor | None
    beta: ProductBetaTensor
    scale: float = eqx.field(static=True)
    use_qk_l2norm: bool = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __init__(
        self,
        q: QKTensor,
        k: ProductKeyTensor,
        v: ProductValueTensor,
        g: GateTensor | None,
        beta: ProductBetaTensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        chunk_size: int = 64,
    ):
        check_delta_product_inputs(q, k, v, g, beta)
        check_chunk_size(chunk_size)
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = chunk_size

    def state_shape(self) -> tuple[int, ...]:
        b, _, _, hv, dv = self.v.shape
        return (b, hv, self.q.shape[-1], dv)

    def state_dtype(self):
        gates = () if self.g is None else (self.g,)
        return compute_dtype(self.q, self.k, self.v, self.beta, *gates)

    def prepare(self) -> DeltaFactors:
        dt = self.state_dtype()
        b, t, n, h, dk = self.k.shape
        hv = self.v.shape[3]
        q, k = self.q.astype(dt), self.k.astype(dt)
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * jnp.asarray(self.scale, dt)
        # Interleave: token t's steps are pseudo-tokens t * n_h + j. The query sits on the
        # last step, the decay on the first; zeros elsewhere are exact no-ops.
        q = jnp.concatenate([jnp.zeros((b, t, n - 1, h, dk), dt), q[:, :, None]], axis=2)
        g = None
        if self.g is not None:
            g = self.g.astype(dt)[:, :, None]
            g = jnp.concatenate([g, jnp.zeros((b, t, n - 1, hv), dt)], axis=2).reshape(b, t * n, hv)

        def pseudo(x):  # (B, T, n_h, heads, ...) -> (B, T * n_h, heads, ...)
            return x.reshape(b, t * n, *x.shape[3:])

        r = hv // h
        c = self.chunk_size * n  # whole tokens per chunk
        return delta_factors(
            to_chunks(_head_major(pseudo(q), r), c),
            to_chunks(_head_major(pseudo(k), r), c),
            to_chunks(_head_major(pseudo(self.v.astype(dt))), c),
            to_chunks(_head_major(pseudo(self.beta.astype(dt))), c),
            None if g is None else to_chunks(_head_major(g), c),
            output_rows=slice(n - 1, None, n),
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
        return jnp.moveaxis(o, 1, 2).astype(self.v.dtype)


def chunk_gated_delta_product(
    q: QKTensor,
    k: ProductKeyTensor,
    v: ProductValueTensor,
    g: GateTensor | None,
    beta: ProductBetaTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[ValueTensor, State | None]:
    r"""Gated DeltaProduct in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow e^{g_t} h$, then for $j = 1, \dots, n_h$:
    $h \leftarrow h + k_{tj} (\beta_{tj} (v_{tj} - h^\top k_{tj}))^\top$; finally
    $o_t = h^\top (s\, q_t)$. The number of steps $n_h$ is axis 2 of `k`.
    flash-linear-attention's flat layout `(B, T * n_h, H, K)` is
    `k.reshape(B, T, n_h, H, K)` here (and likewise for `v` and `beta`).

    **Arguments:**

    - `q`: queries, shape `(B, T, H, K)`.
    - `k`: keys, shape `(B, T, n_h, H, K)`.
    - `v`: values, shape `(B, T, n_h, HV, V)`; `HV` must be a multiple of `H` and value
        head `j` reads key head `j // (HV // H)`.
    - `g`: natural-log decays $\le 0$, one per token and value head, `(B, T, HV)`, applied
        once before the token's steps; `None` for the ungated DeltaProduct.
    - `beta`: step sizes, shape `(B, T, n_h, HV)`; in $[0, 2]$ for householder
        reflections with negative eigenvalues, $[0, 1]$ otherwise.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
    - `use_qk_l2norm`: L2-normalise `q` and every `k` over `K` (eps `1e-6`) first.
    - `chunk_size`: tokens per chunk (so `chunk_size * n_h` updates).

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final state
    `(B, HV, K, V)` in float32 if `output_final_state`, else `None`.
    """
    check_delta_product_inputs(q, k, v, g, beta, initial_state)
    rec = GatedDeltaProduct(
        q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
    )
    o, h = run_local(rec, initial_state)
    return o, (h if output_final_state else None)


def chunk_gated_delta_product_cp(
    q: QKTensor,
    k: ProductKeyTensor,
    v: ProductValueTensor,
    g: GateTensor | None,
    beta: ProductBetaTensor,
    *,
    axis_name: str,
    layout: ContiguousLayout = Contiguous(),
    strategy: str = "allgather",
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[ValueTensor, State | None]:
    r"""Chunked Gated DeltaProduct with context parallelism, inside `jax.shard_map`.

    The sequence axis (axis 1 of `q`, `k`, `v`, `g`, `beta`) is sharded over `axis_name`,
    rank `r` holding a contiguous slice of tokens (all `n_h` steps of a token stay on one
    rank); each argument here is this rank's slice. Ranks exchange one `(K, K)` + `(K, V)`
    map per batch element and value head (or less, depending on `strategy`), whatever
    `n_h`.

    **Arguments:**

    - `q`, `k`, `v`, `g`, `beta`, `scale`, `use_qk_l2norm`, `chunk_size`: as in
        [`deltanet_cp.chunk_gated_delta_product`][], for this rank's tokens.
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
    check_contiguous(layout, "chunk_gated_delta_product_cp")
    check_delta_product_inputs(q, k, v, g, beta, initial_state)
    rec = GatedDeltaProduct(
        q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
    )
    return run_context_parallel(
        rec,
        initial_state,
        axis_name=axis_name,
        layout=layout,
        strategy=strategy,
        output_final_state=output_final_state,
    )


def recurrent_gated_delta_product(
    q: QKTensor,
    k: ProductKeyTensor,
    v: ProductValueTensor,
    g: GateTensor | None,
    beta: ProductBetaTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[ValueTensor, State | None]:
    r"""Gated DeltaProduct token by token (a `lax.scan` over time): the decoding path.

    Takes the same arguments as [`deltanet_cp.chunk_gated_delta_product`][] (without
    `chunk_size`) and returns the same `(o, final_state)`.
    """
    check_delta_product_inputs(q, k, v, g, beta, initial_state)
    gates = () if g is None else (g,)
    dt = compute_dtype(q, k, v, beta, *gates)
    b, t, n, h, dk = k.shape
    hv, dv = v.shape[3], v.shape[4]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = q.astype(dt), k.astype(dt)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    r = hv // h
    qf = jnp.repeat(qf * jnp.asarray(scale, dt), r, axis=2)
    kf = jnp.repeat(kf, r, axis=3)
    gf = jnp.zeros((b, t, hv), dt) if g is None else g.astype(dt)
    h0 = jnp.zeros((b, hv, dk, dv), dt) if initial_state is None else initial_state.astype(dt)

    def body(state, xs):
        q_t, k_t, v_t, g_t, beta_t = xs  # k_t: (B, n_h, HV, K)
        state = jnp.exp(g_t)[..., None, None] * state
        for j in range(n):
            kj = k_t[:, j]
            delta = beta_t[:, j, :, None] * (v_t[:, j] - _einsum("bhkv,bhk->bhv", state, kj))
            state = state + kj[..., :, None] * delta[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, v.astype(dt), gf, beta.astype(dt)))
    h_final, o = jax.lax.scan(body, h0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (h_final if output_final_state else None)
