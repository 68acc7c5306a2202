"""The library at two source trees, side by side: did a change cost time, memory or depth?

Each tree's `deltanet_cp` runs in its own worker process (`PYTHONPATH=<tree>`), paired
through `_harness` (stopped while the other is timed, order rotating, per-round ratios).
For the gated delta rule at Qwen3-Next's heads (B=1, H=16, HV=32, K=V=128, float32,
chunk 64, q/k L2 norm) on one device and context-parallel over 4 simulated devices (the
contiguous layout, the all-gather exchange), it prints per tree:

- ops inside while loops per token (`_seqdepth`, from the compiled HLO), fwd and fwd+bwd;
- compiled temporaries per token (`memory_analysis().temp_size_in_bytes / T`);
- fwd and fwd+bwd median time, and the paired ratio against the first tree.

Either tree may use the call shape from before `ContextParallel` (`chunk_gated_delta_rule_cp`
with `axis_name=`, `output_final_state=True`) or the current one (`cp=`); the worker picks
the one its tree has.

Usage: `python benchmarks/revisions.py BEFORE_TREE AFTER_TREE [--t 4096] [--rounds 3]`,
where a tree is a directory holding a `deltanet_cp/` package (e.g. a `git worktree`).
"""

import argparse
import functools as ft
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Impl, Prepared, Session  # noqa: E402
from _impls import problem, pullback  # noqa: E402


CP = 4


def at(*, cp: int, b: int, t: int, h: int, hv: int, d: int, passes, **_) -> Prepared:
    """The gated delta rule of the `deltanet_cp` on this worker's path, on `cp` devices."""
    import jax
    import jax.numpy as jnp
    from _seqdepth import depth
    from jax.sharding import NamedSharding, PartitionSpec as P

    import deltanet_cp as dcp

    options = dict(use_qk_l2norm=True, chunk_size=64)
    current = hasattr(dcp, "ContextParallel")
    if cp == 1:
        if current:
            call = ft.partial(dcp.chunk_gated_delta_rule, **options)
        else:
            call = ft.partial(dcp.chunk_gated_delta_rule, output_final_state=True, **options)
    elif current:
        call = ft.partial(dcp.chunk_gated_delta_rule, cp=dcp.ContextParallel("cp"), **options)
    else:
        call = ft.partial(
            dcp.chunk_gated_delta_rule_cp, axis_name="cp", output_final_state=True, **options
        )
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
    calls, info = {}, {"package": os.path.dirname(dcp.__file__)}
    for p in passes:
        fn, a = programs[p]
        c = jax.jit(fn).lower(*a).compile()
        memory = c.memory_analysis()
        info[f"temp_bytes {p}"] = None if memory is None else memory.temp_size_in_bytes
        info[f"depth {p}"] = depth(c).inside / (t // cp)
        calls[p] = lambda c=c, a=a: jax.block_until_ready(c(*a))
    return Prepared(calls, lambda: {}, info)


def _table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="directories holding a deltanet_cp package")
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="T=256, small heads, 1 round")
    a = parser.parse_args()
    t, rounds, shape = a.t, a.rounds, dict(b=1, h=16, hv=32, d=128)
    if a.quick:
        t, rounds, shape = 256, 1, dict(b=1, h=2, hv=4, d=32)
    passes = ["fwd", "fwd+bwd"]
    names = [f"{i}:{os.path.basename(os.path.abspath(tree))}" for i, tree in enumerate(a.trees)]
    flags = f"--xla_force_host_platform_device_count={CP}"
    print(f"trees {dict(zip(names, a.trees))} at T={t}, {shape}; load {os.getloadavg()}")
    start = time.perf_counter()
    for cp in [1, CP]:
        env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        impls = [
            Impl(name, "revisions:at", {"cp": cp}, {**env, "PYTHONPATH": os.path.abspath(tree)})
            for name, tree in zip(names, a.trees)
        ]
        with Session(impls, log=lambda s: None) as session:
            session.prepare(t=t, passes=passes, **shape)
            result = session.time(passes, rounds=rounds)
        rows = []
        for name in names:
            info = result.outcomes[name].info
            if cp == 1:
                print(f"{name}: deltanet_cp from {info['package']}")
            row = [name, str(cp)]
            row += [f"{info[f'depth {p}']:.3f}" for p in passes]
            row += [f"{info[f'temp_bytes {p}'] / (t // cp) / 1024:.1f}" for p in passes]
            for p in passes:
                median = result.median(name, p)
                ratio = result.ratio(name, names[0], p)
                row.append(
                    "-"
                    if median is None
                    else f"{median * 1e3:.0f} ({'-' if ratio is None else f'{ratio:.2f}'}x)"
                )
            rows.append(row)
        _table(
            [
                "tree",
                "cp",
                "fwd ops in loops / token",
                "fwd+bwd ops in loops / token",
                "fwd KiB/token",
                "fwd+bwd KiB/token",
                "fwd ms (/ first)",
                "fwd+bwd ms (/ first)",
            ],
            rows,
        )
    print(f"load average after: {os.getloadavg()}; whole run {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
