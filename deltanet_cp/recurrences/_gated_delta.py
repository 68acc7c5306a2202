"""The gated delta rule (Gated DeltaNet; Qwen3-Next, Qwen3.5).

One token, per value head (decay first, then the delta update):

    h <- exp(g_t) h
    h <- h + k_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (gamma I - k~^T w) h + k~^T u`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._affine import AffineMap
from .._chunking import from_chunk_major, to_chunk_major
from .._custom_types import GateTensor, QKTensor, State, States, ValueTensor
from .._engine import AbstractChunkedRecurrence, run_context_parallel, run_local, run_packed
from .._layout import check_contiguous, Contiguous, ContiguousLayout


_HI = jax.lax.Precision.HIGHEST
_L2NORM_EPS = 1e-6


def _einsum(spec, *args):
    return jnp.einsum(spec, *args, precision=_HI)


def check_inputs(q, k, v, g, beta, initial_state=None, *, g_per_key: bool = False) -> None:
    """Raise a `ValueError` naming the problem if the inputs don't fit together.

    Expected: `q, k: (B, T, H, K)`, `v: (B, T, HV, V)` with `HV` a multiple of `H`,
    `g, beta: (B, T, HV)` (or `g: (B, T, HV, K)` when `g_per_key`), `initial_state:
    (B, HV, K, V)`, all floating point.
    """
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if initial_state is not None:
        named["initial_state"] = initial_state
    for name, x in named.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"`{name}` must be an array; got {type(x).__name__}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"`{name}` must be a floating-point array (float32, bfloat16, ...); got "
                f"dtype {x.dtype}. Cast it with `.astype(jnp.float32)`."
            )
    g_rank = 4 if g_per_key else 3
    for name, rank, layout in [
        ("q", 4, "(batch, seq, heads, K)"),
        ("k", 4, "(batch, seq, heads, K)"),
        ("v", 4, "(batch, seq, value_heads, V)"),
        ("g", g_rank, "(batch, seq, value_heads, K)" if g_per_key else "(batch, seq, value_heads)"),
        ("beta", 3, "(batch, seq, value_heads)"),
    ]:
        if named[name].ndim != rank:
            raise ValueError(
                f"`{name}` must have rank {rank} with layout {layout}; got shape "
                f"{named[name].shape}."
            )
    if q.shape != k.shape:
        raise ValueError(f"`q` and `k` must have the same shape; got {q.shape} and {k.shape}.")
    b, t, h, dk = q.shape
    if v.shape[:2] != (b, t):
        raise ValueError(
            f"`v` must share batch and sequence length with `q`: expected (B, T) = {(b, t)}, "
            f"got {v.shape[:2]} (v has shape {v.shape})."
        )
    hv = v.shape[2]
    if hv % h != 0:
        raise ValueError(
            f"The number of value heads ({hv}, from `v`) must be a multiple of the number of "
            f"key heads ({h}, from `q`/`k`): value head j reads key head j // (HV // H)."
        )
    g_shape = (b, t, hv, dk) if g_per_key else (b, t, hv)
    if g.shape != g_shape:
        raise ValueError(f"`g` must have shape {g_shape}; got {g.shape}.")
    if beta.shape != (b, t, hv):
        raise ValueError(f"`beta` must have shape (B, T, HV) = {(b, t, hv)}; got {beta.shape}.")
    if initial_state is not None and initial_state.shape != (b, hv, dk, v.shape[3]):
        raise ValueError(
            f"`initial_state` must have shape (B, HV, K, V) = {(b, hv, dk, v.shape[3])}; "
            f"got {initial_state.shape}."
        )


def compute_dtype(*xs) -> jnp.dtype:
    """float32 for float32/16-bit inputs, float64 for float64 inputs; never promotes further."""
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def l2norm(x: Float[Array, "... k"]) -> Float[Array, "... k"]:
    """`x * rsqrt(sum(x**2) + 1e-6)` over the last axis (the convention of every reference)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2NORM_EPS)


def _head_major(x: Array, repeats: int = 1) -> Array:
    """(B, T, H, ...) -> (B, H * repeats, T, ...), each head repeated `repeats` times in place."""
    if repeats > 1:
        x = jnp.repeat(x, repeats, axis=2)
    return jnp.moveaxis(x, 2, 1)


def _lift(x: Array, ndim: int) -> Array:
    """Prepend unit axes so `x` has `ndim` axes (rank promotion is explicit here)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


@jax.custom_jvp
def _compensated_cumsum(g: Float[Array, "... c"]) -> tuple[Array, Array]:
    """`cumsum(g)` over the last axis in float32 and its rounding error (a two-sum scan).

    `hi + lo` is the prefix sum to about twice the working precision, so `G_i - G_j` stays
    accurate even after a very negative gate has made `|G|` large. The derivative is that of
    the exact prefix sum (a cumsum of the tangent; `lo` has none), so the backward pass is
    one reverse cumsum rather than the transpose of the scan.
    """

    def combine(x, y):
        (xh, xl), (yh, yl) = x, y
        s = xh + yh
        bv = s - xh
        err = (xh - (s - bv)) + (yh - bv)
        return s, err + xl + yl

    return jax.lax.associative_scan(combine, (g, jnp.zeros_like(g)), axis=-1)


@_compensated_cumsum.defjvp
def _compensated_cumsum_jvp(primals, tangents):
    (g,), (dg,) = primals, tangents
    hi, lo = _compensated_cumsum(g)
    return (hi, lo), (jnp.cumsum(dg, axis=-1), jnp.zeros_like(lo))


@jax.custom_vjp
def unit_lower_inverse(a: Float[Array, "*batch c c"]) -> Float[Array, "*batch c c"]:
    r"""$(I + a)^{-1}$ for a strictly lower-triangular `a`, by recursive 2x2 blocking.

    $\begin{pmatrix} I + a_{11} & 0 \\ a_{21} & I + a_{22} \end{pmatrix}^{-1} =
    \begin{pmatrix} t_{11} & 0 \\ -t_{22} a_{21} t_{11} & t_{22} \end{pmatrix}$, with both
    diagonal halves inverted together (stacked on a new leading axis): $\log_2 c$ levels of
    batched matmuls, about $c^3 / 3$ flops, instead of a sequential triangular solve. Each
    level multiplies true inverses (no power series), so it is as accurate as substitution.
    A size that is not a power of two is padded with zeros (an identity block) and cut back.
    """
    c = a.shape[-1]
    p = 1 << (c - 1).bit_length()
    if p != c:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, p - c), (0, p - c)])
    return _inverse_pow2(a)[..., :c, :c]


def _unit_lower_inverse_fwd(a):
    t = unit_lower_inverse(a)
    return t, t


def _unit_lower_inverse_bwd(t, ct):
    # d(I + a)^-1 = -T da T, so the cotangent of `a` is -T^T ct T^T, on the strictly lower
    # triangle (the only entries of `a` that are read): two products instead of the
    # transpose of every level of the recursion.
    c = t.shape[-1]
    tt = jnp.swapaxes(t, -1, -2)
    da = -_einsum("...ij,...jk->...ik", tt, _einsum("...ij,...jk->...ik", ct, tt))
    strict = _lift(jnp.tril(jnp.ones((c, c), dtype=bool), k=-1), da.ndim)
    return (jnp.where(strict, da, jnp.zeros((), da.dtype)),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _inverse_pow2(a: Array) -> Array:
    n = a.shape[-1]
    if n == 1:
        return jnp.ones_like(a)
    h = n // 2
    halves = _inverse_pow2(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
    t11, t22 = halves[0], halves[1]
    t21 = -_einsum("...ij,...jk->...ik", t22, _einsum("...ij,...jk->...ik", a[..., h:, :h], t11))
    top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


class GatedDeltaFactors(eqx.Module):
    r"""The per-chunk quantities of the gated delta rule that do not depend on the state.

    Every field has leading axes `(n_chunks, batch, value_heads)`. With $T = (I + A)^{-1}$,
    $w = T(\beta e^{G} k)$, $u = T(\beta v)$ and the decayed causal attention `attn`, a chunk
    maps the state $h$ to $h' = \gamma h + \tilde k^\top (u - w h)$ and emits
    $o = (q e^{G} - \mathrm{attn}\, w) h + \mathrm{attn}\, u$.

    - `wq`: $w$ (rows `:c`) stacked over $q e^{G} - \mathrm{attn}\, w$ (rows `c:`), so one
        product with the state gives both $w h$ and the state's share of the outputs.
    - `u`: $u$.
    - `o_intra`: $\mathrm{attn}\, u$, the outputs' share that does not depend on the state.
    - `k_decayed_t`: $\tilde k^\top = (k e^{G_C - G})^\top$, shape `(..., K, c)`.
    - `gamma`: $e^{G_C}$, the decay over the whole chunk.
    """

    wq: Float[Array, "n b h c2 k"]
    u: Float[Array, "n b h c v"]
    o_intra: Float[Array, "n b h c v"]
    k_decayed_t: Float[Array, "n b h k c"]
    gamma: Float[Array, "n b h"]

    @property
    def w(self) -> Float[Array, "*chunks b h c k"]:
        """The WY factor $w$ (the first `c` rows of `wq`)."""
        return self.wq[..., : self.u.shape[-2], :]


def _chunk_factors(q, k, v, g, beta, hv: int) -> GatedDeltaFactors:
    """The factors from chunk-major inputs: `q, k: (N, B, H, C, K)`, `v: (N, B, H, r, C, V)`,
    `g, beta: (N, B, H, r, C)`."""
    c, dk = q.shape[-2], q.shape[-1]
    dt = q.dtype
    cum, cum_err = _compensated_cumsum(g)  # G_i from the chunk start, and its rounding error
    # G_i - G_j without cancellation: the float32 difference plus the difference of errors.
    seg = (cum[..., :, None] - cum[..., None, :]) + jax.lax.stop_gradient(
        cum_err[..., :, None] - cum_err[..., None, :]
    )
    incl = _lift(jnp.tril(jnp.ones((c, c), dtype=bool)), seg.ndim)
    strict = _lift(jnp.tril(jnp.ones((c, c), dtype=bool), k=-1), seg.ndim)
    zero = jnp.zeros((), dt)
    decay = jnp.exp(jnp.where(incl, seg, -jnp.inf))  # masked before exp
    decay_in = jnp.exp(cum)  # e^{G_i}

    # Products of keys with queries and keys: once per key head, (N, B, H, 1, C, C).
    qk = _einsum("...ik,...jk->...ij", q, k)[:, :, :, None]
    kk = _einsum("...ik,...jk->...ij", k, k)[:, :, :, None]
    attn = qk * decay
    a = jnp.where(strict, kk * decay, zero) * beta[..., :, None]
    kr = k[:, :, :, None]  # (N, B, H, 1, C, K)
    rhs = jnp.concatenate(
        [(beta * decay_in)[..., None] * kr, beta[..., None] * v], axis=-1
    )  # (..., r, C, K + V)
    wu = _einsum("...ij,...jd->...id", unit_lower_inverse(a), rhs)
    a_wu = _einsum("...ij,...jd->...id", attn, wu)  # [attn w | attn u]
    q_out = decay_in[..., None] * q[:, :, :, None] - a_wu[..., :dk]
    k_decayed = kr * decay[..., -1, :, None]  # k e^{G_C - G_i}

    def heads(x):  # (N, B, H, r, ...) -> (N, B, HV, ...); value head j reads key head j // r
        return x.reshape(x.shape[:2] + (hv,) + x.shape[4:])

    return GatedDeltaFactors(
        wq=heads(jnp.concatenate([wu[..., :dk], q_out], axis=-2)),
        u=heads(wu[..., dk:]),
        o_intra=heads(a_wu[..., dk:]),
        k_decayed_t=heads(jnp.swapaxes(k_decayed, -1, -2)),
        gamma=heads(decay_in[..., -1]),
    )


class GatedDeltaRule(AbstractChunkedRecurrence[GatedDeltaFactors, AffineMap]):
    """The gated delta rule as a chunked recurrence (one call's inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`, with `HV` a multiple of `H`.
    - `g`: log decays (`<= 0`), `(B, T, HV)`.
    - `beta`: delta-rule step sizes in `[0, 1]`, `(B, T, HV)`.
    - `scale`: query scale; defaults to `K ** -0.5`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` first.
    - `chunk_size`: tokens per chunk.
    """

    q: QKTensor
    k: QKTensor
    v: ValueTensor
    g: GateTensor
    beta: GateTensor
    scale: float = eqx.field(static=True)
    use_qk_l2norm: bool = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __init__(
        self,
        q: QKTensor,
        k: QKTensor,
        v: ValueTensor,
        g: GateTensor,
        beta: GateTensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        chunk_size: int = 64,
    ):
        check_inputs(q, k, v, g, beta)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"`chunk_size` must be a positive int; got {chunk_size!r}.")
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = chunk_size

    def state_shape(self) -> tuple[int, ...]:
        b, _, hv, dv = self.v.shape
        return (b, hv, self.q.shape[-1], dv)

    def state_dtype(self):
        return compute_dtype(self.q, self.k, self.v, self.g, self.beta)

    def prepare(self) -> GatedDeltaFactors:
        # Everything here is batched over all chunks at once, chunk axis first, so the scan
        # reads contiguous slices and only the products with the state remain sequential.
        # Products of keys with keys or queries are formed once per key head and broadcast
        # over its `r` value heads (no repeated keys are materialised).
        dt = self.state_dtype()
        c = self.chunk_size
        b, t, h, dk = self.q.shape
        hv, dv = self.v.shape[2], self.v.shape[3]
        r = hv // h
        q, k = self.q.astype(dt), self.k.astype(dt)
        q = to_chunk_major(q, c)  # (N, B, H, C, K)
        k = to_chunk_major(k, c)
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * jnp.asarray(self.scale, dt)
        v = to_chunk_major(self.v.astype(dt).reshape(b, t, h, r, dv), c)  # (N, B, H, r, C, V)
        g = to_chunk_major(self.g.astype(dt).reshape(b, t, h, r), c, features=0)  # (.., r, C)
        beta = to_chunk_major(self.beta.astype(dt).reshape(b, t, h, r), c, features=0)

        return _chunk_factors(q, k, v, g, beta, hv)

    def step(self, factors: GatedDeltaFactors, h: State) -> tuple[State, Array]:
        f = factors
        c = f.u.shape[-2]
        y = _einsum("bhck,bhkv->bhcv", f.wq, h)  # [w h; (q_g - attn w) h]
        v_new = f.u - y[..., :c, :]
        o = y[..., c:, :] + f.o_intra
        h_next = f.gamma[..., None, None] * h + _einsum("bhkc,bhcv->bhkv", f.k_decayed_t, v_new)
        return h_next, o

    def advance(self, factors: GatedDeltaFactors, h: State) -> State:
        f = factors
        v_new = f.u - _einsum("bhck,bhkv->bhcv", f.w, h)
        return f.gamma[..., None, None] * h + _einsum("bhkc,bhcv->bhkv", f.k_decayed_t, v_new)

    def identity_map(self) -> AffineMap:
        b, hv, dk, dv = self.state_shape()
        return AffineMap.identity(dk, dv, (b, hv), self.state_dtype())

    def chunk_map(self, factors: GatedDeltaFactors) -> AffineMap:
        f = factors
        dk = f.wq.shape[-1]
        eye = _lift(jnp.eye(dk, dtype=f.wq.dtype), f.wq.ndim)
        m = f.gamma[..., None, None] * eye - _einsum("bhkc,bhcj->bhkj", f.k_decayed_t, f.w)
        return AffineMap(m, _einsum("bhkc,bhcv->bhkv", f.k_decayed_t, f.u))

    def compose(self, factors: GatedDeltaFactors, running: AffineMap) -> AffineMap:
        # [M | U] <- gamma [M | U] + k~^T ([0 | u] - w [M | U]): 2 K (K + V) C multiply-adds
        # per chunk in two products, instead of a dense K^3 one.
        f = factors
        dk = running.M.shape[-1]
        mu = jnp.concatenate([running.M, running.U], axis=-1)
        rhs = jnp.concatenate([jnp.zeros_like(f.w), f.u], axis=-1)
        rhs = rhs - _einsum("bhck,bhkd->bhcd", f.w, mu)
        mu = f.gamma[..., None, None] * mu + _einsum("bhkc,bhcd->bhkd", f.k_decayed_t, rhs)
        return AffineMap(mu[..., :dk], mu[..., dk:])

    def finalize(self, outputs: Float[Array, "n b h c v"]) -> ValueTensor:
        return from_chunk_major(outputs, self.v.shape[1]).astype(self.v.dtype)


def chunk_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Int[Array, " docs_plus_one"] | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""The gated delta rule in chunked (WY) form: the training path.

    Any sequence length works (the last chunk is padded with identity steps). The state,
    decays, triangular solve and transition math run in float32 (float64 for float64
    inputs); the output has `v`'s dtype.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays $\log \alpha_t \le 0$, shape `(B, T, HV)`.
    - `beta`: step sizes in $[0, 1]$, shape `(B, T, HV)`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
    - `cu_seqlens`: packed documents (batch size 1): the document offsets
        `[0, len_0, len_0 + len_1, ..., T]`, shape `(N + 1,)` (the flash-linear-attention
        convention). The state resets at each document start, no chunk mixes two
        documents, and `initial_state` / the final state are per document, `(N, HV, K, V)`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `chunk_size`: tokens per chunk.

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final state
    `(B, HV, K, V)` in float32 if `output_final_state`, else `None`.
    """
    if cu_seqlens is not None:
        check_inputs(q, k, v, g, beta)
        return run_packed(
            _builder(scale, use_qk_l2norm, chunk_size),
            (q, k, v, g, beta),
            cu_seqlens,
            initial_state,
            chunk_size=chunk_size,
            output_final_state=output_final_state,
        )
    check_inputs(q, k, v, g, beta, initial_state)
    rec = GatedDeltaRule(
        q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
    )
    o, h = run_local(rec, initial_state)
    return o, (h if output_final_state else None)


def chunk_gated_delta_rule_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    *,
    axis_name: str,
    layout: ContiguousLayout = Contiguous(),
    strategy: str = "allgather",
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " docs_plus_one"] | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""The chunked gated delta rule with context parallelism, called inside `jax.shard_map`.

    The sequence axis (axis 1 of `q`, `k`, `v`, `g`, `beta`) is sharded over `axis_name`,
    rank `r` holding a contiguous slice; each argument here is this rank's slice. The
    cross-rank payload is one `(K, K)` + `(K, V)` map per batch element and value head
    (or less, depending on `strategy`): it does not grow with the sequence length.

    **Arguments:**

    - `q`, `k`, `v`, `g`, `beta`, `scale`, `use_qk_l2norm`, `chunk_size`: as in
        [`deltanet_cp.chunk_gated_delta_rule`][], for this rank's tokens. Any number of
        tokens per rank works.
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `layout`: [`deltanet_cp.Contiguous`][] (the default) is the only layout accepted; a
        [`deltanet_cp.Zigzag`][] is a type error for pyright and a `ValueError` at run time.
    - `strategy`: how ranks exchange their maps: `"allgather"`, `"ppermute"`, `"ring"` or
        `"auto"`; see [`deltanet_cp.payload_elements`][] and
        [`deltanet_cp.choose_strategy`][].
    - `initial_state`: the state before the first token of the whole sequence, replicated
        on every rank; zeros if `None`.
    - `output_final_state`: also return the state after the last token of the sequence.
    - `cu_seqlens`: packed documents: the *global* document offsets `(N + 1,)`, the same
        array on every rank (replicated); documents may cross rank boundaries.
        `initial_state` and the final state are then per document, `(N, HV, K, V)`.

    **Returns:**

    `(o, final_state)`: this rank's outputs `(B, T_local, HV, V)` in `v`'s dtype, and the
    global final state `(B, HV, K, V)` (the same on every rank) or `None`.
    """
    check_contiguous(layout, "chunk_gated_delta_rule_cp")
    if cu_seqlens is not None:
        check_inputs(q, k, v, g, beta)
        return run_packed(
            _builder(scale, use_qk_l2norm, chunk_size),
            (q, k, v, g, beta),
            cu_seqlens,
            initial_state,
            chunk_size=chunk_size,
            output_final_state=output_final_state,
            axis_name=axis_name,
            layout=layout,
            strategy=strategy,
        )
    check_inputs(q, k, v, g, beta, initial_state)
    rec = GatedDeltaRule(
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


def _builder(scale, use_qk_l2norm, chunk_size):
    def build(q, k, v, g, beta):
        return GatedDeltaRule(
            q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size
        )

    return build


def recurrent_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[ValueTensor, State | None]:
    r"""The gated delta rule token by token (a `lax.scan` over time): the decoding path.

    Takes the same arguments as [`deltanet_cp.chunk_gated_delta_rule`][] (without
    `chunk_size`) and returns the same `(o, final_state)`.
    """
    check_inputs(q, k, v, g, beta, initial_state)
    dt = compute_dtype(q, k, v, g, beta)
    b, _, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = q.astype(dt), k.astype(dt)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    r = hv // h
    qf = jnp.repeat(qf * jnp.asarray(scale, dt), r, axis=2)
    kf = jnp.repeat(kf, r, axis=2)
    h0 = jnp.zeros((b, hv, dk, dv), dt) if initial_state is None else initial_state.astype(dt)

    def body(state, xs):
        q_t, k_t, v_t, g_t, beta_t = xs
        state = jnp.exp(g_t)[..., None, None] * state
        predicted = _einsum("bhkv,bhk->bhv", state, k_t)
        delta = beta_t[..., None] * (v_t - predicted)
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, v.astype(dt), g.astype(dt), beta.astype(dt)))
    h_final, o = jax.lax.scan(body, h0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (h_final if output_final_state else None)


def chunk_gated_delta_rule_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    **kwargs,
) -> tuple[ValueTensor, State | None]:
    """[`deltanet_cp.chunk_gated_delta_rule_cp`][] on global arrays: does the `shard_map`.

    Shards the sequence axis of the inputs over `axis_name` of `mesh` (and optionally the
    batch axis over `batch_axis`), runs the context-parallel kernel and returns global
    arrays. Use it at the top level; inside your own `shard_map`, call
    `chunk_gated_delta_rule_cp` directly.

    **Arguments:**

    - `q`, `k`, `v`, `g`, `beta`: global arrays, as for
        [`deltanet_cp.chunk_gated_delta_rule`][]. The sequence length must be divisible by
        the size of `axis_name`.
    - `mesh`: a `jax.sharding.Mesh` with an axis named `axis_name`.
    - `axis_name`: the mesh axis to shard the sequence over.
    - `batch_axis`: optionally, a mesh axis to shard the batch over (data parallelism).
    - `**kwargs`: any keyword argument of `chunk_gated_delta_rule_cp` but `axis_name`;
        `initial_state` is replicated over `axis_name`.

    **Returns:**

    `(o, final_state)` as global arrays, as from `chunk_gated_delta_rule`.
    """
    P = jax.sharding.PartitionSpec
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}.")
    check_inputs(q, k, v, g, beta, kwargs.get("initial_state"))
    cp = mesh.shape[axis_name]
    t = q.shape[1]
    if t % cp:
        raise ValueError(
            f"The sequence length ({t}) must be divisible by the context-parallel size "
            f"(mesh axis {axis_name!r} has {cp} devices): pad the sequence to a multiple of "
            f"{cp} (for example with g = 0, beta = 0 and zero q, k, v, which leaves the state "
            "unchanged) or pick a cp that divides it."
        )
    initial_state = kwargs.pop("initial_state", None)
    seq = P(batch_axis, axis_name)
    state = P(batch_axis)
    args = [q, k, v, g, beta]
    specs = [seq] * 5
    if initial_state is not None:
        args.append(initial_state)
        specs.append(state)
    args = [jax.device_put(x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    need_state = kwargs.get("output_final_state", False)

    def per_rank(q, k, v, g, beta, h0=None):
        return chunk_gated_delta_rule_cp(
            q, k, v, g, beta, axis_name=axis_name, initial_state=h0, **kwargs
        )

    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=(seq, state if need_state else None),
    )
    return jax.jit(fn)(*args)
