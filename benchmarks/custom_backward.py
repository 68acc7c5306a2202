"""What a recurrence of your own costs in the backward, and which lever helps.

The extension guide's example, retention (`examples/own_recurrence.py`), is gated linear
attention with a fixed decay per head, so the library's `chunk_gla` with a per-head gate
`log(gamma_h)` computes the same thing. Their training steps (a loss of the outputs, its
gradients w.r.t. q, k and v) run in one process, interleaved A/B/A/B; the table gives the
medians and the paired median ratio, the matmul FLOPs of each compiled step (loops x trips)
and its temporaries per token (`memory_analysis`). The variants:

- `gla`: the library's `chunk_gla`, per-head gate.
- `retention`: the example as written (its factors hold the chunk's map, `U = K~^T V`
  formed in `prepare`; the engine's default `factor_cotangents`, `step`'s VJP mapped over
  the chunks).
- `retention + factor_cotangents`: the same with the cotangents written out as batched
  products (the override the guide describes).
- `retention, one block`: `block_size` = the whole sequence (`prepare` runs once over all
  chunks instead of once per block of 512 tokens, forward and backward).
- `retention, dense map`: the example with its chunk map a dense `AffineMap` (`M` a
  `K x K` diagonal matrix) instead of a `DiagonalAffineMap`: every step a `K x K x V`
  product instead of a scaling.
- `retention, lean factors`: `prepare` keeps `K~` and `V` and `chunk_map` forms `U` (what
  `chunk_gla` does), so the forward's factors and the backward's cotangents hold `C (K + V)`
  numbers per chunk and head instead of `K V`.

    python benchmarks/custom_backward.py                 # T = 4096, H = 4, K = V = 64
    python benchmarks/custom_backward.py --t 2048 --rounds 5
"""

import argparse
import importlib.util
import os
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine_line, paired_ratio, paired_times, print_table  # noqa: E402
from _seqdepth import matmul_flops  # noqa: E402
from jaxtyping import Array, Float  # noqa: E402

import deltanet_cp as dcp  # noqa: E402
from deltanet_cp import chunkops  # noqa: E402


def _example():
    path = os.path.join(os.path.dirname(HERE), "examples", "own_recurrence.py")
    spec = importlib.util.spec_from_file_location("own_recurrence", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = _example()


class HandWritten(ex.Retention):
    """The example with `step`'s VJP in its factors written out as batched products."""

    def factor_cotangents(self, factors, states, d_next, d_outputs):
        # step: o = q h + o_intra, h' = decay * h + U (decay per key row). So
        # d q = d_o h^T, d o_intra = d_o, d decay = rows of d_next . h, d U = d_next.
        d_q = jnp.einsum("nbchv,nbhkv->nbhck", d_outputs, states)
        d_map = dcp.DiagonalAffineMap(jnp.sum(d_next * states, axis=-1), d_next)
        return ex.RetentionFactors(d_q, d_outputs, d_map)


class DenseFactors(eqx.Module):
    q: Float[Array, "n b h c k"]
    o: Float[Array, "n b c h v"]
    map: dcp.AffineMap


class DenseMap(ex.Retention):
    """The example with a dense chunk map: what a diagonal recurrence costs written as dense."""

    def prepare(self, chunks):  # pyright: ignore[reportIncompatibleMethodOverride]
        f = super().prepare(chunks)
        eye = jnp.eye(f.map.decay.shape[-1], dtype=f.map.decay.dtype)
        return DenseFactors(f.q, f.o, dcp.AffineMap(f.map.decay[..., :, None] * eye, f.map.U))


class LeanFactors(eqx.Module):
    q: Float[Array, "n b h c k"]  # q e^G / sqrt(K)
    o: Float[Array, "n b c h v"]  # the chunk's own part of the outputs
    k: Float[Array, "n b h c k"]  # k e^(G_C - G)
    v: Float[Array, "n b h c v"]
    decay: Float[Array, "n b h k"]  # e^(G_C) per key row


class Lean(ex.Retention):
    """The example keeping `K~` and `V` (`C (K + V)` per chunk and head) instead of `U`
    (`K V`): `chunk_map` forms `U`, as the library's `chunk_gla` does."""

    def prepare(self, chunks):  # pyright: ignore[reportIncompatibleMethodOverride]
        q, k, v = (
            chunkops.chunk_major(x.astype(jnp.float32)) for x in (chunks.q, chunks.k, chunks.v)
        )
        m = chunkops.chunk_major(chunks.mask.astype(jnp.float32), features=0)[:, :, None]
        g = m * jnp.log(jnp.asarray(self.gammas, jnp.float32)).reshape(1, 1, -1, 1)
        q, k = q * q.shape[-1] ** -0.5, k * m[..., None]
        attn = chunkops.decayed_gram(q, k, g)
        into, out = chunkops.cumulative_decays(g, per_channel=False)
        o = jnp.swapaxes(chunkops.einsum("...ij,...jv->...iv", attn, v), 2, 3)
        decay = jnp.broadcast_to(into[..., -1, :], (*k.shape[:3], k.shape[-1]))
        return LeanFactors(q * into, o, k * out, v, decay)

    def chunk_map(self, factors):  # pyright: ignore[reportIncompatibleMethodOverride]
        return dcp.DiagonalAffineMap(
            factors.decay, jnp.einsum("bhck,bhcv->bhkv", factors.k, factors.v)
        )

    def step(self, factors, h):  # pyright: ignore[reportIncompatibleMethodOverride]
        o = jnp.einsum("bhck,bhkv->bchv", factors.q, h) + factors.o
        return self.chunk_map(factors)(h), o

    def factor_cotangents(self, factors, states, d_next, d_outputs):  # pyright: ignore
        return LeanFactors(
            jnp.einsum("nbchv,nbhkv->nbhck", d_outputs, states),
            d_outputs,
            jnp.einsum("nbhkv,nbhcv->nbhck", d_next, factors.v),
            jnp.einsum("nbhck,nbhkv->nbhcv", factors.k, d_next),
            jnp.sum(d_next * states, axis=-1),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--d", type=int, default=64, help="K = V")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.t, args.h, args.d, args.chunk, args.rounds = 128, 2, 16, 16, 1
    b, t, h, d = 1, args.t, args.h, args.d
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(3))
    k = k / jnp.sqrt(d)
    gammas = np.linspace(0.9, 0.999, h).tolist()
    g = jnp.broadcast_to(jnp.log(jnp.asarray(gammas, jnp.float32)), (b, t, h))
    mask = jnp.ones((b, t), bool)
    w = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)

    def retention_step(rec, block_size=None):
        def loss(q, k, v):
            o, _ = dcp.run(rec, ex.RetentionInputs(q, k, v, mask), block_size=block_size)
            return jnp.sum(o * w)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def gla_loss(q, k, v):
        o, _ = dcp.chunk_gla(q, k, v, g, chunk_size=args.chunk)
        return jnp.sum(o * w)

    steps = {
        "gla": jax.jit(jax.grad(gla_loss, argnums=(0, 1, 2))),
        "retention": retention_step(ex.Retention(gammas=gammas, chunk_size=args.chunk)),
        "retention + factor_cotangents": retention_step(
            HandWritten(gammas=gammas, chunk_size=args.chunk)
        ),
        "retention, one block": retention_step(
            ex.Retention(gammas=gammas, chunk_size=args.chunk), block_size=t
        ),
        "retention, dense map": retention_step(DenseMap(gammas=gammas, chunk_size=args.chunk)),
        "retention, lean factors": retention_step(Lean(gammas=gammas, chunk_size=args.chunk)),
    }
    print(machine_line())
    print(f"B={b} T={t} H={h} K=V={d} chunk={args.chunk}, float32, {args.rounds} rounds")
    info, reference = {}, None
    for name, step in steps.items():
        start = time.perf_counter()
        compiled = step.lower(q, k, v).compile()
        grads = compiled(q, k, v)
        jax.block_until_ready(grads)
        if reference is None:
            reference = grads
        err = max(
            float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r))) for a, r in zip(grads, reference)
        )
        memory = compiled.memory_analysis()
        info[name] = dict(
            compiled=compiled,
            gflop=matmul_flops(compiled) / 1e9,
            temp=memory.temp_size_in_bytes / t / 1024 if memory is not None else float("nan"),
            err=err,
            compile_s=time.perf_counter() - start,
        )

    def call(c):
        return lambda: jax.block_until_ready(c(q, k, v))

    times = paired_times({n: call(i["compiled"]) for n, i in info.items()}, args.rounds)
    rows = []
    for name, i in info.items():
        rows.append(
            [
                name,
                f"{1e3 * float(np.median(times[name])):.1f}",
                f"{paired_ratio(times[name], times['gla']):.2f}",
                f"{i['gflop']:.2f}",
                f"{i['temp']:.1f}",
                f"{i['err']:.1e}",
            ]
        )
    print_table(
        [
            "fwd+bwd",
            "ms (median)",
            "vs gla (paired)",
            "matmul GFLOP",
            "temp KiB/token",
            "grads vs gla",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
