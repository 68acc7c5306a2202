"""Add your own recurrence: retention (RetNet), written in one class against the engine.

Retention is linear attention with a fixed decay per head, `gamma_h = exp(a_h)`:

    h <- gamma h + k_t v_t^T
    o_t = h^T q_t

It is a special case of `deltanet_cp.chunk_gla` (per-head `g` constant in time); it is here
because it is the smallest recurrence that exercises every piece of the interface. The file
uses only the public API and checks itself: chunked vs a token loop, and context
parallelism on 4 (simulated) devices vs one device. Run it with
`python examples/own_recurrence.py`; `docs/guides/own_recurrence.md` walks through it.
"""

import os


if __name__ == "__main__":  # 4 simulated CPU devices; must be set before jax is imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

import deltanet_cp as dcp


# 1. The per-chunk factors: everything that does not depend on the incoming state.
# --8<-- [start:factors]
class RetentionFactors(eqx.Module):
    """Leading axes `(n_chunks, batch, heads)`, then the chunk axis `c`."""

    q_decayed: Float[Array, "n b h c k"]  # q_i gamma^(i+1): reads the incoming state
    k_decayed: Float[Array, "n b h c k"]  # k_j gamma^(end-1-j): writes the outgoing state
    v: Float[Array, "n b h c v"]
    attn: Float[Array, "n b h c c"]  # (q_i . k_j) gamma^(i-j) for i >= j, else 0
    gamma: Float[Array, "n b h k"]  # gamma^end on every key channel: the chunk's decay


# --8<-- [end:factors]


# 2. The recurrence: one final class holding one call's inputs.
# --8<-- [start:class]
class Retention(dcp.AbstractChunkedRecurrence[RetentionFactors, dcp.DiagonalAffineMap]):
    """Retention as a chunked recurrence.

    **Arguments:**

    - `q`, `k`: `(B, T, H, K)`; `v`: `(B, T, H, V)`.
    - `log_decay`: `a_h <= 0` per head, `(H,)`.
    - `chunk_size`: tokens per chunk.
    """

    q: Float[Array, "b t h k"]
    k: Float[Array, "b t h k"]
    v: Float[Array, "b t h v"]
    log_decay: Float[Array, " h"]
    chunk_size: int = eqx.field(static=True)

    def __init__(self, q, k, v, log_decay, *, chunk_size: int = 64):
        if q.shape != k.shape or q.shape[:3] != v.shape[:3] or log_decay.shape != q.shape[2:3]:
            raise ValueError(
                "Retention needs q, k: (B, T, H, K), v: (B, T, H, V) and log_decay: (H,); "
                f"got {q.shape}, {k.shape}, {v.shape} and {log_decay.shape}."
            )
        self.q, self.k, self.v, self.log_decay = q, k, v, log_decay
        self.chunk_size = chunk_size

    def state_shape(self):
        b, _, h, dk = self.q.shape
        return (b, h, dk, self.v.shape[-1])

    def state_dtype(self):
        return jnp.float32

    # --8<-- [end:class]

    # --8<-- [start:prepare]
    def prepare(self) -> RetentionFactors:
        b, t, h, dk = self.q.shape
        c = self.chunk_size
        n = -(-t // c)

        def chunks(x):  # (B, T, H, D) -> (N, B, H, C, D), zero-padded to whole chunks
            x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, n * c - t), (0, 0), (0, 0)])
            return x.reshape(b, n, c, h, -1).transpose(1, 0, 3, 2, 4)

        q = chunks(self.q * dk**-0.5)
        k, v = chunks(self.k), chunks(self.v)
        a = self.log_decay.astype(jnp.float32).reshape(1, 1, h, 1)  # (1, 1, H, 1)
        i = jnp.arange(c, dtype=jnp.float32).reshape(1, 1, 1, c)
        # The padding must be the identity: a padded token must not decay the state, so a
        # chunk ends after its real tokens (the last chunk of a shard may be partial).
        end = jnp.clip(t - c * jnp.arange(n), 0, c).astype(jnp.float32).reshape(n, 1, 1, 1)
        # Exponents are multiples of a <= 0 formed directly: exact, and never positive.
        q_decayed = q * jnp.exp(a * (i + 1))[..., None]
        k_decayed = k * jnp.exp(a * jnp.maximum(end - 1 - i, 0.0))[..., None]
        lag = (i.reshape(c, 1) - i.reshape(1, c)).reshape(1, 1, 1, c, c)  # i - j
        decay = jnp.where(lag >= 0, jnp.exp(a[..., None] * jnp.maximum(lag, 0.0)), 0.0)
        attn = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * decay
        gamma = jnp.broadcast_to(jnp.exp(a * end), (n, b, h, dk))
        return RetentionFactors(q_decayed, k_decayed, v, attn, gamma)

    # --8<-- [end:prepare]

    # --8<-- [start:step]
    # 3. One chunk, with and without outputs. `h` is the state entering the chunk.
    def step(self, factors, h):
        f = factors
        o = jnp.einsum("bhck,bhkv->bhcv", f.q_decayed, h) + f.attn @ f.v
        return self.advance(f, h), o

    def advance(self, factors, h):
        f = factors
        return f.gamma[..., None] * h + jnp.einsum("bhck,bhcv->bhkv", f.k_decayed, f.v)

    # --8<-- [end:step]

    # --8<-- [start:maps]
    # 4. The chunk as an affine map h -> diag(gamma) h + U, for context parallelism.
    def identity_map(self):
        b, h, dk, dv = self.state_shape()
        return dcp.DiagonalAffineMap.identity(dk, dv, (b, h))

    def chunk_map(self, factors):
        f = factors
        return dcp.DiagonalAffineMap(f.gamma, jnp.einsum("bhck,bhcv->bhkv", f.k_decayed, f.v))

    def compose(self, factors, running):
        # running.then(chunk_map(factors)), without building the chunk's map first.
        return dcp.DiagonalAffineMap(
            factors.gamma * running.decay, self.advance(factors, running.U)
        )

    # --8<-- [end:maps]

    # --8<-- [start:finalize]
    # 5. Stacked per-chunk outputs (N, B, H, C, V) -> (B, T, H, V).
    def finalize(self, outputs):
        n, b, h, c, dv = outputs.shape
        o = outputs.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, dv)
        return o[:, : self.q.shape[1]].astype(self.v.dtype)


# --8<-- [end:finalize]


# --8<-- [start:functions]
# 6. The public functions: the engine does the passes.
def chunk_retention(q, k, v, log_decay, *, initial_state=None, chunk_size=64):
    """Chunked retention on one device: returns `(o, final_state)`."""
    return dcp.run_local(Retention(q, k, v, log_decay, chunk_size=chunk_size), initial_state)


def chunk_retention_cp(q, k, v, log_decay, *, axis_name, strategy="allgather", chunk_size=64):
    """Chunked retention inside `jax.shard_map`, the sequence sharded over `axis_name`."""
    rec = Retention(q, k, v, log_decay, chunk_size=chunk_size)
    return dcp.run_context_parallel(
        rec,
        None,
        axis_name=axis_name,
        layout=dcp.Contiguous(),
        strategy=strategy,
        output_final_state=True,
    )


# --8<-- [end:functions]


# --8<-- [start:check]
# 7. The test: against an independent token loop, and context parallel against one device.
def retention_loop(q, k, v, log_decay):
    """Retention token by token in float64 numpy."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, dk = q.shape
    gamma = np.exp(np.asarray(log_decay, np.float64))[None, :, None, None]
    state = np.zeros((b, h, dk, v.shape[-1]))
    o = np.zeros(v.shape)
    for i in range(t):
        state = gamma * state + np.einsum("bhk,bhv->bhkv", k[:, i], v[:, i])
        o[:, i] = np.einsum("bhkv,bhk->bhv", state, q[:, i] * dk**-0.5)
    return o, state


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def main(b=2, t=100, h=2, dk=16, dv=8, chunk_size=16, cp=4):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(b, t, h, d)).astype(np.float32) for d in (dk, dk, dv))
    log_decay = np.log(np.array([0.9, 0.99], np.float32)[:h])
    expected_o, expected_h = retention_loop(q, k, v, log_decay)

    o, final = jax.jit(lambda *a: chunk_retention(*a, chunk_size=chunk_size))(q, k, v, log_decay)
    errors = {"chunked o": rel_err(o, expected_o), "chunked state": rel_err(final, expected_h)}

    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P(None, "cp")

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=(seq, P()))
    def sharded(q, k, v, log_decay):
        return chunk_retention_cp(q, k, v, log_decay, axis_name="cp", chunk_size=chunk_size)

    placed = [jax.device_put(x, NamedSharding(mesh, seq)) for x in (q, k, v)]
    o_cp, final_cp = sharded(*placed, jax.device_put(log_decay, NamedSharding(mesh, P())))
    errors["cp o"] = rel_err(o_cp, expected_o)
    errors["cp state"] = rel_err(final_cp, expected_h)
    for name, err in errors.items():
        print(f"{name:>14}: rel. err {err:.1e}")
    return errors


# --8<-- [end:check]


if __name__ == "__main__":
    assert max(main().values()) <= 1e-5
