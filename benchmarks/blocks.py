"""The block size: time, sequential depth and memory of our gated delta rule per block.

A recurrence's chunk factors are formed batched over a block of chunks (`block_size`
tokens); only the state recursion walks the chunks one by one. Larger blocks mean fewer,
larger batched operations and fewer ops inside loops; smaller blocks bound the factors'
memory. This prints, per block size, at Qwen3-Next's heads (B=1, H=16, HV=32, K=V=128,
float32, chunk 64, q/k L2 norm):

- ops inside while loops per token (`_seqdepth`, from the compiled HLO), fwd and fwd+bwd;
- compiled temporaries per token (`memory_analysis().temp_size_in_bytes / T`);
- fwd and fwd+bwd time, each block size in its own worker process, paired (`_harness`).

Usage: `python benchmarks/blocks.py [--t 4096] [--blocks 256,512,1024,2048,4096] [--rounds 3]`
"""

import argparse
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Impl, Prepared, Session  # noqa: E402
from _impls import problem, pullback  # noqa: E402


def ours_block(*, block_size: int, b: int, t: int, h: int, hv: int, d: int, passes, **_):
    """Our gated delta rule through `dcp.run(..., block_size=block_size)`."""
    import jax
    import jax.numpy as jnp
    from _seqdepth import depth

    import deltanet_cp as dcp

    rule = dcp.GatedDeltaRule(chunk_size=64, use_qk_l2norm=True)

    def forward(q, k, v, g, beta):
        inputs = dcp.DeltaInputs(q, k, v, g, beta)
        return dcp.run(rule, inputs, block_size=block_size)

    inputs, cot = problem(b, t, h, hv, d)
    args = tuple(jnp.asarray(x) for x in inputs)
    cots = tuple(jnp.asarray(c) for c in cot)
    programs = {"fwd": (forward, args), "fwd+bwd": (pullback(forward), (args, cots))}
    calls, info = {}, {}
    for p in passes:
        fn, a = programs[p]
        c = jax.jit(fn).lower(*a).compile()
        memory = c.memory_analysis()
        info[f"temp_bytes {p}"] = None if memory is None else memory.temp_size_in_bytes
        info[f"depth {p}"] = depth(c).inside / t
        calls[p] = lambda c=c, a=a: jax.block_until_ready(c(*a))
    return Prepared(calls, lambda: {}, info)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--blocks", default="256,512,1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="T=256, two block sizes, 1 round")
    a = parser.parse_args()
    blocks = [int(x) for x in a.blocks.split(",")]
    t, rounds, shape = a.t, a.rounds, dict(b=1, h=16, hv=32, d=128)
    if a.quick:
        t, rounds, blocks, shape = 256, 1, [64, 256], dict(b=1, h=2, hv=4, d=32)
    passes = ["fwd", "fwd+bwd"]
    impls = [Impl(f"{bs}", "blocks:ours_block", {"block_size": bs}) for bs in blocks]
    print(f"block sizes {blocks} at T={t}, {shape}; load average {os.getloadavg()}")
    start = time.perf_counter()
    with Session(impls, log=lambda s: None) as session:
        session.prepare(t=t, passes=passes, **shape)
        result = session.time(passes, rounds=rounds)
    rows = []
    for bs in blocks:
        info = result.outcomes[f"{bs}"].info
        row = [f"{bs}", f"{-(-t // bs)}"]
        for p in passes:
            row.append(f"{info[f'depth {p}']:.3f}")
        for p in passes:
            row.append(f"{info[f'temp_bytes {p}'] / t / 1024:.1f}")
        for p in passes:
            median = result.median(f"{bs}", p)
            row.append("-" if median is None else f"{median * 1e3:.0f}")
        rows.append(row)
    head = [
        "block (tokens)",
        "blocks",
        "fwd ops in loops / token",
        "fwd+bwd ops in loops / token",
        "fwd KiB/token",
        "fwd+bwd KiB/token",
        "fwd ms",
        "fwd+bwd ms",
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    print(f"load average after: {os.getloadavg()}; whole run {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
