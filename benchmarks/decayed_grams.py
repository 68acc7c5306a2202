"""The decayed Grams of a decay per key channel (KDA, GDN-2, DPLR, GLA): two exact designs.

`sum_c x_ic y_jc exp(G_ic - G_jc)` for every pair of rows of a chunk, exact to float32
rounding for any gates (every exponent a direct sum of gates of one sign, every factor at
most 1). At KDA's shape in our training step: 1,024 chunk-heads (T = 2048, 32 value heads,
chunk 64), left rows `[beta k; q]` (P = 2), right rows `k` (Q = 1), K = 128, float32. The
variants, interleaved in one process (A/B/A/B), forward and forward+backward (the gradient
of a fixed weighting of the output):

- `plain Gram (no decay)`: the same products without the decays, what an exact design
  cannot beat;
- `recursive halving (ours)`: `deltanet_cp.chunkops.decayed_grams`. The chunk halved
  recursively: a pair on either side of a midpoint factors exactly into two decays of at
  most 1, one batched product per level ($\\log_2 C$ levels), its VJP hand-written;
- `sub-chunks of S, reference point`: flash-linear-attention's layout. Rows split into
  sub-chunks of S; a pair in different sub-chunks factors through the first token of the
  row's sub-chunk (the row's decay from there, the column's decay to there: both at most 1),
  one product per row sub-chunk over the columns before it; the pairs inside a sub-chunk by
  the recursive halving; autodiff for the rest of the VJP.

Prints the median times, the ratio to the library's design, the matmul FLOPs of each
compiled program (loop bodies times their trips) and the largest difference from the
library's output.

    python benchmarks/decayed_grams.py                 # about 2 minutes on 2 cores
    python benchmarks/decayed_grams.py --factors 2,2   # DPLR's shape: [q; a] by [k; b]
    python benchmarks/decayed_grams.py --quick         # a smoke test
"""

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, paired_ratio, paired_times, print_table  # noqa: E402
from _seqdepth import matmul_flops  # noqa: E402

from deltanet_cp.chunkops import decayed_grams, einsum  # noqa: E402
from deltanet_cp.chunkops._decays import cumsum, grams_vjp, shift_up  # noqa: E402


def sub_chunks(x, y, g, s: int):
    """Design A: sub-chunks of `s` rows against a reference point (see the module's notes)."""
    b, c, p, k = x.shape
    q, m = y.shape[-2], c // s
    g = jnp.maximum(g, -1e4)  # a decay of exactly zero, finite sums
    gs = g.reshape(b, m, s, k)
    inside = cumsum(gs, -2)  # from the sub-chunk's first token to the row, inclusive
    after = shift_up(cumsum(gs, -2, reverse=True))  # from after the column to the sub-chunk's end
    totals = inside[:, :, -1, :]
    i, j, l_ = np.ogrid[:m, :m, :m]
    between = einsum("blk,ijl->bijk", totals, jnp.asarray((j < l_) & (l_ < i), g.dtype))
    xs = x.reshape(b, m, s, p, k) * jnp.exp(inside)[..., None, :]
    ye = y.reshape(b, m, s, q, k) * jnp.exp(after)[..., None, :]
    rows = [jnp.zeros((b, s, p, c, q), x.dtype)]
    for r in range(1, m):  # the columns before sub-chunk r, carried to its first token
        cols = ye[:, :r] * jnp.exp(between[:, r, :r])[:, :, None, None, :]
        block = einsum("bipk,bjqk->bipjq", xs[:, r], cols.reshape(b, r * s, q, k))
        rows.append(jnp.pad(block, [(0, 0)] * 3 + [(0, c - r * s), (0, 0)]))
    off = jnp.stack(rows, 1).reshape(b, m, s, p, m, s, q)
    diag = grams_vjp(
        x.reshape(b * m, s, p, k),
        y.reshape(b * m, s, q, k),
        gs.reshape(b * m, s, k),
        False,
        "highest",
    ).reshape(b, m, s, p, s, q)
    eye = jnp.asarray(np.eye(m, dtype=bool))[None, :, None, None, :, None, None]
    return jnp.where(eye, diag[:, :, :, :, None], off).reshape(b, c, p, c, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 chunk-heads, 3 rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--factors",
        default="2,1",
        help="P,Q: left and right factors per row (2,1: KDA's [beta k; q] by k; 2,2: DPLR's "
        "[q; a] by [k; b])",
    )
    args = parser.parse_args()
    n, rounds = (64, 3) if args.quick else (1024, args.rounds)
    p, q = (int(f) for f in args.factors.split(","))
    c, k = 64, 128
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, c, p, k)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n, c, q, k)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 0.5, (n, c, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((c, p, c, q)), jnp.float32)
    variants = {
        "plain Gram (no decay)": lambda x, y, g: einsum("nipk,njqk->nipjq", x, y),
        "recursive halving (ours)": decayed_grams,
        "sub-chunks of 16, reference point": lambda x, y, g: sub_chunks(x, y, g, 16),
        "sub-chunks of 32, reference point": lambda x, y, g: sub_chunks(x, y, g, 32),
    }
    ours = decayed_grams(x, y, g)
    calls, flops, diffs = {}, {}, {}
    for name, fn in variants.items():
        grad = jax.grad(lambda x, y, g, fn=fn: jnp.sum(fn(x, y, g) * w), argnums=(0, 1, 2))
        for kind, f in (("fwd", fn), ("fwd+bwd", grad)):
            compiled = jax.jit(f).lower(x, y, g).compile()
            flops[name, kind] = matmul_flops(compiled) / 1e9
            jax.block_until_ready(compiled(x, y, g))
            calls[name, kind] = lambda compiled=compiled: jax.block_until_ready(compiled(x, y, g))
        out = fn(x, y, g)
        diffs[name] = float(jnp.max(jnp.abs(out - ours)) / jnp.max(jnp.abs(ours)))
    times = paired_times(calls, rounds)
    print(machine_line())
    rows = []
    for name in variants:
        for kind in ("fwd", "fwd+bwd"):
            ms = statistics.median(times[name, kind]) * 1e3
            ratio = paired_ratio(times[name, kind], times["recursive halving (ours)", kind])
            diff = "-" if name.startswith("plain") else f"{diffs[name]:.1e}"
            rows.append([name, kind, f"{ms:.1f}", f"{ratio:.2f}", f"{flops[name, kind]:.2f}", diff])
    print_table(
        ["design", "pass", "ms", "vs ours", "matmul GFLOP", "max diff from ours / max"],
        rows,
        title=f"{n} chunk-heads of {c} rows, P = {p}, Q = {q}, K = {k}, float32; {rounds} rounds",
    )


if __name__ == "__main__":
    main()
