"""Our gated delta rule under two or more settings, side by side: did a change of source
tree, block size or XLA flags cost time, memory or depth?

One setting per worker process, paired through `_harness` (stopped while another is timed,
the order rotating, per-round ratios). Exactly one kind of variant per run:

- `--trees A B ...`: the library at two source trees (e.g. `git worktree`s of two
  revisions), each worker with `PYTHONPATH=<tree>`; one device and cp = 4 (`--cp`);
- `--blocks 256,512,...`: `deltanet_cp.run(..., block_size=...)` per block size (tokens
  whose factors are formed together: a block bounds the memory, fewer and larger blocks
  mean fewer ops inside loops);
- `--ynn`: XLA:CPU's YNNPACK fusions on (XLA's default) and off
  (`--xla_cpu_experimental_ynn_fusion_type=`);
- `--memory`: `deltanet_cp.run(..., memory=...)`: `"low"` (the default: one state per
  block kept, the factors and chunk states formed again in the backward) at the backend's
  default block and at one block, and `"high"` (every chunk's factors and state kept) at the
  default block and at one block.

The gated delta rule, float32, chunk 64, q/k L2 norm, the final state returned; by default
at Qwen3-Next's heads (B=1, H=16, HV=32, K=V=128, T=4096); under CP over simulated CPU
devices (the contiguous layout, the all-gather exchange). Per variant it prints:

- ops inside while loops per token (`_seqdepth`, from the compiled HLO), fwd and fwd+bwd
  (the pullback of fixed cotangents of `o` and the final state to every input);
- compiled temporaries per token (`memory_analysis().temp_size_in_bytes / T`);
- matmul GFLOP of the compiled program (every `dot`, loop bodies times their trips);
- fwd and fwd+bwd median time, and the paired ratio against the first variant.

    python benchmarks/variants.py --trees BEFORE AFTER
    python benchmarks/variants.py --blocks 256,512,1024,2048,4096
    python benchmarks/variants.py --ynn --t 2048 --h 4 --hv 4 --d 64 --calls 5
    python benchmarks/variants.py --memory --t 2048,4096,16384
    python benchmarks/variants.py --blocks 64,256 --quick      # tiny heads, T=256, 1 round
"""

import argparse
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, print_table  # noqa: E402
from _harness import Impl, Prepared, Session  # noqa: E402
from _impls import problem, pullback  # noqa: E402


PASSES = ["fwd", "fwd+bwd"]
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="


def at(
    *, cp: int, block_size=None, memory=None, b: int, t: int, h: int, hv: int, d: int, passes
) -> Prepared:
    """The gated delta rule of the `deltanet_cp` on this worker's path, on `cp` devices."""
    import jax
    import jax.numpy as jnp
    from _seqdepth import depth, matmul_flops
    from jax.sharding import NamedSharding, PartitionSpec as P

    import deltanet_cp as dcp

    parallel = dcp.ContextParallel("cp") if cp > 1 else None
    rule = dcp.GatedDeltaRule(chunk_size=64, use_qk_l2norm=True)

    def call(q, k, v, g, beta):
        if block_size is None and memory is None:
            return dcp.chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm=True, chunk_size=64, cp=parallel
            )
        inputs = dcp.DeltaInputs(q, k, v, g, beta)
        return dcp.run(rule, inputs, cp=parallel, block_size=block_size, memory=memory)

    inputs, cot = problem(b, t, h, hv, d)
    args = tuple(jnp.asarray(x) for x in inputs)
    cots = tuple(jnp.asarray(c) for c in cot)
    forward = call
    if cp > 1:
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        seq = P(None, "cp")
        forward = jax.shard_map(call, mesh=mesh, in_specs=(seq,) * len(args), out_specs=(seq, P()))
        args = jax.device_put(args, NamedSharding(mesh, seq))
        cots = (
            jax.device_put(cots[0], NamedSharding(mesh, seq)),
            jax.device_put(cots[1], NamedSharding(mesh, P())),
        )
    programs = {"fwd": (forward, args), "fwd+bwd": (pullback(forward), (args, cots))}
    calls: dict = {}
    info: dict = {"package": os.path.dirname(dcp.__file__)}
    for p in passes:
        fn, a = programs[p]
        c = jax.jit(fn).lower(*a).compile()
        stats = c.memory_analysis()
        info[f"temp_bytes {p}"] = None if stats is None else stats.temp_size_in_bytes
        info[f"depth {p}"] = depth(c).inside / (t // cp)
        info[f"gflop {p}"] = matmul_flops(c) / 1e9
        calls[p] = lambda c=c, a=a: jax.block_until_ready(c(*a))
    return Prepared(calls, lambda: {}, info)


def variants(a, cp: int) -> list[Impl]:
    """One `Impl` per variant of this run, on `cp` devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(YNN_OFF)]
    if cp > 1:
        flags.append(f"--xla_force_host_platform_device_count={cp}")

    def impl(name: str, *extra_flags: str, block_size=None, memory=None, path=None) -> Impl:
        env = {"XLA_FLAGS": " ".join([*flags, *extra_flags]), "JAX_PLATFORMS": "cpu"}
        if path is not None:
            env["PYTHONPATH"] = os.path.abspath(path)
        kw = {"cp": cp, "block_size": block_size, "memory": memory}
        return Impl(name, "variants:at", kw, env)

    if a.trees:
        names = [f"{i}:{os.path.basename(os.path.abspath(p))}" for i, p in enumerate(a.trees)]
        return [impl(n, path=p) for n, p in zip(names, a.trees)]
    if a.blocks:
        return [impl(f"block {s}", block_size=int(s)) for s in a.blocks.split(",")]
    if a.memory:
        one_block = 1 << 30
        return [
            impl('"low" (default)'),
            impl('"low", one block', block_size=one_block),
            impl('"high"', memory="high"),
            impl('"high", one block', memory="high", block_size=one_block),
        ]
    return [impl("YNN on"), impl("YNN off", YNN_OFF)]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--trees", nargs="+", help="directories holding a deltanet_cp package")
    kind.add_argument("--blocks", help="comma-separated block sizes")
    kind.add_argument("--ynn", action="store_true", help="YNNPACK fusions on and off")
    kind.add_argument("--memory", action="store_true", help='memory="low" and "high"')
    parser.add_argument("--cp", default=None, help="comma-separated device counts")
    parser.add_argument("--t", default="4096", help="comma-separated sequence lengths")
    parser.add_argument("--h", type=int, default=16, help="query and key heads")
    parser.add_argument("--hv", type=int, default=32, help="value heads")
    parser.add_argument("--d", type=int, default=128, help="K = V")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds")
    parser.add_argument("--calls", type=int, default=1, help="calls per pass per round")
    parser.add_argument("--quick", action="store_true", help="T=256, tiny heads, 1 round")
    a = parser.parse_args()
    ts, rounds, shape = [int(x) for x in a.t.split(",")], a.rounds, dict(b=1, h=a.h, hv=a.hv, d=a.d)
    if a.quick:
        ts, rounds, shape = [256], 1, dict(b=1, h=2, hv=4, d=32)
    cps = [int(x) for x in a.cp.split(",")] if a.cp else ([1, 4] if a.trees else [1])
    print(f"{shape}, float32, chunk 64; {machine_line()}")
    start = time.perf_counter()
    for t, cp in [(t, cp) for t in ts for cp in cps]:
        impls = variants(a, cp)
        names = [i.name for i in impls]
        with Session(impls, log=lambda s: None) as session:
            session.prepare(t=t, passes=PASSES, **shape)
            result = session.time(PASSES, rounds=rounds, calls=a.calls)
        rows = []
        for name in names:
            out = result.outcomes[name]
            if out.status != "ok" and not out.info:
                rows.append([name, cp] + [out.status.split(":")[0]] * 8)
                continue
            info = out.info
            if a.trees and cp == cps[0]:
                print(f"{name}: deltanet_cp from {info['package']}")
            row = [name, cp] + [f"{info[f'depth {p}']:.3f}" for p in PASSES]
            row += [f"{info[f'gflop {p}']:.1f}" for p in PASSES]
            for p in PASSES:
                temp = info[f"temp_bytes {p}"]
                row.append("-" if temp is None else f"{temp / (t // cp) / 1024:.1f}")
            for p in PASSES:
                ratio = result.ratio(name, names[0], p)
                row.append(f"{result.ms(name, p)} ({'-' if ratio is None else f'{ratio:.2f}'}x)")
            rows.append(row)
        print_table(
            ["variant", "cp", "fwd ops in loops / token", "fwd+bwd ops in loops / token"]
            + ["fwd GFLOP", "fwd+bwd GFLOP"]
            + ["fwd KiB/token", "fwd+bwd KiB/token", "fwd ms (/ first)", "fwd+bwd ms (/ first)"],
            rows,
            title=f"T={t}, cp={cp}: medians over {rounds} paired rounds x {a.calls} calls, one "
            "process per variant; (/ first) = median of per-round ratios to the first variant",
        )
        for note in result.notes():
            print(f"* {note}")
    print(f"\nmachine after: {machine_line()}; whole run {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
