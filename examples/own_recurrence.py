"""Add your own recurrence: retention (RetNet) on the engine, with context parallelism.

Retention is linear attention with a fixed decay `0 < gamma_h <= 1` per head:

    h <- gamma_h h + k_t v_t^T
    o_t = h^T (q_t / sqrt(K))

Three small classes make it a recurrence of the library: its inputs, its per-chunk factors,
and the recurrence itself (a static configuration). The engine pads with zeros, and a zero
token must be an identity step: a `mask` input, False on padding, keeps the fixed decay from
acting there. `deltanet_cp.run` then runs it on one device, over packed documents and
context-parallel with every exchange, and with keys that read the previous token (a token
shift, through `deltanet_cp.previous_tokens`). The file uses only the public API, builds its chunk
algebra from `deltanet_cp.chunkops`, and checks itself against an independent float64 token
loop, and against the engine's contract with `deltanet_cp.testing.check_recurrence`. Run it
with `python examples/own_recurrence.py`; `docs/guides/own_recurrence.md` walks through it.
"""

import os


if __name__ == "__main__":  # 4 simulated CPU devices; must be set before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float

import deltanet_cp as dcp
from deltanet_cp import chunkops
from deltanet_cp.testing import check_recurrence


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
    """A block of chunks' state-independent parts, chunk index first."""

    q: Float[Array, "n b h c k"]  # q_i e^(G_i) / sqrt(K): reads the incoming state
    o: Float[Array, "n b c h v"]  # the outputs' part written by the chunk's own tokens
    map: dcp.DiagonalAffineMap  # h -> e^(G_C) h + sum_j e^(G_C - G_j) k_j v_j^T


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
        # A block of chunks (B, N, C, ...), chunk-major: (N, B, H, C, K), (N, B, C) for the mask.
        q, k, v = (
            chunkops.chunk_major(x.astype(jnp.float32)) for x in (chunks.q, chunks.k, chunks.v)
        )
        m = chunkops.chunk_major(chunks.mask.astype(jnp.float32), features=0)[:, :, None]
        # The log decay of each token, log(gamma_h) on a real token, 0 on a skipped one.
        g = m * jnp.log(jnp.asarray(self.gammas, jnp.float32)).reshape(1, 1, -1, 1)
        q, k = q * q.shape[-1] ** -0.5, k * m[..., None]  # a skipped token writes nothing
        attn = chunkops.decayed_gram(q, k, g)  # sum_k q_ik k_jk e^(G_i - G_j), j <= i
        into, out = chunkops.cumulative_decays(g, per_channel=False)  # e^G_i, e^(G_C - G_i)
        U = chunkops.einsum("...ck,...cv->...kv", k * out, v)
        gamma = jnp.broadcast_to(into[..., -1, :], U.shape[:-1])  # e^(G_C) per key channel
        o = chunkops.einsum("...ij,...jv->...iv", attn, v)  # (N, B, H, C, V)
        o = jnp.swapaxes(o, 2, 3)  # in the outputs' layout (N, B, C, H, V)
        return RetentionFactors(q * into, o, dcp.DiagonalAffineMap(gamma, U))

    # --8<-- [end:prepare]

    # --8<-- [start:step]
    def step(self, factors: RetentionFactors, h: Array) -> tuple[Array, Array]:
        o = chunkops.einsum("bhck,bhkv->bchv", factors.q, h) + factors.o
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
    o, final = dcp.run(retention, inputs, initial_state=h0)
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
    po, ph = dcp.run(retention, packed, initial_state=doc_h0, cu_seqlens=cu)
    errors["packed o"] = rel_err(po, np.concatenate([o_ for o_, _ in docs], axis=1))
    errors["packed states"] = rel_err(ph, np.concatenate([h_ for _, h_ in docs]))

    # Context parallelism on global arrays (`mesh=`: dcp.run does the shard_map): the
    # sequence split over `cp` devices, against one device, for every exchange.
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    for exchange in (dcp.AllGather(), dcp.PPermute(), dcp.Ring()):
        parallel = dcp.ContextParallel("cp", exchange=exchange, mesh=mesh)
        o_cp, final_cp = dcp.run(retention, inputs, initial_state=h0, cp=parallel)
        errors[f"cp {type(exchange).__name__} o"] = rel_err(o_cp, o)
        errors[f"cp {type(exchange).__name__} state"] = rel_err(final_cp, final)

    # Inside your own shard_map, each rank on its slice of the time axis: the packed
    # documents, which cross rank borders (`cu_seqlens` is global, the same on every rank).
    seq = P(None, "cp")  # (B, T, ...): time sharded over "cp"

    def per_rank(inputs, doc_h0):
        return dcp.run(
            retention, inputs, initial_state=doc_h0, cu_seqlens=cu, cp=dcp.ContextParallel("cp")
        )

    sharded = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq, P()), out_specs=(seq, P()))
    on_mesh = jax.device_put(packed, NamedSharding(mesh, seq))  # each rank gets its slice
    po_cp, ph_cp = jax.jit(sharded)(on_mesh, jax.device_put(doc_h0, NamedSharding(mesh, P())))
    errors["cp packed o"] = rel_err(po_cp, po)
    errors["cp packed states"] = rel_err(ph_cp, ph)

    # Keys that read the previous token (a token shift, as in RWKV:
    # k'_t = k_t + mu (k_{t-1} - k_t), k_{-1} = 0 at each document's first token), in the
    # zigzag layout (2 cp pieces, so the first tz tokens): `dcp.previous_tokens` brings each
    # piece's predecessor from the rank that holds it and resets at the documents' starts.
    # Against the float64 loop per document, which shifts its own keys.
    mu, tz = 0.6, t - t % (2 * cp)
    zigzag = dcp.ContextParallel("cp", layout=dcp.Zigzag())
    cu_z = [0, tz // 7, tz // 2, tz // 2 + 1, tz]

    def shift(k, k_prev):
        return k + mu * (k_prev - k)

    def per_rank_shifted(inputs, doc_h0):
        k_prev = dcp.previous_tokens(inputs.k, cp=zigzag, cu_seqlens=cu_z)
        inputs = eqx.tree_at(lambda i: i.k, inputs, shift(inputs.k, k_prev))
        return dcp.run(retention, inputs, initial_state=doc_h0, cu_seqlens=cu_z, cp=zigzag)

    sharded = jax.shard_map(per_rank_shifted, mesh=mesh, in_specs=(seq, P()), out_specs=(seq, P()))
    in_zigzag = jax.tree.map(lambda x: zigzag.layout.to_layout(x[:, :tz], cp), packed)
    in_zigzag = jax.device_put(in_zigzag, NamedSharding(mesh, seq))
    so, sh = jax.jit(sharded)(in_zigzag, jax.device_put(doc_h0, NamedSharding(mesh, P())))
    so = zigzag.layout.from_layout(so, cp)  # back in sequence order
    docs = []
    for s, e, h0_ in zip(cu_z[:-1], cu_z[1:], doc_h0):
        k_doc = np.asarray(k[:1, s:e], np.float64)
        k_prev = np.concatenate([np.zeros_like(k_doc[:, :1]), k_doc[:, :-1]], axis=1)
        k_doc = shift(k_doc, k_prev)
        docs.append(
            retention_loop(q[:1, s:e], k_doc, v[:1, s:e], packed.mask[:, s:e], gammas, h0_[None])
        )
    errors["token shift o"] = rel_err(so, np.concatenate([o_ for o_, _ in docs], axis=1))
    errors["token shift states"] = rel_err(sh, np.concatenate([h_ for _, h_ in docs]))

    for what, err in errors.items():
        print(f"{what:>18}: rel. err {err:.1e}")
    return errors


# --8<-- [end:check]


# --8<-- [start:contract]
def check_contract(cp=(4,)):
    """The engine's contract, law by law (`deltanet_cp.testing`): shapes, a zero token is the
    identity, `step` affine in `h`, `chunk_map` and `compose` against `step`, chunked against
    `chunk_size=1`, gradients, and context parallelism on `cp` devices (both layouts)."""
    rng = np.random.default_rng(1)
    b, t, h, dk, dv = 1, 20, 2, 8, 4  # small: 3 chunks of 8, the last one partial
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for d in (dk, dk, dv))
    inputs = RetentionInputs(q, k, v, jnp.asarray(rng.random((b, t)) > 0.1))
    retention = Retention(gammas=[0.5, 1.0], chunk_size=8)
    return check_recurrence(retention, inputs, cp=cp)  # raises on the first broken law


# --8<-- [end:contract]


if __name__ == "__main__":
    assert max(main().values()) <= 1e-5
    for what, err in check_contract().items():
        print(f"{what:>18}: rel. err {err:.1e}")
