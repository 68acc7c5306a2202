"""Add your own recurrence: retention (RetNet) on the engine, with context parallelism.

Retention is linear attention with a fixed decay `0 < gamma_h <= 1` per head:

    h <- gamma_h h + k_t v_t^T
    o_t = h^T (q_t / sqrt(K))

Three small classes make it a recurrence of the library: its inputs, its per-chunk factors,
and the recurrence itself (a static configuration). The engine pads with zeros, and a zero
token must be an identity step: a `mask` input, False on padding, keeps the fixed decay from
acting there. `deltanet_cp.run` then runs it on one device, over packed documents and
context-parallel with every exchange. The file uses only
the public API and checks itself against an independent float64 token loop. Run it with
`python examples/own_recurrence.py`; `docs/guides/own_recurrence.md` walks through it.
"""

import os


if __name__ == "__main__":  # 4 simulated CPU devices; must be set before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=4 --xla_cpu_experimental_ynn_fusion_type="
    )

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

import deltanet_cp as dcp


HI = jax.lax.Precision.HIGHEST  # float32 products stay float32 on every backend


# --8<-- [start:inputs]
class RetentionInputs(eqx.Module):
    """Time on axis 1. `mask` is False on a skipped token, and so on the engine's padding."""

    q: Float[Array, "b t h k"]
    k: Float[Array, "b t h k"]
    v: Float[Array, "b t h v"]
    mask: Bool[Array, "b t"]


# --8<-- [end:inputs]


# --8<-- [start:factors]
class RetentionFactors(eqx.Module):
    """All chunks' state-independent parts; `n_i`: a chunk's real tokens up to token `i`."""

    q: Float[Array, "n b h c k"]  # q_i gamma^n_i / sqrt(K): reads the incoming state
    o: Float[Array, "n b c h v"]  # the outputs' part written by the chunk's own tokens
    map: dcp.DiagonalAffineMap  # h -> gamma^n_C h + sum_j gamma^(n_C - n_j) k_j v_j^T


# --8<-- [end:factors]


# --8<-- [start:class]
class Retention(dcp.AbstractRecurrence[RetentionInputs, RetentionFactors, dcp.DiagonalAffineMap]):
    """Retention: head h's state decays by `gammas[h]` a token (RetNet: `1 - 2 ** (-5 - h)`)."""

    gammas: tuple[float, ...] = eqx.field(static=True, converter=tuple)
    chunk_size: int = eqx.field(default=64, static=True)

    def __check_init__(self):
        if not all(0 < g <= 1 for g in self.gammas):
            raise ValueError(f"Every decay must lie in (0, 1]; got gammas={self.gammas}.")

    def check(self, inputs: RetentionInputs) -> None:
        q, k, v = inputs.q, inputs.k, inputs.v
        if k.shape != q.shape or v.shape[:3] != q.shape[:3] or q.shape[2] != len(self.gammas):
            raise ValueError(
                f"Need q, k (B, T, H, K), v (B, T, H, V) and H = len(gammas); got q {q.shape}, "
                f"k {k.shape}, v {v.shape} and {len(self.gammas)} gammas."
            )

    def state(self, inputs: RetentionInputs) -> jax.ShapeDtypeStruct:
        (b, _, h, dk), dv = inputs.q.shape, inputs.v.shape[-1]
        return jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)

    # --8<-- [end:class]

    # --8<-- [start:prepare]
    def prepare(self, chunks: RetentionInputs) -> RetentionFactors:
        def heads_first(x):  # (B, N, C, H, D) -> (N, B, H, C, D)
            return jnp.moveaxis(x, (1, 3), (0, 2)).astype(jnp.float32)

        m = jnp.moveaxis(chunks.mask, 1, 0)[:, :, None].astype(jnp.float32)  # (N, B, 1, C)
        n = jnp.cumsum(m, axis=-1)  # real tokens so far: exact small integers
        a = jnp.log(jnp.asarray(self.gammas, jnp.float32)).reshape(1, 1, -1, 1)  # (1, 1, H, 1)
        q = heads_first(chunks.q) * chunks.q.shape[-1] ** -0.5
        k, v = heads_first(chunks.k) * m[..., None], heads_first(chunks.v)  # skipped: k = 0
        # Every exponent is a <= 0 times a count; the upper triangle is clipped, then dropped.
        decay = jnp.exp(jnp.minimum(a[..., None] * (n[..., :, None] - n[..., None, :]), 0.0))
        attn = jnp.tril(jnp.einsum("...ik,...jk->...ij", q, k, precision=HI) * decay)
        k = k * jnp.exp(a * (n[..., -1:] - n))[..., None]
        U = jnp.einsum("...ck,...cv->...kv", k, v, precision=HI)
        gamma = jnp.broadcast_to(jnp.exp(a * n[..., -1:]), U.shape[:-1])
        o = jnp.einsum("...ij,...jv->...iv", attn, v, precision=HI)  # (N, B, H, C, V)
        o = jnp.swapaxes(o, 2, 3)  # in the outputs' layout (N, B, C, H, V)
        return RetentionFactors(q * jnp.exp(a * n)[..., None], o, dcp.DiagonalAffineMap(gamma, U))

    # --8<-- [end:prepare]

    # --8<-- [start:step]
    def step(self, factors: RetentionFactors, h: Array) -> tuple[Array, Array]:
        o = jnp.einsum("bhck,bhkv->bchv", factors.q, h, precision=HI) + factors.o
        return factors.map(h), o  # outputs (B, C, H, V): batch, then the chunk's positions

    def chunk_map(self, factors: RetentionFactors) -> dcp.DiagonalAffineMap:
        return factors.map  # diagonal: the default `compose` (`then`) is already cheap

    # --8<-- [end:step]

    # --8<-- [start:finalize]
    def finalize(self, outputs: Float[Array, "b t h v"], inputs: RetentionInputs) -> Array:
        return outputs.astype(inputs.v.dtype)


# --8<-- [end:finalize]


# --8<-- [start:check]
def retention_loop(q, k, v, mask, gammas, h):
    """Retention token by token in float64 numpy, from the state `h`: `(o, final state)`."""
    q, k, v, h = (np.asarray(x, np.float64) for x in (q, k, v, h))
    gamma = np.asarray(gammas, np.float64)[:, None, None]
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        stepped = gamma * h + np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        h = np.where(np.asarray(mask)[:, t, None, None, None], stepped, h)
        o[:, t] = np.einsum("bhkv,bhk->bhv", h, q[:, t] * q.shape[-1] ** -0.5)
    return o, h


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def main(b=2, t=100, h=3, dk=16, dv=8, chunk_size=16, cp=4):
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    q, k = normal(b, t, h, dk), normal(b, t, h, dk)
    v, h0 = normal(b, t, h, dv), normal(b, h, dk, dv)
    mask = jnp.asarray(rng.random((b, t)) > 0.1)  # a few skipped tokens
    gammas = np.linspace(0.5, 1.0, h).tolist()  # a strong decay ... none
    retention = Retention(gammas=gammas, chunk_size=chunk_size)
    inputs = RetentionInputs(q, k, v, mask)
    errors = {}

    # One device, against the float64 loop (t is not a multiple of the chunk size).
    o, final = dcp.run(retention, inputs, initial_state=h0, output_final_state=True)
    loop_o, loop_h = retention_loop(q, k, v, mask, gammas, h0)
    errors["chunked o"] = rel_err(o, loop_o)
    errors["chunked state"] = rel_err(final, loop_h)

    # Packed documents (batch 1): the state restarts at each document, from that document's
    # initial state; against one loop per document. Documents cross chunk and rank borders.
    cu = [0, t // 7, t // 2, t // 2 + 1, t]
    packed = RetentionInputs(q[:1], k[:1], v[:1], jnp.ones((1, t), bool))
    doc_h0 = normal(len(cu) - 1, h, dk, dv)
    docs = [
        retention_loop(q[:1, s:e], k[:1, s:e], v[:1, s:e], packed.mask[:, s:e], gammas, h0_[None])
        for s, e, h0_ in zip(cu[:-1], cu[1:], doc_h0)
    ]
    po, ph = dcp.run(
        retention, packed, initial_state=doc_h0, output_final_state=True, cu_seqlens=cu
    )
    errors["packed o"] = rel_err(po, np.concatenate([o_ for o_, _ in docs], axis=1))
    errors["packed states"] = rel_err(ph, np.concatenate([h_ for _, h_ in docs]))

    # Context parallelism: the sequence split over `cp` devices, against one device, for
    # every exchange; then the packed documents, which cross rank borders.
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    for exchange in (dcp.AllGather(), dcp.PPermute(), dcp.Ring()):
        o_cp, final_cp = dcp.run_sharded(
            retention,
            inputs,
            initial_state=h0,
            output_final_state=True,
            mesh=mesh,
            axis_name="cp",
            exchange=exchange,
        )
        errors[f"cp {type(exchange).__name__} o"] = rel_err(o_cp, o)
        errors[f"cp {type(exchange).__name__} state"] = rel_err(final_cp, final)
    po_cp, ph_cp = dcp.run_sharded(
        retention,
        packed,
        initial_state=doc_h0,
        output_final_state=True,
        cu_seqlens=cu,
        mesh=mesh,
        axis_name="cp",
    )
    errors["cp packed o"] = rel_err(po_cp, po)
    errors["cp packed states"] = rel_err(ph_cp, ph)

    for what, err in errors.items():
        print(f"{what:>18}: rel. err {err:.1e}")
    return errors


# --8<-- [end:check]


if __name__ == "__main__":
    assert max(main().values()) <= 1e-5
