"""The delta rule (DeltaNet): the gated delta rule without a decay.

One token, per value head:

    h <- h + k_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (I - k^T w) h + k^T u`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

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


def check_delta_inputs(q, k, v, beta, initial_state=None) -> None:
    """Raise a `ValueError` naming the problem if the delta-rule inputs don't fit together."""
    sizes = check_arrays(
        {
            "q": (q, ("batch", "seq", "heads", "K")),
            "k": (k, ("batch", "seq", "heads", "K")),
            "v": (v, ("batch", "seq", "value_heads", "V")),
            "beta": (beta, ("batch", "seq", "value_heads")),
            "initial_state": (initial_state, ("batch", "value_heads", "K", "V")),
        }
    )
    check_grouped_heads(sizes["heads"], sizes["value_heads"])


class DeltaRule(AbstractChunkedRecurrence[DeltaFactors, AffineMap]):
    """The delta rule (DeltaNet) as a chunked recurrence (one call's inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, `(B, T, H, K)`.
    - `v`: values, `(B, T, HV, V)`, with `HV` a multiple of `H`.
    - `beta`: delta-rule step sizes in `[0, 1]`, `(B, T, HV)`.
    - `scale`: query scale; defaults to `K ** -0.5`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` first.
    - `chunk_size`: tokens per chunk.
    """

    q: QKTensor
    k: QKTensor
    v: ValueTensor
    beta: GateTensor
    scale: float = eqx.field(static=True)
    use_qk_l2norm: bool = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __init__(
        self,
        q: QKTensor,
        k: QKTensor,
        v: ValueTensor,
        beta: GateTensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        chunk_size: int = 64,
    ):
        check_delta_inputs(q, k, v, beta)
        check_chunk_size(chunk_size)
        self.q, self.k, self.v, self.beta = q, k, v, beta
        self.scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = chunk_size

    def state_shape(self) -> tuple[int, ...]:
        b, _, hv, dv = self.v.shape
        return (b, hv, self.q.shape[-1], dv)

    def state_dtype(self):
        return compute_dtype(self.q, self.k, self.v, self.beta)

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
            None,
        )

    def step(self, factors: DeltaFactors, h: State) -> tuple[State, jax.Array]:
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

    def finalize(self, outputs: jax.Array) -> ValueTensor:
        o = from_chunks(jnp.moveaxis(outputs, 0, 2), self.v.shape[1])  # (B, HV, T, V)
        return jnp.moveaxis(o, 1, 2).astype(self.v.dtype)


def chunk_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[ValueTensor, State | None]:
    r"""The delta rule (DeltaNet) in chunked (WY) form: the training path.

    $h \leftarrow h + k_t (\beta_t (v_t - h^\top k_t))^\top$, $o_t = h^\top (s\, q_t)$.
    Any sequence length works. The math runs in float32 (float64 for float64 inputs); the
    output has `v`'s dtype.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `beta`: step sizes in $[0, 1]$, shape `(B, T, HV)`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `chunk_size`: tokens per chunk.

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final state
    `(B, HV, K, V)` in float32 if `output_final_state`, else `None`.
    """
    check_delta_inputs(q, k, v, beta, initial_state)
    rec = DeltaRule(q, k, v, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    o, h = run_local(rec, initial_state)
    return o, (h if output_final_state else None)


def chunk_delta_rule_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor,
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
    r"""The chunked delta rule with context parallelism, called inside `jax.shard_map`.

    The sequence axis (axis 1 of `q`, `k`, `v`, `beta`) is sharded over `axis_name`, rank
    `r` holding a contiguous slice; each argument here is this rank's slice. Ranks exchange
    one `(K, K)` + `(K, V)` map per batch element and value head (or less, depending on
    `strategy`).

    **Arguments:**

    - `q`, `k`, `v`, `beta`, `scale`, `use_qk_l2norm`, `chunk_size`: as in
        [`deltanet_cp.chunk_delta_rule`][], for this rank's tokens.
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
    check_contiguous(layout, "chunk_delta_rule_cp")
    check_delta_inputs(q, k, v, beta, initial_state)
    rec = DeltaRule(q, k, v, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    return run_context_parallel(
        rec,
        initial_state,
        axis_name=axis_name,
        layout=layout,
        strategy=strategy,
        output_final_state=output_final_state,
    )


def recurrent_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[ValueTensor, State | None]:
    r"""The delta rule token by token (a `lax.scan` over time): the decoding path.

    Takes the same arguments as [`deltanet_cp.chunk_delta_rule`][] (without `chunk_size`)
    and returns the same `(o, final_state)`.
    """
    check_delta_inputs(q, k, v, beta, initial_state)
    dt = compute_dtype(q, k, v, beta)
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
        q_t, k_t, v_t, beta_t = xs
        delta = beta_t[..., None] * (v_t - _einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, v.astype(dt), beta.astype(dt)))
    h_final, o = jax.lax.scan(body, h0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (h_final if output_final_state else None)
